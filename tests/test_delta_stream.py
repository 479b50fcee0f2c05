"""Delta sync of a named-tensor stream (:mod:`verl_fastsync.delta.stream`), in-process: every yielded
tensor of many delta syncs equals a full sync of the same weights, byte for byte; bases stay in step
or the next sync is full; a wrong base fails loudly, never yields wrong bytes."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Iterator

import pytest
import torch

from verl_fastsync.delta.stream import DELTA_PREFIX, DeltaDecoder, DeltaEncoder, DeltaSyncError

Model = list[tuple[str, torch.Tensor]]


def _digest(name: str, tensor: torch.Tensor) -> tuple[str, tuple[int, ...], torch.dtype, str]:
    data = tensor.detach().contiguous().reshape(-1)
    raw = data.view(torch.uint8).numpy().tobytes() if data.numel() else b""
    return name, tuple(tensor.shape), tensor.dtype, hashlib.sha256(raw).hexdigest()


def _model(gen: torch.Generator) -> Model:
    """bf16/fp16/fp32 weights, int and bool buffers, an empty and a 0-d tensor, a non-contiguous view."""
    wide = torch.randn(64, 96, generator=gen)
    return [
        ("embed.weight", torch.randn(300, 64, generator=gen).to(torch.bfloat16)),
        ("layer0.w", torch.randn(128, 64, generator=gen).to(torch.bfloat16)),
        ("layer0.b", torch.randn(128, generator=gen).to(torch.float16)),
        ("master", torch.randn(2000, generator=gen)),
        ("steps", torch.arange(50, dtype=torch.int64)),
        ("mask", torch.rand(333, generator=gen) > 0.5),
        ("empty", torch.empty(0, 7, dtype=torch.bfloat16)),
        ("scalar", torch.tensor(3.5)),
        ("strided", wide[:, ::2]),
    ]


def _step(model: Model, gen: torch.Generator, fraction: float) -> Model:
    """Change ``fraction`` of each floating tensor's values (and a few int/bool entries)."""
    out: Model = []
    for name, tensor in model:
        new = tensor.clone()
        flat = new.reshape(-1)
        if flat.numel():
            pick = torch.rand(flat.numel(), generator=gen) < fraction
            if new.dtype == torch.bool:
                flat[pick] = ~flat[pick]
            elif new.dtype.is_floating_point:
                noise = 0.01 * torch.randn(int(pick.sum()), generator=gen)
                flat[pick] = (flat[pick].float() + noise).to(new.dtype)
            else:
                flat[pick] += 1
        out.append((name, new))
    return out


def _sync(
    encoder: DeltaEncoder, decoders: list[DeltaDecoder], model: Model, epoch: str, *, commit: bool = True
) -> list[Model]:
    """One sync through the codec: what every receiver yields (clones, as a consumer keeps them)."""
    epochs = {encoder.epoch, *(d.epoch for d in decoders)}
    against = epochs.pop() if len(epochs) == 1 else None
    encoder.begin(against, epoch)
    for decoder in decoders:
        decoder.begin(against, epoch)
    wire = [encoder.encode(name, tensor) for name, tensor in model]
    got = [[decoder.decode(name, tensor) for name, tensor in wire] for decoder in decoders]
    if commit:
        encoder.commit()
        for decoder in decoders:
            decoder.commit()
    return got


def _steps() -> Iterator[tuple[int, Model]]:
    gen = torch.Generator().manual_seed(0)
    model = _model(gen)
    yield 0, model
    for step in range(1, 9):
        model = _step(model, gen, 0.02 if step % 4 else 1.0)  # every 4th step changes (nearly) everything
        yield step, model


