"""The host memory a delta sync keeps or stages (:mod:`verl_fastsync.delta.hostmem`): a page-locked
base is its own registration of just its pages, counted by the memory guard at that and returned to
the host (unregistered and unmapped) when the base is dropped or delta turns off; where pinning is
refused, bases and the staging buffer are pageable and every sync still exact.

There is no GPU here: CUDA's host registration (``cudaHostRegister``/``cudaHostUnregister``) is
replaced by a recorder for the accounting tests; the refusal tests use this CPU torch's own refusal
(no fake)."""

from __future__ import annotations

import gc
import logging

import pytest
import torch

from verl_fastsync.delta import hostmem
from verl_fastsync.delta.room import Room
from verl_fastsync.delta.stream import DeltaDecoder, DeltaEncoder
from verl_fastsync.io.views import byte_view

PAGE = hostmem.PAGE
EMBED = (1519, 358)
"""A bf16 embedding of 1,087,604 bytes (a 1.09 GB one scaled down 1000x): not a whole number of pages,
and half of the power of two (2 MiB) torch's caching host allocator would take for it."""


class _CountingRoom(Room):
    """A room on a host with plenty of memory that records what each :meth:`take` asked for."""

    def __init__(self) -> None:
        super().__init__(read=lambda: 64 << 30)
        self.asked: list[int] = []

    def take(self, nbytes: int) -> bool:
        self.asked.append(nbytes)
        return super().take(nbytes)


@pytest.fixture
def registrations(monkeypatch: pytest.MonkeyPatch) -> dict[str, dict[int, int]]:
    """CUDA's host registrations as a recorder sees them: ``live`` (address -> bytes registered) and
    ``ended`` (address -> bytes, once unregistered)."""
    seen: dict[str, dict[int, int]] = {"live": {}, "ended": {}}

    def register(address: int, nbytes: int) -> None:
        assert address % PAGE == 0 and address not in seen["live"], hex(address)
        seen["live"][address] = nbytes

    def unregister(address: int) -> None:
        seen["ended"][address] = seen["live"].pop(address)

    monkeypatch.setattr(hostmem, "_register", register)
    monkeypatch.setattr(hostmem, "_unregister", unregister)
    return seen


