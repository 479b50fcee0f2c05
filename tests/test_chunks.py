"""Chunk core: split/merge round trips (hypothesis), bucket planning rules, assembler validation."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from verl_fastsync.chunks import (
    BUCKET_ALIGN,
    CHUNK_SCHEMA_VERSION,
    Assembler,
    Bucket,
    BucketPlanner,
    ChunkCorruptedError,
    ChunkMeta,
    ChunkMismatchError,
    DuplicateTensorError,
    EmptySyncError,
    IncompleteTensorError,
    aassemble,
    aplan_buckets,
    assemble,
    bucket_chunk_views,
    byte_view,
    chunk_checksum,
    dtype_to_str,
    leading_slice_bytes,
    pack_bucket,
    plan_buckets,
    str_to_dtype,
)

ALL_DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
    torch.complex128,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.float8_e4m3fnuz,
    torch.float8_e5m2fnuz,
]


def make_tensor(
    shape: tuple[int, ...], dtype: torch.dtype, seed: int, layout: str = "contig"
) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    full = list(shape)
    if layout == "strided" and full:
        full[-1] *= 2
    elif layout == "transposed" and len(full) >= 2:
        full[-1], full[-2] = full[-2], full[-1]
    numel = 1
    for d in full:
        numel *= d
    if dtype == torch.bool:
        raw = torch.randint(0, 2, (numel,), generator=gen, dtype=torch.uint8)
    else:
        raw = torch.randint(0, 256, (numel * dtype.itemsize,), generator=gen, dtype=torch.uint8)
    t = raw.view(dtype).reshape(full)
    if layout == "strided" and full:
        t = t[..., ::2]
    elif layout == "transposed" and len(full) >= 2:
        t = t.transpose(-1, -2)
    assert tuple(t.shape) == tuple(shape)
    return t


def roundtrip(
    named: list[tuple[str, torch.Tensor]], bucket_size: int, *, zero_copy: bool = False, **plan_kwargs: Any
) -> tuple[list[tuple[str, torch.Tensor]], list[Bucket]]:
    """Plan, pack into reusable buffers (as a transport would), and assemble."""
    buckets = list(plan_buckets(named, bucket_size, **plan_kwargs))
    out: list[tuple[str, torch.Tensor]] = []
    assembler = Assembler(zero_copy=zero_copy)
    for bucket in buckets:
        buffer = torch.full((bucket_size,), 0xAB, dtype=torch.uint8)
        pack_bucket(bucket, buffer)
        for meta, data in bucket_chunk_views(buffer[: bucket.nbytes], bucket.metas):
            for name, tensor in assembler.feed(meta, data):
                out.append((name, tensor.clone() if zero_copy else tensor))
    assembler.finish()
    return out, buckets


def assert_same(named: list[tuple[str, torch.Tensor]], out: list[tuple[str, torch.Tensor]]) -> None:
    assert [n for n, _ in out] == [n for n, _ in named]
    for (name, src), (_, dst) in zip(named, out, strict=True):
        assert dst.shape == src.shape, name
        assert dst.dtype == src.dtype, name
        assert dst.is_contiguous()
        assert torch.equal(byte_view(dst), byte_view(src)), name


shapes = st.lists(st.integers(0, 9), min_size=0, max_size=3).map(tuple)
tensor_specs = st.lists(
    st.tuples(shapes, st.sampled_from(ALL_DTYPES), st.sampled_from(["contig", "strided", "transposed"])),
    min_size=1,
    max_size=6,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    specs=tensor_specs,
    bucket_size=st.one_of(st.integers(1, 64), st.integers(65, 5000)),
    zero_copy=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_roundtrip_property(
    specs: list[tuple[tuple[int, ...], torch.dtype, str]], bucket_size: int, zero_copy: bool, seed: int
) -> None:
    named = [(f"t{i}", make_tensor(s, d, seed + i, layout)) for i, (s, d, layout) in enumerate(specs)]
    out, buckets = roundtrip(named, bucket_size, zero_copy=zero_copy)
    assert_same(named, out)
    for bucket in buckets:
        assert bucket.nbytes <= bucket_size
        for meta in bucket.metas:
            if meta.chunk_size:
                assert meta.bucket_offset % BUCKET_ALIGN == 0
                assert meta.bucket_offset + meta.chunk_size <= bucket_size


@settings(max_examples=60, deadline=None)
@given(
    experts=st.integers(1, 12),
    per_expert=st.integers(1, 40),
    bucket_size=st.integers(16, 600),
    prefix=st.integers(0, 300),
)
def test_expert_alignment_property(experts: int, per_expert: int, bucket_size: int, prefix: int) -> None:
    """With align=leading_slice_bytes, split chunks start and end on expert boundaries whenever one
    expert fits in a bucket; the bytes still round-trip."""
    named = [
        ("pad", make_tensor((prefix,), torch.uint8, 1)),
        ("experts", make_tensor((experts, per_expert), torch.float32, 2)),
    ]
    unit = leading_slice_bytes(named[1][1])
    assert unit == per_expert * 4
    out, buckets = roundtrip(named, bucket_size, align=lambda _n, t: leading_slice_bytes(t))
    assert_same(named, out)
    metas = [m for b in buckets for m in b.metas if m.name == "experts"]
    if unit <= bucket_size and len(metas) > 1:
        for meta in metas:
            assert meta.chunk_offset % unit == 0
            assert meta.chunk_size % unit == 0


def test_mapping_alignment_and_bad_alignment() -> None:
    t = make_tensor((4, 8), torch.float32, 0)
    buckets = list(plan_buckets([("w", t)], 80, align={"w": 32}))
    assert [m.chunk_size for b in buckets for m in b.metas] == [64, 64]
    with pytest.raises(ValueError, match="alignment for 'w' must be a positive int"):
        list(plan_buckets([("w", t)], 80, align={"w": 0}))


def test_conj_and_neg_views_resolve() -> None:
    c = torch.randn(5, dtype=torch.complex64).conj()
    assert c.is_conj()
    out, _ = roundtrip([("c", c)], 16)
    assert torch.equal(out[0][1], c.resolve_conj())


def test_buckets_filled_and_split() -> None:
    named = [("a", torch.zeros(100, dtype=torch.uint8)), ("b", torch.zeros(250, dtype=torch.uint8))]
    buckets = list(plan_buckets(named, 128))
    # a: 0..100 in bucket 0; b starts at 112 (16-byte aligned): 16 bytes there, then 128, then 106
    assert [(m.name, m.bucket_offset, m.chunk_offset, m.chunk_size) for b in buckets for m in b.metas] == [
        ("a", 0, 0, 100),
        ("b", 112, 0, 16),
        ("b", 0, 16, 128),
        ("b", 0, 144, 106),
    ]
    assert [b.index for b in buckets] == [0, 1, 2]
    assert all(m.tensor_index == 1 for m in buckets[2].metas)


def test_bucket_larger_than_model_is_one_bucket() -> None:
    named = [(f"t{i}", torch.randn(10)) for i in range(5)]
    out, buckets = roundtrip(named, 1 << 20)
    assert len(buckets) == 1
    assert_same(named, out)


def test_zero_size_and_zero_dim() -> None:
    named = [
        ("empty", torch.zeros(0, 3, dtype=torch.bfloat16)),
        ("scalar", torch.tensor(7, dtype=torch.int64)),
        ("empty1d", torch.zeros(0, dtype=torch.complex128)),
    ]
    out, buckets = roundtrip(named, 4, zero_copy=True)
    assert_same(named, out)
    assert out[1][1].shape == () and int(out[1][1]) == 7
    metas = [m for b in buckets for m in b.metas]
    assert metas[0].chunk_size == 0 and metas[0].total_bytes == 0


def test_async_planner_and_assembler_accept_async_iterables() -> None:
    named = [(f"t{i}", make_tensor((i + 3, 5), torch.float16, i)) for i in range(4)]

    async def gen() -> Any:
        for item in named:
            yield item

    async def run() -> list[tuple[str, torch.Tensor]]:
        chunks: list[tuple[ChunkMeta, torch.Tensor]] = []
        async for bucket in aplan_buckets(gen(), 40):
            buf = torch.empty(40, dtype=torch.uint8)
            pack_bucket(bucket, buf)
            chunks += [(m, d.clone()) for m, d in bucket_chunk_views(buf, bucket.metas)]

        async def chunk_gen() -> Any:
            for c in chunks:
                yield c

        return [item async for item in aassemble(chunk_gen())]

    out = asyncio.run(run())
    assert_same(named, out)

    async def run_sync_inputs() -> list[tuple[str, torch.Tensor]]:
        buckets = [b async for b in aplan_buckets(iter(named), 1000)]
        buf = torch.empty(1000, dtype=torch.uint8)
        pack_bucket(buckets[0], buf)
        return [item async for item in aassemble(list(bucket_chunk_views(buf, buckets[0].metas)))]

    assert_same(named, asyncio.run(run_sync_inputs()))


# -- errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "64", None])
def test_bad_bucket_size(bad: Any) -> None:
    with pytest.raises((ValueError, TypeError), match="bucket_size must be a positive"):
        list(plan_buckets([("a", torch.zeros(1))], bad))


def test_duplicate_names_rejected() -> None:
    with pytest.raises(DuplicateTensorError, match="'a' appears twice"):
        list(plan_buckets([("a", torch.zeros(1)), ("a", torch.zeros(2))], 64))


def test_non_tensor_values_rejected() -> None:
    with pytest.raises(TypeError, match=r"weight 'a' is a list, not a torch\.Tensor"):
        list(plan_buckets([("a", [1, 2])], 64))  # type: ignore[list-item]
    with pytest.raises(TypeError, match="names must be str"):
        list(plan_buckets([(3, torch.zeros(1))], 64))  # type: ignore[list-item]
    with pytest.raises(TypeError, match=r"\(name, tensor\) pairs"):
        list(plan_buckets([torch.zeros(1)], 64))  # type: ignore[list-item]
    with pytest.raises(TypeError, match="meta device"):
        list(plan_buckets([("m", torch.empty(3, device="meta"))], 64))
    with pytest.raises(TypeError, match="only dense"):
        list(plan_buckets([("s", torch.eye(3).to_sparse())], 64))


def test_empty_sync_is_an_error_unless_allowed() -> None:
    with pytest.raises(EmptySyncError, match="no tensor"):
        list(plan_buckets([], 64))
    assert list(plan_buckets([], 64, allow_empty=True)) == []
    assert list(assemble([])) == []


def _chunks(named: list[tuple[str, torch.Tensor]], bucket: int) -> list[tuple[ChunkMeta, torch.Tensor]]:
    out = []
    for b in plan_buckets(named, bucket):
        buf = torch.empty(bucket, dtype=torch.uint8)
        pack_bucket(b, buf)
        out += [(m, d.clone()) for m, d in bucket_chunk_views(buf, b.metas)]
    return out


def test_incomplete_tensor_named_at_end() -> None:
    chunks = _chunks([("w", torch.randn(64))], 64)
    assert len(chunks) == 4
    with pytest.raises(IncompleteTensorError, match=r"'w' \(192/256 bytes\)"):
        list(assemble(chunks[:3]))


def test_tensor_never_yielded_before_complete() -> None:
    chunks = _chunks([("w", torch.randn(64))], 64)
    asm = Assembler()
    results = [asm.feed(m, d) for m, d in chunks]
    assert results[:-1] == [[], [], []]
    assert results[-1][0][0] == "w"
    assert asm.peak_in_progress_bytes == 256 and asm.in_progress_bytes == 0


def test_out_of_order_chunks_assemble() -> None:
    t = torch.randn(64)
    chunks = _chunks([("w", t)], 64)
    out = list(assemble(list(reversed(chunks))))
    assert torch.equal(out[0][1], t)


def test_mismatched_metadata_rejected() -> None:
    chunks = _chunks([("w", torch.randn(64))], 64)
    meta, data = chunks[1]
    asm = Assembler()
    asm.feed(*chunks[0])
    with pytest.raises(ChunkMismatchError, match=r"'w': chunk metadata .* differs from its first chunk"):
        asm.feed(msgspec.structs.replace(meta, shape=(32, 2)), data)
    with pytest.raises(ChunkMismatchError, match="differs"):
        asm.feed(msgspec.structs.replace(meta, dtype="int32"), data)


def test_overlap_and_range_rejected() -> None:
    chunks = _chunks([("w", torch.randn(64))], 64)
    asm = Assembler()
    asm.feed(*chunks[0])
    meta, data = chunks[1]
    with pytest.raises(ChunkMismatchError, match="overlaps"):
        asm.feed(msgspec.structs.replace(meta, chunk_offset=32), data)
    with pytest.raises(ChunkMismatchError, match="out of range"):
        asm.feed(msgspec.structs.replace(meta, chunk_offset=250), data)
    with pytest.raises(ChunkMismatchError, match="data has"):
        asm.feed(meta, data[:10])
    with pytest.raises(ChunkMismatchError, match="total_bytes=9"):
        asm.feed(msgspec.structs.replace(meta, total_bytes=9), data)
    with pytest.raises(ChunkMismatchError, match="unknown torch dtype"):
        asm.feed(msgspec.structs.replace(meta, dtype="nonsense"), data)
    with pytest.raises(ChunkMismatchError, match="schema version 99"):
        asm.feed(msgspec.structs.replace(meta, schema_version=99), data)
    with pytest.raises(ChunkMismatchError, match="outside the 64-byte bucket"):
        list(
            bucket_chunk_views(
                torch.empty(64, dtype=torch.uint8), [msgspec.structs.replace(meta, bucket_offset=8)]
            )
        )


def test_duplicate_on_receiver_rejected() -> None:
    chunks = _chunks([("w", torch.randn(4))], 64)
    asm = Assembler()
    asm.feed(*chunks[0])
    with pytest.raises(DuplicateTensorError, match="'w' received twice"):
        asm.feed(*chunks[0])


def test_verify_checksums() -> None:
    chunks = _chunks([("w", torch.randn(64))], 64)
    signed = [(msgspec.structs.replace(m, checksum=chunk_checksum(d)), d) for m, d in chunks]
    assert len(list(assemble(signed, verify=True))) == 1
    bad = [(m, d.clone()) for m, d in signed]
    bad[2][1][5] ^= 0xFF
    with pytest.raises(ChunkCorruptedError, match="tensor 'w': chunk \\[128, 192\\) is corrupted"):
        list(assemble(bad, verify=True))
    with pytest.raises(ChunkCorruptedError, match="sent no checksum"):
        list(assemble(chunks, verify=True))


def test_zero_copy_views_alias_bucket_and_copies_do_not() -> None:
    named = [("a", torch.arange(8, dtype=torch.int32))]
    bucket = next(plan_buckets(named, 64))
    buf = torch.zeros(64, dtype=torch.uint8)
    pack_bucket(bucket, buf)
    ((meta, data),) = list(bucket_chunk_views(buf, bucket.metas))
    view = Assembler(zero_copy=True).feed(meta, data)[0][1]
    copy = Assembler(zero_copy=False).feed(meta, data)[0][1]
    assert view.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
    assert copy.untyped_storage().data_ptr() != buf.untyped_storage().data_ptr()
    buf.zero_()
    assert int(view.sum()) == 0 and torch.equal(copy, named[0][1])


def test_meta_struct_round_trip_and_dtypes() -> None:
    meta = ChunkMeta(
        name="x",
        shape=(2, 3),
        dtype="bfloat16",
        total_bytes=12,
        chunk_offset=0,
        chunk_size=12,
        bucket_offset=0,
        tensor_index=0,
    )
    assert meta.schema_version == CHUNK_SCHEMA_VERSION
    assert meta.checksum is None and meta.is_whole
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(meta), type=ChunkMeta) == meta
    for dtype in ALL_DTYPES:
        assert str_to_dtype(dtype_to_str(dtype)) == dtype
    with pytest.raises(ChunkMismatchError):
        str_to_dtype("Tensor")


def test_planner_statistics() -> None:
    planner = BucketPlanner(100)
    assert planner.add("a", torch.zeros(300, dtype=torch.uint8))
    planner.add("b", torch.zeros(10, dtype=torch.uint8))
    planner.finish()
    assert (planner.num_tensors, planner.total_bytes, planner.largest_tensor_bytes) == (2, 310, 300)
