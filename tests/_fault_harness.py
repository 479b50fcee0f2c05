"""Fault-injection and soak helpers for tests/test_faults.py and tests/test_soak.py.

Every kill is done by TEST code, in the child process that dies: a weights generator that calls
``os._exit(17)`` when asked for the Nth tensor, a consumer loop that exits after N tensors, or a
wrapper the test installs around one of the transport instance's own steps (``_post_bucket``,
``_recv_next``, ``_release_slot``) or the colocated ``event_hook``. ``os._exit`` runs no ``atexit``
handler and no ``finally`` block, like SIGKILL. Nothing in the package knows about these tests.

Engine transports reuse :class:`_transport_harness.Cluster` (spawned ranks, pipes, per-cluster
segment log). Colocated pairs use :func:`colocated_sender_main` / :func:`colocated_receiver_main`
below as spawn targets (they use ``ColocatedSender`` / ``ColocatedReceiver`` directly: no verl).

Receivers append a digest line to a file per tensor *as it is yielded*, so what a receiver handed
to its consumer before the failure can be compared byte for byte with the sender's model.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _transport_harness import (
    Cluster,
    TensorSpec,
    digest,
    iter_model,
)

EXIT_CODE = 17

# ------------------------------------------------------------------------------------------
# models and where the kill points fall
# ------------------------------------------------------------------------------------------


def fault_model(bucket: int, small: int = 16, big_factor: float = 3.5) -> list[TensorSpec]:
    """``small`` float32 tensors of a quarter bucket each, with one tensor ``big_factor`` buckets
    large in the middle (the oversize tensor, chunked across several buckets)."""
    quarter = max(1, bucket // 16)  # float32 elements: bucket/4 bytes
    specs = [TensorSpec(f"layers.{i}.w", (quarter,), "float32") for i in range(small)]
    big = TensorSpec("embed.big", (int(bucket * big_factor) // 4,), "float32")
    specs.insert(3 * small // 4, big)
    return specs


@dataclass(frozen=True)
class KillPlan:
    """Indices derived from the real planner for one model and bucket size."""

    n_buckets: int
    tensor_bucket: list[int]  # bucket of the first chunk of each tensor
    mid_bucket_tensor: int  # a tensor that shares its bucket with the previous one, bucket >= 2
    big_index: int  # the oversize tensor
    big_first_bucket: int
    big_last_bucket: int


def engine_plan(specs: list[TensorSpec], bucket: int) -> KillPlan:
    from verl_fastsync.chunks import plan_buckets

    first: dict[str, int] = {}
    last: dict[str, int] = {}
    n = 0
    for b in plan_buckets(iter_model(specs), bucket):
        n += 1
        for meta in b.metas:
            first.setdefault(meta.name, b.index)
            last[meta.name] = b.index
    return _plan(specs, first, last, n)


def colocated_plan(specs: list[TensorSpec], bucket: int) -> KillPlan:
    from verl_fastsync.colocated import WholeTensorPlanner

    planner = WholeTensorPlanner(bucket)
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    buckets = []
    for name, tensor in iter_model(specs):
        buckets += planner.add(name, tensor)
    buckets += planner.finish()
    for seq, b in enumerate(buckets):
        for meta in b.metas:
            first.setdefault(meta.name, seq)
            last[meta.name] = seq
    return _plan(specs, first, last, len(buckets))


def _plan(specs: list[TensorSpec], first: dict[str, int], last: dict[str, int], n: int) -> KillPlan:
    tb = [first[s.name] for s in specs]
    big = max(range(len(specs)), key=lambda i: last[specs[i].name] - first[specs[i].name])
    mid = next(i for i in range(1, len(specs)) if tb[i] == tb[i - 1] and tb[i] >= 2 and i != big)
    plan = KillPlan(n, tb, mid, big, first[specs[big].name], last[specs[big].name])
    assert plan.big_last_bucket - plan.big_first_bucket >= 2, plan
    assert plan.big_last_bucket < n - 1, plan
    return plan


# ------------------------------------------------------------------------------------------
# engine transports: code run inside a Cluster rank (through its "exec" command)
# ------------------------------------------------------------------------------------------


def _die() -> None:
    os._exit(EXIT_CODE)


def arm_engine_sender(worker: Any, point: str, plan: KillPlan) -> None:
    """Install a kill on the sender's transport instance (``mid-oversize``, ``before-last``);
    ``before-first`` and ``mid-bucket`` are done by the weights generator (``die_after``), for
    ``mid-bucket`` after a pause that lets the previous bucket reach the receiver."""
    engine = worker.engine
    original = engine._post_bucket

    def post(slot: int, message: Any) -> None:
        if point == "before-last" and message.bucket_index == plan.n_buckets - 1:
            _die()
        original(slot, message)
        if point == "mid-bucket" and message.bucket_index == plan.tensor_bucket[plan.mid_bucket_tensor] - 1:
            time.sleep(0.3)  # the previous bucket reaches the receiver; the generator kills next
        if point == "mid-oversize" and message.bucket_index == plan.big_first_bucket:
            time.sleep(0.2)  # let the first chunk reach the receiver
            _die()

    engine._post_bucket = post


def arm_engine_receiver(worker: Any, point: str, plan: KillPlan) -> None:
    engine = worker.engine
    recv_next = engine._recv_next
    release = engine._release_slot

    def next_message() -> Any:
        if point == "before-first":
            _die()
        message = recv_next()
        if point == "before-last" and getattr(message, "bucket_index", None) == plan.n_buckets - 1:
            _die()
        return message

    def release_slot(slot: int, bucket_index: int) -> None:
        release(slot, bucket_index)
        if point == "mid-oversize" and bucket_index == plan.big_first_bucket:
            _die()

    engine._recv_next = next_message
    engine._release_slot = release_slot


def engine_receive_logged(worker: Any, log_path: str, die_after: int | None = None) -> int:
    """Receive one sync, appending a digest line per yielded tensor to ``log_path`` (flushed);
    with ``die_after``, exit when the consumer is handed tensor number ``die_after``."""

    async def run() -> int:
        count = 0
        with open(log_path, "a") as log:
            async for name, tensor in worker.engine.receive():
                if die_after is not None and count >= die_after:
                    _die()
                log.write(json.dumps(digest(name, tensor)) + "\n")
                log.flush()
                count += 1
                del tensor
        return count

    return asyncio.run(run())


def read_digests(path: str) -> list[tuple[str, tuple[int, ...], str, str]]:
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as fh:
        for line in fh:
            if line.strip():
                name, shape, dtype, sha = json.loads(line)
                out.append((name, tuple(shape), dtype, sha))
    return out


class FaultCluster(Cluster):
    """A :class:`Cluster` whose ranks are spawned without waiting for them, so several clusters
    start concurrently; call :meth:`ready` before use."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._deferred = True
        super().__init__(*args, **kwargs)
        self._deferred = False

    def call_all(self, cmd: str, *args: Any) -> list[Any]:
        if self._deferred:
            for i in range(len(self.conns)):
                self.post(i, cmd, *args)
            return []
        return super().call_all(cmd, *args)

    def ready(self) -> None:
        for i in range(len(self.conns)):
            self.wait(i)

    def exec(self, i: int, code: str) -> None:
        self.post(i, "exec", code)

    def wait_death(self, i: int, timeout: float) -> float:
        """Wait until rank ``i`` has exited; returns the monotonic time it was seen dead."""
        self.procs[i].join(timeout)
        assert not self.procs[i].is_alive(), f"{self.labels[i]} did not die within {timeout}s"
        return time.monotonic()


