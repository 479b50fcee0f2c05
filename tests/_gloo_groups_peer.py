"""A process of ``test_gloo_abort.py``'s two-groups test: builds two gloo groups at once (one thread
each, one store each, as the lanes of two senders do) with the transport's socket bookkeeping, shuts
the first group's connections down, then broadcasts on the second."""

from __future__ import annotations

import datetime
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

from verl_fastsync.transports.gloo_abort import GroupSockets, create_devices

TIMEOUT = datetime.timedelta(seconds=60)


def _build(
    store: Any, rank: int, world: int, tag: str, out: dict[str, Any], barrier: threading.Barrier
) -> None:
    barrier.wait()
    devices, listeners = create_devices(dist.ProcessGroupGloo.create_default_device, 2)
    GroupSockets.publish_listeners(store, f"sockets/{tag}", rank, listeners)
    opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    opts._devices = devices
    opts._timeout = TIMEOUT
    group = dist.ProcessGroupGloo(dist.PrefixStore(f"group/{tag}", store), rank, world, opts)
    out[tag] = (group, GroupSockets.exchange(store, f"sockets/{tag}", rank, world, listeners, 60))


def main(rank: int, world: int, ports: list[int], conn: Connection) -> None:
    stores = [dist.TCPStore("127.0.0.1", port, None, rank == 0, TIMEOUT) for port in ports]
    report: dict[str, Any] = {"rounds": []}
    for round_ in range(3):
        out: dict[str, Any] = {}
        barrier = threading.Barrier(2)
        threads = [
            threading.Thread(target=_build, args=(stores[k], rank, world, f"{round_}-{k}", out, barrier))
            for k in range(2)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        (first, first_sockets), (second, second_sockets) = out[f"{round_}-0"], out[f"{round_}-1"]
        shared = set(first_sockets.links) & set(second_sockets.links)
        peers = sorted(first_sockets.links.values())
        first_links = len(first_sockets.links)
        # every rank cuts the first group before anyone uses the second
        closed = first_sockets.shutdown()
        stores[0].add(f"cut/{round_}", 1)
        deadline = time.monotonic() + TIMEOUT.total_seconds()
        while int(stores[0].add(f"cut/{round_}", 0)) < world:
            if time.monotonic() > deadline:
                raise TimeoutError(f"round {round_}: not every rank cut the first group")
            time.sleep(0.01)
        tensor = (
            torch.arange(1 << 16, dtype=torch.int32) if rank == 0 else torch.zeros(1 << 16, dtype=torch.int32)
        )
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        error = ""
        try:
            second.broadcast([tensor], opts).wait(TIMEOUT)
        except RuntimeError as exc:
            error = str(exc).splitlines()[0]
        report["rounds"].append(
            {
                "shared": len(shared),
                "first_links": first_links,
                "closed": closed,
                "peers": peers,
                "second_links": len(second_sockets.links),
                "equal": bool(torch.equal(tensor, torch.arange(1 << 16, dtype=torch.int32))),
                "error": error,
            }
        )
        del first, second
    conn.send(report)
