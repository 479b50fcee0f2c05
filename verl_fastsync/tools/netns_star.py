"""K simulated trainer hosts and one rollout host: a hub network namespace joined to each of ``K``
leaf namespaces by its own veth link, each link optionally shaped with ``tc`` (token bucket, both
ends), so a multi-sender sync is limited by K separate links as on K hosts.

Addressing: each link is its own random /30 of the RFC 2544 benchmarking range (as
:class:`~verl_fastsync.tools.netns.NamespacePair`); a leaf's default route points at the hub's end of
its own link, so whatever address of the hub a leaf talks to, its traffic crosses its own link only.
The hub's hostname resolves to its address on link 0; each leaf's to its own address. With
``switch=True`` the hub forwards between its links (a switch: the leaves are the hosts, e.g. a trainer
host and rollout hosts, and leaf-to-leaf traffic crosses both leaves' links). Workers run
with :class:`~verl_fastsync.tools.netns_worker.NetnsWorker` as in the pair. Everything is deleted on
exit (and swept by the next star if the creator was killed).
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import secrets

from verl_fastsync.tools.netns import (
    _LIVE,
    Endpoint,
    NetnsUnavailableError,
    _delete_netns,
    _pick_subnet,
    _run,
    shape_device,
    sweep_stale,
    unavailable_reason,
    write_hosts,
)
from verl_fastsync.tools.netns_worker import NetnsWorker

__all__ = ["STAR_PREFIX", "NamespaceStar"]

STAR_PREFIX = "fss"


class NamespaceStar:
    """A hub namespace (the rollout host) and ``leaves`` leaf namespaces (trainer hosts), one veth
    link each (see the module docstring). Use as a context manager."""

    def __init__(
        self, leaves: int, rate_gbit: float | None = None, prefix: str = STAR_PREFIX, switch: bool = False
    ) -> None:
        if isinstance(leaves, bool) or not isinstance(leaves, int) or not 1 <= leaves <= 16:
            raise ValueError(f"leaves must be an int in [1, 16], got {leaves!r}")
        if rate_gbit is not None and not 0 < rate_gbit <= 400:
            raise ValueError(f"rate_gbit must be in (0, 400] Gbit/s or None, got {rate_gbit!r}")
        self.prefix, self.rate_gbit, self.switch = prefix, rate_gbit, switch
        token = self.token = secrets.token_hex(3)
        pid = os.getpid()
        nets: list[ipaddress.IPv4Network] = []
        while len(nets) < leaves:
            net = _pick_subnet()
            if not any(net.overlaps(other) for other in nets):
                nets.append(net)
        self.hub_netns = f"{prefix}-{pid}-{token}-h"
        self.hub_devs = [f"{prefix}{token}h{i}" for i in range(leaves)]
        self.hub_addrs = [str(next(iter(net.hosts()))) for net in nets]
        self.hub = Endpoint(self.hub_netns, self.hub_devs[0], self.hub_addrs[0], f"{prefix}-{token}-h")
        self.leaves = [
            Endpoint(
                f"{prefix}-{pid}-{token}-l{i}",
                f"{prefix}{token}l{i}",
                str(list(net.hosts())[1]),
                f"{prefix}-{token}-l{i}",
            )
            for i, net in enumerate(nets)
        ]
        self.workers: list[NetnsWorker] = []
        self._open = False

    def open(self) -> NamespaceStar:
        reason = unavailable_reason()
        if reason is not None:
            raise NetnsUnavailableError(reason)
        sweep_stale(self.prefix)
        _LIVE.add(self)
        self._open = True
        try:
            for end in (self.hub, *self.leaves):
                _run(["ip", "netns", "add", end.netns])
                _run(["ip", "-n", end.netns, "link", "set", "lo", "up"])
                write_hosts(end)
            for hub_dev, hub_addr, leaf in zip(self.hub_devs, self.hub_addrs, self.leaves, strict=True):
                _run(["ip", "link", "add", hub_dev, "netns", self.hub_netns, "type", "veth",
                      "peer", "name", leaf.dev, "netns", leaf.netns])  # fmt: skip
                _run(["ip", "-n", self.hub_netns, "addr", "add", f"{hub_addr}/30", "dev", hub_dev])
                _run(["ip", "-n", leaf.netns, "addr", "add", f"{leaf.addr}/30", "dev", leaf.dev])
                _run(["ip", "-n", self.hub_netns, "link", "set", hub_dev, "up"])
                _run(["ip", "-n", leaf.netns, "link", "set", leaf.dev, "up"])
                _run(["ip", "-n", leaf.netns, "route", "add", "default", "via", hub_addr])
            if self.switch:
                _run(["ip", "netns", "exec", self.hub_netns, "sysctl", "-qw", "net.ipv4.ip_forward=1"])
            if self.rate_gbit is not None:
                self.shape(self.rate_gbit)
        except BaseException:
            self.close()
            raise
        return self

    def shape(self, rate_gbit: float | None) -> None:
        """Token-bucket shape every link (both ends' egress) to ``rate_gbit`` Gbit/s; ``None``: none."""
        ends = [(self.hub_netns, dev) for dev in self.hub_devs]
        ends += [(leaf.netns, leaf.dev) for leaf in self.leaves]
        for netns, dev in ends:
            shape_device(netns, dev, rate_gbit)
        self.rate_gbit = rate_gbit

    def rx_bytes(self) -> list[int]:
        """Bytes each link has delivered into the hub so far (its hub-side veth's receive counter)."""
        return [rx for rx, _ in self.link_bytes()]

    def link_bytes(self) -> list[tuple[int, int]]:
        """Per link, the bytes so far (from its leaf into the hub, from the hub into its leaf): the
        hub-side veth's receive and transmit counters."""
        counts = []
        for dev in self.hub_devs:
            out = _run(["ip", "-n", self.hub_netns, "-s", "-j", "link", "show", "dev", dev])
            stats = json.loads(out)[0]["stats64"]
            counts.append((int(stats["rx"]["bytes"]), int(stats["tx"]["bytes"])))
        return counts

    def spawn(
        self,
        end: Endpoint,
        env: dict[str, str] | None = None,
        mount_ns: str | None = None,
        hostname: str | None = None,
    ) -> NetnsWorker:
        """A worker in ``end``'s namespace (first in the mount namespace ``mount_ns``, if given), named
        ``hostname`` (default ``end.hostname``; it is made to resolve to ``end``'s address there)."""
        if not self._open:
            raise RuntimeError("NamespaceStar.spawn before open()")
        if hostname is not None and hostname != end.hostname:
            self.add_name(end, hostname)
        worker = NetnsWorker(end, env=env, start_timeout_s=180.0, mount_ns=mount_ns, hostname=hostname)
        self.workers.append(worker)
        return worker

    def add_name(self, end: Endpoint, name: str) -> None:
        """Make ``name`` resolve to ``end``'s address inside ``end``'s namespace (several namespaces
        may share a name, each resolving it to its own link: the ranks of one host with a link
        each)."""
        path = os.path.join("/etc/netns", end.netns, "hosts")
        with open(path) as fh:
            known = fh.read().split()
        if name not in known:
            with open(path, "a") as fh:  # in place: a worker's bind-mounted /etc/hosts sees it
                fh.write(f"{end.addr} {name}\n")

    def close(self) -> None:
        for worker in self.workers:
            with contextlib.suppress(Exception):
                worker.kill()
        self.workers = []
        if self._open:
            for end in (self.hub, *self.leaves):
                _delete_netns(end.netns)
            self._open = False
        _LIVE.discard(self)

    def __enter__(self) -> NamespaceStar:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()
