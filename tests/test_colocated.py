"""Colocated transport: persistent double-buffered slots, fence/ack protocol, oversize and expert
chunking, substitution into verl's ``bucketed_weight_transfer`` module."""

from __future__ import annotations

import asyncio
import gc
import itertools
import multiprocessing as mp
import os
import re
import sys
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import zmq

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _colocated_harness as harness

from verl_fastsync import colocated
from verl_fastsync.colocated import (
    ENV_ENABLE,
    ENV_TIMEOUT,
    METRIC_PREFIX,
    ColocatedError,
    ColocatedReceiver,
    ColocatedSender,
    ColocatedTimeoutError,
    ShmSlotMemory,
    SlotDesc,
    colocated_transport_name,
    expert_alignment,
    install_colocated,
    release_colocated_resources,
    uninstall_colocated,
)
from verl_fastsync.colocated import slots as slots_mod
from verl_fastsync.io import shm as shm_mod
from verl_fastsync.plugins import (
    UnknownPluginNameError,
    available_transports,
    get_plugin_manager,
    select_transport,
)


@pytest.fixture
def handle() -> Iterator[str]:
    path = f"/tmp/vfs-colo-{uuid.uuid4().hex[:12]}.sock"
    yield f"ipc://{path}"
    release_colocated_resources()
    if os.path.exists(path):
        os.remove(path)


def _run_pair(
    sender: ColocatedSender,
    receiver: ColocatedReceiver,
    weights: list[tuple[str, torch.Tensor]],
    callback: Any,
    timeout: float = 30.0,
) -> None:
    """Receiver in a thread, sender on this thread's event loop; re-raise either side's error."""
    errors: list[BaseException] = []

    def run_receiver() -> None:
        try:
            receiver.receive_weights(callback)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run_receiver, daemon=True)
    thread.start()
    try:
        asyncio.run(sender.async_send_weights(iter(weights)))
    finally:
        thread.join(timeout)
    assert not thread.is_alive(), "receiver thread did not finish"
    if errors:
        raise errors[0]


# ---------------------------------------------------------------- configuration


def test_colocated_transports_are_registered() -> None:
    pm = get_plugin_manager()
    assert {"shm", "ipc"} <= set(available_transports(pm, "colocated"))
    memory = select_transport(pm, "shm", "colocated")()
    assert isinstance(memory, ShmSlotMemory)
    with pytest.raises(UnknownPluginNameError, match=r"ipc, .*shm"):
        select_transport(pm, "carrier-pigeon", "colocated")


