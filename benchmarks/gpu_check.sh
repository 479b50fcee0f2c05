#!/usr/bin/env bash
# GPU check of verl-fastsync on ONE machine with a single GPU (H200), torch with CUDA preinstalled,
# no internet and no verl. Finishes in under 8 minutes; every step has its own timeout and the
# script goes on when a step fails. Writes JSON (and logs) into the directory given as argument:
#
#   benchmarks/gpu_check.sh <outdir>
#
#   <outdir>/env.json            python/torch/GPU facts
#   <outdir>/delta_gpu.json      delta sync's sender and receiver with the weights on the GPU: copy,
#                                encode and rebuild seconds, bytes, every tensor checked
#                                and a profile of one more encode and rebuild (benchmarks/gpu_delta_check.py)
#   <outdir>/cleanup.json        cleanup A/B on the real CUDA caching allocator (3M-object heap):
#                                light vs adaptive vs aggressive (= verl 0.9.0), bytes freed, seconds,
#                                GC objects (benchmarks/gpu_cleanup_check.py)
#   <outdir>/colocated.json      colocated CUDA IPC path (benchmarks/gpu_colocated.py, if present)
#   <outdir>/nccl_gpu.json       the nccl engine transport, plain and delta (benchmarks/gpu_nccl_check.py)
#   <outdir>/bench.json          verl-fastsync bench: colocated ipc/shm and the engine transports nixl,
#                                gloo, shm (with cleanup on CUDA)
#   <outdir>/summary.json        each step's exit status and wall seconds
#   <outdir>/*.log               each step's output
#
# Knobs (for a dry run on a CPU host): PYTHON (default python3), GPU_CHECK_QUICK=1 (tiny heap and
# models), GPU_CHECK_SKIP_INSTALL=1 (use the environment as it is), GPU_CHECK_BUDGET (seconds the
# whole script may take, default 460: the bench gets what the steps before it left).
#
# Install: this package with --no-deps from the working tree; pluggy/msgspec/pyzmq/xxhash only when they
# are missing, from wheels shipped in benchmarks/wheels/ (no index is contacted). When pip cannot
# install the package (no setuptools for the build), the working tree is used via PYTHONPATH.
set -uo pipefail

