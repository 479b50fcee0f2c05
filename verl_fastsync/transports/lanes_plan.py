"""Who sends what when several trainer ranks send (``engine_kwargs.fastsync.senders``), and the
receiver's exactly-once bookkeeping. The moving parts are in :mod:`verl_fastsync.transports.lanes`.

**The plan.** verl produces the weights lazily on every trainer rank (each rank gathers the same full
tensors in the same order), so nothing about the sync is known before it starts but the sequence
itself. Every sending rank walks the whole sequence and runs the same greedy assignment: each tensor
goes to the lane (= sending rank) with the fewest bytes so far, the lowest lane on a tie
(:class:`LanePlan`). Every sender computes the same plan from the same (name, size, order) without
talking to the others; a lane's bytes differ from the mean by at most one tensor. Nothing of the
previous sync is needed, so the first sync is balanced too.

**The manifest.** The last item of every lane is a :class:`~verl_fastsync.wire.LaneManifest` (tensor
name :data:`MANIFEST_NAME`, a ``uint8`` tensor carried like any weight): what each lane was planned
to carry and a digest of the whole plan. A receiver (:class:`LaneTally`) checks each tensor arrives
once (a duplicate names both senders), that every sender planned the same sync (same digest), and
that each lane delivered its planned tensors and bytes (a shortfall names the sender).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from verl_fastsync.transports.base import TransportError
from verl_fastsync.wire import LaneManifest, decode_lane_manifest, encode_lane_manifest

__all__ = [
    "MANIFEST_NAME",
    "LanePlan",
    "LaneTally",
    "choose_senders",
    "manifest_tensor",
    "read_manifest",
    "tensor_nbytes",
]

MANIFEST_NAME = "__fastsync_lane_manifest__"
"""Reserved tensor name of a lane's manifest (never handed to the consumer)."""


def tensor_nbytes(tensor: torch.Tensor) -> int:
    """The bytes a tensor's data occupies (what the plan balances)."""
    return int(tensor.numel()) * int(tensor.element_size())


def choose_senders(hosts: Sequence[str], senders: int | None) -> list[int]:
    """The sending trainer ranks, in lane order (ascending rank), for the hosts of the trainer ranks
    (index = rank) and ``senders`` (``None``: all). Hosts are taken in turn (rank 0's first) so that
    ``senders=2`` on two hosts uses both links; trainer rank 0 always sends."""
    count = len(hosts) if senders is None else min(int(senders), len(hosts))
    by_host: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        by_host.setdefault(str(host), []).append(rank)
    chosen: list[int] = []
    queues = list(by_host.values())
    while len(chosen) < count:
        for queue in queues:
            if queue and len(chosen) < count:
                chosen.append(queue.pop(0))
    return sorted(chosen)


class LanePlan:
    """The greedy byte-balanced assignment of a weight sequence to ``lanes`` lanes (see the module
    docstring). Feed every tensor in producer order; every sender gets the same answers."""

    def __init__(self, lanes: int) -> None:
        if lanes < 1:
            raise ValueError(f"a lane plan needs at least one lane, got {lanes}")
        self.lanes = lanes
        self.counts = [0] * lanes
        self.nbytes = [0] * lanes
        self._digest = hashlib.blake2b(digest_size=16)

    def assign(self, name: str, nbytes: int) -> int:
        """The lane of the next tensor (``nbytes`` of data)."""
        if name == MANIFEST_NAME:
            raise TransportError(f"fastsync senders: the tensor name {MANIFEST_NAME!r} is reserved")
        lane = min(range(self.lanes), key=lambda i: (self.nbytes[i], i))
        self.counts[lane] += 1
        self.nbytes[lane] += nbytes
        self._digest.update(f"{name}\0{nbytes}\0{lane}\n".encode())
        return lane

    @property
    def total_bytes(self) -> int:
        return sum(self.nbytes)

    def manifest(self, lane: int, sender: int) -> LaneManifest:
        return LaneManifest(
            lane=lane,
            sender=sender,
            counts=list(self.counts),
            nbytes=list(self.nbytes),
            digest=self._digest.hexdigest(),
        )


