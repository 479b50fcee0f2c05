"""The delta encode that compares on the tensor's device (:func:`encode_on_device`) gives exactly the
encoding, base and undo patch of the host codec (:func:`encode`) for the same bytes; where the host
codec goes raw it returns None and leaves the base untouched. Runs on CPU tensors here (the code is
device-agnostic torch); on CUDA too when a GPU is present."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from verl_fastsync.delta import compare
from verl_fastsync.delta.codec import BLOCK, DeltaError, Kind, decode, encode
from verl_fastsync.delta.device import encode_on_device

DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]
DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int8, torch.int64, torch.bool]


def _pair(dtype: torch.dtype, elements: int, fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A tensor and a copy with about ``fraction`` of its bytes changed (bit flips, so every dtype,
    NaN patterns and -0.0 included, changes by its bits)."""
    gen = np.random.default_rng(seed)
    width = torch.empty(0, dtype=dtype).element_size()
    raw = gen.integers(0, 256, elements * width, dtype=np.uint8)
    if dtype == torch.bool:
        raw &= 1
    changed = raw.copy()
    pick = gen.random(raw.size) < fraction
    changed[pick] ^= 1
    as_tensor = lambda data: torch.from_numpy(data).view(dtype) if elements else torch.empty(0, dtype=dtype)  # noqa: E731
    return as_tensor(raw), as_tensor(changed)


