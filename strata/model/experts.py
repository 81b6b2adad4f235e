"""Reference routed-expert compute (the op a grouped expert kernel replaces)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from strata.model.act_quant import q8_input
from strata.weights.tensor import StoredTensor


def experts_ref(a: torch.Tensor, top_i: torch.Tensor, top_w: torch.Tensor, gate: StoredTensor, up: StoredTensor,
                down: StoredTensor, linear) -> torch.Tensor:
    """Σ_slots w · down_e(silu(gate_e a) ⊙ up_e a) for each token's selected experts e, in the model dtype.
    Loops over the distinct experts on the host (a data-dependent loop: not for captured steps)."""
    routed = torch.zeros_like(a)
    for e in torch.unique(top_i).tolist():
        tok, slot = (top_i == e).nonzero(as_tuple=True)
        x = a[tok]
        f = linear(F.silu(linear(x, gate[e])) * linear(x, up[e]), down[e])
        routed.index_add_(0, tok, (f * top_w[tok, slot, None]).to(a.dtype))
    return routed


def experts_gather(a: torch.Tensor, top_i: torch.Tensor, top_w: torch.Tensor, gate: StoredTensor,
                   up: StoredTensor, down: StoredTensor, linear, q8: bool = False) -> torch.Tensor:
    """The same sum with expert ids kept on the device: gathers the selected experts' dense weights per slot.
    Shapes depend only on (L, k), so it can be captured; used as the capturable twin of the expert kernel. q8:
    each product's input rounded as `strata.model.ops.linear_q8_ref` rounds it."""
    dt = a.dtype
    g, u, d = gate.dense(dt, a.device), up.dense(dt, a.device), down.dense(dt, a.device)
    ag, au = q8_input(a, gate.kind, q8), q8_input(a, up.kind, q8)
    out = torch.zeros_like(a)
    for j in range(top_i.shape[1]):
        e = top_i[:, j]
        h = F.silu(torch.einsum("lih,lh->li", g[e], ag)) * torch.einsum("lih,lh->li", u[e], au)
        out = out + (torch.einsum("lhi,li->lh", d[e], q8_input(h, down.kind, q8)) * top_w[:, j, None]).to(dt)
    return out
