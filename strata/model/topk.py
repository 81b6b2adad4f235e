"""Top-k selection shared by the router and the QSA indexer.

Both choose a *set* by score, and the reference's torch.topk leaves the order of equal scores undefined; kept in
one place so tests can observe the margin at the k-th place and reject tied draws instead of loosening tolerances.
"""

from __future__ import annotations

import torch


def select(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of the k largest scores along the last axis, largest first."""
    return scores.topk(k, dim=-1)
