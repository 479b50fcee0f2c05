"""Both processes of tests/test_sglang_format.py, run as ``python _sglang_format_harness.py MODE DIR``
with the real SGLang (``.sglang-lib``) on ``PYTHONPATH``: each is a plain subprocess, so it has its own
multiprocessing authkey, as the trainer and an SGLang scheduler process do.

* ``trainer``: the real :func:`sglang_update_weights` on the TP leader with an engine that hands the
  request on as verl's ``AsyncHttpServerAdapter`` posts it (each entry base64-encoded into JSON) and
  answers when the worker is done; its real ColocatedSender streams :func:`make_weights` over shm.
* ``worker``: what SGLang does with that JSON, with SGLang's real code where it imports on a CPU
  host: ``normalize_serialized_named_tensor_payloads`` (tokenizer manager), per TP rank
  ``MultiprocessingSerializer.deserialize`` (its ``SafeUnpickler``), then ``tensor.to(device)`` as
  ``_unwrap_tensor`` does, then the custom loader called as ``WeightUpdater`` calls it.
"""

from __future__ import annotations

import ast
import asyncio
import base64
import hashlib
import json
import os
import sys
import time
import types
from pathlib import Path
from typing import Any

import torch

BUCKET_MB = 1
TP_SIZE = 2
TIMEOUT_S = 120.0


def make_weights() -> list[tuple[str, torch.Tensor]]:
    """Deterministic weights, one of them larger than the 1 MiB bucket."""
    gen = torch.Generator().manual_seed(1234)
    return [
        ("model.embed_tokens.weight", torch.randn(700, 512, generator=gen)),  # 1.4 MB > bucket
        ("model.layers.0.mlp.weight", torch.randn(128, 96, generator=gen).to(torch.float16)),
        ("model.norm.weight", torch.randn(64, generator=gen).to(torch.bfloat16)),
        ("model.positions", torch.arange(7, dtype=torch.int64)),
    ]


def describe(name: str, tensor: torch.Tensor) -> list[Any]:
    raw = tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
    return [name, list(tensor.shape), str(tensor.dtype), hashlib.sha256(raw).hexdigest()]


def handles(workdir: Path) -> list[str]:
    return [f"ipc://{workdir}/tp{rank}.sock" for rank in range(TP_SIZE)]


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def _wait_json(path: Path, timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear in {timeout_s} s")
        time.sleep(0.05)
    return json.loads(path.read_text())


def real_request_fields() -> set[str]:
    """The fields of SGLang's real ``UpdateWeightsFromTensorReqInput``, read from its source."""
    import sglang

    source = Path(sglang.__file__).parent / "srt" / "managers" / "io_struct.py"
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.ClassDef) and node.name == "UpdateWeightsFromTensorReqInput":
            return {
                item.target.id
                for item in node.body
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
            }
    raise AssertionError("UpdateWeightsFromTensorReqInput not found in SGLang's io_struct.py")


def _request_struct(report: dict[str, Any]) -> None:
    """The real io_struct where it imports; on a CPU host it cannot (SGLang imports torchvision
    through ``sglang.srt.configs``): then a recorder whose keywords must be fields of the real one."""
    try:
        from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput

        report["io_struct"] = "real"
    except ImportError as exc:
        report["io_struct"] = f"recorder ({type(exc).__name__}: {exc})"[:300]
        fields = real_request_fields()

        class UpdateWeightsFromTensorReqInput:
            def __init__(self, **kwargs: Any) -> None:
                unknown = set(kwargs) - fields
                if unknown:
                    raise TypeError(f"not fields of SGLang's UpdateWeightsFromTensorReqInput: {unknown}")
                self.__dict__.update(kwargs)

        module = types.ModuleType("sglang.srt.managers.io_struct")
        module.UpdateWeightsFromTensorReqInput = UpdateWeightsFromTensorReqInput  # type: ignore[attr-defined]
        sys.modules["sglang.srt.managers.io_struct"] = module


def trainer(workdir: Path) -> None:
    from verl_fastsync.colocated.sglang import sglang_update_weights

    report: dict[str, Any] = {}
    _request_struct(report)

    class VerlHttpAdapterEngine:
        """Posts like verl 0.9.1's ``AsyncHttpServerAdapter.update_weights_from_tensor``."""

        async def update_weights_from_tensor(self, req: Any) -> dict[str, Any]:
            payload = {
                "serialized_named_tensors": [
                    base64.b64encode(entry).decode("utf-8") for entry in req.serialized_named_tensors
                ],
                "load_format": req.load_format,
                "flush_cache": req.flush_cache,
            }
            _write_json(workdir / "request.json", payload)
            deadline = time.monotonic() + TIMEOUT_S
            while not (workdir / "worker.json").exists():
                if time.monotonic() > deadline:
                    raise TimeoutError("the worker did not answer")
                await asyncio.sleep(0.05)
            result = json.loads((workdir / "worker.json").read_text())
            return {"success": result["ok"], "message": result.get("error", "Success")}

    tp = handles(workdir)
    asyncio.run(
        sglang_update_weights(
            VerlHttpAdapterEngine(),
            iter(make_weights()),
            zmq_handle=tp[0],
            tp_zmq_handles=tp,
            bucket_size_mb=BUCKET_MB,
            timeout_s=TIMEOUT_S,
            transport="shm",
        )
    )
    report["ok"] = True
    _write_json(workdir / "trainer.json", report)


def worker(workdir: Path) -> None:
    from sglang.srt.utils.common import (
        MultiprocessingSerializer,
        SafeUnpickler,
        normalize_serialized_named_tensor_payloads,
    )

    from verl_fastsync.colocated.sglang import (
        SGLANG_LOADER_FQN,
        pull_request_tensor,
        read_pull_request,
        sglang_fastsync_loader,
    )

    result: dict[str, Any] = {"ok": False}
    try:
        payload = _wait_json(workdir / "request.json", TIMEOUT_S)
        result["load_format"] = payload["load_format"]
        result["entries"] = len(payload["serialized_named_tensors"])
        payloads = normalize_serialized_named_tensor_payloads(payload["serialized_named_tensors"])
        assert MultiprocessingSerializer.deserialize is not None and SafeUnpickler is not None
        per_rank = [MultiprocessingSerializer.deserialize(payloads[rank]) for rank in range(TP_SIZE)]
        result["rank_handles"] = [read_pull_request(named).zmq_handle for named in per_rank]
        # SGLang's own HTTP engine adapter serializes with output_str=True: that form decodes too
        text = MultiprocessingSerializer.serialize([pull_request_tensor("ipc:///x", 1.0)], output_str=True)
        result["output_str_handle"] = read_pull_request(
            MultiprocessingSerializer.deserialize(text)
        ).zmq_handle

        loaded: list[list[Any]] = []

        class Model:  # SGLang's model: load_weights copies the tensors in
            def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
                loaded.extend(describe(name, tensor) for name, tensor in weights)

        device = torch.device("cpu")
        named = [(name, tensor.to(device)) for name, tensor in per_rank[0]]  # _unwrap_tensor's body
        custom_weight_loaders = [SGLANG_LOADER_FQN]  # server arg custom_weight_loader
        assert payload["load_format"] in custom_weight_loaders
        sglang_fastsync_loader(Model(), named)
        result["loaded"] = loaded
        result["ok"] = True
    except BaseException as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        _write_json(workdir / "worker.json", result)


if __name__ == "__main__":
    mode, directory = sys.argv[1], Path(sys.argv[2])
    {"trainer": trainer, "worker": worker}[mode](directory)
