"""The delta codec (:mod:`verl_fastsync.delta.codec`): bit-exact round trips for every dtype's bytes and
changed fraction, odd and empty sizes, NaN payloads and signed zeros compared as bits; the raw fallback;
every truncation and every corrupted byte of an encoding raises instead of decoding wrong bytes; a failed
in-place decode leaves the base as it was."""

from __future__ import annotations

import importlib.util
import sys
import threading
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verl_fastsync.delta import codec, compare
from verl_fastsync.delta.codec import (
    BLOCK,
    HEADER,
    Delta,
    DeltaCorruptedError,
    DeltaDigestError,
    DeltaError,
    Kind,
    as_bytes,
    decode,
    decode_in_place,
    element_width,
    encode,
    sparse_size,
)

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.int8, torch.int32, torch.int64, torch.bool]
FRACTIONS = [0.0, 0.02, 0.5, 1.0]


def _tensor(dtype: torch.dtype, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(n, generator=g) < 0.5
    if dtype.is_floating_point:
        return torch.randn(n, generator=g).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -(2**31)), min(info.max, 2**31 - 1), (n,), generator=g, dtype=dtype)


def _changed(base: torch.Tensor, fraction: float, seed: int) -> tuple[torch.Tensor, int]:
    """``base`` with exactly ``round(fraction * n)`` elements changed (every changed one differs in its
    bits), and that count."""
    n = base.numel()
    count = round(fraction * n)
    where = torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:count]
    new = base.clone()
    if base.dtype == torch.bool:
        new[where] = ~base[where]
    else:  # flip the lowest bit: the smallest change an optimizer step makes to a bf16 value
        bits = new.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[base.element_size()])
        bits[where] ^= 1
    return new, count


def _bits(buffer: object) -> bytes:
    return as_bytes(buffer).tobytes()


