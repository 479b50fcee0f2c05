"""Synthetic model presets for ``verl-fastsync bench``.

The presets reproduce the *layout* of real checkpoints (tensor names, shape ratios, counts, one large
embedding, expert-stacked MoE tensors) at a size chosen by the caller, so that a weight sync can be
measured without a model download:

``dense-small``
    Qwen3-8B's layout scaled down: untied ``embed_tokens``/``lm_head`` with vocab = 37 x hidden,
    grouped-query attention (4 query heads per KV head, ``q_norm``/``k_norm``), SwiGLU MLP with
    intermediate = 3 x hidden, 8 decoder layers.
``moe-small``
    Qwen3-30B-A3B's layout scaled down: attention with 8 query heads per KV head, a router
    (``mlp.gate``) and experts stored stacked as ``mlp.experts.gate_up_proj [E, 2*I, H]`` and
    ``mlp.experts.down_proj [E, H, I]`` (E = 32 experts, I = 3/8 x hidden), vocab = 20 x hidden,
    6 decoder layers. The stacked ``gate_up_proj`` tensors are the largest tensors of the model (as
    in Qwen3-30B-A3B, where they outweigh the embedding); at the bench's default size (256 MiB) they
    are larger than the smaller default bucket (16 MiB), which verl's shared-memory sender cannot
    carry.

The hidden size is the one free parameter: it is picked (multiple of 16) so that the model's total
bytes come closest to the requested size. All tensors are bf16 by default.

The tensor contents are deterministic and cheap to produce (a seeded 1 MiB random block, tiled with a
per-tensor rotation), so a receiver can check what it got via :func:`fingerprint`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

PRESETS = ("dense-small", "moe-small")

_DTYPE_SIZES = {"bfloat16": 2, "float16": 2, "float32": 4}


class UnknownModelPresetError(ValueError):
    """A model preset name that does not exist."""


@dataclass(frozen=True)
class TensorSpec:
    """One named tensor of a synthetic model."""

    name: str
    shape: tuple[int, ...]
    dtype: str = "bfloat16"

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * _DTYPE_SIZES[self.dtype]


@dataclass(frozen=True)
class ModelSpec:
    """A synthetic model: a preset name, its hidden size and its ordered tensors."""

    preset: str
    hidden: int
    tensors: tuple[TensorSpec, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def largest_tensor_bytes(self) -> int:
        return max(t.nbytes for t in self.tensors)

    def describe(self) -> str:
        return (
            f"{self.preset} (hidden {self.hidden}, {len(self.tensors)} tensors, "
            f"{self.nbytes / 2**20:.1f} MiB, largest {self.largest_tensor_bytes / 2**20:.1f} MiB)"
        )


def _round(x: float, multiple: int = 16) -> int:
    return max(multiple, round(x / multiple) * multiple)


def _attention(p: str, hidden: int, heads: int, kv_heads: int, head_dim: int, dtype: str) -> list[TensorSpec]:
    """One Qwen3 decoder layer's norms and attention (GQA with q/k norms), shared by both layouts."""
    return [
        TensorSpec(p + "input_layernorm.weight", (hidden,), dtype),
        TensorSpec(p + "self_attn.q_proj.weight", (heads * head_dim, hidden), dtype),
        TensorSpec(p + "self_attn.k_proj.weight", (kv_heads * head_dim, hidden), dtype),
        TensorSpec(p + "self_attn.v_proj.weight", (kv_heads * head_dim, hidden), dtype),
        TensorSpec(p + "self_attn.o_proj.weight", (hidden, heads * head_dim), dtype),
        TensorSpec(p + "self_attn.q_norm.weight", (head_dim,), dtype),
        TensorSpec(p + "self_attn.k_norm.weight", (head_dim,), dtype),
        TensorSpec(p + "post_attention_layernorm.weight", (hidden,), dtype),
    ]