@pytest.mark.parametrize("on_device", [False, True], ids=["host_compare", "device_compare"])
def test_many_delta_syncs_yield_exactly_what_a_full_sync_yields(on_device: bool) -> None:
    encoder, decoders = DeltaEncoder(compare_on_device=on_device), [DeltaDecoder(), DeltaDecoder()]
    for step, model in _steps():
        got = _sync(encoder, decoders, model, f"e{step}")
        want = [_digest(n, t) for n, t in model]
        for received in got:
            assert [_digest(n, t) for n, t in received] == want, f"step {step}"
        stats = encoder.stats
        assert stats.delta_sync == (step > 0)
        if step and step % 4:  # 2% changed: the sparse form, far fewer bytes
            assert stats.delta_tensors >= 4
            assert stats.codec_s > 0.0 and decoders[0].stats.codec_s > 0.0
            assert stats.wire_bytes < 0.2 * stats.model_bytes, stats
            assert 0.0 < stats.changed_elements / stats.compared_elements < 0.1
            assert decoders[0].stats.changed_elements == stats.changed_elements
        if step and not step % 4:  # everything changed: each tensor goes raw, as itself
            assert stats.delta_tensors == 0 and stats.wire_bytes == stats.model_bytes
    assert encoder.full_syncs == 1 and decoders[0].full_syncs == 1


def test_raw_tensors_go_as_themselves_and_deltas_under_the_reserved_prefix() -> None:
    encoder, decoder = DeltaEncoder(), DeltaDecoder()
    model = _model(torch.Generator().manual_seed(1))
    _sync(encoder, [decoder], model, "a")
    encoder.begin("a", "b")
    changed = [(n, t.clone()) for n, t in model]
    changed[3][1][5] += 1.0  # one value of "master"
    names = [encoder.encode(n, t)[0] for n, t in changed]
    assert names[3] == DELTA_PREFIX + "master"
    assert "empty" in names and "scalar" in names  # nothing to diff: as themselves


def test_added_removed_reshaped_and_retyped_tensors() -> None:
    encoder, decoder = DeltaEncoder(), DeltaDecoder()
    model = _model(torch.Generator().manual_seed(2))
    _sync(encoder, [decoder], model, "a")
    table = dict(model)
    table["layer0.w"] = table["layer0.w"].reshape(64, 128).clone()  # reshaped
    table["layer0.b"] = table["layer0.b"].to(torch.bfloat16)  # retyped, same bytes
    table["new.w"] = torch.randn(40)  # added
    del table["steps"]  # removed
    model2 = list(table.items())
    [got] = _sync(encoder, [decoder], model2, "b")
    assert [_digest(n, t) for n, t in got] == [_digest(n, t) for n, t in model2]
    assert encoder.stats.raw_tensors >= 3
    assert "steps" not in encoder.base and "steps" not in decoder.base  # removed from both bases
    assert encoder.base_bytes == decoder.base_bytes == sum(t.numel() * t.element_size() for _, t in model2)


def _base_digests(side: DeltaEncoder | DeltaDecoder) -> dict[str, str]:
    return {
        name: hashlib.sha256(entry.data.numpy().tobytes()).hexdigest() for name, entry in side.base.items()
    }


@pytest.mark.parametrize("on_device", [False, True], ids=["host_compare", "device_compare"])
def test_a_failed_delta_sync_puts_both_bases_back_and_the_next_one_diffs(on_device: bool) -> None:
    """A delta sync fails after 6 tensors, with a tensor that went raw, one added and one reshaped
    among them, the consumer holding one of the yielded tensors: both bases are back at epoch a,
    byte for byte (the held tensor untouched); the next sync diffs against a and yields exactly."""
    gen = torch.Generator().manual_seed(3)
    encoder, decoder = DeltaEncoder(compare_on_device=on_device), DeltaDecoder()
    model = _model(gen)
    _sync(encoder, [decoder], model, "a")
    at_a = (_base_digests(encoder), _base_digests(decoder))
    table = dict(_step(model, gen, 0.02))
    table["layer0.b"] = torch.randn(128, generator=gen).to(torch.float16)  # every value changed: raw
    table["mask"] = table["mask"].reshape(9, 37).clone()  # reshaped: goes as itself
    half = [(n, table[n]) for n in ("embed.weight", "layer0.w", "layer0.b", "master", "mask")]
    half.append(("added", torch.randn(30, generator=gen)))
    encoder.begin("a", "b")
    decoder.begin("a", "b")
    held = []
    for name, tensor in half:  # the sync fails after these: nobody commits
        held.append(decoder.decode(*encoder.encode(name, tensor)))
    assert encoder.stats.delta_tensors >= 2 and encoder.stats.raw_tensors >= 2
    kept = [_digest(n, t) for n, t in held]
    assert encoder.epoch is None and decoder.epoch is None  # not usable while the sync is open
    encoder.settle()
    decoder.settle()
    assert encoder.epoch == decoder.epoch == "a" and encoder.rolled_back == decoder.rolled_back == 1
    assert (_base_digests(encoder), _base_digests(decoder)) == at_a
    assert [_digest(n, t) for n, t in held] == kept  # what the consumer holds was not written
    later = _step(model, gen, 0.02)
    [got] = _sync(encoder, [decoder], later, "c")
    assert encoder.stats.delta_sync and encoder.stats.delta_tensors >= 4 and encoder.full_syncs == 1
    assert [_digest(n, t) for n, t in got] == [_digest(n, t) for n, t in later]
    [got] = _sync(encoder, [decoder], _step(later, gen, 0.02), "d")
    assert encoder.stats.delta_sync