@pytest.mark.parametrize("fraction", FRACTIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_is_bit_exact_for_every_dtype_and_changed_fraction(
    dtype: torch.dtype, fraction: float
) -> None:
    base = _tensor(dtype, 3 * BLOCK + 17, seed=1)  # several index blocks, a partial last one
    new, count = _changed(base, fraction, seed=2)
    delta = encode(base, new, base.element_size())
    assert delta.size == new.numel() * new.element_size()
    assert delta.kind is (Kind.SPARSE if fraction <= 0.02 else Kind.RAW)
    assert delta.changed == (count if delta.kind is Kind.SPARSE else None)
    wire = delta.tobytes()
    assert len(wire) == delta.nbytes
    assert _bits(decode(base, wire)) == _bits(new)
    in_place = base.clone()  # the receiver's way: the base becomes the new bytes
    decode(in_place, wire, out=in_place)
    assert _bits(in_place) == _bits(new)
    sender = base.clone()  # the sender's way: its base becomes what it sent
    assert encode(sender, new, base.element_size(), update_base=True).tobytes() == wire
    assert _bits(sender) == _bits(new)


def test_a_bf16_bucket_with_2_percent_changed_costs_under_5_percent_of_its_bytes() -> None:
    base = _tensor(torch.bfloat16, 1 << 20, seed=3)
    new, count = _changed(base, 0.02, seed=4)
    delta = encode(base, new, 2)
    assert delta.kind is Kind.SPARSE and delta.payload_bytes == sparse_size(2 << 20, 2, count)
    assert delta.nbytes < 0.042 * (2 << 20)
    unchanged = encode(base, base.clone(), 2)
    assert unchanged.changed == 0 and unchanged.nbytes < 200  # counts per block, nothing else


def test_bits_not_float_equality_decide_what_changed() -> None:
    # -0.0 vs 0.0 compare equal as floats; NaNs with other payloads compare unequal to everything,
    # the same NaN included: the codec must see neither as floats
    base = torch.tensor([0.0, -0.0, 1.0, 0.0, 2.0, 3.0] + [1.0] * 10, dtype=torch.bfloat16).repeat(40)
    bits = base.view(torch.int16)
    bits[4::16] = 0x7FC1  # a quiet NaN with payload 1
    new = base.clone()
    new[0::16] = -0.0  # 0.0 -> -0.0: equal as floats, other bits
    new[1::16] = 0.0  # -0.0 -> 0.0
    new.view(torch.int16)[4::16] = 0x7FC2  # another NaN payload
    new.view(torch.int16)[5::16] = 0x7FC1  # 3.0 -> NaN
    # elements 2 (1.0) and 3 (0.0) stay, the NaN at 4 changes payload: 4 of every 16 elements changed
    delta = encode(base, new, 2, max_ratio=1.0)
    assert delta.kind is Kind.SPARSE and delta.changed == 4 * 40
    out = decode(base, delta.tobytes())
    assert out.tobytes() == _bits(new)
    assert (out.view(np.uint16)[4::16] == 0x7FC2).all() and (out.view(np.uint16)[0::16] == 0x8000).all()
    same_nan = base.clone()  # an unchanged NaN is unchanged, though NaN != NaN
    assert encode(base, same_nan, 2).changed == 0


@pytest.mark.parametrize("width", [1, 2, 4, 8])
@pytest.mark.parametrize("size", [0, 1, 3, 5, 7, 9, 2 * BLOCK + 3, 8 * BLOCK + 7])
def test_empty_and_odd_lengths_round_trip_at_every_width(size: int, width: int) -> None:
    rng = np.random.default_rng(size * 10 + width)
    base = rng.integers(0, 256, size, dtype=np.uint8)
    for fraction in (0.0, 0.01, 1.0):
        new = base.copy()
        new[rng.random(size) < fraction] ^= 0x80
        new[size - size % width :] ^= 0xFF  # the bytes past the last whole element change too
        delta = encode(base, new, width, max_ratio=1.0)
        assert decode(base, delta.tobytes()).tobytes() == new.tobytes()
    assert encode(base, base, width).size == size


def test_changes_at_block_edges_and_the_last_element() -> None:
    base = np.zeros(2 * (3 * BLOCK + 5), dtype=np.uint8)  # 3 blocks and 5 elements of 2 bytes
    new = base.copy()
    elements = new.view(np.uint16)
    for i in (0, BLOCK - 1, BLOCK, 2 * BLOCK - 1, 3 * BLOCK, elements.size - 1):
        elements[i] = 0xFFFF - i % 7
    delta = encode(base, new, 2)
    assert delta.kind is Kind.SPARSE and delta.changed == 6
    assert decode(base, delta.tobytes()).tobytes() == new.tobytes()


@pytest.mark.parametrize("scan", [1, 7, 64, compare.SCAN])
def test_changes_across_scan_slices_and_the_early_stop(monkeypatch: pytest.MonkeyPatch, scan: int) -> None:
    monkeypatch.setattr(compare, "SCAN", scan)
    rng = np.random.default_rng(scan)
    base = rng.integers(0, 256, 4 * 1000 + 3, dtype=np.uint8)
    for fraction in (0.0, 0.05, 0.2, 0.9):
        new = np.where(
            rng.random(base.size) < fraction, rng.integers(0, 256, base.size, dtype=np.uint8), base
        )
        expected = int(np.count_nonzero(base[:4000].view(np.uint32) != new[:4000].view(np.uint32)))
        delta = encode(base, new, 4)
        assert delta.changed == (expected if delta.kind is Kind.SPARSE else None)
        assert delta.kind is (Kind.SPARSE if fraction < 0.2 else Kind.RAW)
        assert decode(base, delta.tobytes()).tobytes() == new.tobytes()
    late = base.copy()  # unchanged until the last slice, then every element changes: raw
    late[-400:] ^= 0xFF
    assert encode(base, late, 4, max_ratio=0.1).kind is Kind.RAW


@pytest.mark.parametrize("threads", [2, 5])
def test_ranges_compared_in_threads_give_the_one_thread_encoding(
    monkeypatch: pytest.MonkeyPatch, threads: int
) -> None:
    # slices of 1000 elements (not a divisor of an index block: ranges must still start on one)
    monkeypatch.setattr(compare, "SCAN", 1000)
    rng = np.random.default_rng(threads)
    base = rng.integers(0, 256, 2 * (5 * BLOCK + 123) + 1, dtype=np.uint8)
    for fraction in (0.0, 0.001, 0.05, 0.2, 0.9):
        new = np.where(
            rng.random(base.size) < fraction, rng.integers(0, 256, base.size, dtype=np.uint8), base
        )
        monkeypatch.setattr(compare, "THREADS", 1)
        serial = encode(base, new, 2)
        monkeypatch.setattr(compare, "THREADS", threads)
        sender = base.copy()
        parallel = encode(sender, new, 2, update_base=True)
        assert parallel.kind is serial.kind and parallel.tobytes() == serial.tobytes()
        assert decode(base, parallel.tobytes()).tobytes() == new.tobytes()
        assert sender.tobytes() == new.tobytes()  # the base is the new bytes, sparse or raw
    # the first ranges find few changes and write them into the base, the last one spends the budget:
    # raw, and the base still ends as the new bytes
    late = base.copy()
    late[-2 * BLOCK :] ^= 0xFF
    sender = base.copy()
    assert encode(sender, late, 2, max_ratio=0.2, update_base=True).kind is Kind.RAW
    assert sender.tobytes() == late.tobytes()


def test_a_sample_that_says_raw_skips_the_scan_and_errs_only_in_speed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rng = np.random.default_rng(11)
    size = 8 * compare.SAMPLE
    base = rng.integers(0, 1 << 16, size, dtype=np.uint16)
    stride = size // compare.SAMPLE

    def no_scan(*args: object) -> None:
        raise AssertionError("scanned although the sample said raw")

    every = base ^ 0x5A5A  # re-initialised weights: the sample decides, nothing is scanned
    with monkeypatch.context() as patched:
        patched.setattr(codec, "changes", no_scan)
        sender = base.copy()
        assert encode(sender, every, 2, update_base=True).kind is Kind.RAW
        assert sender.tobytes() == every.tobytes()
    sampled = base.copy()  # only the sampled elements changed (12.5%): the sample errs, raw all the same
    sampled[::stride] ^= 1
    assert encode(base, sampled, 2).kind is Kind.RAW
    assert decode(base, encode(base, sampled, 2).tobytes()).tobytes() == sampled.tobytes()
    unsampled = base ^ 1  # all but the sampled ones changed: the scan finds it and stops
    unsampled[::stride] = base[::stride]
    assert encode(base, unsampled, 2).kind is Kind.RAW
    few = base.copy()  # a few changed, some of them sampled: scanned, sparse, exact
    few[:: stride * 7] ^= 1
    few[3::101] ^= 1
    delta = encode(base, few, 2)
    assert delta.kind is Kind.SPARSE and delta.changed == int(np.count_nonzero(base != few))
    assert decode(base, delta.tobytes()).tobytes() == few.tobytes()


@pytest.mark.parametrize("threads", [1, 2, 5])
def test_undo_puts_the_base_back_and_a_raw_outcome_leaves_it_untouched(
    monkeypatch: pytest.MonkeyPatch, threads: int
) -> None:
    """``encode(update_base=True, undo=True)``: a sparse outcome updates the base and its patch puts it
    back exactly (about the delta's size); a raw one leaves the base as it was, also when the first
    range had finished and written its changes before the last one spent the budget, or the sample
    decided."""
    monkeypatch.setattr(compare, "SCAN", 1000)
    monkeypatch.setattr(compare, "THREADS", threads)
    rng = np.random.default_rng(threads)
    elements = 6 * BLOCK
    base = rng.integers(0, 256, 2 * elements + 1, dtype=np.uint8)
    new = base.copy()
    new[:-1].view(np.uint16)[rng.choice(elements, 3000, replace=False)] ^= 1
    new[-1] ^= 0x10  # the odd tail byte too
    sender = base.copy()
    delta = encode(sender, new, 2, update_base=True, undo=True)
    assert delta.kind is Kind.SPARSE and delta.undo is not None
    assert sender.tobytes() == new.tobytes()
    assert delta.undo.nbytes <= delta.payload_bytes
    delta.undo.apply(sender)
    assert sender.tobytes() == base.tobytes()

    late = base.copy()  # a few changes everywhere, then the last block changes (but where sampled)
    values = late[:-1].view(np.uint16)
    values[::4099] ^= 1
    values[-BLOCK:] ^= 1
    stride = elements // compare.SAMPLE
    values[-BLOCK:][(BLOCK - elements) % stride :: stride] ^= 1  # the sample sees none of the late changes
    first_done = threading.Event()
    changes_in = compare.changes_in

    def first_range_first(*args: Any) -> Any:  # the first range finishes before any other starts
        if args[2] != 0:
            assert first_done.wait(60)
        try:
            return changes_in(*args)
        finally:
            if args[2] == 0:
                first_done.set()

    monkeypatch.setattr(compare, "changes_in", first_range_first)
    put_back = compare.Changes.put_back
    written: list[int] = []

    def counted(self: Any, old: np.ndarray) -> None:
        written.append(self.low.size)
        put_back(self, old)

    monkeypatch.setattr(compare.Changes, "put_back", counted)
    for changed in (late, base ^ 0x5A):  # scanned, stopped late; re-initialised (the sample decides)
        sender = base.copy()
        delta = encode(sender, changed, 2, max_ratio=0.2, update_base=True, undo=True)
        assert delta.kind is Kind.RAW and delta.undo is None
        assert sender.tobytes() == base.tobytes()
        if changed is late:  # what the finished ranges had written was put back
            assert sum(written) > 0, written


@pytest.mark.parametrize("kind", ["sparse", "raw"])
def test_decode_in_place_returns_the_patch_that_puts_the_base_back(kind: str) -> None:
    base, new, wire = _small(kind)
    target = base.copy()
    patch = decode_in_place(target, wire)
    assert target.tobytes() == new.tobytes()
    # the old values of the changed elements (sparse), or the whole old bytes (raw)
    assert patch.nbytes == base.nbytes if kind == "raw" else patch.nbytes < 0.1 * base.nbytes
    patch.apply(target)
    assert target.tobytes() == base.tobytes()
    if kind == "sparse":
        other = base.copy()
        other[10] ^= 1  # another base: raises, nothing written
        kept = other.copy()
        with pytest.raises(DeltaDigestError):
            decode_in_place(other, wire)
        assert other.tobytes() == kept.tobytes()
    empty = np.empty(0, dtype=np.uint8)
    decode_in_place(empty, encode(empty, empty, 1).tobytes()).apply(empty)


def _encode_in_child(base: np.ndarray, new: np.ndarray, expected: bytes) -> None:
    sys.exit(0 if encode(base, new, 2).tobytes() == expected else 3)


def test_a_forked_child_encodes_with_threads_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    import multiprocessing

    monkeypatch.setattr(compare, "SCAN", 1000)
    monkeypatch.setattr(compare, "THREADS", 2)
    rng = np.random.default_rng(12)
    base = rng.integers(0, 256, 8 * BLOCK, dtype=np.uint8)
    new = base.copy()
    new[::97] ^= 1
    expected = encode(base, new, 2).tobytes()  # the parent's threads exist now
    child = multiprocessing.get_context("fork").Process(target=_encode_in_child, args=(base, new, expected))
    child.start()
    child.join(timeout=60)  # the parent's threads do not exist in the child: work given them never ends
    if child.is_alive():
        child.kill()
        child.join()
        pytest.fail("a forked child's encode hung on the parent's thread pool")
    assert child.exitcode == 0


def test_raw_fallback_when_the_delta_is_not_smaller() -> None:
    base = _tensor(torch.float32, 10_000, seed=5)
    half, _ = _changed(base, 0.5, seed=6)  # sparse: 0.5 * (2 + 4) / 4 = 75% of the bytes
    assert encode(base, half, 4, max_ratio=1.0).kind is Kind.SPARSE  # smaller: sparse
    raw = encode(base, half, 4)  # past DEFAULT_MAX_RATIO: raw
    assert raw.kind is Kind.RAW and raw.nbytes == HEADER.size + 40_000
    assert np.shares_memory(raw.parts[0], as_bytes(half))  # raw sends the new bytes, uncopied
    every, _ = _changed(base, 1.0, seed=7)  # sparse would be 150%: raw even at max_ratio 1
    assert encode(base, every, 4, max_ratio=1.0).kind is Kind.RAW
    tiny = np.zeros(4, dtype=np.uint8)  # the counts alone outweigh 4 bytes: raw
    assert encode(tiny, tiny.copy(), 2, max_ratio=1.0).kind is Kind.RAW
    sender = base.clone()
    encode(sender, every, 4, update_base=True)
    assert _bits(sender) == _bits(every)


@given(
    size=st.integers(0, 3000),
    width=st.sampled_from([1, 2, 4, 8]),
    seed=st.integers(0, 2**32 - 1),
    fraction=st.floats(0.0, 1.0),
    max_ratio=st.floats(0.0, 1.0),
)
@settings(max_examples=150, deadline=None)
def test_round_trip_property(size: int, width: int, seed: int, fraction: float, max_ratio: float) -> None:
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, size, dtype=np.uint8)
    new = np.where(rng.random(size) < fraction, rng.integers(0, 256, size, dtype=np.uint8), base)
    delta = encode(base, new, width, max_ratio=max_ratio)
    assert delta.kind is Kind.RAW or delta.payload_bytes <= max_ratio * size
    assert decode(base, delta.tobytes()).tobytes() == new.tobytes()


