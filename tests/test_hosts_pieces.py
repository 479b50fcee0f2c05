"""Pieces (:mod:`verl_fastsync.transports.hosts_pieces`): a tensor larger than the bucket crosses the
chain of hosts as bucket-sized pieces, put back together where a consumer needs it. The chain itself
is tested in ``test_hosts.py`` (a leader passes each piece on before the tensor's last one arrived)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import torch

from verl_fastsync.chunks import FLUSH_BUCKET, DuplicateTensorError, byte_view
from verl_fastsync.io.lending import DestinationPool
from verl_fastsync.transports.base import TransportError
from verl_fastsync.transports.hosts_pieces import PIECE_PREFIX, Pieces, piece_name, split_pieces

SIZE = 64


def _split(items: object, size: int = SIZE, copy: bool = True) -> tuple[list[tuple[str, torch.Tensor]], int]:
    """What a sender would pack: each piece copied as it is taken (as a sender's planner does)."""
    counts = [0]

    async def run() -> list[tuple[str, torch.Tensor]]:
        out = []
        async for item in split_pieces(items, size, counts):  # type: ignore[arg-type]
            if item is FLUSH_BUCKET:
                out.append(("<flush>", torch.empty(0)))
                continue
            name, tensor = item  # type: ignore[misc]
            out.append((name, tensor.clone() if copy else tensor))
        return out

    return asyncio.run(run()), counts[0]


def _assemble(items: list[tuple[str, torch.Tensor]]) -> tuple[list[tuple[str, torch.Tensor]], Pieces]:
    pieces = Pieces("rollout rank 0")
    out = []
    for name, tensor in items:
        whole = pieces.feed(name, tensor)
        if whole is not None:
            out.append(whole)
    pieces.finish()
    return out, pieces


def _model() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    wide = torch.randn(7, 9, generator=g)
    return [
        ("scalar", torch.tensor(3.5)),
        ("empty", torch.empty(0, 4)),
        ("exactly_a_piece", torch.randn(16, generator=g)),  # 64 bytes: whole
        ("one_byte_more", torch.randint(0, 255, (65,), dtype=torch.uint8, generator=g)),
        ("bf16", torch.randn(3, 50, generator=g).to(torch.bfloat16)),
        ("mask", torch.rand(130, generator=g) > 0.5),
        ("complex", torch.randn(20, dtype=torch.complex64, generator=g).conj()),
        ("transposed", wide.t()),  # not contiguous: its row-major bytes
        ("experts.gate_up_proj", torch.randn(4, 3, 5, generator=g)),
    ]


def test_every_tensor_comes_back_exact_in_order_and_only_large_ones_are_cut() -> None:
    model = _model()
    sent, count = _split(iter(model))
    assert count == len(model)
    whole = [name for name, _ in sent if not name.startswith(PIECE_PREFIX)]
    assert whole == ["scalar", "empty", "exactly_a_piece"]
    assert all(t.numel() <= SIZE for _, t in sent)
    assert sent[3][0] == f"{PIECE_PREFIX}0-64 of 65, uint8[65]] one_byte_more"
    assert sent[4][0] == f"{PIECE_PREFIX}64-65 of 65, uint8[65]] one_byte_more"
    got, pieces = _assemble(sent)
    assert pieces.tensors == len(model)
    assert [name for name, _ in got] == [name for name, _ in model]
    for (name, want), (_, tensor) in zip(model, got, strict=True):
        assert tensor.dtype == want.dtype and tensor.shape == want.shape, name
        assert torch.equal(byte_view(tensor), byte_view(want)), name


def test_a_flush_passes_through_and_an_async_producer_works() -> None:
    async def produce() -> object:
        yield "a", torch.ones(40)
        yield FLUSH_BUCKET
        yield "b", torch.ones(3)

    sent, count = _split(produce())
    assert count == 2
    assert [name.split("] ")[-1] for name, _ in sent] == ["a", "a", "a", "<flush>", "b"]


def test_a_producer_that_reuses_its_buffer_is_read_before_it_is_asked_again() -> None:
    """The producer overwrites one tensor for every weight: each piece is taken (copied, as a
    sender's planner does) before the producer is asked for the next weight."""
    buffer = torch.empty(100)
    asked: list[int] = []
    seen: list[tuple[str, int]] = []

    def produce() -> Iterator[tuple[str, torch.Tensor]]:
        for i in range(4):
            asked.append(i)
            buffer.fill_(float(i))
            yield f"w{i}", buffer

    counts = [0]

    async def run() -> list[tuple[str, torch.Tensor]]:
        out = []
        async for item in split_pieces(produce(), SIZE, counts):
            name, tensor = item  # type: ignore[misc]
            seen.append((name, len(asked)))
            out.append((name, tensor.clone()))
        return out

    got, _ = _assemble(asyncio.run(run()))
    assert all(int(name.split("] w")[-1]) == n - 1 for name, n in seen)  # never asked ahead
    for i, (name, tensor) in enumerate(got):
        assert name == f"w{i}" and torch.equal(tensor, torch.full((100,), float(i))), name


def test_an_assembled_tensor_is_its_own_memory() -> None:
    """The receive buffer a piece arrived in is refilled by the next bucket: the assembled tensor
    keeps the bytes it got."""
    sent, _ = _split(iter([("w", torch.arange(50, dtype=torch.float32))]))
    slot = torch.empty(SIZE, dtype=torch.uint8)
    pieces = Pieces("rollout rank 0")
    whole = None
    for name, tensor in sent:
        slot[: tensor.numel()].copy_(tensor)
        whole = pieces.feed(name, slot[: tensor.numel()])
        slot.fill_(0xFF)
    assert whole is not None and torch.equal(whole[1], torch.arange(50, dtype=torch.float32))


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("a whole tensor between pieces", "'b' arrived while 'a' still missed bytes 64-400"),
        ("a piece skipped", "bytes 128-192 of 400 of 'a' arrived while 'a' still missed bytes 64-400"),
        ("another tensor's piece", "of 'b' arrived while 'a' still missed bytes 64-400"),
        ("the first piece missing", "the first piece of 'a' to arrive carries bytes 64-128"),
        ("the last piece missing", "the sync ended while 'a' still missed bytes 384-400"),
        ("a short piece", "says bytes 0-64 of 400 but carries 63 bytes"),
        ("a wrong shape", "say 400 bytes, but a float32 tensor of shape [99] has 396"),
    ],
)
def test_a_broken_stream_of_pieces_fails_naming_the_tensor_and_the_bytes(case: str, message: str) -> None:
    a = _split(iter([("a", torch.ones(100))]))[0]
    b = _split(iter([("b", torch.ones(100))]))[0]
    items = {
        "a whole tensor between pieces": [*a[:1], ("b", torch.ones(2))],
        "a piece skipped": a[:1] + a[2:],
        "another tensor's piece": a[:1] + b[1:],
        "the first piece missing": a[1:],
        "the last piece missing": a[:-1],
        "a short piece": [(a[0][0], a[0][1][:63])],
        "a wrong shape": [(piece_name("a", 0, 64, 400, torch.float32, (99,)), a[0][1])],
    }[case]
    with pytest.raises(TransportError) as caught:
        _assemble(items)
    assert message in str(caught.value) and str(caught.value).startswith("rollout rank 0: ")