def _dense_layout(hidden: int, dtype: str, layers: int = 8) -> list[TensorSpec]:
    head_dim = 64 if hidden >= 256 else 16
    heads = max(4, hidden // head_dim)
    kv_heads = max(1, heads // 4)
    inter = 3 * hidden
    vocab = _round(37 * hidden, 64)
    out = [TensorSpec("model.embed_tokens.weight", (vocab, hidden), dtype)]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [
            *_attention(p, hidden, heads, kv_heads, head_dim, dtype),
            TensorSpec(p + "mlp.gate_proj.weight", (inter, hidden), dtype),
            TensorSpec(p + "mlp.up_proj.weight", (inter, hidden), dtype),
            TensorSpec(p + "mlp.down_proj.weight", (hidden, inter), dtype),
        ]
    out += [
        TensorSpec("model.norm.weight", (hidden,), dtype),
        TensorSpec("lm_head.weight", (vocab, hidden), dtype),
    ]
    return out


def _moe_layout(hidden: int, dtype: str, layers: int = 6, experts: int = 32) -> list[TensorSpec]:
    head_dim = 64 if hidden >= 256 else 16
    heads = max(8, hidden // head_dim)
    kv_heads = max(1, heads // 8)
    inter = _round(3 * hidden / 8, 16)
    vocab = _round(20 * hidden, 64)
    out = [TensorSpec("model.embed_tokens.weight", (vocab, hidden), dtype)]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [
            *_attention(p, hidden, heads, kv_heads, head_dim, dtype),
            TensorSpec(p + "mlp.gate.weight", (experts, hidden), dtype),
            TensorSpec(p + "mlp.experts.gate_up_proj", (experts, 2 * inter, hidden), dtype),
            TensorSpec(p + "mlp.experts.down_proj", (experts, hidden, inter), dtype),
        ]
    out += [
        TensorSpec("model.norm.weight", (hidden,), dtype),
        TensorSpec("lm_head.weight", (vocab, hidden), dtype),
    ]
    return out


_LAYOUTS: dict[str, Callable[[int, str], list[TensorSpec]]] = {
    "dense-small": _dense_layout,
    "moe-small": _moe_layout,
}


def model_spec(preset: str, size_bytes: int, dtype: str = "bfloat16") -> ModelSpec:
    """The preset's layout with the hidden size whose total bytes come closest to ``size_bytes``."""
    if preset not in _LAYOUTS:
        raise UnknownModelPresetError(f"unknown model preset {preset!r}; allowed: {', '.join(PRESETS)}")
    if dtype not in _DTYPE_SIZES:
        raise ValueError(f"unsupported dtype {dtype!r}; allowed: {', '.join(_DTYPE_SIZES)}")
    if size_bytes <= 0:
        raise ValueError(f"model size must be positive, got {size_bytes} bytes")
    layout = _LAYOUTS[preset]
    # bytes grow ~quadratically with hidden: start from the estimate, then walk to the closest.
    base = sum(t.nbytes for t in layout(1024, dtype))
    hidden = _round(1024 * math.sqrt(size_bytes / base))

    def err(h: int) -> int:
        return abs(sum(t.nbytes for t in layout(h, dtype)) - size_bytes)

    while hidden > 16 and err(hidden - 16) < err(hidden):
        hidden -= 16
    while err(hidden + 16) < err(hidden):
        hidden += 16
    return ModelSpec(preset=preset, hidden=hidden, tensors=tuple(layout(hidden, dtype)))


def split_spec(spec: ModelSpec, pieces: int) -> ModelSpec:
    """The same bytes as ``spec`` in about ``pieces`` times as many tensors (for the tensor-count scan).

    Each tensor is cut along its first dimension into up to ``pieces`` parts (names ``<name>.part<k>``).
    """
    if pieces < 1:
        raise ValueError(f"pieces must be >= 1, got {pieces}")
    out: list[TensorSpec] = []
    for t in spec.tensors:
        rows = t.shape[0]
        n = min(pieces, rows)
        step = -(-rows // n)
        for k, start in enumerate(range(0, rows, step)):
            length = min(step, rows - start)
            out.append(TensorSpec(f"{t.name}.part{k}", (length, *t.shape[1:]), t.dtype))
    return ModelSpec(preset=f"{spec.preset}/x{pieces}", hidden=spec.hidden, tensors=tuple(out))


_BLOCK_ELEMS = 1 << 19  # 1 MiB of bf16


def _torch_dtype(dtype: str) -> torch.dtype:
    import torch

    dt: torch.dtype = getattr(torch, dtype)
    return dt


def materialize(spec: ModelSpec, seed: int = 0, device: str = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor of ``spec``, contents deterministic in ``seed``.

    Each tensor is allocated when it is yielded; the caller decides whether to keep them.
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    block = torch.randn(2 * _BLOCK_ELEMS, generator=gen)
    blocks: dict[str, torch.Tensor] = {}
    for index, t in enumerate(spec.tensors):
        if t.dtype not in blocks:
            blocks[t.dtype] = block.to(_torch_dtype(t.dtype)).to(device)
        src = blocks[t.dtype]
        tensor = torch.empty(t.shape, dtype=_torch_dtype(t.dtype), device=device)
        flat = tensor.view(-1)
        shift = (index * 7919) % _BLOCK_ELEMS
        for off in range(0, t.numel, _BLOCK_ELEMS):
            n = min(_BLOCK_ELEMS, t.numel - off)
            flat[off : off + n].copy_(src[shift : shift + n])
        yield t.name, tensor


def build_model(spec: ModelSpec, seed: int = 0, device: str = "cpu") -> list[tuple[str, torch.Tensor]]:
    """All tensors of ``spec`` materialised (see :func:`materialize`)."""
    return list(materialize(spec, seed=seed, device=device))


def fingerprint(tensor: torch.Tensor) -> int:
    """A cheap content fingerprint: the 16-bit words summed per 1 MiB chunk, chunks weighted by position.

    Equal bytes give equal fingerprints; a swapped, shifted or missing chunk almost surely does not.
    """
    import torch

    data = tensor.detach().contiguous().view(-1).view(torch.uint8)
    words = data.view(torch.int16) if data.numel() % 2 == 0 else data
    total = 0
    step = 1 << 19
    for k, off in enumerate(range(0, words.numel(), step)):
        total += (k + 1) * int(words[off : off + step].sum(dtype=torch.int64))
    return total