def test_names_resolve_in_this_process_registry(handle: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # the colocated path sits below the registry (which registers its shm and ipc): it is handed the
    # registry's lookup when imported, so a blocked built-in fails as blocked, never falls back
    from verl_fastsync import plugins, selection
    from verl_fastsync.colocated import memory

    assert memory._lookup is selection.colocated_transport
    # until it is handed one (importing verl_fastsync wires it) it knows only its own two
    assert memory.builtin_transport("shm") is memory.make_shm_memory
    assert memory.builtin_transport("ipc") is memory.make_ipc_memory
    with pytest.raises(ValueError, match=r"='rdma': unknown colocated transport; available: ipc, shm$"):
        memory.builtin_transport("rdma")
    with pytest.raises(
        UnknownPluginNameError,
        match=r"^VERL_FASTSYNC_COLOCATED='carrier-pigeon': unknown colocated transport; available: ipc, shm$",
    ):
        ColocatedSender(handle, 1, transport="carrier-pigeon")._make_memory()
    monkeypatch.setenv(plugins.ENV_DISABLED, plugins.BUILTIN_TRANSPORTS)
    plugins.reset()
    try:
        with pytest.raises(UnknownPluginNameError, match=r"='shm': colocated transport blocked by disabled"):
            ColocatedSender(handle, 1, transport="shm")._make_memory()
    finally:
        monkeypatch.delenv(plugins.ENV_DISABLED)
        plugins.reset()


@pytest.mark.parametrize(
    ("value", "use_shm", "expected"),
    [
        (None, True, None),
        ("0", False, None),
        ("off", True, None),
        ("1", True, "shm"),
        ("auto", False, "ipc"),
        ("shm", False, "shm"),
        ("ipc", True, "ipc"),
    ],
)
def test_enable_flag(value: str | None, use_shm: bool, expected: str | None) -> None:
    env = {} if value is None else {ENV_ENABLE: value}
    assert colocated_transport_name(use_shm, env) == expected


def test_enable_flag_rejects_garbage() -> None:
    with pytest.raises(ValueError, match="allowed: unset/0/false/off"):
        colocated_transport_name(True, {ENV_ENABLE: "yes please!"})


def test_bad_arguments_are_refused(handle: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="bucket_size_mb"):
        ColocatedSender(handle, bucket_size_mb=0)
    with pytest.raises(ValueError, match="timeout_s"):
        ColocatedReceiver(handle, torch.device("cpu"), timeout_s=-1)
    monkeypatch.setenv(ENV_TIMEOUT, "soon")
    with pytest.raises(ValueError, match=ENV_TIMEOUT):
        ColocatedSender(handle)


def test_expert_alignment() -> None:
    stacked = torch.empty(8, 4, 16, dtype=torch.bfloat16)
    assert expert_alignment("model.layers.0.mlp.experts.w13_weight", stacked) == 4 * 16 * 2
    assert expert_alignment("model.layers.0.mlp.experts.gate_up_proj", stacked) == 128
    assert expert_alignment("model.layers.0.mlp.experts.3.up_proj.weight", stacked) is None
    assert expert_alignment("model.layers.0.mlp.gate.weight", stacked) is None
    assert expert_alignment("model.layers.0.mlp.experts.bias", torch.empty(8)) is None


# ---------------------------------------------------------------- shm, in one process


@pytest.mark.timeout(60)
def test_shm_roundtrip_bytes_identical_and_is_last(handle: str) -> None:
    weights = harness.make_weights("mixed")
    got: list[tuple[str, tuple[int, ...], str, str]] = []
    flags: list[bool] = []

    def on_bucket(batch: list[tuple[str, torch.Tensor]], is_last: bool) -> None:
        got.extend(harness.describe(batch))
        flags.append(is_last)

    sender = ColocatedSender(handle, bucket_size_mb=1, use_shm=True, timeout_s=20)
    receiver = ColocatedReceiver(handle, torch.device("cpu"), use_shm=True, timeout_s=20)
    _run_pair(sender, receiver, weights, on_bucket)
    assert got == harness.describe(weights)
    assert flags[-1] is True and not any(flags[:-1]) and len(flags) > 3
    metrics = sender.last_metrics
    assert metrics[f"{METRIC_PREFIX}bytes"] == sum(t.numel() * t.element_size() for _, t in weights)
    assert metrics[f"{METRIC_PREFIX}buckets"] == len(flags)
    assert metrics[f"{METRIC_PREFIX}chunked_tensors"] >= 3
    for key in ("seconds", "gbps", "slot_waits", "slot_wait_seconds"):
        assert f"{METRIC_PREFIX}{key}" in metrics
    assert colocated.get_last_metrics("sender") == metrics


@pytest.mark.timeout(60)
def test_one_argument_callback_and_empty_sync(handle: str) -> None:
    calls: list[list[str]] = []

    def on_bucket(batch: list[tuple[str, torch.Tensor]]) -> None:
        calls.append([n for n, _ in batch])

    sender = ColocatedSender(handle, bucket_size_mb=1, use_shm=True, timeout_s=20)
    receiver = ColocatedReceiver(handle, "cpu", use_shm=True, timeout_s=20)
    _run_pair(sender, receiver, [], on_bucket)
    assert calls == [[]]


@pytest.mark.timeout(60)
def test_expert_chunks_are_valid_slices_without_merge(handle: str) -> None:
    weights = harness.make_weights("experts")
    slices: list[tuple[str, int, int]] = []
    rebuilt: dict[str, torch.Tensor] = {}
    whole: dict[str, torch.Tensor] = {}

    def slice_loader(name: str, first: int, stop: int, tensor: torch.Tensor) -> None:
        slices.append((name, first, stop))
        source = dict(weights)[name]
        assert tensor.shape == (stop - first, *source.shape[1:])
        rebuilt.setdefault(name, torch.zeros_like(source))[first:stop] = tensor

    def on_bucket(batch: list[tuple[str, torch.Tensor]], is_last: bool) -> None:
        whole.update((n, t.clone()) for n, t in batch)

    sender = ColocatedSender(handle, bucket_size_mb=0.25, use_shm=True, timeout_s=20)
    receiver = ColocatedReceiver(handle, "cpu", timeout_s=20, expert_slice_loader=slice_loader)
    _run_pair(sender, receiver, weights, on_bucket)
    stacked = {n for n, _ in weights if expert_alignment(n, dict(weights)[n])}
    assert {n for n, _, _ in slices} == stacked
    for name in stacked:
        assert torch.equal(rebuilt[name], dict(weights)[name])
        covered = sorted((a, b) for n, a, b in slices if n == name)
        assert covered[0][0] == 0 and covered[-1][1] == dict(weights)[name].shape[0]
        assert all(prev[1] == nxt[0] for prev, nxt in itertools.pairwise(covered))
    assert set(whole) == {n for n, _ in weights} - stacked
    assert receiver.last_metrics[f"{METRIC_PREFIX}recv_merge_peak_bytes"] == 0


@pytest.mark.timeout(60)
def test_persistent_slots_reused_and_reallocated_on_size_change(handle: str) -> None:
    weights = harness.make_weights("small")
    tokens: list[tuple[str, ...]] = []

    def run(bucket_mb: float) -> None:
        sender = ColocatedSender(handle, bucket_size_mb=bucket_mb, use_shm=True, timeout_s=20)
        receiver = ColocatedReceiver(handle, "cpu", timeout_s=20)
        _run_pair(sender, receiver, weights, lambda batch, is_last: None)
        tokens.append(tuple(d.token for d in slots_mod._SENDER_SLOTS[(handle, "shm")].descs))

    def pid_segments() -> list[str]:
        return [s for s in harness.shm_segments() if s.startswith(f"verl_fastsync_{os.getpid()}_")]

    def pid_maps() -> int:
        with open("/proc/self/maps") as maps:
            return sum(1 for line in maps if f"/verl_fastsync_{os.getpid()}_" in line)

    run(1)
    # the names are unlinked once the receiver attached: nothing in /dev/shm, both mappings live
    assert pid_segments() == []
    assert pid_maps() == 4  # two slots, mapped by the sender and by the receiver (one process here)
    run(1)
    assert tokens[0] == tokens[1]
    run(2)
    assert tokens[2] != tokens[1]
    assert pid_segments() == [] and pid_maps() == 4
    release_colocated_resources()
    assert pid_segments() == [] and pid_maps() == 0


# ---------------------------------------------------------------- failures and timeouts


@pytest.mark.timeout(30)
def test_receiver_timeout_names_peer_and_phase(handle: str) -> None:
    receiver = ColocatedReceiver(handle, "cpu", timeout_s=0.3)
    with pytest.raises(
        ColocatedTimeoutError, match=r"(waiting for|sending to) the sender at ipc://.*phase=hello"
    ):
        receiver.receive_weights(lambda batch, is_last: None)


@pytest.mark.timeout(30)
def test_sender_timeout_names_peer_and_phase(handle: str) -> None:
    sender = ColocatedSender(handle, bucket_size_mb=1, use_shm=True, timeout_s=0.3)
    with pytest.raises(
        ColocatedTimeoutError, match=r"(waiting for|sending to) the receiver at ipc://.*phase=hello"
    ):
        asyncio.run(sender.async_send_weights(iter(harness.make_weights("small"))))


@pytest.mark.timeout(60)
def test_receiver_failure_reaches_sender_with_bucket_and_tensor(handle: str) -> None:
    def on_bucket(batch: list[tuple[str, torch.Tensor]], is_last: bool) -> None:
        if any(n == "model.norm.weight" for n, _ in batch):
            raise RuntimeError("loader exploded")

    sender = ColocatedSender(handle, bucket_size_mb=1, use_shm=True, timeout_s=20)
    receiver = ColocatedReceiver(handle, "cpu", timeout_s=20)
    with pytest.raises(ColocatedError, match="loader exploded") as info:
        _run_pair(sender, receiver, harness.make_weights("mixed"), on_bucket)
    assert "bucket" in str(info.value)


@pytest.mark.timeout(60)
def test_sender_failure_aborts_receiver(handle: str) -> None:
    def weights() -> Iterator[tuple[str, torch.Tensor]]:
        yield from harness.make_weights("oversize")
        raise KeyError("generator broke")

    errors: list[BaseException] = []
    receiver = ColocatedReceiver(handle, "cpu", timeout_s=20)

    def run_receiver() -> None:
        try:
            receiver.receive_weights(lambda batch, is_last: None)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run_receiver, daemon=True)
    thread.start()
    sender = ColocatedSender(handle, bucket_size_mb=1, use_shm=True, timeout_s=20)
    with pytest.raises(ColocatedError, match="generator broke"):
        asyncio.run(sender.async_send_weights(weights()))
    thread.join(20)
    assert not thread.is_alive()
    assert errors and "sender aborted" in str(errors[0])