def test_a_reserved_or_repeated_name_is_refused_at_the_sender() -> None:
    with pytest.raises(TransportError, match="starts with '\\[fastsync: bytes ', which is reserved"):
        _split(iter([(f"{PIECE_PREFIX}0-1 of 1, uint8[1]] x", torch.ones(1))]))
    with pytest.raises(DuplicateTensorError, match="'w' appears twice"):
        _split(iter([("w", torch.ones(100)), ("w", torch.ones(100))]))
    with pytest.raises(TypeError, match=r"not a torch\.Tensor"):
        _split(iter([("w", [1.0, 2.0])]))


def test_assembled_tensors_reuse_host_memory_the_consumer_let_go_and_never_memory_it_holds() -> None:
    """Through a transport's DestinationPool: a tensor the consumer dropped gives its memory to the
    next one (no fresh allocation, no page faults, per large tensor per sync); one it still holds is
    never written."""
    pool = DestinationPool()
    pieces = Pieces("rollout rank 0", pool.allocate)

    def receive(name: str, value: float) -> torch.Tensor:
        whole = None
        for piece_item in _split(iter([(name, torch.full((100,), value))]))[0]:
            whole = pieces.feed(*piece_item)
        assert whole is not None
        return whole[1]

    held = receive("a", 1.0)
    dropped = receive("b", 2.0)
    del dropped
    receive("c", 3.0)
    receive("d", 4.0)
    assert torch.equal(held, torch.full((100,), 1.0))  # the consumer's tensor was never reused
    assert pool.made == 2  # "a" (held) and "b", whose memory "c" and then "d" reused
