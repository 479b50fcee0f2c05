"""A side of a delta sync whose host cannot hold its base turns delta off for the run
(:mod:`verl_fastsync.delta.room`, :mod:`verl_fastsync.delta.side`), in-process: the sync that ran out
still yields every byte, the side drops its base, and once the topology passes the word on, every
side runs full syncs with no base. A host here is a reader of available memory that falls as bases
are made (the real cgroup run is in ``test_delta_sync.py``)."""

from __future__ import annotations

import hashlib
import logging

import pytest
import torch

from verl_fastsync.delta.room import RECHECK_MIN, RESERVE_FRACTION, RESERVE_MIN, Room
from verl_fastsync.delta.stream import DELTA_PREFIX, DeltaDecoder, DeltaEncoder

MIB = 1 << 20
Model = list[tuple[str, torch.Tensor]]


class Host:
    """Available memory of a host: ``free`` bytes, less every base byte the sides on it keep."""

    def __init__(self, free: int) -> None:
        self.free = free
        self.sides: list[DeltaEncoder | DeltaDecoder] = []
        self.reads = 0

    def read(self) -> int:
        self.reads += 1
        return self.free - sum(side.base_bytes for side in self.sides)

    def room(self, side: DeltaEncoder | DeltaDecoder) -> DeltaEncoder | DeltaDecoder:
        self.sides.append(side)
        return side


def _digest(name: str, tensor: torch.Tensor) -> tuple[str, str]:
    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return name, hashlib.sha256(raw).hexdigest()


