"""Control-channel messages: msgpack round trips, version rejection, malformed input."""

from __future__ import annotations

import msgspec
import pytest

from verl_fastsync.chunks import ChunkMeta
from verl_fastsync.wire import (
    WIRE_SCHEMA_VERSION,
    Abort,
    Attached,
    BucketAck,
    BucketReady,
    Hello,
    SyncEnd,
    Welcome,
    WireError,
    WireVersionError,
    decode,
    encode,
)

META = ChunkMeta(
    name="layer.0.w",
    shape=(4, 2),
    dtype="float8_e4m3fn",
    total_bytes=8,
    chunk_offset=0,
    chunk_size=8,
    bucket_offset=16,
    tensor_index=3,
    checksum=123,
)

MESSAGES = [
    Hello(rank=1, host="h", pid=42),
    Welcome(bucket_size=1024, buffers=["a", "b"], verify=True),
    Attached(rank=2),
    BucketReady(sync_id="s", bucket_index=7, slot=1, nbytes=24, chunks=[META]),
    BucketAck(rank=1, bucket_index=7, slot=1),
    SyncEnd(sync_id="s", num_buckets=8, num_tensors=3, total_bytes=100),
    Abort(reason="boom", rank=None),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(message: object) -> None:
    data = encode(message)  # type: ignore[arg-type]
    assert isinstance(data, bytes)
    assert decode(data) == message
    assert msgspec.msgpack.decode(data)["schema_version"] == WIRE_SCHEMA_VERSION


def test_other_version_rejected_naming_both_versions() -> None:
    raw = msgspec.msgpack.decode(encode(MESSAGES[3]))
    raw["schema_version"] = WIRE_SCHEMA_VERSION + 1
    with pytest.raises(
        WireVersionError,
        match=rf"trainer sent version {WIRE_SCHEMA_VERSION + 1}, this side "
        rf"speaks version {WIRE_SCHEMA_VERSION}",
    ):
        decode(msgspec.msgpack.encode(raw), peer="trainer")
    # a future message type with other fields is still reported as a version problem, not a field error
    with pytest.raises(WireVersionError):
        decode(msgspec.msgpack.encode({"type": "new-thing", "schema_version": 2, "x": [1]}))
    # a message without a version at all (e.g. an ancient peer)
    with pytest.raises(WireVersionError, match=r"sent version 0 \(no schema_version: treated as 0\)"):
        decode(msgspec.msgpack.encode({"type": "hello", "rank": 1}))


def test_malformed_messages() -> None:
    with pytest.raises(WireError, match="undecodable"):
        decode(b"\xc1garbage")
    with pytest.raises(WireError, match="malformed hello"):
        decode(msgspec.msgpack.encode({"type": "hello", "schema_version": WIRE_SCHEMA_VERSION, "rank": "x"}))
    with pytest.raises(WireError, match="malformed"):
        decode(msgspec.msgpack.encode({"type": "unknown", "schema_version": WIRE_SCHEMA_VERSION}))


def test_never_pickle() -> None:
    import pickle

    with pytest.raises(WireError):
        decode(pickle.dumps({"schema_version": 1}))