def test_a_receiver_that_committed_a_sync_that_failed_elsewhere_makes_the_next_one_full() -> None:
    """One receiver got its whole part and committed; the sender and the other receiver failed and
    went back: the epochs differ, so the next sync is full on every side, and exact."""
    gen = torch.Generator().manual_seed(33)
    encoder, decoders = DeltaEncoder(), [DeltaDecoder(), DeltaDecoder()]
    model = _model(gen)
    _sync(encoder, decoders, model, "a")
    step = _step(model, gen, 0.02)
    for side in (encoder, *decoders):
        side.begin("a", "b")
    wire = [encoder.encode(n, t) for n, t in step]
    for item in wire:
        decoders[0].decode(*item)
    decoders[0].commit()
    for item in wire[:3]:
        decoders[1].decode(*item)
    for side in (encoder, *decoders):
        side.settle()
    assert (encoder.epoch, decoders[0].epoch, decoders[1].epoch) == ("a", "b", "a")
    later = _step(step, gen, 0.02)
    got = _sync(encoder, decoders, later, "c")
    assert not encoder.stats.delta_sync and all(not d.stats.delta_sync for d in decoders)
    for received in got:
        assert [_digest(n, t) for n, t in received] == [_digest(n, t) for n, t in later]


@pytest.mark.parametrize("on_device", [False, True], ids=["host_compare", "device_compare"])
def test_a_sync_that_begins_over_an_unsettled_failed_one_settles_it_first(on_device: bool) -> None:
    gen = torch.Generator().manual_seed(13)
    encoder, decoder = DeltaEncoder(compare_on_device=on_device), DeltaDecoder()
    model = _model(gen)
    _sync(encoder, [decoder], model, "a")
    encoder.begin("a", "b")
    decoder.begin("a", "b")
    for name, tensor in _step(model, gen, 0.02)[:3]:
        decoder.decode(*encoder.encode(name, tensor))
    later = _step(model, gen, 0.02)
    encoder.begin("a", "c")  # no settle() between: begin() rolls the failed sync back itself
    decoder.begin("a", "c")
    got = [decoder.decode(*encoder.encode(n, t)) for n, t in later]
    assert [_digest(n, t) for n, t in got] == [_digest(n, t) for n, t in later]
    with pytest.raises(DeltaSyncError, match="no sync is running"):
        encoder.commit()
        encoder.commit()


@pytest.mark.parametrize("on_device", [False, True], ids=["host_compare", "device_compare"])
def test_a_failed_sync_past_the_journal_limit_leaves_no_epoch_and_the_next_one_is_full(
    on_device: bool,
) -> None:
    """A delta sync that re-initialises the weights (every tensor raw: the journal passes its eighth
    of the base and is dropped) fails: no epoch on either side, a stale topology cannot make either
    diff, and the next sync is full and exact. A failed full sync keeps no journal either."""
    gen = torch.Generator().manual_seed(23)
    encoder, decoder = DeltaEncoder(compare_on_device=on_device), DeltaDecoder()
    model = _model(gen)
    _sync(encoder, [decoder], model, "a")
    fresh = _model(gen)
    encoder.begin("a", "b")
    decoder.begin("a", "b")
    for name, tensor in fresh[:4]:
        decoder.decode(*encoder.encode(name, tensor))
    encoder.settle()
    decoder.settle()
    assert encoder.epoch is None and decoder.epoch is None and encoder.rolled_back == 0
    with pytest.raises(DeltaSyncError, match="diff against base a, this sender holds none"):
        encoder.begin("a", "c")  # a stale topology cannot make it diff against a half-updated base
    later = _step(fresh, gen, 0.02)
    [got] = _sync(encoder, [decoder], later, "c")  # epochs differ: full
    assert not encoder.stats.delta_sync and encoder.full_syncs == 2 and decoder.full_syncs == 2
    assert [_digest(n, t) for n, t in got] == [_digest(n, t) for n, t in later]
    encoder.begin(None, "d")  # a full sync that fails: nothing to go back to
    decoder.begin(None, "d")
    decoder.decode(*encoder.encode(*later[0]))
    encoder.settle()
    decoder.settle()
    assert encoder.epoch is None and decoder.epoch is None


