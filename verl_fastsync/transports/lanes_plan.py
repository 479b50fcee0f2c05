"""Who sends what when several trainer ranks send (``engine_kwargs.fastsync.senders``), and the
receiver's exactly-once bookkeeping. The moving parts are in :mod:`verl_fastsync.transports.lanes`.

**The plan.** verl produces the weights lazily on every trainer rank (each rank gathers the same full
tensors in the same order), so nothing about the sync is known before it starts but the sequence
itself. Every sending rank walks the whole sequence and runs the same greedy assignment: each tensor
goes to the lane (= sending rank) with the fewest bytes so far, the lowest lane on a tie
(:class:`LanePlan`). Every sender computes the same plan from the same (name, size, order) without
talking to the others; a lane's bytes differ from the mean by at most one tensor. Nothing of the
previous sync is needed, so the first sync is balanced too.

**The descriptions.** Before each tensor of its own share (and before its manifest) a sender puts
on its lane the descriptions (name, dtype, shape, bytes, in producer order) of every tensor it walked
since its last ones, its own and the other lanes' (:data:`DESCRIPTIONS_NAME`, a small ``uint8``
tensor in the same bucket). A receiver so learns every sender's view of the whole sequence as the
lanes progress, and compares them per position (:class:`LaneTally`): trainer ranks that disagree (a
name, a dtype, a shape, a size, the order) fail the sync naming the first position they differ at and
both trainer ranks, and a tensor is handed out only once every sender has described its position
alike. A tensor that arrives before a slower lane described it is held meanwhile (its own copy where
it was a view into a lane's bucket, so that no lane ever waits for the rollout: the trainer ranks'
producer may be collective, and a stalled lane would stall every sender); a sender puts its pending
descriptions out at once (a bucket flush) after each bucket's worth of the other lanes' bytes, which
bounds what a rollout rank holds to about one bucket a lane.

**The manifest.** The last item of every lane is a :class:`~verl_fastsync.wire.LaneManifest` (tensor
name :data:`MANIFEST_NAME`, a ``uint8`` tensor carried like any weight): what each lane was planned
to carry and a digest of the whole plan (every description and its lane). A receiver checks each
tensor arrives once (a duplicate names both senders), that every sender planned the same sync (same
digest), and that each lane delivered its planned tensors and bytes (a shortfall names the sender).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import NamedTuple

import msgspec
import torch

from verl_fastsync.transports.base import TransportError
from verl_fastsync.wire import LaneManifest, decode_lane_manifest, encode_lane_manifest

__all__ = [
    "DESCRIPTIONS_NAME",
    "MANIFEST_NAME",
    "Description",
    "LanePlan",
    "LaneTally",
    "choose_senders",
    "describe",
    "is_reserved",
    "manifest_tensor",
    "read_descriptions",
    "read_manifest",
    "tensor_nbytes",
]

MANIFEST_NAME = "[fastsync: the end of a sender's share]"
"""Reserved tensor name of a lane's manifest (never handed to the consumer; named so that a
transport's error about the item in flight reads as what it is)."""
DESCRIPTIONS_NAME = "[fastsync: a sender's descriptions of the weights]"
"""Reserved prefix of the tensor names of a lane's description records (each record's name adds
the position of its first description: names are unique within a sync). Never handed out."""


def is_reserved(name: str) -> bool:
    return name == MANIFEST_NAME or name.startswith(DESCRIPTIONS_NAME)


class Description(NamedTuple):
    """What a sender says about one tensor of the sequence."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int

    def __str__(self) -> str:
        return f"{self.name!r} {self.dtype} {list(self.shape)} ({self.nbytes} bytes)"


def tensor_nbytes(tensor: torch.Tensor) -> int:
    """The bytes a tensor's data occupies (what the plan balances)."""
    return int(tensor.numel()) * int(tensor.element_size())


def describe(name: str, tensor: torch.Tensor) -> Description:
    return Description(
        name,
        str(tensor.dtype).removeprefix("torch."),
        tuple(int(d) for d in tensor.shape),
        tensor_nbytes(tensor),
    )


