"""Every control message of verl-fastsync: typed, versioned msgspec structs (msgpack), one module.

Never pickle. Every message carries ``schema_version``; :func:`check_version` reads it *before*
decoding the rest, so a peer speaking another version gets a :class:`WireVersionError` naming both
versions instead of a confusing field error. One rule for every message family (the engine
transports', the colocated path's and the SGLang pull request), and for the
:class:`~verl_fastsync.chunks.ChunkMeta` a bucket message carries: a missing ``schema_version`` is
version 0, and any version other than this side's is rejected.

The engine transports' messages (tagged union :data:`Message`, tag field ``type``):

* :class:`Hello` - a receiver introduces itself to the sender (rank, host, protocol version).
* :class:`PeerBuffers` - the same for RDMA-style transports (NIXL): agent metadata and the
  addresses of the receiver's two bucket buffers.
* :class:`Welcome` - the sender's answer: the bucket buffers to attach to and the bucket size.
* :class:`Attached` - a receiver has mapped/registered its buffers.
* :class:`BucketReady` - bucket ``bucket_index`` is in buffer ``slot`` (``nbytes`` used) with chunks.
* :class:`BucketAck` - a receiver is done with a bucket; its slot may be reused.
* :class:`SyncEnd` - the sender has sent every bucket (totals for cross-checking).
* :class:`Abort` - a side failed; ``reason`` says why (the peer raises with it).

The colocated path's messages (``Colocated*``, :data:`COLOCATED_CODEC`) and the SGLang loader's
:class:`PullRequest` (same version, :func:`encode_pull_request` / :func:`decode_pull_request`) are at
the end of this module, with the multi-sender engine's :class:`LaneManifest` (the last item of every
sender's lane, :func:`encode_lane_manifest` / :func:`decode_lane_manifest`).
"""

from __future__ import annotations

from typing import Any, Union, get_args

import msgspec

from verl_fastsync.chunks import CHUNK_SCHEMA_VERSION, ChunkMeta

__all__ = [
    "COLOCATED_CODEC",
    "COLOCATED_SCHEMA_VERSION",
    "WIRE_SCHEMA_VERSION",
    "Abort",
    "Attached",
    "BucketAck",
    "BucketReady",
    "Codec",
    "ColocatedAbort",
    "ColocatedAck",
    "ColocatedBucket",
    "ColocatedHello",
    "ColocatedHelloAck",
    "ColocatedMessage",
    "ColocatedReady",
    "Hello",
    "IpcHandle",
    "LaneManifest",
    "Message",
    "PeerBuffers",
    "PullRequest",
    "SlotDesc",
    "SyncEnd",
    "Welcome",
    "WireError",
    "WireVersionError",
    "check_chunk_versions",
    "check_version",
    "decode",
    "decode_lane_manifest",
    "decode_pull_request",
    "encode",
    "encode_lane_manifest",
    "encode_pull_request",
]

WIRE_SCHEMA_VERSION = 2
"""Version of the control messages; a receiver rejects any other version."""


class WireError(ValueError):
    """A control message could not be decoded."""


class WireVersionError(WireError):
    """The peer speaks another wire schema version."""


class _Base(msgspec.Struct, tag_field="type", kw_only=True):
    schema_version: int = WIRE_SCHEMA_VERSION


class Hello(_Base, tag="hello"):
    rank: int
    host: str
    pid: int
    mapped: list[str] = msgspec.field(default_factory=list)
    """Buffers of an earlier sync this receiver still has attached (e.g. shm segment names): the
    sender reuses them when every receiver has them."""
    lent: list[str] = msgspec.field(default_factory=list)
    """Those of ``mapped`` its consumer still references (lent, see ``BucketAck.kept``)."""


class PeerBuffers(_Base, tag="peer-buffers"):
    """A receiver's introduction for RDMA-style transports: its agent and bucket addresses."""

    rank: int
    host: str
    pid: int
    agent: str
    agent_metadata: bytes
    addresses: list[int]
    mem_type: str = "DRAM"
    device_id: int = 0


class Welcome(_Base, tag="welcome"):
    bucket_size: int
    buffers: list[str]
    """Transport-specific handles of the bucket buffers (e.g. shared-memory segment names)."""
    verify: bool = False
    slots: int = 2
    """How many slots the sender fills in turn (receivers follow the sender)."""


class Attached(_Base, tag="attached"):
    rank: int


class BucketReady(_Base, tag="bucket"):
    sync_id: str
    bucket_index: int
    slot: int
    nbytes: int
    chunks: list[ChunkMeta]
    buffer: str = ""
    """Which of the sender's buffers holds the bucket, where a slot can move between buffers (shm:
    a segment name); empty: the slot's own buffer."""
    dropped: list[str] = msgspec.field(default_factory=list)
    """Buffers the sender no longer uses: receivers unmap them."""


