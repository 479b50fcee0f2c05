"""A tiny model, its tokenizer and a GRPO data set, written locally (nothing is downloaded).

``python tiny_assets.py OUT_DIR`` writes ``OUT_DIR/model`` (a 2-layer Qwen3, fp32, random, with its
tokenizer) and ``OUT_DIR/train.parquet`` / ``OUT_DIR/val.parquet`` in the layout verl's RL data set
reads (``prompt`` as chat messages, ``data_source``, ``reward_model.ground_truth``). Idempotent: an
existing complete ``OUT_DIR`` is kept.

The tokenizer is byte-level (256 byte tokens, no merges) plus three special tokens and a ChatML
template; the model's ``vocab_size`` equals the tokenizer's length, so vLLM samples from the same
vocabulary the trainer scores (a larger model vocabulary is masked by vLLM and shows up in verl's
``rollout_corr/log_ppl_diff`` as ln(vocab/len)).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
DONE = "assets.json"


def _byte_vocab() -> dict[str, int]:
    # GPT-2's printable stand-in for every byte (what a byte-level BPE stores in its vocab)
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {chars[b]: b for b in range(256)}


def build_tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(vocab=_byte_vocab(), merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=list(SPECIAL[1:2]),
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_model(vocab_size: int, eos_id: int, pad_id: int, seed: int = 0) -> Any:
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).to(torch.float32)


def _rows(n: int, split: str) -> list[dict[str, Any]]:
    rows = []
    for i in range(n):
        a, b = 3 + i % 7, 5 + (i * 3) % 11
        rows.append(
            {
                "data_source": "tiny_digits",
                "prompt": [{"role": "user", "content": f"{a}+{b}="}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                "extra_info": {"split": split, "index": i},
            }
        )
    return rows


def write_assets(out_dir: Path, train_rows: int = 64, val_rows: int = 8) -> dict[str, str]:
    """Write the model, tokenizer and data under ``out_dir``; return their paths."""
    out_dir = Path(out_dir)
    marker = out_dir / DONE
    if marker.exists():
        return dict(json.loads(marker.read_text()))
    import pandas as pd

    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    model = build_model(len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id)
    model_dir = out_dir / "model"
    model.save_pretrained(str(model_dir), safe_serialization=True)
    tokenizer.save_pretrained(str(model_dir))
    paths = {"model": str(model_dir)}
    for split, n in (("train", train_rows), ("val", val_rows)):
        path = out_dir / f"{split}.parquet"
        pd.DataFrame(_rows(n, split)).to_parquet(path)
        paths[split] = str(path)
    paths["vocab_size"] = str(len(tokenizer))
    marker.write_text(json.dumps(paths))
    return paths


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tiny_assets.py OUT_DIR")
    print(json.dumps(write_assets(Path(sys.argv[1]))))
