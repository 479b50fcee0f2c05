"""Trainer-side weight generators, including the adversaries of issue 9.

``plain``   yields each tensor once and leaves it alone.
``reuse``   refills ONE staging buffer per tensor and yields views of it (a sender that keeps a
            reference instead of copying at yield time ships the last tensor's bytes everywhere).
``restore`` yields the tensors themselves and, after its last yield, adds 1.0 to every one of them in
            place (a merged-LoRA restore; a sender that flushes after the generator ends ships the
            restored bytes).
The receiver must end up with the bytes as they were when each tensor was yielded.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

PRODUCERS = ("plain", "reuse", "restore")


def produce(kind: str, tensors: list[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    if kind == "plain":
        yield from tensors
    elif kind == "reuse":
        biggest = max(t.nbytes for _, t in tensors)
        staging = torch.empty(biggest, dtype=torch.uint8)
        for name, t in tensors:
            view = staging[: t.nbytes].view(t.dtype).view(t.shape)
            view.copy_(t)
            yield name, view
        staging.fill_(0x5A)
    elif kind == "restore":
        own = [(name, t.clone()) for name, t in tensors]
        yield from own
        with torch.no_grad():
            for _, t in own:
                t.add_(1.0)
    else:
        raise ValueError(f"unknown producer {kind!r}; allowed: {', '.join(PRODUCERS)}")
