"""Engine-side receivers of the colocated path for SGLang.

verl 0.9.1 updates a colocated SGLang server bucket by bucket
(``verl/workers/rollout/sglang_rollout/sglang_rollout.py``: ``get_named_tensor_buckets`` then
``sglang.srt.weight_sync.utils.update_weights`` per bucket): each tensor is exported as its own CUDA
IPC handle, pickled by SGLang's ``MultiprocessingSerializer``, gathered to TP rank 0 and posted as
one ``update_weights_from_tensor`` request per bucket. SGLang's ``update_weights_from_tensor``
also accepts a ``load_format`` naming a function ``loader(model, named_tensors)`` that it imports
and calls inside every TP worker process (verl's delta path uses this,
``delta_loader.LOADER_FQN``).

The fastsync path uses that hook once per sync instead of once per bucket:

1. trainer side, every rank: :func:`sglang_update_weights` posts (on the TP leader) a single
   ``update_weights_from_tensor`` request with ``load_format=`` :data:`SGLANG_LOADER_FQN`, whose
   per-TP-rank payload is one tiny marker tensor (:func:`pull_request_tensor`: a msgspec-encoded
   :class:`PullRequest` naming that rank's ZMQ endpoint), and streams its weights with
   :class:`~verl_fastsync.colocated.ColocatedSender` (persistent double-buffered CUDA-IPC slots);
2. SGLang worker side: :func:`sglang_fastsync_loader` decodes the marker and pulls the weights with
   :class:`~verl_fastsync.colocated.ColocatedReceiver`, handing each bucket to
   ``model.load_weights``.

What the SGLang server must be started with: SGLang calls a ``load_format`` only if it is listed in
its ``custom_weight_loader`` server argument (``WeightUpdater.update_weights_from_tensor`` raises
``NotImplementedError("Unknown load_format=...")`` otherwise), so launch it with
``custom_weight_loader=["verl_fastsync.colocated.sglang.sglang_fastsync_loader"]`` (CLI
``--custom-weight-loader verl_fastsync.colocated.sglang.sglang_fastsync_loader``; in verl
``+actor_rollout_ref.rollout.engine_kwargs.sglang.custom_weight_loader='["verl_fastsync.colocated.sglang.sglang_fastsync_loader"]'``),
and with this package importable in its worker processes. SGLang releases with weight-update
sessions (0.5.23 has them; verl 0.9.1 pins 0.5.12) also refuse ``update_weights_from_tensor``
outside ``begin_weight_update()`` / ``end_weight_update()``; opening that session is the caller's
part, as for verl's own per-bucket loop.

The marker is SGLang's real wire format (checked against sglang 0.5.23 in
``tests/test_sglang_format.py``): each TP rank's entry of ``serialized_named_tensors`` is the
``MultiprocessingSerializer`` (``ForkingPickler``) bytes of ``[(name, tensor)]``, unpickled in the
SGLang scheduler process by its allow-listing ``SafeUnpickler`` and moved with ``tensor.to(device)``.
A CPU tensor *with data* pickles as a file descriptor lent through ``multiprocessing.resource_sharer``,
which only a process holding the trainer's multiprocessing authkey can fetch (an SGLang scheduler
fails with ``AuthenticationError``); so the request travels in the marker's *name* and its tensor is
empty (pickled as ``rebuild_storage_empty``: no descriptor, no shared memory).

SGLang is imported lazily and only by :func:`sglang_update_weights`; the loader itself needs only
torch and this package.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
from collections.abc import AsyncIterable, Iterable, Sequence
from typing import Any

import torch

from verl_fastsync.colocated import (
    DEFAULT_TIMEOUT_S,
    ColocatedProtocolError,
    ColocatedReceiver,
    ColocatedSender,
)
from verl_fastsync.wire import PullRequest, WireError, decode_pull_request, encode_pull_request

__all__ = [
    "MARKER_NAME",
    "SGLANG_LOADER_FQN",
    "PullRequest",
    "pull_request_tensor",
    "read_pull_request",
    "sglang_fastsync_loader",
    "sglang_update_weights",
]

SGLANG_LOADER_FQN = "verl_fastsync.colocated.sglang.sglang_fastsync_loader"
"""``load_format`` of the ``update_weights_from_tensor`` request: SGLang imports and calls it."""

MARKER_NAME = "__verl_fastsync_colocated_pull__"
"""Name prefix of the marker that carries a :class:`PullRequest` through SGLang's request: the name
is ``MARKER_NAME + ":" + base64(msgspec PullRequest)`` (:class:`PullRequest` is
:class:`verl_fastsync.wire.PullRequest`, with every other control message)."""


def pull_request_tensor(zmq_handle: str, timeout_s: float) -> tuple[str, torch.Tensor]:
    """The ``(name, tensor)`` marker to put in a rank's ``serialized_named_tensors``: the request in
    the name, an empty tensor (it pickles with no file descriptor or shared memory, see above)."""
    data = encode_pull_request(PullRequest(zmq_handle=zmq_handle, timeout_s=float(timeout_s)))
    return f"{MARKER_NAME}:{base64.b64encode(data).decode('ascii')}", torch.empty(0, dtype=torch.uint8)


def _marker_bytes(name: str, tensor: Any) -> bytes | None:
    if name.startswith(MARKER_NAME + ":"):
        try:
            return base64.b64decode(name[len(MARKER_NAME) + 1 :], validate=True)
        except (binascii.Error, ValueError):
            raise ColocatedProtocolError(
                f"verl-fastsync SGLang loader: the {MARKER_NAME!r} marker's name is not base64"
            ) from None
    if name == MARKER_NAME:  # the earlier form: the request in the tensor's bytes
        raw = tensor if isinstance(tensor, torch.Tensor) else torch.as_tensor(tensor)
        return bytes(raw.cpu().numpy().tobytes())
    return None


def read_pull_request(named_tensors: Iterable[tuple[str, Any]]) -> PullRequest:
    """Find and decode the marker; a clear error when it is absent or of another version."""
    items = list(named_tensors)
    for name, tensor in items:
        data = _marker_bytes(name, tensor)
        if data is None:
            continue
        try:  # the one version rule of every control message
            return decode_pull_request(data, peer="the trainer's pull request")
        except WireError as exc:
            raise ColocatedProtocolError(f"verl-fastsync SGLang loader: {exc}") from None
    names = [name for name, _ in items][:4]
    raise ColocatedProtocolError(
        f"verl-fastsync SGLang loader: no {MARKER_NAME!r} tensor in the request (got {names}); it was "
        f"called with load_format={SGLANG_LOADER_FQN!r} by something other than sglang_update_weights"
    )


def _worker_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def sglang_fastsync_loader(
    model: Any, named_tensors: Iterable[tuple[str, Any]], *, device: torch.device | None = None
) -> None:
    """SGLang custom loader (``load_format=SGLANG_LOADER_FQN``): pull this worker's weights from the
    trainer rank named in the request and load them bucket by bucket with ``model.load_weights``."""
    request = read_pull_request(named_tensors)
    receiver = ColocatedReceiver(  # load_weights copies each tensor into the model: no copy needed
        request.zmq_handle, device or _worker_device(), timeout_s=request.timeout_s, zero_copy=True
    )

    def load(weights: list[tuple[str, torch.Tensor]], is_last: bool) -> None:
        if weights:
            model.load_weights(weights)

    receiver.receive_weights(load)


async def sglang_update_weights(
    engine: Any,
    weights: Iterable[tuple[str, torch.Tensor]] | AsyncIterable[tuple[str, torch.Tensor]],
    *,
    zmq_handle: str,
    tp_zmq_handles: Sequence[str] | None,
    bucket_size_mb: float,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    flush_cache: bool = True,
    transport: str = "ipc",
) -> None:
    """Trainer side, called on every rank of a colocated SGLang replica (the adapter's replacement
    for verl's per-bucket ``sgl_update_weights`` loop).

    :param engine: verl's SGLang engine handle on the TP leader (``self._engine``), ``None`` elsewhere.
    :param zmq_handle: this rank's endpoint (its SGLang TP worker on the same device pulls from it).
    :param tp_zmq_handles: on the TP leader, the endpoints of all TP ranks in TP order; else ``None``.
    :param transport: colocated transport (``ipc``; ``shm`` where the device has no IPC, e.g. NPU).
    """
    post: asyncio.Future[Any] | None = None
    if engine is not None:
        if not tp_zmq_handles:
            raise ValueError("the TP leader must pass tp_zmq_handles (one endpoint per TP rank)")
        from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput
        from sglang.srt.utils import MultiprocessingSerializer

        request = UpdateWeightsFromTensorReqInput(
            # one entry per TP rank, raw bytes (verl's HTTP adapter base64-encodes them itself)
            serialized_named_tensors=[
                MultiprocessingSerializer.serialize([pull_request_tensor(handle, timeout_s)])
                for handle in tp_zmq_handles
            ],
            load_format=SGLANG_LOADER_FQN,
            flush_cache=flush_cache,
        )
        post = asyncio.ensure_future(_post(engine, request))
    sender = ColocatedSender(
        zmq_handle, bucket_size_mb, use_shm=transport == "shm", transport=transport, timeout_s=timeout_s
    )
    send = asyncio.ensure_future(sender.async_send_weights(weights))
    try:
        if post is not None:
            await asyncio.wait({send, post}, return_when=asyncio.FIRST_COMPLETED)
            if not send.done() and post.done() and (post.cancelled() or post.exception() is not None):
                # SGLang refused the request (loader not registered, no session, ...): its worker
                # will never pull, so stop now with SGLang's reason instead of at the sender's timeout
                send.cancel()
                with contextlib.suppress(Exception, asyncio.CancelledError):
                    await send
                post.result()
        await send
    finally:
        if not send.done():
            send.cancel()
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await send
        if post is not None:
            await post


async def _post(engine: Any, request: Any) -> Any:
    """Post the request; raise SGLang's message when it answers with ``success`` false (verl's HTTP
    adapter raises on the 400 itself; SGLang's ``Engine`` returns ``(success, message)``)."""
    result = await engine.update_weights_from_tensor(request)
    if isinstance(result, dict) and result.get("success") is False:
        raise RuntimeError(f"SGLang refused the verl-fastsync weight update: {result.get('message')}")
    if isinstance(result, tuple) and len(result) == 2 and result[0] is False:
        raise RuntimeError(f"SGLang refused the verl-fastsync weight update: {result[1]}")
    return result
