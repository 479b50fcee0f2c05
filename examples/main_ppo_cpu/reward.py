"""The custom reward of the CPU example (``reward.custom_reward_function.path=<this file>``).

The fraction of the response's characters that are digits of the right answer: a random tiny model
earns small, varied rewards, so GRPO's group advantages are non-zero and every step changes the
weights (which is what makes the weight sync observable).
"""

from __future__ import annotations

from typing import Any


def compute_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None, **kwargs: Any
) -> float:
    if not solution_str:
        return 0.0
    hits = sum(1 for ch in solution_str if ch in ground_truth)
    return hits / len(solution_str)
