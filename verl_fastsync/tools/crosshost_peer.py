"""The peer side of :mod:`verl_fastsync.tools.crosshost`: what each simulated host runs.

Every public function here is called by name through the JSON-lines protocol of
:mod:`verl_fastsync.tools.netns_worker` inside a namespace: it takes and returns JSON values. Sockets,
process groups, agents and buffers of the current row live in this process's ``_STATE`` until
:func:`reset`. Sender functions return the start time of each repeat, receiver functions the time
the last byte arrived (the system-wide monotonic clock), and both the xxh3 digest of their bytes.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

MIB = 1 << 20
POLL_S = 0.0002
"""The polling interval of fastsync's nixl transport, used by the raw NIXL rows that poll."""
_STATE: dict[Any, Any] = {}
_AGENTS: list[str] = []  # every agent name this process used (each new agent gets a new name)


def _payload(nbytes: int) -> Any:
    import torch

    key = ("payload", nbytes)
    if key not in _STATE:
        gen = torch.Generator().manual_seed(nbytes)
        _STATE[key] = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    return _STATE[key]


def _digest(tensors: list[Any]) -> str:
    import xxhash

    h = xxhash.xxh3_64()
    for t in tensors:
        h.update(memoryview(t.contiguous().view(-1).view(__import__("torch").uint8).numpy()))
    return h.hexdigest()


def _buffer(nbytes: int) -> Any:
    import torch

    key = ("buffer", nbytes)
    if key not in _STATE:
        _STATE[key] = torch.zeros(nbytes, dtype=torch.uint8)
    return _STATE[key]


def reset() -> None:
    """Drop every socket, group, agent and buffer of the previous row."""
    for value in list(_STATE.values()):
        for closer in ("close", "abort", "finalize"):
            if hasattr(value, closer) and not isinstance(value, type):
                try:
                    getattr(value, closer)()
                except Exception:
                    pass
                break
    _STATE.clear()


