"""Hyper-connections (spec 3): S parallel residual streams, read through a low-rank gated mixer and written
back with per-stream injection weights."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from strata.model.norms import grouped_rms_norm
from strata.model.ops import Ops
from strata.weights.schema import Weights


def hc_read(x: torch.Tensor, w: Weights, prefix: str, streams: int, eps: float, ops: Ops,
            inject: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Block input a (L, H) from the state x (L, S*H), and the injection weights (L, S) for the write."""
    xn = grouped_rms_norm(x, w[prefix + ".norm"].dense(torch.float32, x.device), x.shape[-1] // streams, eps)
    m = F.silu(ops.linear(xn, w[prefix + ".down"]) / streams)
    gates = torch.sigmoid(ops.linear(m, w[prefix + ".up"]))
    a = (gates.unflatten(-1, (streams, -1)) * xn.unflatten(-1, (streams, -1))).mean(-2)
    if not inject:
        return a, None
    return a, 2 * torch.sigmoid(ops.linear(xn, w[prefix + ".inject"]) / streams)


def hc_write(x: torch.Tensor, inject: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """x_s += inject_s * y for every stream s (the un-normalised pre-block state is the base)."""
    return x + (y.unsqueeze(-2) * inject.unsqueeze(-1)).flatten(-2)