def first_difference(a: Description, b: Description) -> str:
    """The first field ``a`` and ``b`` differ in, in words."""
    for field in Description._fields:
        if getattr(a, field) != getattr(b, field):
            return field
    return "nothing"  # pragma: no cover - only called on different descriptions


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
        self.walked = 0
        """Tensors assigned so far (the position of the next one)."""
        self._unsent: list[tuple[int, str, str, list[int], int]] = []
        self._digest = hashlib.blake2b(digest_size=16)

    def assign(self, name: str, nbytes: int, dtype: str = "", shape: Sequence[int] = ()) -> int:
        """The lane of the next tensor (``nbytes`` of data, ``dtype`` and ``shape`` as the producer
        yielded it)."""
        if is_reserved(name):
            raise TransportError(f"fastsync senders: the tensor name {name!r} is reserved")
        lane = min(range(self.lanes), key=lambda i: (self.nbytes[i], i))
        self.counts[lane] += 1
        self.nbytes[lane] += nbytes
        dims = [int(d) for d in shape]
        self._digest.update(f"{name}\0{dtype}\0{dims}\0{nbytes}\0{lane}\n".encode())
        self._unsent.append((self.walked, name, dtype, dims, nbytes))
        self.walked += 1
        return lane

    def descriptions(self) -> tuple[str, torch.Tensor] | None:
        """The descriptions walked since the last call, as the named ``uint8`` tensor a lane
        carries (``None``: nothing new)."""
        if not self._unsent:
            return None
        unsent, self._unsent = self._unsent, []
        record = torch.frombuffer(bytearray(msgspec.msgpack.encode(unsent)), dtype=torch.uint8)
        return f"{DESCRIPTIONS_NAME} {unsent[0][0]}", record

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


def read_descriptions(tensor: torch.Tensor, peer: str) -> list[tuple[int, Description]]:
    """A description record (see :meth:`LanePlan.descriptions`): ``[(position, description)]``."""
    try:
        rows = msgspec.msgpack.decode(bytes(tensor.cpu().numpy().tobytes()))
        return [
            (int(i), Description(str(n), str(d), tuple(int(x) for x in s), int(b))) for i, n, d, s, b in rows
        ]
    except (msgspec.DecodeError, TypeError, ValueError) as exc:
        raise TransportError(f"fastsync senders: malformed descriptions from {peer}: {exc}") from exc