if [ $# -ne 1 ]; then
    echo "usage: $0 <outdir>" >&2
    exit 2
fi
OUT=$1
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(dirname "$HERE")
PY=${PYTHON:-python3}
START=$(date +%s)
SUMMARY=()

step() {
    # step <name> <timeout_s> <command...>: run, log, record exit status and seconds
    local name=$1 limit=$2
    shift 2
    local t0 rc
    t0=$(date +%s)
    echo "== $name (limit ${limit}s)" >&2
    timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    tail -n 25 "$OUT/$name.log" >&2
    SUMMARY+=("{\"step\": \"$name\", \"rc\": $rc, \"seconds\": $(($(date +%s) - t0))}")
    echo "== $name: rc=$rc in $(($(date +%s) - t0))s" >&2
    return 0
}

install() {
    local pip=("$PY" -m pip install --no-index --disable-pip-version-check)
    local have_wheels=0
    [ -d "$HERE/wheels" ] && have_wheels=1
    for pair in pluggy:pluggy msgspec:msgspec zmq:pyzmq xxhash:xxhash; do
        local mod=${pair%%:*} pkg=${pair##*:}
        if ! "$PY" -c "import $mod" 2>/dev/null; then
            if [ $have_wheels = 1 ]; then
                "${pip[@]}" --find-links "$HERE/wheels" "$pkg" || echo "could not install $pkg" >&2
            else
                echo "missing $pkg and no benchmarks/wheels/ to install it from" >&2
            fi
        fi
    done
    if ! "${pip[@]}" --no-deps --no-build-isolation "$ROOT"; then
        echo "pip install of the working tree failed; using PYTHONPATH=$ROOT" >&2
    fi
    "$PY" -c "import verl_fastsync, pluggy, msgspec, zmq, xxhash; print('verl_fastsync', verl_fastsync.__version__)"
}

# the working tree first, whether or not pip installed it
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

HEAP=3000000
SIZE=1
BUCKETS=64,256,1024
DELTA_GIB=1
NCCL_MIB=512
BUDGET=${GPU_CHECK_BUDGET:-460}
if [ "${GPU_CHECK_QUICK:-0}" = 1 ]; then
    HEAP=30000
    SIZE=0.01
    BUCKETS=1,4
    DELTA_GIB=0.02
    NCCL_MIB=8
fi

# (a shell function cannot run under `timeout`: pip --no-index contacts nothing and is quick)
if [ "${GPU_CHECK_SKIP_INSTALL:-0}" != 1 ]; then
    t0=$(date +%s)
    echo "== install" >&2
    install >"$OUT/install.log" 2>&1
    rc=$?
    tail -n 5 "$OUT/install.log" >&2
    SUMMARY+=("{\"step\": \"install\", \"rc\": $rc, \"seconds\": $(($(date +%s) - t0))}")
fi

step env 60 "$PY" - "$OUT/env.json" <<'EOF'
import json, platform, sys
import torch
info = {
    "python": platform.python_version(),
    "torch": torch.__version__,
    "cuda_available": torch.cuda.is_available(),
    "cuda": torch.version.cuda,
    "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
}
try:
    import verl
    info["verl"] = verl.__version__
except Exception as exc:
    info["verl"] = f"not importable: {exc!r}"
for mod in ("cupy", "nixl._api", "pluggy", "msgspec", "zmq"):
    try:
        m = __import__(mod, fromlist=["_"])
        info[mod] = getattr(m, "__version__", "present")
    except Exception as exc:
        info[mod] = f"missing: {exc!r}"
json.dump(info, open(sys.argv[1], "w"), indent=2)
print(json.dumps(info, indent=2))
EOF

# 0. delta sync's two sides with the trainer's weights on the GPU (~1 min: 1 GiB of bf16, 2 lrs x 4 syncs)
step delta_gpu 150 "$PY" "$HERE/gpu_delta_check.py" --out "$OUT/delta_gpu.json" --gib "$DELTA_GIB" --steps 3 --profile

# 1. cleanup A/B on the real CUDA caching allocator (~1 min: 3M-object heap, 3 repeats)
step cleanup 150 "$PY" "$HERE/gpu_cleanup_check.py" --out "$OUT/cleanup.json" \
    --heap-objects "$HEAP" --repeats 3 --cached-mib 4096 --cycle-mib 1024

# 2. colocated CUDA IPC path (the colocated engineer's script, when it exists)
if [ -f "$HERE/gpu_colocated.py" ]; then
    step colocated 120 "$PY" "$HERE/gpu_colocated.py" "$OUT"
fi

# 3. the nccl engine transport, plain and with delta sync (~30 s): its two ranks set their own
#    NCCL_HOSTID (NCCL refuses two ranks of one communicator on one GPU otherwise)
step nccl 120 "$PY" "$HERE/gpu_nccl_check.py" --out "$OUT/nccl_gpu.json" --mib "$NCCL_MIB"

# 4. bench: colocated ipc + shm, engine transports (nixl/gloo/shm; nccl is step 3: the bench's ranks
#    share one GPU as one host), 1 GiB models, buckets 64 MiB..1 GiB; no cleanup section (step 1)
left=$((BUDGET - ($(date +%s) - START)))
[ $left -lt 60 ] && left=60
step bench "$left" "$PY" -m verl_fastsync.tools.cli bench --quiet \
    --sections transfer,scale --transports ipc,nixl,gloo,shm \
    --size-gib "$SIZE" --bucket-mib "$BUCKETS" --repeats 3 --scale-sizes 0.5,1,2 --scale-pieces 1,8 \
    --timeout 120 --json "$OUT/bench.json"

{
    echo "{\"wall_seconds\": $(($(date +%s) - START)), \"steps\": ["
    (IFS=,; echo "${SUMMARY[*]}")
    echo "]}"
} >"$OUT/summary.json"
cat "$OUT/summary.json" >&2
