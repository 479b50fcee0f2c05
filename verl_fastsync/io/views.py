"""The one flat byte view of a tensor (:func:`byte_view`): what the transports send of a tensor and
what a delta sync keeps and compares of it, so every tensor one accepts the other accepts too.
Imports torch only."""

from __future__ import annotations

import torch

__all__ = ["byte_view", "viewed_in_place"]


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """A flat ``uint8`` view of ``tensor``'s bytes, in row-major order.

    Contiguous tensors are viewed without a copy; a non-contiguous tensor (or one with a lazy
    conjugate/negative bit) is materialised once with ``.contiguous()``.
    """
    if tensor.is_conj():
        tensor = tensor.resolve_conj()
    if tensor.is_neg():
        tensor = tensor.resolve_neg()
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    flat = tensor.detach().reshape(-1)
    if flat.numel() <= 1 and flat.stride(0) != 1:
        # 0/1-element tensors count as contiguous whatever their stride; give them a unit stride
        flat = flat.as_strided((flat.numel(),), (1,))
    if flat.dtype == torch.uint8:
        return flat
    return flat.view(torch.uint8)


def viewed_in_place(tensor: torch.Tensor) -> bool:
    """Whether :func:`byte_view` views ``tensor``'s own memory (else it materialises a copy)."""
    return tensor.is_contiguous() and not (tensor.is_conj() or tensor.is_neg())