class BucketAck(_Base, tag="ack"):
    rank: int
    bucket_index: int
    slot: int
    kept: bool = False
    """The consumer still references the bucket's buffer (it was lent): never write into it again
    until this receiver names it in ``returned``."""
    returned: list[str] = msgspec.field(default_factory=list)
    """Buffers this receiver kept earlier whose last reference is gone."""
    address: int = 0
    """Where the sender writes this slot from now on (RDMA-style transports: one of the addresses the
    receiver announced in ``PeerBuffers``); 0: where it wrote so far."""


class SyncEnd(_Base, tag="end"):
    sync_id: str
    num_buckets: int
    num_tensors: int
    total_bytes: int
    dropped: list[str] = msgspec.field(default_factory=list)
    """Buffers the sender stopped using at the end of the sync (shm: segments beyond its slots and
    spare, including those a consumer still holds): receivers unmap them, so their memory is freed
    the moment the consumer lets go instead of staying mapped until the next sync."""


class Abort(_Base, tag="abort"):
    reason: str
    rank: int | None = None


Message = Union[Hello, PeerBuffers, Welcome, Attached, BucketReady, BucketAck, SyncEnd, Abort]  # noqa: UP007


class _Probe(msgspec.Struct):
    schema_version: int | None = None
    type: str = ""


_probe = msgspec.msgpack.Decoder(_Probe)


def check_version(
    data: bytes | memoryview, *, peer: str = "peer", expected: int = WIRE_SCHEMA_VERSION
) -> str:
    """The one schema-version rule of every control message (engine and colocated).

    The version is read before anything else is decoded. A message without ``schema_version`` is
    treated as version 0 (it predates versioning) and, like any version other than ``expected``,
    rejected with :class:`WireVersionError` naming both versions. Returns the message's ``type`` tag.
    """
    try:
        probe = _probe.decode(data)
    except msgspec.DecodeError as exc:
        raise WireError(f"undecodable control message from {peer}: {exc}") from exc
    _refuse_other_version(probe.schema_version, expected, f"wire schema: {peer} sent")
    return probe.type


def _refuse_other_version(sent: int | None, expected: int, what: str) -> None:
    """The one version rule: a missing version is 0, and any version but ``expected`` is refused."""
    version = 0 if sent is None else sent
    if version != expected:
        missing = " (no schema_version: treated as 0)" if sent is None else ""
        raise WireVersionError(
            f"incompatible verl-fastsync {what} version {version}{missing}, this side speaks version "
            f"{expected}; install the same verl-fastsync on both sides"
        )


class _ChunkProbe(msgspec.Struct):
    schema_version: int | None = None
    name: str = "?"


class _ChunksProbe(msgspec.Struct):
    chunks: list[_ChunkProbe] = []


_chunks_probe = msgspec.msgpack.Decoder(_ChunksProbe)


def check_chunk_versions(data: bytes | memoryview, *, peer: str = "peer") -> None:
    """The same rule for the :class:`~verl_fastsync.chunks.ChunkMeta` a message carries (``chunks``):
    ``ChunkMeta.schema_version`` defaults to the current version when a chunk is built in this
    process, so a chunk decoded without one would pass as current; read before decoding, it is
    version 0 and refused like any other version. A message whose ``chunks`` cannot even be probed
    is left to the decoder (which reports it malformed)."""
    try:
        probe = _chunks_probe.decode(data)
    except msgspec.DecodeError:
        return
    for chunk in probe.chunks:
        _refuse_other_version(
            chunk.schema_version,
            CHUNK_SCHEMA_VERSION,
            f"chunk schema: {peer} sent a chunk of tensor {chunk.name!r} with",
        )


class Codec:
    """Encoder/decoder of one tagged union of control messages, applying :func:`check_version`.

    ``Codec(Union[A, B, ...])``: each struct is tagged (``tag_field="type"``) and has a
    ``schema_version`` field defaulting to ``version``.
    """

    def __init__(self, union: Any, version: int = WIRE_SCHEMA_VERSION) -> None:
        self.version = version
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(union)
        # the tags of the messages that carry chunks (only those are probed for chunk versions)
        self._chunk_tags = {
            cls.__struct_config__.tag for cls in get_args(union) if "chunks" in cls.__struct_fields__
        }

    def encode(self, message: Any) -> bytes:
        return self._encoder.encode(message)

    def decode(self, data: bytes | memoryview, *, peer: str = "peer") -> Any:
        kind = check_version(data, peer=peer, expected=self.version)
        if kind in self._chunk_tags:
            check_chunk_versions(data, peer=peer)
        try:
            return self._decoder.decode(data)
        except msgspec.DecodeError as exc:
            raise WireError(f"malformed {kind or 'control'} message from {peer}: {exc}") from exc


_codec = Codec(Message)


def encode(message: Message) -> bytes:
    """Serialize an engine control message (msgpack)."""
    return _codec.encode(message)


def decode(data: bytes | memoryview, *, peer: str = "peer") -> Message:
    """Decode an engine control message (:func:`check_version` first)."""
    message: Message = _codec.decode(data, peer=peer)
    return message