@pytest.mark.timeout(60)
def test_no_gc_collect_on_the_sync_path(handle: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*args: Any) -> int:
        raise AssertionError("gc.collect() called on the colocated sync path")

    monkeypatch.setattr(gc, "collect", forbidden)
    sender = ColocatedSender(handle, bucket_size_mb=1, use_shm=True, timeout_s=20)
    receiver = ColocatedReceiver(handle, "cpu", timeout_s=20)
    _run_pair(sender, receiver, harness.make_weights("mixed"), lambda batch, is_last: None)
    release_colocated_resources()


# ---------------------------------------------------------------- IPC protocol with a fake device


class _Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, str, dict[str, Any]]] = []
        self.lock = threading.Lock()

    def hook(self, side: str) -> Any:
        def record(event: str, fields: dict[str, Any]) -> None:
            with self.lock:
                self.events.append((side, event, dict(fields)))

        return record

    def index(self, side: str, event: str, **fields: Any) -> int:
        for i, (s, e, f) in enumerate(self.events):
            if s == side and e == event and all(f.get(k) == v for k, v in fields.items()):
                return i
        raise AssertionError(f"no event {side}/{event} {fields} in {self.events}")


class _FakeDevice:
    """Stands in for ``torch.cuda`` (test only): records the fence and the receiver's sync."""

    def __init__(self, recorder: _Recorder, side: str) -> None:
        self._record = recorder.hook(side)

    class _Event:
        def __init__(self, owner: _FakeDevice) -> None:
            self.owner = owner

        def record(self) -> None:
            self.owner._record("device_event_record", {})

        def synchronize(self) -> None:
            self.owner._record("device_event_sync", {})

    def Event(self) -> _FakeDevice._Event:
        return _FakeDevice._Event(self)

    def synchronize(self) -> None:
        self._record("device_synchronize", {})

    def ipc_collect(self) -> None:
        self._record("ipc_collect", {})


