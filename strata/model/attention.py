"""Reference attention over selected cache rows (the op a fused decode-attention kernel replaces)."""

from __future__ import annotations

import torch

from strata.config import ModelConfig
from strata.runtime.state import QSAState

QUERY_BLOCK = 64  # queries per slice, to bound the gathered K/V memory in long prefills


def attend_ref(q: torch.Tensor, state: QSAState, idx: torch.Tensor, ok: torch.Tensor, cfg: ModelConfig,
               gate: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax attention of q (L, Hq, hd) over the cached K/V rows `idx` (L, W) where `ok`, times
    sigmoid(gate (L, Hq, hd)) when given (QSA's output gate, in the model dtype); (L, Hq*hd)."""
    L, hq, hd = q.shape
    hkv = cfg.num_key_value_heads
    out = []
    for s in range(0, L, QUERY_BLOCK):
        sl = slice(s, s + QUERY_BLOCK)
        rows = idx[sl].clamp(0, state.capacity - 1)
        keys, vals = state.k[rows], state.v[rows]  # (l, W, hkv, hd): each KV head serves hq / hkv query heads
        qg = q[sl].unflatten(1, (hkv, hq // hkv))  # query head h = kv head h // group, member h % group
        scores = torch.einsum("lkgd,lwkd->lkgw", qg, keys) * hd ** -0.5
        scores = scores.masked_fill(~ok[sl, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out.append(torch.einsum("lkgw,lwkd->lkgd", probs, vals).reshape(-1, hq * hd))
    o = torch.cat(out)
    return o if gate is None else o * torch.sigmoid(gate).reshape(L, hq * hd)