def manifest_tensor(manifest: LaneManifest) -> torch.Tensor:
    """The manifest as the ``uint8`` tensor a lane carries last."""
    return torch.frombuffer(bytearray(encode_lane_manifest(manifest)), dtype=torch.uint8)


def read_manifest(tensor: torch.Tensor, peer: str) -> LaneManifest:
    return decode_lane_manifest(bytes(tensor.cpu().numpy().tobytes()), peer=peer)


class LaneTally:
    """A rollout rank's view of one multi-sender sync: what arrived on which lane."""

    def __init__(self, senders: Sequence[int], who: str) -> None:
        self.senders = list(senders)
        self.who = who
        self.seen: dict[str, int] = {}
        self.counts = [0] * len(self.senders)
        self.nbytes = [0] * len(self.senders)
        self.manifests: list[LaneManifest | None] = [None] * len(self.senders)
        self.ended = [False] * len(self.senders)

    def sender(self, lane: int) -> str:
        return f"sender trainer rank {self.senders[lane]} (lane {lane} of {len(self.senders)})"

    def take(self, lane: int, name: str, tensor: torch.Tensor) -> None:
        """A tensor arrived complete on ``lane``; raises before it is handed out twice."""
        if self.manifests[lane] is not None:
            raise TransportError(f"{self.who}: {self.sender(lane)} sent tensor {name!r} after its manifest")
        earlier = self.seen.get(name)
        if earlier is not None:
            raise TransportError(
                f"{self.who}: tensor {name!r} arrived twice, from {self.sender(earlier)} and from "
                f"{self.sender(lane)} (the senders must send disjoint shares)"
            )
        self.seen[name] = lane
        self.counts[lane] += 1
        self.nbytes[lane] += tensor_nbytes(tensor)

    def manifest(self, lane: int, manifest: LaneManifest) -> None:
        if self.manifests[lane] is not None:
            raise TransportError(f"{self.who}: {self.sender(lane)} sent a second manifest")
        if manifest.lane != lane or manifest.sender != self.senders[lane]:
            raise TransportError(
                f"{self.who}: {self.sender(lane)} sent the manifest of lane {manifest.lane} (trainer rank "
                f"{manifest.sender})"
            )
        self.manifests[lane] = manifest

    def end(self, lane: int) -> None:
        """``lane``'s stream ended: it must have delivered its manifest and its whole share."""
        self.ended[lane] = True
        manifest = self.manifests[lane]
        if manifest is None:
            raise TransportError(f"{self.who}: {self.sender(lane)} ended its lane without its manifest")
        want, got = manifest.counts[lane], self.counts[lane]
        if (want, manifest.nbytes[lane]) != (got, self.nbytes[lane]):
            raise TransportError(
                f"{self.who}: {self.sender(lane)} delivered {got} of the {want} tensors "
                f"({self.nbytes[lane]} of {manifest.nbytes[lane]} bytes) planned for it; "
                f"{max(want - got, 0)} missing"
            )

    def finish(self) -> None:
        """Every lane ended: all senders planned the same sync, and it all arrived."""
        manifests = [m for m in self.manifests if m is not None]
        if len(manifests) != len(self.senders) or not all(self.ended):
            missing = [self.sender(i) for i, m in enumerate(self.manifests) if m is None]
            raise TransportError(f"{self.who}: no manifest from {', '.join(missing)}")
        first = manifests[0]
        for lane, manifest in enumerate(manifests):
            planned = (manifest.digest, manifest.counts, manifest.nbytes)
            if planned != (first.digest, first.counts, first.nbytes):
                raise TransportError(
                    f"{self.who}: the senders planned different syncs: {self.sender(0)} planned "
                    f"{sum(first.counts)} tensors / {sum(first.nbytes)} bytes (digest {first.digest}), "
                    f"{self.sender(lane)} {sum(manifest.counts)} / {sum(manifest.nbytes)} (digest "
                    f"{manifest.digest}); every trainer rank must produce the same weights in the same order"
                )
        if len(self.seen) != sum(first.counts):  # pragma: no cover - implied by the per-lane checks
            raise TransportError(f"{self.who}: {len(self.seen)} of {sum(first.counts)} tensors arrived")
