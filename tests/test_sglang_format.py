"""The SGLang receiver against SGLang's real wire format (sglang 0.5.23 from ``.sglang-lib``, put
there by scripts/setup.sh; SGLang itself cannot run on a CPU host, its serialization code can).

The trainer side (the real :func:`sglang_update_weights`, its ColocatedSender over shm) and the
SGLang side (SGLang's real payload normalization and ``SafeUnpickler`` deserialization, then the
real :func:`sglang_fastsync_loader`) run as two plain subprocesses, so SGLang stays out of this
process and the two have different multiprocessing authkeys, as a trainer and an SGLang scheduler
do. See tests/_sglang_format_harness.py.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import types
import uuid
from pathlib import Path

import pytest
import torch

from verl_fastsync.colocated.sglang import SGLANG_LOADER_FQN, sglang_update_weights

REPO = Path(__file__).resolve().parent.parent
SGLANG_LIB = REPO / ".sglang-lib"
HARNESS = Path(__file__).resolve().parent / "_sglang_format_harness.py"

needs_sglang = pytest.mark.skipif(
    not (SGLANG_LIB / "sglang").is_dir(),
    reason=f"SGLang's real code is not installed in {SGLANG_LIB} (run scripts/setup.sh)",
)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SGLANG_LIB), str(REPO), env.get("PYTHONPATH")) if p)
    return env


def _run(mode: str, workdir: Path) -> subprocess.Popen[bytes]:
    log = (workdir / f"{mode}.log").open("wb")
    return subprocess.Popen(
        [sys.executable, str(HARNESS), mode, str(workdir)], env=_env(), stdout=log, stderr=subprocess.STDOUT
    )


@needs_sglang
@pytest.mark.timeout(300)
def test_marker_and_weights_through_sglangs_real_format(tmp_path: Path) -> None:
    sys.path.insert(0, str(HARNESS.parent))
    try:
        import _sglang_format_harness as harness
    finally:
        sys.path.remove(str(HARNESS.parent))
    import json

    trainer, worker = _run("trainer", tmp_path), _run("worker", tmp_path)
    try:
        worker_rc = worker.wait(240)
        trainer_rc = trainer.wait(60)
    finally:
        for proc in (trainer, worker):
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
    logs = {
        mode: (tmp_path / f"{mode}.log").read_text(errors="replace")[-3000:] for mode in ("trainer", "worker")
    }
    assert worker_rc == 0 and trainer_rc == 0, logs
    result = json.loads((tmp_path / "worker.json").read_text())
    assert result["ok"], logs
    # one request: the fastsync loader as load_format, one entry per TP rank naming that rank's endpoint
    assert result["load_format"] == SGLANG_LOADER_FQN
    assert result["entries"] == harness.TP_SIZE
    assert result["rank_handles"] == harness.handles(tmp_path)
    assert result["output_str_handle"] == "ipc:///x"
    # exactly the trainer's bytes reached model.load_weights, the over-bucket tensor included
    expected = [harness.describe(name, tensor) for name, tensor in harness.make_weights()]
    assert result["loaded"] == expected
    assert json.loads((tmp_path / "trainer.json").read_text())["ok"]


@pytest.mark.timeout(120)
def test_a_refused_request_fails_the_sync_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang refusing the request (loader not in ``custom_weight_loader``, no weight-update
    session, ...) means no worker will ever pull: the trainer side raises SGLang's reason then,
    not at the sender's timeout. SGLang's modules are stand-ins here (only the race is tested)."""
    io_struct = types.ModuleType("sglang.srt.managers.io_struct")
    io_struct.UpdateWeightsFromTensorReqInput = types.SimpleNamespace  # type: ignore[attr-defined]
    utils = types.ModuleType("sglang.srt.utils")
    utils.MultiprocessingSerializer = types.SimpleNamespace(serialize=repr)  # type: ignore[attr-defined]
    for name in ("sglang", "sglang.srt", "sglang.srt.managers"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "sglang.srt.managers.io_struct", io_struct)
    monkeypatch.setitem(sys.modules, "sglang.srt.utils", utils)

    class RefusingEngine:
        async def update_weights_from_tensor(self, req: object) -> dict[str, object]:
            await asyncio.sleep(0.2)
            return {"success": False, "message": f"Unknown load_format={SGLANG_LOADER_FQN}"}

    handle = f"ipc:///tmp/vfs-sgl-{uuid.uuid4().hex[:12]}.sock"
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="Unknown load_format"):
        asyncio.run(
            sglang_update_weights(
                RefusingEngine(),
                iter([("w", torch.zeros(4))]),
                zmq_handle=handle,
                tp_zmq_handles=[handle],
                bucket_size_mb=1,
                timeout_s=600,
                transport="shm",
            )
        )
    assert time.monotonic() - start < 60
