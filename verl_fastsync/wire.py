"""Control-channel messages of the engine transports: typed, versioned msgspec structs (msgpack).

Never pickle. Every message carries ``schema_version``; :func:`decode` checks it *before* decoding
the rest, so a peer speaking another version gets a :class:`WireVersionError` naming both versions
instead of a confusing field error.

Messages (tagged union, tag field ``type``):

* :class:`Hello` - a receiver introduces itself to the sender (rank, host, protocol version).
* :class:`PeerBuffers` - the same for RDMA-style transports (NIXL): agent metadata and the
  addresses of the receiver's two bucket buffers.
* :class:`Welcome` - the sender's answer: the bucket buffers to attach to and the bucket size.
* :class:`Attached` - a receiver has mapped/registered its buffers.
* :class:`BucketReady` - bucket ``bucket_index`` is in buffer ``slot`` (``nbytes`` used) with chunks.
* :class:`BucketAck` - a receiver is done with a bucket; its slot may be reused.
* :class:`SyncEnd` - the sender has sent every bucket (totals for cross-checking).
* :class:`Abort` - a side failed; ``reason`` says why (the peer raises with it).
"""

from __future__ import annotations

from typing import Union

import msgspec

from verl_fastsync.chunks import ChunkMeta

__all__ = [
    "WIRE_SCHEMA_VERSION",
    "Abort",
    "Attached",
    "BucketAck",
    "BucketReady",
    "Hello",
    "Message",
    "PeerBuffers",
    "SyncEnd",
    "Welcome",
    "WireError",
    "WireVersionError",
    "decode",
    "encode",
]

WIRE_SCHEMA_VERSION = 1
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
    """Transport-specific handles of the two bucket buffers (e.g. shared-memory segment names)."""
    verify: bool = False


class Attached(_Base, tag="attached"):
    rank: int


class BucketReady(_Base, tag="bucket"):
    sync_id: str
    bucket_index: int
    slot: int
    nbytes: int
    chunks: list[ChunkMeta]


class BucketAck(_Base, tag="ack"):
    rank: int
    bucket_index: int
    slot: int


class SyncEnd(_Base, tag="end"):
    sync_id: str
    num_buckets: int
    num_tensors: int
    total_bytes: int


class Abort(_Base, tag="abort"):
    reason: str
    rank: int | None = None


Message = Union[Hello, PeerBuffers, Welcome, Attached, BucketReady, BucketAck, SyncEnd, Abort]  # noqa: UP007


class _Probe(msgspec.Struct):
    schema_version: int = -1
    type: str = ""


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)
_probe = msgspec.msgpack.Decoder(_Probe)


def encode(message: Message) -> bytes:
    """Serialize a control message (msgpack)."""
    return _encoder.encode(message)


def decode(data: bytes | memoryview, *, peer: str = "peer") -> Message:
    """Decode a control message, rejecting another ``schema_version`` with :class:`WireVersionError`."""
    try:
        probe = _probe.decode(data)
    except msgspec.DecodeError as exc:
        raise WireError(f"undecodable control message from {peer}: {exc}") from exc
    if probe.schema_version != WIRE_SCHEMA_VERSION:
        raise WireVersionError(
            f"incompatible verl-fastsync wire schema: {peer} sent version {probe.schema_version}, "
            f"this side speaks version {WIRE_SCHEMA_VERSION}; install the same verl-fastsync on both sides"
        )
    try:
        return _decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise WireError(f"malformed {probe.type or 'control'} message from {peer}: {exc}") from exc
