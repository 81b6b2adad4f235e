"""Gated DeltaNet layer (spec 4): projections, causal depthwise conv, gates, and the gated delta rule in
its chunked form (prefill) and its recurrent form (one token), both reading and writing one state."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from strata.config import ModelConfig
from strata.model.norms import gated_rms_norm, l2norm
from strata.runtime.state import GDNState
from strata.weights.schema import Weights

if TYPE_CHECKING:
    from strata.model.ops import Ops


def causal_conv(x: torch.Tensor, window: torch.Tensor, weight: torch.Tensor, dilation: int = 1,
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv over time. x (L, C), window (C, W) = the previous inputs, weight (C, K).
    Returns the L outputs (L, C) and the new window."""
    full = torch.cat([window, x.transpose(0, 1)], dim=1)  # (C, W + L)
    out = F.conv1d(full.unsqueeze(0), weight.unsqueeze(1), groups=weight.shape[0], dilation=dilation)[0]
    return out.transpose(0, 1), full[:, full.shape[1] - window.shape[1]:]


def delta_rule_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token gated delta rule. q, k (L, nv, dk); v (L, nv, dv); g, beta (L, nv); state (nv, dk, dv).
    All float32. Returns outputs (L, nv, dv) and the new state."""
    out = torch.empty_like(v)
    for t in range(q.shape[0]):
        state = state * g[t].exp()[:, None, None]
        r = (state * k[t].unsqueeze(-1)).sum(-2)
        delta = (v[t] - r) * beta[t].unsqueeze(-1)
        state = state + k[t].unsqueeze(-1) * delta.unsqueeze(-2)
        out[t] = (state * q[t].unsqueeze(-1)).sum(-2)
    return out, state


def delta_rule_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       state: torch.Tensor, chunk: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """The same recurrence, evaluated a chunk at a time with the UT transform (spec 4, chunked form)."""
    L = q.shape[0]
    pad = (chunk - L % chunk) % chunk
    # (nv, L, d) layout
    q, k, v = (F.pad(x.transpose(0, 1), (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x.transpose(0, 1), (0, pad)) for x in (g, beta))
    nv, T, dk = k.shape
    n = T // chunk
    q, k, v = (x.reshape(nv, n, chunk, x.shape[-1]) for x in (q, k, v))
    g, beta = g.reshape(nv, n, chunk), beta.reshape(nv, n, chunk)
    G = g.cumsum(-1)  # cumulative log decay inside a chunk
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    D = (G.unsqueeze(-1) - G.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
    kb, vb = k * beta.unsqueeze(-1), v * beta.unsqueeze(-1)
    A = (kb @ k.transpose(-1, -2)) * D
    A = A.masked_fill(~torch.ones_like(upper).tril(-1), 0.0)  # strictly lower part
    eye = torch.eye(chunk, dtype=A.dtype, device=A.device)
    U = torch.linalg.solve_triangular(A + eye, vb, upper=False, unitriangular=True)
    W = torch.linalg.solve_triangular(A + eye, kb * G.exp().unsqueeze(-1), upper=False, unitriangular=True)
    intra = (q @ k.transpose(-1, -2)) * D
    qg = q * G.exp().unsqueeze(-1)
    kg = k * (G[..., -1:] - G).exp().unsqueeze(-1)
    decay = G[..., -1].exp()
    out = torch.empty_like(v)
    for i in range(n):
        vnew = U[:, i] - W[:, i] @ state
        out[:, i] = qg[:, i] @ state + intra[:, i] @ vnew
        state = state * decay[:, i, None, None] + kg[:, i].transpose(-1, -2) @ vnew
    out = out.reshape(nv, T, -1)[:, :L].transpose(0, 1)
    return out, state


@dataclass
class GDNParams:
    """The small per-layer tensors of the GDN core, on the compute device, in their compute dtypes."""

    conv: torch.Tensor  # (C, K) model dtype
    A: torch.Tensor  # (nv,) fp32, = -exp(A_log)
    dt_bias: torch.Tensor  # (nv,) fp32
    norm: torch.Tensor  # (dv,) fp32, the plain gated-norm weight
    value_order: str  # "grouped" or "tiled"


def gdn_core_ref(x: torch.Tensor, z: torch.Tensor, b: torch.Tensor, alpha: torch.Tensor, prm: GDNParams,
                 state: GDNState, cfg: ModelConfig) -> torch.Tensor:
    """Everything between the input projections and out_proj: causal conv + activation, gates, l2 norms, the
    gated delta rule (recurrent for one token, chunked otherwise) and the gated RMSNorm.
    x (L, C), z (L, nv*dv), b / alpha (L, nv) -> (L, nv*dv) in the model dtype; updates `state` in place."""
    dt = x.dtype
    L = x.shape[0]
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    conv, window = causal_conv(x, state.conv, prm.conv)
    state.conv.copy_(window)
    conv = F.silu(conv) if cfg.hidden_act == "silu" else torch.sigmoid(conv)
    q, k, v = torch.split(conv, [cfg.gdn_key_dim, cfg.gdn_key_dim, cfg.gdn_value_dim], dim=-1)
    q, k, v = q.reshape(L, nk, dk), k.reshape(L, nk, dk), v.reshape(L, nv, dv)
    beta = torch.sigmoid(b)  # model dtype, as the reference
    g = prm.A * F.softplus(alpha.float() + prm.dt_bias)
    rep = nv // nk
    if rep > 1:
        if prm.value_order == "grouped":
            q, k = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)
        else:
            q, k = q.repeat(1, rep, 1), k.repeat(1, rep, 1)
    qf = l2norm(q.float()) * dk ** -0.5
    kf = l2norm(k.float())
    rule = delta_rule_recurrent if L == 1 else delta_rule_chunked
    o, recurrent = rule(qf, kf, v.float(), g, beta.float(), state.recurrent)
    state.recurrent.copy_(recurrent)
    o = gated_rms_norm(o.to(dt), z.reshape(L, nv, dv), prm.norm, cfg.rms_norm_eps, cfg.gdn_gate_act)
    return o.reshape(L, nv * dv)


def gdn_layer(a: torch.Tensor, w: Weights, layer: int, cfg: ModelConfig, state: GDNState, ops: Ops,
              ) -> torch.Tensor:
    """One Gated DeltaNet mixer over L tokens (L, H) -> (L, H); updates `state` in place (so a captured step
    writes into the same buffers every replay)."""
    p = f"L{layer}.gdn."
    dev = a.device
    prm = GDNParams(w[p + "conv"].dense(a.dtype, dev), w[p + "A"].dense(torch.float32, dev),
                    w[p + "dt_bias"].dense(torch.float32, dev), w[p + "norm"].dense(torch.float32, dev),
                    w.gdn_value_order)
    qkv, z, b, alpha = ops.linears(a, [w[p + n] for n in ("qkv", "z", "b", "a")], [None] * 4, ops.linear)
    o = ops.gdn_core(qkv, z, b, alpha, prm, state, cfg)
    return ops.linear(o, w[p + "out"])