def _model(step: int, tensors: int = 8, elements: int = MIB // 2) -> Model:
    """``tensors`` bf16 tensors of ``elements`` (1 MiB each by default); each step changes 2%."""
    gen = torch.Generator().manual_seed(7)
    model = [(f"w{i}", torch.randn(elements, generator=gen).to(torch.bfloat16)) for i in range(tensors)]
    for s in range(1, step + 1):
        gen = torch.Generator().manual_seed(100 + s)
        for _, tensor in model:
            pick = torch.rand(elements, generator=gen) < 0.02
            tensor[pick] = (tensor[pick].float() + 0.05).to(torch.bfloat16)
    return model


def _sync(
    encoder: DeltaEncoder,
    decoders: list[DeltaDecoder],
    model: Model,
    epoch: str,
    held: list[Model] | None = None,
) -> list[Model]:
    """One sync as the engine runs it: the topology from what each side reports (its epoch, and
    why delta is off on it), then every side's part; a consumer that copies what it gets."""
    sides = [encoder, *decoders]
    epochs = {side.epoch for side in sides}
    off = next((f"side {i}, {s.off}" for i, s in enumerate(sides) if s.off), None)
    against = None if off or len(epochs) != 1 else epochs.pop()
    for side in sides:
        side.begin(against, epoch, off=off)
    wire = [encoder.encode(name, tensor) for name, tensor in model]
    got = [[(n, t.clone()) for n, t in (d.decode(name, tensor) for name, tensor in wire)] for d in decoders]
    for side in sides:
        side.commit()
    return got


def test_room_reserves_the_larger_of_4_gib_and_an_eighth_and_rereads_as_it_fills() -> None:
    used = [0]
    room = Room(lambda: RESERVE_MIN + 100 * MIB - used[0])
    assert room.take(60 * MIB) and room.reserve == RESERVE_MIN
    used[0] += 60 * MIB  # (what the side allocated for it)
    assert not room.take(41 * MIB)  # 100 MiB of room, 60 in use: re-read, 40 left
    assert room.take(40 * MIB)
    # a read is the truth: memory the side gave back (or never used) is there again
    used[0] = 0
    room.reset()
    assert room.take(100 * MIB)
    used[0] += 100 * MIB
    assert not room.take(1)
    big = Room(lambda: 64 << 30)
    assert big.take(MIB) and big.reserve == (64 << 30) // RESERVE_FRACTION
    # another process on the host fills it: the next read (after RECHECK_MIN of takes) sees that
    readings = [RESERVE_MIN + 1024 * MIB]
    host = Room(lambda: readings[-1])
    assert host.take(RECHECK_MIN)
    readings.append(RESERVE_MIN + 10 * MIB)
    assert not host.take(11 * MIB) and host.available == RESERVE_MIN + 10 * MIB
    host.reset()  # a new sync reads again
    readings.append(RESERVE_MIN + 500 * MIB)
    assert host.take(400 * MIB)
    assert "delta base of 'w3' (2.0 MiB more)" in host.refusal("w3", 2 * MIB)


def test_a_receiver_without_room_turns_delta_off_for_every_side(caplog: pytest.LogCaptureFixture) -> None:
    """Rollout rank 1's host holds half the model: it runs out in the first (full) sync, still yields
    every byte, keeps no base; from the next sync every side is full and keeps nothing."""
    roomy, tight = Host(RESERVE_MIN + 64 * MIB), Host(RESERVE_MIN + 4 * MIB + MIB // 2)
    encoder = roomy.room(DeltaEncoder(room=Room(roomy.read)))
    decoders = [
        roomy.room(DeltaDecoder(room=Room(roomy.read))),
        tight.room(DeltaDecoder(room=Room(tight.read))),
    ]
    assert isinstance(encoder, DeltaEncoder)
    caplog.set_level(logging.WARNING, logger="verl_fastsync.delta.stream")
    for step in range(4):
        model = _model(step)
        got = _sync(encoder, [d for d in decoders if isinstance(d, DeltaDecoder)], model, f"e{step}")
        want = [_digest(n, t) for n, t in model]
        for received in got:
            assert [_digest(n, t) for n, t in received] == want, f"step {step}"
        if step == 0:  # the tight rank ran out mid-sync; the others do not know yet
            assert decoders[1].off is not None and "would leave less than 4.00 GiB free" in decoders[1].off
            assert decoders[1].stats.off and not encoder.stats.off and not decoders[0].stats.off
            assert decoders[1].base_bytes == 0 and decoders[1].epoch is None
            assert decoders[0].base_bytes == 8 * MIB and encoder.base_bytes == 8 * MIB
        else:  # every side: full, nothing kept, the reason passed on
            for side in (encoder, *decoders):
                assert side.stats.off and not side.stats.delta_sync and side.base_bytes == 0, step
                assert side.off is not None and "side 2, receiver: keeping the delta base" in (
                    side.off if side is not decoders[1] else f"side 2, {side.off}"
                )
            assert encoder.stats.wire_bytes == encoder.stats.model_bytes == 8 * MIB
            assert encoder.stats.delta_tensors == 0
    turned = [r for r in caplog.records if "turned off for this run" in r.getMessage()]
    told = [r for r in caplog.records if "is off for this run" in r.getMessage()]
    assert len(turned) == 1 and len(told) == 2, [r.getMessage() for r in caplog.records]  # once per side


def test_a_sender_that_runs_out_mid_delta_sync_sends_the_rest_raw() -> None:
    """A delta sync that adds a tensor the sender's host cannot hold: the tensors before it went as
    deltas, it and the rest go raw; every receiver rebuilds exactly; the next sync is off."""
    host = Host(RESERVE_MIN + 8 * MIB + MIB // 2)
    encoder = DeltaEncoder(room=Room(host.read))
    host.sides.append(encoder)
    decoder = DeltaDecoder()
    _sync(encoder, [decoder], _model(0), "e0")
    assert encoder.base_bytes == 8 * MIB and encoder.off is None
    model = _model(1)
    model.insert(4, ("added", torch.ones(MIB, dtype=torch.bfloat16)))  # 2 MiB more: no room
    [got] = _sync(encoder, [decoder], model, "e1")
    assert [_digest(n, t) for n, t in got] == [_digest(n, t) for n, t in model]
    assert encoder.stats.off and encoder.stats.delta_sync and encoder.stats.delta_tensors == 4
    assert encoder.stats.raw_tensors == 5 and encoder.base_bytes == 0 and encoder.epoch is None
    [got] = _sync(encoder, [decoder], _model(2), "e2")
    assert [_digest(n, t) for n, t in got] == [_digest(n, t) for n, t in _model(2)]
    assert decoder.stats.off and decoder.base_bytes == 0 and decoder.off is not None


def test_a_receiver_that_runs_out_mid_delta_sync_still_rebuilds_the_deltas() -> None:
    """A reshaped tensor arrives raw in a delta sync and does not fit the receiver's host: it passes
    as it came, the deltas after it are still rebuilt from the base, and the base goes at the end."""
    host = Host(RESERVE_MIN + 8 * MIB + MIB // 4)
    encoder, decoder = DeltaEncoder(), DeltaDecoder(room=Room(host.read))
    host.sides.append(decoder)
    _sync(encoder, [decoder], _model(0), "e0")
    model = _model(1)
    model[2] = ("w2", torch.randn(MIB, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16))
    wire_names: list[str] = []
    epochs = {encoder.epoch, decoder.epoch}
    assert len(epochs) == 1
    [against] = epochs
    encoder.begin(against, "e1")
    decoder.begin(against, "e1")
    got = []
    for name, tensor in model:
        sent = encoder.encode(name, tensor)
        wire_names.append(sent[0])
        name_out, out = decoder.decode(*sent)
        got.append((name_out, out.clone()))
    encoder.commit()
    decoder.commit()
    assert wire_names[2] == "w2" and all(
        n.startswith(DELTA_PREFIX) for i, n in enumerate(wire_names) if i != 2
    )
    assert [_digest(n, t) for n, t in got] == [_digest(n, t) for n, t in model]
    assert decoder.stats.off and decoder.stats.delta_tensors == 7 and decoder.base_bytes == 0
    assert decoder.epoch is None and encoder.epoch == "e1"


def test_a_sync_that_fails_after_delta_turned_off_leaves_it_off_and_no_base() -> None:
    """The receiver runs out in a delta sync, then the sync fails (its consumer raised): it does not
    go back to the old epoch (a base it no longer fully holds), reports why delta is off, and the
    next sync, told so, is full and exact with no base on any side."""
    host = Host(RESERVE_MIN + 8 * MIB + MIB // 4)
    encoder, decoder = DeltaEncoder(), DeltaDecoder(room=Room(host.read))
    host.sides.append(decoder)
    _sync(encoder, [decoder], _model(0), "e0")
    model = _model(1)
    model[5] = ("w5", torch.randn(MIB, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16))
    encoder.begin("e0", "e1")
    decoder.begin("e0", "e1")
    for name, tensor in model[:7]:  # the consumer fails before the last tensor: no commit
        decoder.decode(*encoder.encode(name, tensor))
    assert decoder.off is not None and decoder.stats.off
    assert decoder.base_bytes > 0  # (the bases it held when it ran out, until the sync ends)
    decoder.settle()  # what the engine does before it reports this side for the next sync
    assert decoder.epoch is None and decoder.rolled_back == 0 and decoder.base_bytes == 0
    got = _sync(encoder, [decoder], _model(2), "e2")
    assert [_digest(n, t) for n, t in got[0]] == [_digest(n, t) for n, t in _model(2)]
    assert encoder.stats.off and not encoder.stats.delta_sync and encoder.base_bytes == 0
    assert decoder.base_bytes == 0 and encoder.off is not None and encoder.off.endswith(decoder.off)
