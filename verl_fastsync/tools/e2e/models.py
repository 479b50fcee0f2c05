"""Tiny random Qwen3-shaped models written locally with transformers ``save_pretrained`` (no hub).

``dense``: Qwen3ForCausalLM, untied embedding/lm_head of 8192 x 512 fp32 (16 MiB each), larger than the
8 MiB bucket the fastsync runs use, so the colocated transport must chunk it.
``moe``: Qwen3MoeForCausalLM, 8 experts stored stacked (``mlp.experts.gate_up_proj [E, 2I, H]``,
``mlp.experts.down_proj [E, H, I]``) as transformers 5 keeps them, so vLLM's FusedMoE loader gets
expert-stacked tensors.

Every parameter (norms included) is filled from a seeded generator, so two seeds differ in every
tensor and a transport that drops or misroutes any tensor is visible.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

KINDS = ("dense", "moe")
DTYPE = torch.float32


def _config(kind: str) -> Any:
    if kind == "dense":
        from transformers import Qwen3Config

        return Qwen3Config(
            vocab_size=8192,
            hidden_size=512,
            intermediate_size=1536,
            num_hidden_layers=2,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=64,
            max_position_embeddings=512,
            tie_word_embeddings=False,
            rms_norm_eps=1e-6,
        )
    if kind == "moe":
        from transformers import Qwen3MoeConfig

        moe_config: Any = Qwen3MoeConfig
        return moe_config(
            vocab_size=4096,
            hidden_size=256,
            intermediate_size=512,
            moe_intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            num_experts=8,
            num_experts_per_tok=2,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=True,
            max_position_embeddings=512,
            tie_word_embeddings=False,
            rms_norm_eps=1e-6,
        )
    raise ValueError(f"unknown e2e model kind {kind!r}; allowed: {', '.join(KINDS)}")


def build_model(kind: str, seed: int) -> Any:
    """The transformers model of ``kind`` with every parameter drawn from ``seed``."""
    from transformers import AutoModelForCausalLM

    config = _config(kind)
    torch.manual_seed(seed)
    model: Any = AutoModelForCausalLM.from_config(config)
    model = model.to(DTYPE).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * noise)
            else:
                param.copy_(0.05 * noise)
    return model


DELTA_FRACTION = 0.02
"""Fraction of each parameter's values one :func:`train_like` step changes (at least one value)."""


def train_like(model: Any, seed: int, step: int) -> Any:
    """``model`` after a step that changes a few values of every parameter, as an RL step does (the
    delta e2e's consecutive models): :data:`DELTA_FRACTION` of each parameter's values, drawn from
    ``(seed, step)``, move by a small amount. In place; returns ``model``."""
    gen = torch.Generator().manual_seed(seed * 1000 + step)
    with torch.no_grad():
        for _, param in model.named_parameters():
            flat = param.view(-1)
            picked = torch.randperm(flat.numel(), generator=gen)[: max(1, int(DELTA_FRACTION * flat.numel()))]
            flat[picked] += 1e-3 * (1.0 + torch.rand(picked.numel(), generator=gen))
    return model


def build_variant(kind: str, seed: int, steps: int) -> Any:
    """The model of ``seed`` after ``steps`` :func:`train_like` steps."""
    model = build_model(kind, seed)
    for step in range(1, steps + 1):
        train_like(model, seed, step)
    return model


def write_model(model: Any, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    return out_dir


def state(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The trainer's view of the weights: transformers' own state-dict names and layouts (fresh,
    contiguous copies, so the producers can do what they like with them)."""
    return [(name, t.detach().clone().contiguous()) for name, t in model.state_dict().items()]


def greedy(model: Any, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt (no EOS stop)."""
    outs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt], dtype=torch.long)
            for _ in range(max_new_tokens):
                logits = model(input_ids=ids).logits[0, -1]
                ids = torch.cat([ids, logits.argmax().view(1, 1)], dim=1)
            outs.append(ids[0, len(prompt) :].tolist())
    return outs