def test_a_consumer_that_writes_into_a_yielded_tensor_fails_the_next_delta_loudly() -> None:
    gen = torch.Generator().manual_seed(4)
    encoder, decoder = DeltaEncoder(), DeltaDecoder()
    model = _model(gen)
    [got] = _sync(encoder, [decoder], model, "a")
    held = dict(got)
    held["master"][0] += 1.0  # the consumer writes into what it was given
    encoder.begin("a", "b")
    decoder.begin("a", "b")
    step = _step(model, gen, 0.02)
    with pytest.raises(DeltaSyncError, match=r"tensor 'master': .*digest.*consumer write into a tensor"):
        for name, tensor in step:
            decoder.decode(*encoder.encode(name, tensor))


def test_what_the_consumer_holds_is_never_written_by_a_later_sync() -> None:
    gen = torch.Generator().manual_seed(5)
    encoder, decoder = DeltaEncoder(), DeltaDecoder()
    model = _model(gen)
    [first] = _sync(encoder, [decoder], model, "a")
    before = [_digest(n, t) for n, t in first]
    for i in range(3):
        model = _step(model, gen, 0.05)
        _sync(encoder, [decoder], model, f"b{i}")
    assert [_digest(n, t) for n, t in first] == before


def test_bad_input_is_refused_naming_what_is_wrong() -> None:
    encoder, decoder = DeltaEncoder(), DeltaDecoder()
    encoder.begin(None, "a")
    with pytest.raises(DeltaSyncError, match="reserved"):
        encoder.encode(DELTA_PREFIX + "x", torch.zeros(3))
    encoder.encode("x", torch.zeros(3))
    with pytest.raises(DeltaSyncError, match="'x' came twice in one sync"):
        encoder.encode("x", torch.zeros(3))
    decoder.begin(None, "a")
    with pytest.raises(DeltaSyncError, match="arrived as a delta in a full sync"):
        decoder.decode(DELTA_PREFIX + "x", torch.zeros(40, dtype=torch.uint8))
    other = DeltaDecoder()
    other.epoch = "a"
    other.begin("a", "b")
    with pytest.raises(DeltaSyncError, match="receiver's base holds nothing under that name"):
        encoder2 = DeltaEncoder()
        encoder2.begin(None, "a")
        encoder2.encode("w", torch.zeros(1000))
        encoder2.commit()
        encoder2.begin("a", "b")
        update = torch.zeros(1000)
        update[3] = 1.0
        other.decode(*encoder2.encode("w", update))


def test_the_stream_releases_each_producer_tensor() -> None:
    """:meth:`DeltaEncoder.stream` over an async producer: items in order, the same bytes."""
    encoder = DeltaEncoder()
    encoder.begin(None, "a")
    model = _model(torch.Generator().manual_seed(6))

    async def produce() -> object:
        for item in model:
            yield item

    async def collect() -> Model:
        return [item async for item in encoder.stream(produce())]

    got = asyncio.run(collect())
    assert [_digest(n, t) for n, t in got] == [_digest(n, t) for n, t in model]


