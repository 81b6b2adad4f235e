"""Hyper-connections (spec 3): S parallel residual streams, read through a low-rank gated mixer and written
back with per-stream injection weights."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from strata.model.norms import grouped_rms_norm
from strata.weights.schema import Weights
from strata.weights.tensor import StoredTensor

if TYPE_CHECKING:
    from strata.model.ops import Ops


def hc_read_ref(x: torch.Tensor, norm: torch.Tensor, down: StoredTensor, up: StoredTensor,
                inject: StoredTensor | None, streams: int, eps: float, linear,
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Block input a (L, H) from the state x (L, S*H), and the injection weights (L, S) for the write (None
    for the final mixer, which has no inject weight). `norm` is the fp32 grouped-norm scale."""
    xn = grouped_rms_norm(x, norm, x.shape[-1] // streams, eps)
    m = F.silu(linear(xn, down) / streams)
    gates = torch.sigmoid(linear(m, up))
    a = (gates.unflatten(-1, (streams, -1)) * xn.unflatten(-1, (streams, -1))).mean(-2)
    if inject is None:
        return a, None
    return a, 2 * torch.sigmoid(linear(xn, inject) / streams)


def hc_read(x: torch.Tensor, w: Weights, prefix: str, streams: int, eps: float, ops: Ops,
            inject: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The read of hyper-connection `prefix` ("L3.hc_attn", "final", ...) through the op table."""
    return ops.hc_read(x, w[prefix + ".norm"].dense(torch.float32, x.device), w[prefix + ".down"],
                       w[prefix + ".up"], w[prefix + ".inject"] if inject else None, streams, eps, ops.linear)


def hc_write_ref(x: torch.Tensor, inject: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """x_s += inject_s * y for every stream s (the un-normalised pre-block state is the base).
    x (L, S*H), inject (L, S), y (L, H) -> (L, S*H); the product is rounded to the model dtype, then the sum."""
    return x + (y.unsqueeze(-2) * inject.unsqueeze(-1)).flatten(-2)


def hc_write_read_ref(x: torch.Tensor, inject_prev: torch.Tensor, y: torch.Tensor, norm: torch.Tensor,
                      down: StoredTensor, up: StoredTensor, inject: StoredTensor | None, streams: int, eps: float,
                      linear) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A block's write followed by the next read (the next block's, or the final one): (x', a, injection
    weights | None) with x' = `hc_write_ref`(x, inject_prev, y). One op so that a fast backend can fold the
    write into the read's launches."""
    x = hc_write_ref(x, inject_prev, y)
    a, inj = hc_read_ref(x, norm, down, up, inject, streams, eps, linear)
    return x, a, inj


def hc_write_read(x: torch.Tensor, inject_prev: torch.Tensor, y: torch.Tensor, w: Weights, prefix: str,
                  streams: int, eps: float, ops: Ops, inject: bool = True,
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The write x + inject_prev * y, then the read of hyper-connection `prefix`, through `ops.hc_write_read`."""
    return ops.hc_write_read(x, inject_prev, y, w[prefix + ".norm"].dense(torch.float32, x.device),
                             w[prefix + ".down"], w[prefix + ".up"], w[prefix + ".inject"] if inject else None,
                             streams, eps, ops.linear)


hc_write = hc_write_ref  # the reference under its historical name; the model calls `ops.hc_write`