def _small(kind: str = "sparse") -> tuple[np.ndarray, np.ndarray, bytes]:
    """A 601-byte base, the new bytes (3 of 300 elements and the odd tail byte changed) and their
    encoding of ``kind``."""
    base = np.arange(300, dtype=np.uint16).view(np.uint8).copy()  # 600 bytes
    new = base.copy()
    new.view(np.uint16)[[3, 100, 299]] += 1
    new = np.concatenate([new, np.array([7], dtype=np.uint8)])  # an odd tail byte too
    base = np.concatenate([base, np.array([9], dtype=np.uint8)])
    delta = encode(base, new, 2, max_ratio=0.5 if kind == "sparse" else 0.0)
    assert delta.kind is Kind[kind.upper()]
    return base, new, delta.tobytes()


@pytest.mark.parametrize("kind", ["sparse", "raw"])
def test_every_truncation_raises_a_clear_error(kind: str) -> None:
    base, _new, wire = _small(kind)
    for cut in range(len(wire)):
        with pytest.raises(DeltaCorruptedError, match=r"truncated|header|payload|magic"):
            decode(base, wire[:cut])
    with pytest.raises(DeltaCorruptedError, match="payload"):
        decode(base, wire + b"\0")


@pytest.mark.parametrize("kind", ["sparse", "raw"])
def test_every_corrupted_byte_raises_and_leaves_an_in_place_base_unchanged(kind: str) -> None:
    base, _new, wire = _small(kind)
    for at in range(len(wire)):
        for flip in (0x01, 0x80):
            corrupted = bytearray(wire)
            corrupted[at] ^= flip
            target = base.copy()
            with pytest.raises(DeltaCorruptedError):
                decode(target, bytes(corrupted), out=target)
            assert target.tobytes() == base.tobytes(), f"byte {at} ^ {flip:#x} left the base changed"


