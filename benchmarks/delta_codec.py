"""Measures the delta codec on weights from real optimizer steps, against the other candidate encodings.

A small transformer (``torch.nn``, a few M parameters) trains on random tokens with fp32 master weights
and AdamW; after every step the weights are cast to bf16 and laid end to end in one buffer, cut into
buckets, and each bucket is encoded against the previous step's bytes of it. Per step it prints the
fraction of bf16 values changed, the bytes of each encoding relative to raw, and the encode and decode
speed of each (GB/s of bucket bytes, one thread):

* ``codec``: :func:`verl_fastsync.delta.codec.encode` as a sender runs it (``update_base``) and
  :func:`~verl_fastsync.delta.codec.decode` as a receiver does (in place);
* ``sparse``: the codec's sparse form even where it would go raw (bytes only);
* ``xor+<compressor>``: the base XOR the new bytes, then a general compressor (zlib level 1 always;
  zstandard level 1 and lz4 when installed; they are not dependencies of the package), decoded by
  decompressing and XOR-ing into the base.

Every decode is checked bit-exact. The last row of each learning rate is a re-initialised model (every
value changed): the raw fallback's cost. Run: ``python benchmarks/delta_codec.py [--lrs 1e-6 1e-5]
[--steps 5] [--bucket-mb 4]``.
"""

from __future__ import annotations

import argparse
import importlib
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from verl_fastsync.delta.codec import HEADER, Delta, Kind, as_bytes, decode, encode, sparse_size

Bytes = np.ndarray
Compressor = tuple[Callable[[Bytes], bytes], Callable[[bytes, int], bytes]]


def compressors() -> dict[str, Compressor]:
    """name -> (compress, decompress(data, size)) for each general compressor importable here."""
    found: dict[str, Compressor] = {
        "zlib1": (lambda x: zlib.compress(x.data, 1), lambda d, n: zlib.decompress(d)),
    }
    try:
        zstd = importlib.import_module("zstandard")
        cctx, dctx = zstd.ZstdCompressor(level=1), zstd.ZstdDecompressor()
        found["zstd1"] = (cctx.compress, lambda d, n: dctx.decompress(d, max_output_size=n))
    except ImportError:
        pass
    try:
        lz4 = importlib.import_module("lz4.block")
        found["lz4"] = (
            lambda x: lz4.compress(x, store_size=False),
            lambda d, n: lz4.decompress(d, uncompressed_size=n),
        )
    except ImportError:
        pass
    return found