class LaneTally:
    """A rollout rank's view of one multi-sender sync: what each sender said it walks, and what
    arrived on which lane."""

    def __init__(self, senders: Sequence[int], who: str) -> None:
        self.senders = list(senders)
        self.who = who
        self.seen: dict[str, int] = {}
        self.counts = [0] * len(self.senders)
        self.nbytes = [0] * len(self.senders)
        self.manifests: list[LaneManifest | None] = [None] * len(self.senders)
        self.ended = [False] * len(self.senders)
        self.described: list[list[Description]] = [[] for _ in self.senders]
        """Each lane's sender's descriptions of the sequence, by position."""
        self.next_own: list[int] = [-1] * len(self.senders)
        """The position of the tensor each lane carries next (the last one it described)."""
        self.handed: set[int] = set()
        """Positions of the tensors handed out (every sender had described them alike)."""
        self.held: list[tuple[int, str, torch.Tensor]] = []
        """Tensors that arrived before every sender described their position, in arrival order."""
        self.held_bytes = 0

    def sender(self, lane: int) -> str:
        return f"trainer rank {self.senders[lane]} (lane {lane})"

    def describe(self, lane: int, rows: list[tuple[int, Description]]) -> None:
        """A description record arrived on ``lane``: each position must be described alike by every
        sender that described it already (else the first difference and both senders are named)."""
        mine = self.described[lane]
        for position, description in rows:
            if position != len(mine):
                raise TransportError(
                    f"{self.who}: {self.sender(lane)} described position {position} of the weights after "
                    f"{len(mine)} (its descriptions are out of order)"
                )
            for other, theirs in enumerate(self.described):
                if other != lane and position < len(theirs) and theirs[position] != description:
                    self._disagree(position, other, theirs[position], lane, description)
            mine.append(description)
        if rows:
            self.next_own[lane] = rows[-1][0]

    def _disagree(self, position: int, a: int, first: Description, b: int, second: Description) -> None:
        if a > b:
            a, first, b, second = b, second, a, first
        raise TransportError(
            f"{self.who}: the trainer ranks disagree about what they send: at position {position} of the "
            f"weights (the first difference, in its {first_difference(first, second)}) "
            f"{self.sender(a)} has {first} and {self.sender(b)} has {second}; every trainer rank must "
            f"produce the same weights (names, dtypes, shapes, order); {self._handed_text(position)}"
        )

    def _handed_text(self, position: int) -> str:
        if position in self.handed:
            return (
                f"the tensor at position {position} had been handed to the rollout before both descriptions "
                "arrived; the sync is failed, do not use its weights"
            )
        return "that tensor was not handed to the rollout"

    def ready(self, position: int) -> bool:
        """Every sender described ``position`` (a lane that ended without: a shorter walk, raised)."""
        for lane, mine in enumerate(self.described):
            if position >= len(mine):
                if self.ended[lane]:
                    self._shorter(lane)
                return False
        return True

    def _shorter(self, lane: int) -> None:
        long = max(range(len(self.described)), key=lambda other: len(self.described[other]))
        have = len(self.described[lane])
        raise TransportError(
            f"{self.who}: the trainer ranks disagree about what they send: {self.sender(lane)} walked "
            f"{have} tensors and {self.sender(long)} more (its tensor at position {have}: "
            f"{self.described[long][have]}); every trainer rank must produce the same weights; "
            f"{self._handed_text(have)}"
        )

    def hand_out(self, position: int, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """What may be handed out now that ``tensor`` (at ``position``; -1: not described) arrived:
        itself if every sender described its position, else nothing (it is held, as its own copy
        where it is a view into a bigger buffer such as a lane's bucket)."""
        if position < 0 or self.ready(position):
            self.handed.add(position)
            return [(name, tensor)]
        if tensor.untyped_storage().nbytes() > tensor_nbytes(tensor):
            tensor = tensor.clone()  # a lent view: the lane may refill its bucket meanwhile
        self.held.append((position, name, tensor))
        self.held_bytes += tensor_nbytes(tensor)
        return []

    def release(self) -> list[tuple[str, torch.Tensor]]:
        """The held tensors every sender has described by now (after a description record or the
        end of a lane), in arrival order."""
        out: list[tuple[str, torch.Tensor]] = []
        keep: list[tuple[int, str, torch.Tensor]] = []
        for position, name, tensor in self.held:
            if self.ready(position):
                self.handed.add(position)
                self.held_bytes -= tensor_nbytes(tensor)
                out.append((name, tensor))
            else:
                keep.append((position, name, tensor))
        self.held = keep
        return out

    def take(self, lane: int, name: str, tensor: torch.Tensor) -> int:
        """A tensor arrived complete on ``lane``; raises before it is handed out twice or unlike what
        any sender described at its position. Returns its position (-1: its sender described none)."""
        if self.manifests[lane] is not None:
            raise TransportError(f"{self.who}: {self.sender(lane)} sent tensor {name!r} after its manifest")
        earlier = self.seen.get(name)
        if earlier is not None:
            raise TransportError(
                f"{self.who}: tensor {name!r} arrived twice, from {self.sender(earlier)} and from "
                f"{self.sender(lane)} (the senders must send disjoint shares)"
            )
        position = self.next_own[lane]
        if position >= 0:
            got = describe(name, tensor)
            own = self.described[lane][position]
            if got != own:
                raise TransportError(
                    f"{self.who}: {self.sender(lane)} described position {position} as {own} and sent {got}"
                )
            for other, theirs in enumerate(self.described):
                if other != lane and position < len(theirs) and theirs[position] != got:
                    self._disagree(position, other, theirs[position], lane, got)
            self.next_own[lane] = -1
        self.seen[name] = lane
        self.counts[lane] += 1
        self.nbytes[lane] += tensor_nbytes(tensor)
        return position

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
        """Every lane ended: all senders walked the same sequence, planned the same sync, and it all
        arrived."""
        manifests = [m for m in self.manifests if m is not None]
        if len(manifests) != len(self.senders) or not all(self.ended):
            missing = [self.sender(i) for i, m in enumerate(self.manifests) if m is None]
            raise TransportError(f"{self.who}: no manifest from {', '.join(missing)}")
        lengths = [len(d) for d in self.described]
        if any(lengths) and len(set(lengths)) > 1:
            self._shorter(min(range(len(lengths)), key=lambda lane: lengths[lane]))
        if self.held:  # pragma: no cover - implied: every lane ended and described alike
            raise TransportError(f"{self.who}: {len(self.held)} tensors were never described by every sender")
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