def _slices(nbytes: int, parts: int) -> list[tuple[int, int]]:
    step = -(-nbytes // parts)
    return [(i, min(nbytes, i + step)) for i in range(0, nbytes, step)]


def tcp_listen(addr: str, streams: int) -> int:
    srv = socket.create_server((addr, 0), backlog=streams)
    _STATE["srv"] = srv
    return int(srv.getsockname()[1])


def tcp_recv(nbytes: int, streams: int, repeats: int) -> dict[str, Any]:
    buf = _buffer(nbytes)
    srv = _STATE.pop("srv")
    srv.settimeout(120)
    conns = [srv.accept()[0] for _ in range(streams)]
    srv.close()
    view = memoryview(buf.numpy())
    ends = []

    def pull(conn: socket.socket, lo: int, hi: int) -> None:
        while lo < hi:
            got = conn.recv_into(view[lo:hi], hi - lo, socket.MSG_WAITALL)  # one syscall, no GIL
            if got == 0:
                raise ConnectionError("sender closed the connection early")
            lo += got

    with ThreadPoolExecutor(streams) as pool:
        for _ in range(repeats):
            futures = [
                pool.submit(pull, c, lo, hi)
                for c, (lo, hi) in zip(conns, _slices(nbytes, streams), strict=True)
            ]
            for f in futures:
                f.result()
            ends.append(time.monotonic())
            conns[0].sendall(b"k")
    for c in conns:
        c.close()
    return {"ends": ends, "digest": _digest([buf])}


def tcp_send(addr: str, port: int, nbytes: int, streams: int, repeats: int) -> dict[str, Any]:
    data = _payload(nbytes)
    view = memoryview(data.numpy())
    conns = [socket.create_connection((addr, port), timeout=120) for _ in range(streams)]
    starts = []
    with ThreadPoolExecutor(streams) as pool:
        for _ in range(repeats):
            starts.append(time.monotonic())
            futures = [
                pool.submit(c.sendall, view[lo:hi])
                for c, (lo, hi) in zip(conns, _slices(nbytes, streams), strict=True)
            ]
            for f in futures:
                f.result()
            if conns[0].recv(1) != b"k":
                raise ConnectionError("receiver closed the connection before acknowledging")
    for c in conns:
        c.close()
    return {"starts": starts, "digest": _digest([data])}


def gloo_store(addr: str, timeout_s: float) -> int:
    import datetime

    import torch.distributed as dist

    store = dist.TCPStore(addr, 0, 2, True, datetime.timedelta(seconds=timeout_s), wait_for_workers=False)
    _STATE["store"] = store
    return int(store.port)


def gloo_broadcast(
    addr: str, port: int, rank: int, nbytes: int, repeats: int, timeout_s: float
) -> dict[str, Any]:
    """A plain two-rank ProcessGroupGloo (default options) broadcasting the payload from rank 0."""
    import datetime

    import torch
    import torch.distributed as dist

    td = datetime.timedelta(seconds=timeout_s)
    store = _STATE.get("store") or dist.TCPStore(addr, port, 2, False, td)
    pg: Any = dist.ProcessGroupGloo(store, rank, 2, td)
    _STATE["pg"] = pg
    data = _payload(nbytes) if rank == 0 else _buffer(nbytes)
    ack = torch.zeros(1, dtype=torch.uint8)
    stamps = []
    for _ in range(repeats):
        t0 = time.monotonic()
        pg.broadcast([data], dist.BroadcastOptions()).wait(td)
        t1 = time.monotonic()
        opts = dist.BroadcastOptions()
        opts.rootRank = 1
        pg.broadcast([ack], opts).wait(td)
        stamps.append(t0 if rank == 0 else t1)
    return {"starts" if rank == 0 else "ends": stamps, "digest": _digest([data])}


def _model(nbytes: int, bucket: int) -> list[tuple[str, int, int]]:
    """(name, offset, size) covering the payload: one tensor of 2.5 buckets (at most a quarter of
    the payload; split into chunks when larger than a bucket), then 16 MiB tensors."""
    pieces, off, i = [], 0, 0
    first = min(nbytes // 4, 5 * bucket // 2) & ~1
    while off < nbytes:
        size = first if i == 0 else min(16 * MIB, nbytes - off)
        pieces.append((f"layer{i}.weight", off, size))
        off, i = off + size, i + 1
    return pieces


def fs_prepare(transport: str, is_master: bool, bucket: int, timeout_s: float) -> dict[str, Any]:
    from verl_fastsync.plugins import plugin_manager, select_transport
    from verl_fastsync.transports.base import TransportOptions

    if "fs" not in _STATE:
        factory = select_transport(plugin_manager(), transport, "engine")
        _STATE["fs_factory"] = factory
        _STATE["fs"] = factory(TransportOptions(is_master=is_master, timeout_s=timeout_s))
    return dict(_STATE["fs"].prepare(), bucket_size=bucket)


def fs_topology(metadata: list[dict[str, Any]]) -> list[dict[str, Any]]:
    actor, rollout = _STATE["fs_factory"].build_topology(1, 1, metadata)
    return [{k: v[0] for k, v in actor.items()}, {k: v[0] for k, v in rollout.items()}]


def fs_init(kwargs: dict[str, Any]) -> None:
    _STATE["fs"].init_process_group(**kwargs)


def fs_send(nbytes: int, bucket: int) -> dict[str, Any]:
    import torch

    data = _payload(nbytes)
    tensors = [
        (name, data[off : off + size].view(torch.bfloat16)) for name, off, size in _model(nbytes, bucket)
    ]
    start = time.monotonic()
    asyncio.run(_STATE["fs"].send(iter(tensors)))  # the bucket size came with init_process_group
    return {"start": start, "digest": _digest([t for _, t in tensors])}


def fs_receive(nbytes: int, bucket: int) -> dict[str, Any]:
    import torch

    dest = _STATE.get("fs_dest")
    if dest is None:
        dest = {
            name: torch.zeros(size // 2, dtype=torch.bfloat16) for name, _, size in _model(nbytes, bucket)
        }
        _STATE["fs_dest"] = dest

    async def consume() -> None:
        async for name, tensor in _STATE["fs"].receive():
            dest[name].copy_(tensor)

    asyncio.run(consume())
    return {"end": time.monotonic(), "digest": _digest(list(dest.values()))}


def fs_finalize() -> None:
    _STATE["fs"].finalize()


def nixl_agent(nbytes: int, sender: bool, progress_thread: bool) -> dict[str, Any]:
    """An agent (UCX backend; NIXL's progress thread on or off) with the payload (sender) or the
    target buffer registered; its name, metadata and buffer address for the peer."""
    import os

    from nixl._api import nixl_agent, nixl_agent_config

    _AGENTS.append(name := f"crosshost-{'a' if sender else 'b'}-{os.getpid()}-{len(_AGENTS)}")
    agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=progress_thread, backends=["UCX"]))
    buf = _payload(nbytes) if sender else _buffer(nbytes)
    _STATE["nixl"] = agent
    _STATE["nixl_reg"] = agent.register_memory([buf])
    _STATE["nixl_buf"] = buf
    return {
        "agent": name,
        "metadata": base64.b64encode(agent.get_agent_metadata()).decode(),
        "addr": buf.data_ptr(),
    }


def _wait(check: Callable[[], bool], interval_s: float, deadline: float, what: str) -> None:
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not done by the deadline")
        if interval_s:
            time.sleep(interval_s)


def nixl_write(
    peer: dict[str, Any], nbytes: int, repeats: int, spin: bool, timeout_s: float
) -> dict[str, Any]:
    agent, buf = _STATE["nixl"], _STATE["nixl_buf"]
    remote_name = agent.add_remote_agent(base64.b64decode(peer["metadata"]))
    local = agent.get_xfer_descs([(buf.data_ptr(), nbytes, 0)], "DRAM")
    remote = agent.get_xfer_descs([(int(peer["addr"]), nbytes, 0)], "DRAM")
    starts = []
    for i in range(repeats):
        starts.append(time.monotonic())
        handle = agent.initialize_xfer("WRITE", local, remote, remote_name, f"fsx{i}".encode())
        if agent.transfer(handle) == "ERR":
            raise RuntimeError(f"NIXL WRITE {i} failed to start")
        state = {"s": ""}

        def done(h: Any = handle, s: dict[str, str] = state) -> bool:
            s["s"] = agent.check_xfer_state(h)
            if s["s"] == "ERR":
                raise RuntimeError("NIXL WRITE failed")
            return s["s"] == "DONE"

        _wait(done, 0.0 if spin else POLL_S, time.monotonic() + timeout_s, f"NIXL WRITE {i}")
        agent.release_xfer_handle(handle)
    return {"starts": starts, "digest": _digest([buf])}


def nixl_wait(sender: str, repeats: int, interval_s: float, timeout_s: float) -> dict[str, Any]:
    """Wait for each WRITE's notification, checking every ``interval_s`` (0: busy-poll). Checking
    also progresses this agent's UCX worker; with UCX over TCP the target must progress too."""
    agent, buf = _STATE["nixl"], _STATE["nixl_buf"]
    ends = []
    for i in range(repeats):
        check = functools.partial(agent.check_remote_xfer_done, sender, f"fsx{i}".encode())
        _wait(check, interval_s, time.monotonic() + timeout_s, f"notification of WRITE {i}")
        ends.append(time.monotonic())
    return {"ends": ends, "digest": _digest([buf])}