class _FakeIpcMemory(ShmSlotMemory):
    """Device-resident slots as far as the protocol is concerned (test only); shm underneath."""

    name = "ipc"
    device_resident = True

    def __init__(self, recorder: _Recorder, side: str) -> None:
        super().__init__()
        self._record = recorder.hook(side)

    def allocate(self, index: int, nbytes: int) -> tuple[torch.Tensor, SlotDesc]:
        self._record("export", {"slot": index})
        return super().allocate(index, nbytes)

    def attach(self, desc: SlotDesc, device: torch.device) -> torch.Tensor:
        self._record("map", {"slot": desc.index, "token": desc.token})
        return super().attach(desc, device)

    def detach(self, desc: SlotDesc) -> None:
        self._record("unmap", {"slot": desc.index, "token": desc.token})
        super().detach(desc)


@pytest.mark.timeout(60)
def test_ipc_protocol_fence_before_handover_ack_before_reuse(handle: str) -> None:
    rec = _Recorder()
    weights = harness.make_weights("mixed")
    sender_memory = _FakeIpcMemory(rec, "sender")
    receiver_memory = _FakeIpcMemory(rec, "receiver")
    got: list[Any] = []

    def run(bucket_mb: float) -> None:
        sender = ColocatedSender(
            handle,
            bucket_size_mb=bucket_mb,
            timeout_s=20,
            device_module=_FakeDevice(rec, "sender"),
            memory=sender_memory,
            event_hook=rec.hook("sender"),
        )
        receiver = ColocatedReceiver(
            handle,
            "cpu",
            timeout_s=20,
            device_module=_FakeDevice(rec, "receiver"),
            memory=receiver_memory,
            event_hook=rec.hook("receiver"),
        )
        _run_pair(sender, receiver, weights, lambda batch, is_last: got.extend(harness.describe(batch)))

    run(0.5)
    first_sync = list(rec.events)
    sends = [f for s, e, f in first_sync if s == "sender" and e == "send"]
    assert len(sends) >= 4
    assert got == harness.describe(weights)
    # exported once, mapped once
    assert sum(1 for s, e, _ in first_sync if e == "export") == 2
    assert sum(1 for s, e, _ in first_sync if s == "receiver" and e == "map") == 2
    for f in sends:
        seq, slot = f["seq"], f["slot"]
        pack = rec.index("sender", "pack", seq=seq)
        fence = rec.index("sender", "fence", seq=seq)
        send = rec.index("sender", "send", seq=seq)
        # the device work of the packing is fenced (device synchronize) before the handover
        assert pack < fence < send
        assert any(e == "device_synchronize" for s, e, _ in rec.events[pack:fence] if s == "sender")
        # the receiver syncs its device and drops its views before it acknowledges
        sync = max(
            i
            for i, (s, e, _) in enumerate(rec.events)
            if s == "receiver" and e == "device_synchronize" and i < rec.index("receiver", "ack", seq=seq)
        )
        assert rec.index("receiver", "bucket", seq=seq) < sync
        assert sync < rec.index("receiver", "views_dropped", seq=seq) < rec.index("receiver", "ack", seq=seq)
        # a slot is packed again only after the ack of its previous bucket
        if seq >= 2:
            assert rec.index("receiver", "ack", seq=seq - 2) < rec.index("sender", "ack", seq=seq - 2)
            assert rec.index("sender", "ack", seq=seq - 2) < rec.index("sender", "pack", seq=seq)
            assert slot == (seq - 2) % 2

    # second sync, same size: nothing exported or mapped again
    rec.events.clear()
    got.clear()
    run(0.5)
    assert not any(e in ("export", "map", "unmap") for _, e, _ in rec.events)
    assert got == harness.describe(weights)

    # size change: the receiver drops the old mapping before it acknowledges the new slots
    rec.events.clear()
    got.clear()
    run(1)
    assert sum(1 for _, e, _ in rec.events if e == "export") == 2
    unmaps = [i for i, (s, e, _) in enumerate(rec.events) if s == "receiver" and e == "unmap"]
    assert len(unmaps) == 2
    assert max(unmaps) < rec.index("receiver", "map") < rec.index("receiver", "hello_ack")
    assert rec.index("receiver", "hello_ack") < rec.index("sender", "send", seq=0)
    assert got == harness.describe(weights)