# -- the colocated path (verl_fastsync.colocated): trainer -> engine workers on one host ----------

COLOCATED_SCHEMA_VERSION = 2
"""Version of the colocated messages (same rule: :func:`check_version`)."""


class _ColocatedBase(msgspec.Struct, tag_field="type", kw_only=True):
    schema_version: int = COLOCATED_SCHEMA_VERSION


class IpcHandle(msgspec.Struct, frozen=True, kw_only=True):
    """A CUDA-IPC export of one slot (the fields torch's ``rebuild_cuda_tensor`` needs)."""

    device: int
    handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes | None
    event_sync_required: bool


class SlotDesc(msgspec.Struct, frozen=True, kw_only=True):
    """One slot of the persistent bucket, as the receiver needs it to map it."""

    index: int
    nbytes: int
    token: str
    """Unique per allocation: a receiver keeps its mapping while the token is unchanged."""
    shm_name: str | None = None
    ipc: IpcHandle | None = None


class ColocatedReady(_ColocatedBase, tag="ready"):
    """Receiver -> sender, resent until the hello arrives: "this routing id receives this sync"."""

    receiver_pid: int
    mapped: list[str] = []
    """Tokens of the slots this receiver process already maps for this endpoint (the sender
    re-allocates slots nobody can attach any more, e.g. for a restarted receiver)."""


class ColocatedHello(_ColocatedBase, tag="hello"):
    sync_id: str
    transport: str
    slots: list[SlotDesc]
    sender_pid: int
    verify: bool = False


class ColocatedHelloAck(_ColocatedBase, tag="hello_ack"):
    sync_id: str
    error: str | None = None


class ColocatedBucket(_ColocatedBase, tag="bucket"):
    sync_id: str
    seq: int
    slot: int
    chunks: list[ChunkMeta]
    is_last: bool


class ColocatedAck(_ColocatedBase, tag="ack"):
    sync_id: str
    seq: int
    slot: int
    error: str | None = None


class ColocatedAbort(_ColocatedBase, tag="abort"):
    sync_id: str
    reason: str


ColocatedMessage = Union[  # noqa: UP007
    ColocatedReady, ColocatedHello, ColocatedHelloAck, ColocatedBucket, ColocatedAck, ColocatedAbort
]
COLOCATED_CODEC = Codec(ColocatedMessage, version=COLOCATED_SCHEMA_VERSION)


# -- the SGLang loader (verl_fastsync.colocated.sglang): one marker tensor per TP worker -------------


class PullRequest(msgspec.Struct, frozen=True, kw_only=True):
    """Trainer -> one SGLang TP worker, inside SGLang's ``update_weights_from_tensor`` request: the
    endpoint to pull its weights from (untagged; colocated schema version)."""

    zmq_handle: str
    timeout_s: float
    schema_version: int = COLOCATED_SCHEMA_VERSION


def encode_pull_request(request: PullRequest) -> bytes:
    """Serialize a :class:`PullRequest` (msgpack)."""
    return msgspec.msgpack.encode(request)


def decode_pull_request(data: bytes | memoryview, *, peer: str = "peer") -> PullRequest:
    """Decode a :class:`PullRequest` (:func:`check_version` first); :class:`WireError` otherwise."""
    check_version(data, peer=peer, expected=COLOCATED_SCHEMA_VERSION)
    try:
        return msgspec.msgpack.decode(data, type=PullRequest)
    except msgspec.DecodeError as exc:
        raise WireError(f"malformed pull request from {peer}: {exc}") from exc


# -- the multi-sender engine (verl_fastsync.transports.lanes): one manifest per sender's lane -----------


class LaneManifest(msgspec.Struct, frozen=True, kw_only=True):
    """The last item a sending trainer rank puts on its lane (``engine_kwargs.fastsync.senders``): what
    every lane carried, as this sender planned it from the whole weight sequence (untagged; engine
    schema version). Receivers check that all senders planned the same sync and that each lane
    delivered exactly its share."""

    lane: int
    sender: int
    """The trainer rank sending this lane."""
    counts: list[int]
    """Tensors per lane (index = lane)."""
    nbytes: list[int]
    """Bytes per lane."""
    digest: str
    """Hash of the whole planned sequence (name, bytes, lane of every tensor, in producer order)."""
    schema_version: int = WIRE_SCHEMA_VERSION


def encode_lane_manifest(manifest: LaneManifest) -> bytes:
    """Serialize a :class:`LaneManifest` (msgpack)."""
    return msgspec.msgpack.encode(manifest)


def decode_lane_manifest(data: bytes | memoryview, *, peer: str = "peer") -> LaneManifest:
    """Decode a :class:`LaneManifest` (:func:`check_version` first); :class:`WireError` otherwise."""
    check_version(data, peer=peer)
    try:
        return msgspec.msgpack.decode(data, type=LaneManifest)
    except msgspec.DecodeError as exc:
        raise WireError(f"malformed lane manifest from {peer}: {exc}") from exc