def test_a_base_the_consumer_let_go_of_is_rebuilt_in_place_one_it_holds_is_not() -> None:
    gen = torch.Generator().manual_seed(7)
    encoder, decoder = DeltaEncoder(), DeltaDecoder()
    model = _model(gen)
    [got] = _sync(encoder, [decoder], model, "a")
    kept = dict(got)["master"]  # the consumer keeps one tensor, lets go of the others
    del got
    where = {name: entry.data.data_ptr() for name, entry in decoder.base.items() if entry.data.numel()}
    model = _step(model, gen, 0.02)
    [got] = _sync(encoder, [decoder], model, "b")
    assert [_digest(n, t) for n, t in got] == [_digest(n, t) for n, t in model]
    moved = {name for name, ptr in where.items() if decoder.base[name].data.data_ptr() != ptr}
    # only the held one got new memory, and the 0-d tensor (it goes raw: its old base stays in the
    # undo journal, which the held one costs nothing)
    assert moved == {"master", "scalar"}, moved
    assert kept.data_ptr() == where["master"]


def test_a_delta_stream_flushes_a_bucket_per_bucket_of_model_bytes() -> None:
    """``flush_every`` over a delta stream: a FLUSH_BUCKET after each ``every`` bytes of the model (not
    of the small deltas), so a sending transport posts buckets as often as a full sync would."""
    from verl_fastsync.chunks import FLUSH_BUCKET
    from verl_fastsync.transports.sending import flush_every

    gen = torch.Generator().manual_seed(43)
    encoder, decoder = DeltaEncoder(), DeltaDecoder()
    model = [(f"w{i}", torch.randn(1000, generator=gen).to(torch.bfloat16)) for i in range(10)]  # 2000 B each
    _sync(encoder, [decoder], model, "a")
    encoder.begin("a", "b")

    async def collect() -> list[object]:
        return [
            item
            async for item in flush_every(
                encoder.stream(_step(model, gen, 0.02)), 5000, lambda: encoder.stats.model_bytes
            )
        ]

    items = asyncio.run(collect())
    marks = [i for i, item in enumerate(items) if item is FLUSH_BUCKET]
    assert marks == [3, 7, 11], marks  # after tensors 3, 6 and 9 (6000 bytes each time)
    assert all(
        isinstance(item, tuple) and item[0].startswith(DELTA_PREFIX)
        for item in items
        if item is not FLUSH_BUCKET
    )