# ---------------------------------------------------------------- verl: substitution and end to end


@pytest.mark.verl
@pytest.mark.release
@pytest.mark.timeout(60)
def test_substitution_follows_the_enable_flag(handle: str, monkeypatch: pytest.MonkeyPatch) -> None:
    module = harness.load_verl_bwt("verl_bwt_substitution")
    orig_sender, orig_receiver = module.BucketedWeightSender, module.BucketedWeightReceiver
    install_colocated(module)
    install_colocated(module)  # idempotent
    try:
        monkeypatch.delenv(ENV_ENABLE, raising=False)
        sender = module.BucketedWeightSender(zmq_handle=handle, bucket_size_mb=1, use_shm=True)
        receiver = module.BucketedWeightReceiver(zmq_handle=handle, device=torch.device("cpu"), use_shm=True)
        assert type(sender) is orig_sender and type(receiver) is orig_receiver
        # verl's own classes still work untouched (their shm path, CPU device lookups replaced);
        # a receive timeout on verl's sockets so that a failure cannot hang the test
        zmq.Context.instance().setsockopt(zmq.RCVTIMEO, 20000)
        weights = harness.make_weights("plain")
        got: list[Any] = []
        cb: Any
        if harness.callback_takes_is_last():
            cb = lambda batch, is_last: got.extend(harness.describe(batch))  # noqa: E731
        else:
            cb = lambda batch: got.extend(harness.describe(batch))  # noqa: E731
        _run_pair(sender, receiver, weights, cb)
        assert got == harness.describe(weights)

        monkeypatch.setenv(ENV_ENABLE, "1")
        sender = module.BucketedWeightSender(handle, 1, True)
        receiver = module.BucketedWeightReceiver(zmq_handle=handle, device=torch.device("cpu"), use_shm=True)
        assert isinstance(sender, ColocatedSender) and sender.transport == "shm"
        assert isinstance(receiver, ColocatedReceiver)
        got.clear()
        _run_pair(sender, receiver, weights, cb)
        assert got == harness.describe(weights)
    finally:
        zmq.Context.instance().setsockopt(zmq.RCVTIMEO, -1)
        uninstall_colocated(module)
    assert module.BucketedWeightSender is orig_sender