def _bytes(tensor: torch.Tensor) -> np.ndarray:
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy() if flat.numel() else np.empty(0, dtype=np.uint8)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("undo", [False, True])
@pytest.mark.parametrize("chunk_bytes", [1, 1 << 30], ids=["one_block_chunks", "one_chunk"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_device_encoding_is_the_host_encoding_byte_for_byte(
    dtype: torch.dtype, chunk_bytes: int, undo: bool, device: str
) -> None:
    width = torch.empty(0, dtype=dtype).element_size()
    for elements, fraction in itertools.product([0, 1, 3, BLOCK - 1, 2 * BLOCK + 5], [0.0, 0.002, 0.05, 0.6]):
        old, new = _pair(dtype, elements, fraction, seed=elements + int(fraction * 1000))
        host_base, device_base = _bytes(old).copy(), _bytes(old).copy()
        want = encode(host_base, _bytes(new), width, update_base=True, undo=undo)
        got = encode_on_device(device_base, new.to(device), width, undo=undo, chunk_bytes=chunk_bytes)
        where = f"{dtype} x {elements} at {fraction}"
        if want.kind is Kind.RAW:
            assert got is None, where
            assert (device_base == _bytes(old)).all(), f"{where}: a raw outcome wrote the base"
            continue
        assert got is not None, where
        assert got.tobytes() == want.tobytes(), where
        assert (device_base == _bytes(new)).all() and (host_base == device_base).all(), where
        assert (decode(_bytes(old), got.tobytes()) == _bytes(new)).all(), where
        if undo:
            assert got.undo is not None
            got.undo.apply(device_base)
            assert (device_base == _bytes(old)).all(), f"{where}: the patch did not put the base back"
        else:
            assert got.undo is None


@pytest.mark.parametrize("device", DEVICES)
def test_a_mostly_changed_tensor_is_judged_raw_by_its_sample_and_the_base_is_untouched(device: str) -> None:
    """Large enough to be sampled: at 60% changed the sample says raw before any chunk is compared
    (nothing is brought to the device); the host codec decides the same."""
    old, new = _pair(torch.bfloat16, 8 * compare.SAMPLE, 0.6, seed=5)
    base = _bytes(old).copy()
    assert encode(base.copy(), _bytes(new), 2).kind is Kind.RAW
    assert encode_on_device(base, new.to(device), 2) is None
    assert (base == _bytes(old)).all()


def test_non_contiguous_and_0d_tensors_are_compared_by_their_values_in_order() -> None:
    wide = torch.randn(64, 96)
    view = wide[:, ::2]
    base = _bytes(view).copy()
    changed = view.clone()
    changed[3, 4] += 1.0
    delta = encode_on_device(base, changed, 4)
    assert delta is not None and delta.changed == 1
    assert (base == _bytes(changed)).all()
    scalar_base = _bytes(torch.tensor(1.5)).copy()
    assert encode_on_device(scalar_base, torch.tensor(2.5), 4) is None  # 1 of 1 changed: raw
    assert (scalar_base == _bytes(torch.tensor(1.5))).all()


def test_bad_arguments_are_refused_naming_what_is_allowed() -> None:
    base = np.zeros(16, dtype=np.uint8)
    with pytest.raises(DeltaError, match=r"element width must be one of \[1, 2, 4, 8\], got 3"):
        encode_on_device(base, torch.zeros(16, dtype=torch.uint8), 3)
    with pytest.raises(DeltaError, match=r"max_ratio must be in \[0, 1\], got 1.5"):
        encode_on_device(base, torch.zeros(16, dtype=torch.uint8), 1, max_ratio=1.5)
    with pytest.raises(DeltaError, match="base has 16 bytes, new has 32"):
        encode_on_device(base, torch.zeros(8, dtype=torch.float32), 4)
    base.flags.writeable = False
    with pytest.raises(DeltaError, match="the base must be writable"):
        encode_on_device(base, torch.zeros(16, dtype=torch.uint8), 1)


@pytest.mark.parametrize("device", DEVICES)
def test_a_trainer_ranks_tensors_are_compared_on_their_device_through_the_stream(device: str) -> None:
    """As a GPU trainer rank sends (on CUDA when present; the same code on the CPU otherwise): delta
    syncs rebuild exactly, a tensor that changed nearly everywhere goes raw, a sync that fails after one
    tensor rolls both sides back (checked by the next delta sync's exact rebuild), and on CUDA every
    base is page-locked."""
    from verl_fastsync.delta.stream import DeltaDecoder, DeltaEncoder

    gen = torch.Generator(device=device).manual_seed(7)
    model = {f"w{i}": torch.randn(1 << 20, device=device, generator=gen).to(torch.bfloat16) for i in range(3)}
    encoder, decoder = DeltaEncoder(compare_on_device=True), DeltaDecoder()
    got: dict[str, torch.Tensor] = {}
    for step, epoch in enumerate("abcd"):
        if step:
            for name, tensor in model.items():
                fraction = 0.9 if name == "w2" else 0.03
                pick = torch.rand(tensor.numel(), device=device, generator=gen) < fraction
                tensor.view(torch.int16)[pick] += 1  # (a flip twice would undo itself)
        against = encoder.epoch if encoder.epoch == decoder.epoch else None
        encoder.begin(against, epoch)
        decoder.begin(against, epoch)
        if epoch == "c":  # the consumer let go of b's tensors; the sync fails after one tensor
            got.clear()
            decoder.decode(*encoder.encode("w0", model["w0"]))
            encoder.settle()
            decoder.settle()
            assert encoder.epoch == decoder.epoch == "b"
            continue
        got = dict(decoder.decode(*encoder.encode(name, tensor)) for name, tensor in model.items())
        encoder.commit()
        decoder.commit()
        for name, tensor in model.items():
            assert (_bytes(got[name]) == _bytes(tensor)).all(), f"{epoch}: {name}"
            assert encoder.base[name].data.is_pinned() == (device == "cuda"), name
        if epoch in "bd":
            assert encoder.stats.delta_tensors == 2 and encoder.stats.raw_tensors == 1, encoder.stats


def test_a_device_compare_that_runs_out_of_memory_falls_back_to_the_host_compare(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Device memory is the trainer's, and may be short while it syncs: a compare that runs out of it
    (every other call here) is done on the host instead, with the same bytes on the wire, counted and
    logged once; the sync is exact and the next one diffs against the right base."""
    from verl_fastsync.delta import device, stream
    from verl_fastsync.delta.stream import DeltaDecoder, DeltaEncoder

    calls = {"n": 0}
    real = device.encode_on_device

    def short_of_memory(*args: object, **kwargs: object) -> object:
        calls["n"] += 1
        if calls["n"] % 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 MiB\nmore text")
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(stream, "encode_on_device", short_of_memory)
    gen = torch.Generator().manual_seed(9)
    model = {f"w{i}": torch.randn(40_000, generator=gen).to(torch.bfloat16) for i in range(5)}
    encoder, decoder = DeltaEncoder(compare_on_device=True), DeltaDecoder()
    reference = DeltaEncoder(compare_on_device=False)
    for epoch in "abc":
        if epoch != "a":
            for tensor in model.values():
                pick = torch.rand(tensor.numel(), generator=gen) < 0.03
                tensor.view(torch.int16)[pick] += 1
        against = encoder.epoch if encoder.epoch == decoder.epoch else None
        for side in (encoder, decoder, reference):
            side.begin(against, epoch)
        with caplog.at_level("WARNING", logger="verl_fastsync.delta.stream"):
            for name, tensor in model.items():
                sent = encoder.encode(name, tensor)
                assert _bytes(sent[1]).tobytes() == _bytes(reference.encode(name, tensor)[1]).tobytes()
                got = decoder.decode(*sent)
                assert (_bytes(got[1]) == _bytes(tensor)).all(), f"{epoch}: {name}"
        for side in (encoder, decoder, reference):
            side.commit()
    assert encoder.stats.delta_tensors == 5 and encoder.device_fallbacks == 5  # 3 + 2 of the 10 deltas
    warnings = [r for r in caplog.records if "ran out of memory" in r.getMessage()]
    assert len(warnings) == 1
    assert "Tried to allocate 64.00 MiB); compared on the host" in warnings[0].getMessage()