def test_tensors_to_copy_go_through_one_reused_staging_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Non-contiguous tensors (as device tensors would be) are copied into the sender's one staging
    buffer, reused from tensor to tensor and sync to sync, as large as the largest one staged; a
    producer that rewrites its tensors after each yield and a consumer that holds everything still see
    exact bytes; a tensor over STAGING_MAX is copied into fresh memory and the buffer does not grow."""
    from verl_fastsync.delta import device

    monkeypatch.setattr(device, "STAGING_MAX", 64 * 1024)
    gen = torch.Generator().manual_seed(53)
    encoder, decoder = DeltaEncoder(), DeltaDecoder()
    sizes = [(40, 30), (128, 100), (16, 8), (300, 120)]  # the last one: 72,000 bytes of fp16 > STAGING_MAX
    master = [torch.randn(rows, cols, generator=gen) for rows, cols in sizes]
    held = []
    staging_ptrs = set()
    for step in range(4):
        if step:
            for weight in master:
                pick = torch.rand(weight.shape, generator=gen) < 0.03
                weight[pick] += 0.5
        model = [
            (f"w{i}", weight.to(torch.float16).t()) for i, weight in enumerate(master)
        ]  # transposed views
        want = [_digest(name, tensor) for name, tensor in model]
        against = encoder.epoch if encoder.epoch == decoder.epoch else None
        encoder.begin(against, f"s{step}")
        decoder.begin(against, f"s{step}")
        got = []
        for name, tensor in model:
            got.append(decoder.decode(*encoder.encode(name, tensor)))  # (a transport copies a raw one here)
            tensor.fill_(-1.0)  # the producer reuses its memory as soon as the tensor was taken
            if step:  # (a full sync copies each tensor straight into its new base: nothing staged)
                staging_ptrs.add(encoder._staging.buffer.data_ptr())
            else:
                assert encoder._staging.buffer is None
        encoder.commit()
        decoder.commit()
        assert [_digest(n, t) for n, t in got] == want, f"step {step}"
        assert encoder.stats.delta_sync == (step > 0)
        held.append((got, [_digest(n, t) for n, t in got]))  # the consumer holds every sync's tensors
    assert all([_digest(n, t) for n, t in got] == digests for got, digests in held)
    largest_staged = max(r * c * 2 for r, c in sizes if r * c * 2 <= 64 * 1024)
    assert encoder._staging.buffer.numel() == largest_staged
    assert len(staging_ptrs) <= 2  # grown once (40x30 first, then 128x100), then reused


def _lazy_views(step: int) -> Model:
    """Tensors the transports accept whose bytes only their byte view reads right: a conjugate view, a
    negative-bit view, one-element tensors with a non-unit stride (0.5% of the values change per step)."""
    gen = torch.Generator().manual_seed(61)
    spins = torch.randn(4096, dtype=torch.complex64, generator=gen)
    gains = torch.randn(64, 64, generator=gen)
    spins[step::200] += step
    gains.view(-1)[step::200] -= step
    strided = torch.randn(1, 5, generator=gen) + step
    return [
        ("spins", spins.conj()),
        ("gains", torch._neg_view(gains)),
        ("bias", strided[:, 3]),  # shape (1,), stride (5,)
        ("scale", strided[:, 1:2].t()),  # shape (1, 1), strides (1, 5)
        ("gains_t", torch._neg_view(gains).t()),  # negative bit and not contiguous
    ]


@pytest.mark.parametrize("on_device", [False, True], ids=["host_compare", "device_compare"])
def test_conjugate_negative_bit_and_strided_one_element_tensors_sync_exactly(on_device: bool) -> None:
    """Before the fix each of these failed every delta sync (``view`` of a conjugate or negative-bit
    tensor, or of a one-element tensor whose stride is not 1, raises). Now they arrive as the transports'
    byte view reads them, as deltas where few values changed."""
    from verl_fastsync.chunks import byte_view

    views = _lazy_views(0)
    assert views[0][1].is_conj() and views[1][1].is_neg() and views[2][1].stride() == (5,)
    encoder, decoders = DeltaEncoder(compare_on_device=on_device), [DeltaDecoder(), DeltaDecoder()]
    for step in range(4):
        model = _lazy_views(step)
        got = _sync(encoder, decoders, model, f"v{step}")
        for received in got:
            for (name, tensor), (got_name, out) in zip(model, received, strict=True):
                assert got_name == name and out.shape == tensor.shape and out.dtype == tensor.dtype
                assert torch.equal(byte_view(out), byte_view(tensor)), f"step {step}: {name}"
        if step:
            assert encoder.stats.delta_sync and encoder.stats.delta_tensors == 3, encoder.stats


def test_a_failed_delta_sync_with_a_consumer_holding_every_tensor_rolls_back_and_the_next_diffs() -> None:
    """A consumer that holds what it was given (verl's SGLang adapter batches tensors before it loads
    them; here it keeps them until the next sync ends): every base is held when the next delta sync
    rebuilds it, so each goes to new memory. Before the fix the undo journal charged each held base at
    its size, gave up past an eighth of the model, and a failed sync was followed by a full one. A held
    base costs the journal nothing: the failed sync rolls back and the next one diffs again."""
    gen = torch.Generator().manual_seed(29)
    encoder, decoder = DeltaEncoder(), DeltaDecoder()
    model = _model(gen)
    [kept] = _sync(encoder, [decoder], model, "a")
    model = _step(model, gen, 0.02)
    [kept] = _sync(encoder, [decoder], model, "b")  # (a's tensors are let go of once b's are kept)
    assert encoder.stats.delta_sync
    failing = _step(model, gen, 0.02)
    [partial] = _sync(encoder, [decoder], failing[:7], "c", commit=False)  # fails after 7 tensors
    assert decoder.stats.delta_tensors >= 4
    encoder.settle()
    decoder.settle()
    assert encoder.epoch == decoder.epoch == "b" and decoder.rolled_back == 1
    assert [_digest(n, t) for n, t in kept] == [_digest(n, t) for n, t in model]  # held: never written
    del partial
    later = _step(model, gen, 0.02)
    [got] = _sync(encoder, [decoder], later, "d")
    assert decoder.stats.delta_sync and decoder.stats.delta_tensors >= 4, decoder.stats
    assert encoder.full_syncs == decoder.full_syncs == 1
    assert [_digest(n, t) for n, t in got] == [_digest(n, t) for n, t in later]
    assert [_digest(n, t) for n, t in kept] == [_digest(n, t) for n, t in model]