def _mapped(address: int) -> bool:
    """Whether ``address`` is in one of this process's memory mappings."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            low, high = (int(end, 16) for end in line.split()[0].split("-"))
            if low <= address < high:
                return True
    return False


def _sync(encoder: DeltaEncoder, decoder: DeltaDecoder, model: dict[str, torch.Tensor], epoch: str) -> None:
    against = encoder.epoch if encoder.epoch == decoder.epoch else None
    encoder.begin(against, epoch)
    decoder.begin(against, epoch)
    got = dict(decoder.decode(*encoder.encode(name, tensor)) for name, tensor in model.items())
    encoder.commit()
    decoder.commit()
    for name, tensor in model.items():
        assert torch.equal(byte_view(got[name]), byte_view(tensor)), f"{epoch}: {name}"


def _model(step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    embed = torch.randn(EMBED, generator=gen).to(torch.bfloat16)
    wide = torch.randn(96, 64, generator=gen)
    if step:
        embed.view(-1)[step::40] += 1
        wide[step::9, ::5] += 1
    return {"embed": embed, "norm": torch.randn(7, generator=gen), "wide": wide.t()}  # (.t(): staged)


def test_a_page_locked_base_is_counted_at_its_pages_and_returned_to_the_host_when_dropped(
    registrations: dict[str, dict[int, int]],
) -> None:
    room = _CountingRoom()
    encoder = DeltaEncoder(page_locked=True, room=room)  # (compared on the host: through the staging buffer)
    decoder = DeltaDecoder(room=Room(read=lambda: 64 << 30))
    _sync(encoder, decoder, _model(0), "a")
    embed_bytes = EMBED[0] * EMBED[1] * 2
    sizes = {name: base.data.numel() for name, base in encoder.base.items()}
    assert sizes == {"embed": embed_bytes, "norm": 28, "wide": 96 * 64 * 4}
    # each base one registration of exactly its bytes, counted by the guard at its whole pages
    pages = {name: -(-size // PAGE) * PAGE for name, size in sizes.items()}
    assert room.asked == [pages["embed"], pages["norm"], pages["wide"]]
    assert pages["embed"] == 266 * PAGE < 2 << 20  # (the caching allocator's block: 2 MiB)
    addresses = {name: base.data.data_ptr() for name, base in encoder.base.items()}
    assert registrations["live"] == {addresses[name]: sizes[name] for name in sizes}
    assert encoder._staging.buffer is None  # (a full sync copies straight into the bases)

    _sync(encoder, decoder, _model(1), "b")
    assert encoder.stats.delta_tensors == 2, encoder.stats  # embed and wide (norm is too small: raw)
    for name in ["embed", "wide"]:
        assert encoder.base[name].data.data_ptr() == addresses[name], name  # updated in place
    replaced = encoder.base["norm"].data.data_ptr()  # (its old base stayed in the undo journal)
    assert registrations["live"][replaced] == 28 and addresses["norm"] in registrations["ended"]
    staging = encoder._staging.buffer
    assert staging is not None and registrations["live"][staging.data_ptr()] == 96 * 64 * 4
    staged_at = staging.data_ptr()
    del staging

    # a tensor leaves the model: its base goes back to the host when the sync ends
    model = _model(2)
    del model["norm"]
    _sync(encoder, decoder, model, "c")
    gc.collect()
    assert replaced in registrations["ended"] and not _mapped(replaced)

    # delta turns off: every base and the staging buffer go back to the host
    encoder.begin(None, "d", off="a rollout rank had no room for its base")
    for name, tensor in _model(3).items():
        assert encoder.encode(name, tensor)[0] == name
    encoder.commit()
    gc.collect()
    assert encoder.base == {} and encoder._staging.buffer is None
    assert registrations["live"] == {}, registrations
    for address in [addresses["embed"], addresses["wide"], staged_at]:
        assert address in registrations["ended"] and not _mapped(address), hex(address)


def test_where_pinning_is_refused_bases_and_staging_are_pageable_and_syncs_exact(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A CUDA host (as ``torch.cuda.is_available`` tells the staging buffer) that refuses to page-lock
    (this CPU torch refuses every pinning: no fake): before the fix the staging buffer's pinning raised
    and every delta sync failed. Now both kinds of sender run their syncs exactly in pageable memory,
    and the refusal is logged once, with its reason."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(hostmem, "_refusal_logged", False)
    caplog.set_level(logging.WARNING, logger="verl_fastsync.delta.hostmem")
    for encoder in [DeltaEncoder(), DeltaEncoder(compare_on_device=True, page_locked=True)]:
        decoder = DeltaDecoder()
        for step, epoch in enumerate("abc"):
            _sync(encoder, decoder, _model(step), epoch)
            assert encoder.stats.delta_sync == (step > 0)
            if step:
                assert encoder.stats.delta_tensors == 2, encoder.stats
        staging = encoder._staging.buffer
        assert staging is None if encoder.compare_on_device else not staging.is_pinned()
        assert all(not base.data.is_pinned() for base in encoder.base.values())
    refusals = [r.getMessage() for r in caplog.records if r.name == "verl_fastsync.delta.hostmem"]
    assert len(refusals) == 1, refusals
    assert "could not page-lock" in refusals[0] and "Torch not compiled with CUDA enabled" in refusals[0]
    assert "uses pageable memory where pinning is refused" in refusals[0]


def test_footprint_is_whole_pages_only_when_page_locked() -> None:
    assert hostmem.footprint(0, True) == 0
    assert hostmem.footprint(1, True) == PAGE
    assert hostmem.footprint(PAGE, True) == PAGE
    assert hostmem.footprint(PAGE + 1, True) == 2 * PAGE
    assert hostmem.footprint(PAGE + 1, False) == PAGE + 1
    assert hostmem.host_buffer(0, True).numel() == 0