@pytest.mark.verl
@pytest.mark.release
@pytest.mark.timeout(120)
def test_shm_end_to_end_two_processes_on_verl_shapes(handle: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """verl's module (by file path) with the substitution installed, sender here, receiver in a
    spawned process: small, oversize and expert-stacked tensors bit-exact, then 100 consecutive
    syncs without growth of /dev/shm segments, open files or RSS."""
    monkeypatch.setenv(ENV_ENABLE, "1")
    monkeypatch.setenv(ENV_TIMEOUT, "30")
    # earlier tests in this process may leave slot mappings of their own behind in reference cycles
    # (a failure's traceback holding a lent view; a segment is unmapped only with its last view):
    # collect them, and count this test's mappings on top of whatever still lives
    gc.collect()
    parent_maps_before = harness.resources(os.getpid())["maps"]
    module = harness.load_verl_bwt("verl_bwt_e2e")
    install_colocated(module)
    specs = ["small", "oversize", "experts"]
    n_soak = 100
    n_syncs = len(specs) + n_soak
    soak_weights = harness.make_weights("mixed", seed=7)
    is_last_cb = harness.callback_takes_is_last()
    ctx = mp.get_context("spawn")
    parent_conn, child_conn = ctx.Pipe()
    proc = ctx.Process(
        target=harness.receiver_main,
        args=(child_conn, handle, n_syncs, True, is_last_cb, 10, len(specs), os.getpid()),
        daemon=True,
    )
    proc.start()
    child_conn.close()

    def mine() -> list[str]:
        return [s for s in harness.shm_segments() if s.startswith(f"verl_fastsync_{os.getpid()}_")]

    try:
        reports: list[Any] = []
        parent_res: list[dict[str, int]] = []
        for i in range(n_syncs):
            weights = harness.make_weights(specs[i]) if i < len(specs) else soak_weights
            sender = module.BucketedWeightSender(zmq_handle=handle, bucket_size_mb=1, use_shm=True)
            assert isinstance(sender, ColocatedSender)
            asyncio.run(sender.async_send_weights(iter(weights)))
            assert parent_conn.poll(30), f"no report from the receiver after sync {i}"
            report = parent_conn.recv()
            assert report[0] == "sync", report
            _, index, received, flags, cls_name, res = report
            assert index == i and cls_name == "ColocatedReceiver"
            if i < len(specs) or i % 10 == 0 or i == n_syncs - 1:
                assert received == harness.describe(weights), (
                    f"sync {i} ({specs[i] if i < len(specs) else 'soak'})"
                )
            if is_last_cb:
                assert flags[-1] is True and not any(flags[:-1])
            reports.append(res)
            parent_res.append(harness.resources(os.getpid()))
            assert mine() == []
        assert parent_conn.poll(30)
        assert parent_conn.recv()[0] == "done"
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
    assert proc.exitcode == 0
    warm = len(specs) + 5
    for side, maps_before in ((reports, 0), (parent_res, parent_maps_before)):
        early, late = side[warm : warm + 10], side[-10:]
        # exactly the two persistent slots: one mapping each, every sync; their names were unlinked
        # as soon as the receiver attached them
        assert all(r["shm"] == 0 and r["maps"] == maps_before + 2 for r in side[warm:]), [
            (i, r["shm"], r["maps"]) for i, r in enumerate(side) if r["shm"] or r["maps"] != maps_before + 2
        ]
        assert all(r["files"] == early[0]["files"] for r in side[warm:])
        # zmq closes sockets asynchronously (a few fds come and go): compare windows with a slack far
        # below what one leaked fd per sync would add over 100 syncs
        assert max(r["fds"] for r in late) <= max(r["fds"] for r in early) + 8
        assert late[-1]["rss"] - early[0]["rss"] < 32 << 20, (early[0]["rss"], late[-1]["rss"])
    release_colocated_resources()
    assert mine() == []


# ---------------------------------------------------------------- SGLang loader (protocol only)


@pytest.mark.timeout(60)
def test_sglang_loader_pulls_weights_named_in_the_request(handle: str) -> None:
    from verl_fastsync.colocated.sglang import pull_request_tensor, sglang_fastsync_loader

    weights = harness.make_weights("mixed")
    loaded: list[Any] = []

    class Model:
        def load_weights(self, batch: list[tuple[str, torch.Tensor]]) -> None:
            loaded.extend(harness.describe(batch))

    marker = pull_request_tensor(handle, timeout_s=20)
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            sglang_fastsync_loader(Model(), [marker], device=torch.device("cpu"))
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    asyncio.run(
        ColocatedSender(handle, bucket_size_mb=1, use_shm=True, timeout_s=20).async_send_weights(weights)
    )
    thread.join(20)
    assert not thread.is_alive() and not errors
    assert loaded == harness.describe(weights)


def test_sglang_loader_refuses_a_request_without_marker() -> None:
    from verl_fastsync.colocated import ColocatedProtocolError
    from verl_fastsync.colocated.sglang import sglang_fastsync_loader

    with pytest.raises(ColocatedProtocolError, match="no '__verl_fastsync_colocated_pull__' tensor"):
        sglang_fastsync_loader(object(), [("model.w", torch.zeros(2))])


@pytest.mark.timeout(60)
def test_sglang_trainer_side_yields_to_the_loop_until_the_worker_pulls(handle: str) -> None:
    """A non-leader rank (engine None): the sender's handshake lets other coroutines of its loop
    run, here the one that starts the worker (as SGLang's HTTP request would)."""
    from verl_fastsync.colocated.sglang import (
        pull_request_tensor,
        sglang_fastsync_loader,
        sglang_update_weights,
    )

    weights = harness.make_weights("small")
    loaded: list[Any] = []

    class Model:
        def load_weights(self, batch: list[tuple[str, torch.Tensor]]) -> None:
            loaded.extend(harness.describe(batch))

    async def main() -> None:
        async def start_worker() -> None:
            await asyncio.sleep(0.05)
            threading.Thread(
                target=sglang_fastsync_loader,
                args=(Model(), [pull_request_tensor(handle, 20)]),
                kwargs={"device": torch.device("cpu")},
                daemon=True,
            ).start()

        task = asyncio.ensure_future(start_worker())
        await sglang_update_weights(
            None,
            iter(weights),
            zmq_handle=handle,
            tp_zmq_handles=None,
            bucket_size_mb=1,
            timeout_s=20,
            transport="shm",
        )
        await task

    asyncio.run(main())
    assert loaded == harness.describe(weights)


def test_segments_of_dead_owners_are_swept(monkeypatch: pytest.MonkeyPatch) -> None:
    proc = mp.get_context("spawn").Process(target=int)
    proc.start()
    proc.join(30)
    dead = proc.pid
    alive = os.getppid()
    paths = [
        f"/dev/shm/verl_fastsync_{dead}_feedfacefeedface_0",
        f"/dev/shm/verl_fastsync_{alive}_feedfacefeedface_0",
    ]
    for path in paths:
        with open(path, "wb") as fh:
            fh.write(b"x")
    monkeypatch.setattr(shm_mod, "_SWEPT", set())
    try:
        removed = colocated.sweep_dead_segments()
        assert os.path.basename(paths[0]) in removed
        assert not os.path.exists(paths[0]) and os.path.exists(paths[1])
        assert colocated.sweep_dead_segments() == []  # once per process
    finally:
        for path in paths:
            if os.path.exists(path):
                os.remove(path)


@pytest.mark.timeout(60)
def test_verify_passes_clean_and_rejects_corrupted_bytes(handle: str) -> None:
    from verl_fastsync.chunks import ChunkCorruptedError

    weights = harness.make_weights("mixed")
    got: list[tuple[str, tuple[int, ...], str, str]] = []
    sender = ColocatedSender(handle, bucket_size_mb=1, use_shm=True, timeout_s=20, verify=True)
    receiver = ColocatedReceiver(handle, "cpu", use_shm=True, timeout_s=20)
    _run_pair(sender, receiver, weights, lambda batch, is_last: got.extend(harness.describe(batch)))
    assert got == harness.describe(weights)

    bucket_names: dict[int, list[str]] = {}

    def corrupt_second_bucket(event: str, fields: dict[str, Any]) -> None:
        if event == "bucket":
            bucket_names[fields["seq"]] = fields["names"]
        if event == "bucket" and fields["seq"] == 1:
            fields["view"][7] ^= 0xFF  # one byte flipped in flight, after the sender's checksum

    received: list[str] = []
    sender = ColocatedSender(handle, bucket_size_mb=1, use_shm=True, timeout_s=20, verify=True)
    receiver = ColocatedReceiver(handle, "cpu", use_shm=True, timeout_s=20, event_hook=corrupt_second_bucket)
    with pytest.raises((ColocatedError, ChunkCorruptedError)) as info:
        _run_pair(sender, receiver, weights, lambda batch, is_last: received.extend(n for n, _ in batch))
    assert "does not match" in str(info.value) or "checksum" in str(info.value)
    assert re.search(r"tensor '[^']+'", str(info.value)), str(info.value)
    # exactly the tensors completed by the first bucket were handed over, nothing of the second
    assert sorted(bucket_names) == [0, 1]
    first = [n for n in dict.fromkeys(bucket_names[0]) if n not in bucket_names[1]]
    assert first and received == first, (received, bucket_names)