class TinyLM(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        block = nn.TransformerEncoderLayer(
            dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True
        )
        self.body = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
        return self.head(self.norm(self.body(self.embed(tokens), mask=mask, is_causal=True)))


def bf16_bytes(model: nn.Module) -> Bytes:
    """The model's weights cast to bf16, end to end, as one byte buffer (what a sync sends)."""
    flat = torch.cat([p.detach().to(torch.bfloat16).reshape(-1) for p in model.parameters()])
    return as_bytes(flat).copy()


@dataclass
class Row:
    lr: float
    step: str
    changed: float = 0.0
    raw: int = 0
    size: dict[str, int] = field(default_factory=dict)
    enc_s: dict[str, float] = field(default_factory=dict)
    dec_s: dict[str, float] = field(default_factory=dict)
    kinds: dict[str, int] = field(default_factory=dict)


def _timed(fn: Callable[[], object]) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def measure(row: Row, prev: Bytes, new: Bytes, bucket: int, comps: dict[str, Compressor]) -> None:
    """Adds every bucket of ``new`` (against ``prev``) to ``row``, checking each decode bit-exact."""
    changed = 0
    for at in range(0, new.size, bucket):
        old, now = prev[at : at + bucket], new[at : at + bucket]
        row.raw += now.size
        before = changed
        sender = old.copy()
        seconds, delta = _timed(lambda: encode(sender, now, 2, update_base=True))  # noqa: B023
        assert isinstance(delta, Delta)
        changed += int(np.count_nonzero(old.view(np.uint16) != now.view(np.uint16)))
        row.kinds[delta.kind.name] = row.kinds.get(delta.kind.name, 0) + 1
        _add(row, "codec", delta.nbytes, seconds)
        wire = np.frombuffer(delta.tobytes(), dtype=np.uint8)
        receiver = old.copy()
        seconds, _ = _timed(lambda: decode(receiver, wire, out=receiver))  # noqa: B023
        assert np.array_equal(receiver, now) and np.array_equal(sender, now)
        row.dec_s["codec"] = row.dec_s.get("codec", 0.0) + seconds
        _add(row, "sparse", HEADER.size + sparse_size(now.size, 2, changed - before), 0.0)
        for name, (compress, decompress) in comps.items():

            def pack(c: Callable[[Bytes], bytes] = compress) -> bytes:
                return c(np.bitwise_xor(old, now))  # noqa: B023

            seconds, packed = _timed(pack)
            assert isinstance(packed, bytes)
            _add(row, f"xor+{name}", len(packed), seconds)
            receiver = old.copy()

            def undo(d: Callable[[bytes, int], bytes] = decompress, p: bytes = packed) -> None:
                np.bitwise_xor(receiver, np.frombuffer(d(p, receiver.size), dtype=np.uint8), out=receiver)  # noqa: B023

            seconds, _ = _timed(undo)
            assert np.array_equal(receiver, now)
            row.dec_s[f"xor+{name}"] = row.dec_s.get(f"xor+{name}", 0.0) + seconds
    row.changed = changed / (new.size // 2)


def _add(row: Row, name: str, nbytes: int, seconds: float) -> None:
    row.size[name] = row.size.get(name, 0) + nbytes
    row.enc_s[name] = row.enc_s.get(name, 0.0) + seconds


def run(lr: float, steps: int, bucket: int, comps: dict[str, Compressor], seed: int = 0) -> list[Row]:
    torch.manual_seed(seed)
    vocab, seq, batch = 4096, 64, 8
    model = TinyLM(vocab, dim=256, layers=4, heads=4)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    prev = bf16_bytes(model)
    rows = []
    for step in range(1, steps + 1):
        tokens = torch.randint(0, vocab, (batch, seq + 1))
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        new = bf16_bytes(model)
        row = Row(lr, str(step))
        measure(row, prev, new, bucket, comps)
        rows.append(row)
        prev = new
    fresh = TinyLM(vocab, dim=256, layers=4, heads=4)
    row = Row(lr, "re-init")
    measure(row, prev, bf16_bytes(fresh), bucket, comps)
    rows.append(row)
    return rows


def table(rows: list[Row]) -> str:
    names = list(rows[0].size)
    head = ["lr", "step", "changed %", "raw MB", "codec kinds"]
    head += [f"{n} size %" for n in names]
    head += [f"{n} enc/dec GB/s" for n in names if n != "sparse"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [f"{r.lr:g}", r.step, f"{100 * r.changed:.2f}", f"{r.raw / 1e6:.1f}"]
        cells.append(" ".join(f"{k.lower()}:{v}" for k, v in sorted(r.kinds.items())))
        cells += [f"{100 * r.size[n] / r.raw:.2f}" for n in names]
        speeds = [(r.raw / r.enc_s[n] / 1e9, r.raw / r.dec_s[n] / 1e9) for n in names if n != "sparse"]
        cells += [f"{enc:.2f} / {dec:.2f}" for enc, dec in speeds]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--lrs", type=float, nargs="+", default=[1e-6, 1e-5])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--bucket-mb", type=float, default=4.0)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    comps = compressors()
    bucket = int(args.bucket_mb * 2**20)
    rows = [row for lr in args.lrs for row in run(lr, args.steps, bucket, comps)]
    params = sum(p.numel() for p in TinyLM(4096, 256, 4, 4).parameters())
    kinds = [k.name for k in Kind]
    print(f"{params / 1e6:.2f} M parameters, buckets of {args.bucket_mb:g} MiB, codec kinds: {kinds}")
    print(table(rows))


if __name__ == "__main__":
    main()