def test_a_delta_against_another_base_raises_and_keeps_the_base() -> None:
    base, _new, wire = _small()
    other = base.copy()
    other[10] ^= 1  # the receiver's base is not the sender's
    kept = other.copy()
    with pytest.raises(DeltaDigestError, match="another base"):
        decode(other, wire, out=other)
    assert other.tobytes() == kept.tobytes()
    with pytest.raises(DeltaCorruptedError, match="601 bytes but the base has 600"):
        decode(base[:600], wire)


def test_argument_errors() -> None:
    a = np.zeros(8, dtype=np.uint8)
    with pytest.raises(DeltaError, match="equal lengths"):
        encode(a, np.zeros(9, dtype=np.uint8), 1)
    with pytest.raises(DeltaError, match="width"):
        encode(a, a, 3)
    with pytest.raises(DeltaError, match="writable"):
        encode(bytes(8), a, 1, update_base=True)
    with pytest.raises(DeltaError, match="undo needs update_base"):
        encode(a.copy(), a, 1, undo=True)
    with pytest.raises(DeltaError, match="contiguous"):
        as_bytes(torch.zeros(4, 4).t())
    with pytest.raises(DeltaError, match="overlaps"):
        big = np.zeros(16, dtype=np.uint8)
        decode(big[:8], encode(big[:8], a, 1).tobytes(), out=big[4:12])


