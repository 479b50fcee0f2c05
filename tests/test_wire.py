"""Control-channel messages: msgpack round trips, version rejection, malformed input."""

from __future__ import annotations

import msgspec
import pytest

from verl_fastsync.chunks import CHUNK_SCHEMA_VERSION, ChunkMeta
from verl_fastsync.wire import (
    COLOCATED_CODEC,
    COLOCATED_SCHEMA_VERSION,
    WIRE_SCHEMA_VERSION,
    Abort,
    Attached,
    BucketAck,
    BucketReady,
    ColocatedBucket,
    Hello,
    PullRequest,
    SyncEnd,
    Welcome,
    WireError,
    WireVersionError,
    decode,
    decode_pull_request,
    encode,
    encode_pull_request,
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
        decode(
            msgspec.msgpack.encode({"type": "new-thing", "schema_version": WIRE_SCHEMA_VERSION + 1, "x": [1]})
        )
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


def _without_chunk_version(message: object) -> dict[str, object]:
    raw = msgspec.msgpack.decode(encode(message))  # type: ignore[arg-type]
    del raw["chunks"][0]["schema_version"]
    return raw


def test_chunk_without_schema_version_is_refused_like_a_message_without_one() -> None:
    # ChunkMeta.schema_version defaults to the current version in this process; from a peer a missing
    # one is version 0 and refused, not silently taken as current
    assert META.schema_version == CHUNK_SCHEMA_VERSION
    raw = _without_chunk_version(MESSAGES[3])
    with pytest.raises(
        WireVersionError,
        match=r"trainer sent a chunk of tensor 'layer.0.w' with version 0 \(no schema_version: treated as 0\)"
        rf", this side speaks version {CHUNK_SCHEMA_VERSION}",
    ):
        decode(msgspec.msgpack.encode(raw), peer="trainer")
    raw["chunks"][0]["schema_version"] = CHUNK_SCHEMA_VERSION + 1  # type: ignore[index]
    with pytest.raises(WireVersionError, match=rf"with version {CHUNK_SCHEMA_VERSION + 1}, this side"):
        decode(msgspec.msgpack.encode(raw))
    # the colocated path's bucket message follows the same rule
    bucket = ColocatedBucket(sync_id="s", seq=0, slot=0, chunks=[META], is_last=True)
    assert COLOCATED_CODEC.decode(COLOCATED_CODEC.encode(bucket)) == bucket
    with pytest.raises(WireVersionError, match="no schema_version: treated as 0"):
        COLOCATED_CODEC.decode(msgspec.msgpack.encode(_without_chunk_version(bucket)))


def test_malformed_chunks_are_still_reported_malformed() -> None:
    raw = msgspec.msgpack.decode(encode(MESSAGES[3]))
    raw["chunks"] = "not a list"
    with pytest.raises(WireError, match="malformed bucket message"):
        decode(msgspec.msgpack.encode(raw))


def test_pull_request_lives_here_and_follows_the_version_rule() -> None:
    from verl_fastsync.colocated import sglang

    assert sglang.PullRequest is PullRequest  # the old import keeps working
    request = PullRequest(zmq_handle="ipc:///tmp/x", timeout_s=5.0)
    assert request.schema_version == COLOCATED_SCHEMA_VERSION
    assert decode_pull_request(encode_pull_request(request)) == request
    raw = msgspec.msgpack.decode(encode_pull_request(request))
    del raw["schema_version"]
    with pytest.raises(WireVersionError, match=r"sent version 0 \(no schema_version: treated as 0\)"):
        decode_pull_request(msgspec.msgpack.encode(raw))
    with pytest.raises(WireError, match="malformed pull request"):
        decode_pull_request(msgspec.msgpack.encode({"schema_version": COLOCATED_SCHEMA_VERSION}))