def ipc_path(endpoint: str | None) -> str | None:
    if endpoint and endpoint.startswith("ipc://"):
        return endpoint[len("ipc://") :]
    return None


# ------------------------------------------------------------------------------------------
# colocated pairs: spawn targets
# ------------------------------------------------------------------------------------------


def colocated_sender_main(
    conn: Connection,
    handles: list[str],
    specs: list[TensorSpec],
    bucket_mb: float,
    timeout_s: float,
    kill: dict[str, Any],
    repeats: int = 1,
) -> None:
    """Send ``specs`` ``repeats`` times, round robin over ``handles``; ``kill`` = {"die_after": n}
    (generator) or {"on_send": seq} (after bucket ``seq`` was sent). Reports ("ok"/"err", ...) per
    sync, with resource figures for soak runs."""
    try:
        import torch  # noqa: F401

        from verl_fastsync.colocated import ColocatedSender

        model = list(iter_model(specs))
        die_after = kill.get("die_after")
        on_send = kill.get("on_send")

        def hook(event: str, fields: dict[str, Any]) -> None:
            if on_send is not None and event == "send" and fields["seq"] == on_send:
                time.sleep(0.2)
                _die()

        def gen() -> Iterator[Any]:
            for i, item in enumerate(model):
                if die_after is not None and i >= die_after:
                    time.sleep(0.3)  # what was already sent reaches the receiver
                    _die()
                yield item

        conn.send(("pid", os.getpid()))
        senders = [
            ColocatedSender(h, bucket_size_mb=bucket_mb, use_shm=True, timeout_s=timeout_s, event_hook=hook)
            for h in handles
        ]
        pause_at = set(kill.get("pause_at", ()))
        for i in range(repeats):
            try:
                asyncio.run(senders[i % len(senders)].async_send_weights(gen()))
            except BaseException as exc:
                conn.send(("err", f"{type(exc).__name__}: {exc}", time.monotonic()))
                return
            _report_sync(conn, i, i in pause_at)
        conn.send(("done", resources_now()))
    except BaseException as exc:
        conn.send(("err", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}", time.monotonic()))


def _report_sync(conn: Connection, index: int, pause: bool) -> None:
    """("ok", index, resources or None); at a pause point, settled resources, then wait for "go"
    (soak runs measure both processes while neither is mid-sync)."""
    if not pause:
        conn.send(("ok", index, None))
        return
    conn.send(("ok", index, resources_settled()))
    if not conn.poll(120):
        raise TimeoutError("no 'go' from the test within 120 s")
    conn.recv()


def colocated_receiver_main(
    conn: Connection,
    handles: list[str],
    log_path: str,
    timeout_s: float,
    kill: dict[str, Any],
    repeats: int = 1,
    digests: bool = True,
) -> None:
    """Receive ``repeats`` syncs, round robin over ``handles``, logging a digest line per tensor handed to the
    callback. ``kill``: {"on_bucket": seq} (exit when bucket ``seq`` arrives, before loading it)
    or {"die_after": n} (exit when handed tensor number ``n``, mid-callback)."""
    try:
        import torch

        from verl_fastsync.colocated import ColocatedReceiver

        on_bucket = kill.get("on_bucket")
        die_after = kill.get("die_after")
        count = 0

        def hook(event: str, fields: dict[str, Any]) -> None:
            if on_bucket is not None and event == "bucket" and fields["seq"] == on_bucket:
                _die()

        conn.send(("pid", os.getpid()))
        receivers = [
            ColocatedReceiver(h, torch.device("cpu"), use_shm=True, timeout_s=timeout_s, event_hook=hook)
            for h in handles
        ]
        with open(log_path, "a") as log:

            def callback(weights: list[tuple[str, torch.Tensor]], is_last: bool) -> None:
                nonlocal count
                for name, tensor in weights:
                    if die_after is not None and count >= die_after:
                        _die()
                    if digests:
                        log.write(json.dumps(digest(name, tensor)) + "\n")
                        log.flush()
                    count += 1

            pause_at = set(kill.get("pause_at", ()))
            for i in range(repeats):
                try:
                    receivers[i % len(receivers)].receive_weights(callback)
                except BaseException as exc:
                    conn.send(("err", f"{type(exc).__name__}: {exc}", time.monotonic()))
                    return
                _report_sync(conn, i, i in pause_at)
        conn.send(("done", resources_now()))
    except BaseException as exc:
        conn.send(("err", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}", time.monotonic()))


# ------------------------------------------------------------------------------------------
# resources
# ------------------------------------------------------------------------------------------


def resources_now() -> dict[str, int]:
    """RSS, open fds and shared-memory mappings of this process; fastsync segments in /dev/shm."""
    import psutil

    proc = psutil.Process()
    with open("/proc/self/maps") as maps:
        mapped = sum(1 for line in maps if "/dev/shm/" in line and "fastsync" in line)
    try:
        segments = sum(1 for n in os.listdir("/dev/shm") if "fastsync" in n)
    except FileNotFoundError:  # pragma: no cover
        segments = 0
    return {"rss": proc.memory_info().rss, "fds": proc.num_fds(), "maps": mapped, "dev_shm": segments}


def resources_settled(max_s: float = 5.0) -> dict[str, int]:
    """:func:`resources_now` once the fd count has not changed for 0.5 s (ZMQ closes sockets on its
    own I/O thread, a moment after ``close()`` returns)."""
    deadline = time.monotonic() + max_s
    last = resources_now()
    stable_since = time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = resources_now()
        if now["fds"] != last["fds"] or now["maps"] != last["maps"]:
            stable_since = time.monotonic()
        last = now
        if time.monotonic() - stable_since >= 0.5:
            break
    return last


def colocated_segments_of(pid: int) -> list[str]:
    prefix = f"verl_fastsync_{pid}_"
    try:
        return sorted(n for n in os.listdir("/dev/shm") if n.startswith(prefix))
    except FileNotFoundError:  # pragma: no cover
        return []