def test_torch_tensors_in_and_out_0d_and_empty() -> None:
    for base, new in [
        (torch.tensor(1.5, dtype=torch.bfloat16), torch.tensor(-1.5, dtype=torch.bfloat16)),
        (torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64)),
        (torch.zeros(3, 5, dtype=torch.float16), torch.ones(3, 5, dtype=torch.float16)),
    ]:
        delta: Delta = encode(base, new, base.element_size())
        target = base.clone()
        decode(base, delta.tobytes(), out=target)  # into a tensor's own storage
        assert _bits(target) == _bits(new)


@pytest.mark.parametrize("threads", [1, 2, 8])
def test_memory_follows_the_changed_elements_not_the_bucket(
    monkeypatch: pytest.MonkeyPatch, threads: int
) -> None:
    # a 16 MiB bf16 bucket, 1% changed: encoding and decoding in place allocate in proportion to the
    # ~84k changed elements (indices, values, one compare slice shared by every thread), never a
    # bucket-sized temporary, however many threads compare
    monkeypatch.setattr(compare, "THREADS", threads)
    base = _tensor(torch.bfloat16, 8 << 20, seed=8)
    new, count = _changed(base, 0.01, seed=9)
    sender, receiver = base.clone(), base.clone()
    tracemalloc.start()
    try:
        delta = encode(sender, new, 2, update_base=True)
        encode_peak = tracemalloc.get_traced_memory()[1]
        wire = np.frombuffer(delta.tobytes(), dtype=np.uint8)
        tracemalloc.reset_peak()
        decode(receiver, wire, out=receiver)
        decode_peak = tracemalloc.get_traced_memory()[1] - wire.nbytes
    finally:
        tracemalloc.stop()
    assert delta.kind is Kind.SPARSE and delta.changed == count
    assert encode_peak < 4 << 20, encode_peak  # a bucket-sized mask alone would be 8 MiB
    assert decode_peak < 4 << 20, decode_peak
    assert _bits(sender) == _bits(new) == _bits(receiver)


def test_the_measurement_script_runs_and_checks_what_it_measures(monkeypatch: pytest.MonkeyPatch) -> None:
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "delta_codec.py"
    spec = importlib.util.spec_from_file_location("delta_codec_bench", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, bench)  # its dataclasses look their module up
    spec.loader.exec_module(bench)
    rows = bench.run(1e-6, steps=1, bucket=1 << 20, comps=bench.compressors())
    assert [row.step for row in rows] == ["1", "re-init"]
    assert 0.0 < rows[0].changed < 0.2 and rows[0].kinds == {"SPARSE": rows[0].raw // (1 << 20) + 1}
    assert rows[1].changed > 0.9 and set(rows[1].kinds) == {"RAW"}
    assert rows[0].size["codec"] < 0.2 * rows[0].raw and "xor+zlib1" in rows[0].size
    assert "| 1e-06 | re-init |" in bench.table(rows)


def test_element_width_divides_every_itemsize_in_a_bucket() -> None:
    assert element_width([2]) == 2 and element_width([2, 4, 2]) == 2 and element_width([4, 8]) == 4
    assert element_width([1, 2]) == 1 and element_width([16]) == 8 and element_width([]) == 8
    assert element_width([t.itemsize for t in DTYPES]) == 1  # bool and int8 are one byte


@pytest.mark.parametrize("changed", [1, 2, 3, 4, 5])
def test_max_ratio_bounds_the_payload_exactly_padding_included(changed: int) -> None:
    base = np.zeros(1000, dtype=np.uint8)
    new = base.copy()
    new.view(np.uint16)[:changed] = 1
    exact = sparse_size(1000, 2, changed) / 1000
    assert encode(base, new, 2, max_ratio=exact).kind is Kind.SPARSE
    assert encode(base, new, 2, max_ratio=exact - 1e-9).kind is Kind.RAW


@pytest.mark.parametrize("piece", [1, 7, 1000, compare.PIECE])
def test_a_rebuild_written_in_pieces_on_threads_is_exact_and_a_failed_one_is_put_back(
    monkeypatch: pytest.MonkeyPatch, piece: int
) -> None:
    """The receiver writes a delta's values a few whole blocks at a time on the codec's threads: any
    piece size gives the sender's bytes, the patch puts the base back, and against another base every
    piece written is undone before the digest error comes out. Changes cluster in some blocks and skip
    others (an empty block between pieces, a block alone past the piece size, the short last block)."""
    monkeypatch.setattr(compare, "PIECE", piece)
    elements = 9 * BLOCK + 321
    base = _tensor(torch.bfloat16, elements, seed=61)
    new = base.clone()
    bits = new.view(torch.int16)
    gen = torch.Generator().manual_seed(62)
    for block, fraction in [(0, 0.01), (2, 0.3), (3, 1.0), (4, 0.001), (8, 0.05), (9, 1.0)]:
        span = min(BLOCK, elements - block * BLOCK)
        pick = torch.rand(span, generator=gen) < fraction
        bits[block * BLOCK : block * BLOCK + span][pick] ^= 3
    wire = encode(base, new, 2).tobytes()
    target = base.clone()
    patch = decode_in_place(target, wire)
    assert _bits(target) == _bits(new)
    patch.apply(target)
    assert _bits(target) == _bits(base)
    other = base.clone()
    other.view(torch.int16)[5 * BLOCK] ^= 1  # a block the delta does not touch: only the digest tells
    kept = _bits(other)
    with pytest.raises(DeltaDigestError, match="another base"):
        decode(other, wire, out=other)
    assert _bits(other) == kept


def test_a_sparse_delta_naming_an_element_past_the_short_last_block_is_refused() -> None:
    base = _tensor(torch.bfloat16, BLOCK + 10, seed=63)
    new = base.clone()
    new.view(torch.int16)[BLOCK + 9] ^= 1  # the last element
    wire = bytearray(encode(base, new, 2).tobytes())
    low_at = HEADER.size + 8 + 4 * 2  # header, count, two block counts (already 8-aligned)
    assert int.from_bytes(wire[low_at : low_at + 2], "little") == 9
    wire[low_at : low_at + 2] = (10).to_bytes(2, "little")  # one past the end
    kept = _bits(base)
    with pytest.raises(DeltaCorruptedError, match=f"names element {BLOCK + 10} of {BLOCK + 10}"):
        decode(base, bytes(wire), out=base)
    assert _bits(base) == kept


@pytest.mark.parametrize("segment", [1000, 4096, codec.DIGEST_SEGMENT])
def test_the_digest_is_the_xxh3_of_its_segments_digests_and_catches_a_flip_in_any_segment(
    monkeypatch: pytest.MonkeyPatch, segment: int
) -> None:
    """The format's digest (hashed by segments on threads) is exactly its definition, whatever the
    segment count (none for empty bytes, a short last one); a bit flipped in any segment of a rebuilt
    bucket fails the decode and leaves an in-place base as it was."""
    import xxhash

    monkeypatch.setattr(codec, "DIGEST_SEGMENT", segment)
    for size in (0, 1, segment, 3 * segment + 17):
        data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
        segments = [data[at : at + segment].tobytes() for at in range(0, size, segment)]
        parts = [xxhash.xxh3_64_intdigest(part) for part in segments]
        assert codec.digest(data) == xxhash.xxh3_64_intdigest(np.array(parts, dtype="<u8").tobytes())
    base = _tensor(torch.bfloat16, 2 * segment + 5, seed=71)
    new, _ = _changed(base, 0.01, seed=72)
    wire = encode(base, new, 2).tobytes()
    for flip in (3, segment + 1, 4 * segment + 9):  # the byte of the base flipped: segment 0, 1 and 4
        other = as_bytes(base.clone())
        other[flip] ^= 0x10
        kept = other.tobytes()
        with pytest.raises(DeltaDigestError, match="another base"):
            decode(other, wire, out=other)
        assert other.tobytes() == kept


def test_an_encoding_of_another_format_version_names_both_versions() -> None:
    base, _new, wire = _small()
    older = b"FSD1" + bytes(wire)[4:]
    with pytest.raises(DeltaCorruptedError, match="delta format b'FSD1', this side speaks b'FSD2'"):
        decode(base, older)
