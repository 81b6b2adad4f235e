"""QSA layer (spec 5): gated GQA attention restricted, per query, to the top-k key blocks chosen by a small
indexer over mean-pooled block keys, plus the incomplete tail block.

The indexer's raw keys are cached, and each block's pooled key (mean -> k_layernorm -> RoPE at the block's
first position) is computed once, when the block completes, and cached; the reference recomputes all of
them every step, with identical results.
"""

from __future__ import annotations

import torch

from strata.config import ModelConfig
from strata.model import topk
from strata.model.norms import rms_norm
from strata.model.ops import Ops
from strata.runtime.state import QSAState
from strata.weights.schema import Weights


def rope_tables(positions: torch.Tensor, cfg: ModelConfig, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (L, r) for integer positions, computed in fp32 and cast to the model dtype."""
    r = cfg.rotary_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, r, 2, dtype=torch.float32, device=positions.device) / r))
    freqs = positions.float()[:, None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX rotate-half RoPE on the first r dims of the last axis. x (L, heads, d); cos/sin (L, r)."""
    r = cos.shape[-1]
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    xr, xp = x[..., :r], x[..., r:]
    x1, x2 = xr[..., : r // 2], xr[..., r // 2:]
    rot = torch.cat([-x2, x1], dim=-1)
    return torch.cat([xr * cos + rot * sin, xp], dim=-1)


def select_blocks(q_idx: torch.Tensor, blocks: torch.Tensor, positions: torch.Tensor, cfg: ModelConfig,
                  ) -> torch.Tensor:
    """The visibility mask (L, T) of the queries at `positions` over keys 0..T-1 (T = positions[-1] + 1).

    Query t sees the keys of its top-k complete blocks (by the head sum of ReLU'd dot products with the pooled
    block keys) plus its tail (the incomplete block, including itself when (t+1) % c != 0). Exactly dense while
    a query has no more complete blocks than k.
    """
    c, kb = cfg.indexer_compress_ratio, cfg.block_topk
    T = int(positions[-1]) + 1
    L = q_idx.shape[0]
    n_vis = positions + 1
    nb_q = n_vis // c  # complete blocks visible to each query
    nb = blocks.shape[0]
    key_pos = torch.arange(T, device=q_idx.device)
    tail = (key_pos[None, :] >= (nb_q * c)[:, None]) & (key_pos[None, :] <= positions[:, None])
    if nb == 0:
        return tail
    scores = torch.relu(torch.einsum("lhd,md->lhm", q_idx.float(), blocks.float())).sum(1)
    scores = scores / cfg.indexer_head_dim ** 0.5
    visible_block = torch.arange(nb, device=q_idx.device)[None, :] < nb_q[:, None]
    scores = scores.masked_fill(~visible_block, float("-inf"))
    k = min(kb, nb)
    top = topk.select(scores, k)[1]  # (L, k)
    chosen = torch.zeros(L, nb, dtype=torch.bool, device=q_idx.device)
    chosen.scatter_(1, top, True)
    chosen &= visible_block
    token_sel = torch.zeros(L, T, dtype=torch.bool, device=q_idx.device)
    token_sel[:, : nb * c] = chosen.repeat_interleave(c, dim=1)
    return token_sel | tail


def qsa_layer(a: torch.Tensor, positions: torch.Tensor, w: Weights, layer: int, cfg: ModelConfig,
              state: QSAState, ops: Ops) -> torch.Tensor:
    """One QSA mixer over L tokens at `positions` (consecutive, continuing the cache). Updates `state`."""
    p = f"L{layer}."
    dt, dev = a.dtype, a.device
    L = a.shape[0]
    hq, hkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    hi, di, c = cfg.indexer_n_heads, cfg.indexer_head_dim, cfg.indexer_compress_ratio
    eps = cfg.rms_norm_eps
    cos, sin = rope_tables(positions, cfg, dt)

    # Indexer: query heads, raw key cached; pooled keys for every block this call completes.
    qi = ops.linear(a, w[p + "idx.q"]).reshape(L, hi, di)
    qi = apply_rope(rms_norm(qi, w[p + "idx.q_norm"].dense(torch.float32, dev), eps), cos, sin)
    state.idx_raw = torch.cat([state.idx_raw, ops.linear(a, w[p + "idx.k"])])
    T = state.idx_raw.shape[0]
    done = state.idx_blocks.shape[0]
    if T // c > done:
        raw = state.idx_raw[done * c: (T // c) * c].reshape(-1, c, di)
        pooled = rms_norm(raw.float().mean(1).to(dt), w[p + "idx.k_norm"].dense(torch.float32, dev), eps)
        starts = torch.arange(done, T // c, device=dev) * c
        bcos, bsin = rope_tables(starts, cfg, dt)
        new_blocks = apply_rope(pooled.unsqueeze(1), bcos, bsin).squeeze(1)
        state.idx_blocks = torch.cat([state.idx_blocks, new_blocks])
    allowed = select_blocks(qi, state.idx_blocks, positions, cfg)  # (L, T)

    # Main attention.
    qg = ops.linear(a, w[p + "attn.q"], w.get(p + "attn.q_bias")).reshape(L, hq, 2 * hd)
    q, gate = qg[..., :hd], qg[..., hd:].reshape(L, hq * hd)
    q = apply_rope(rms_norm(q, w[p + "attn.q_norm"].dense(torch.float32, dev), eps), cos, sin)
    k = ops.linear(a, w[p + "attn.k"], w.get(p + "attn.k_bias")).reshape(L, hkv, hd)
    k = apply_rope(rms_norm(k, w[p + "attn.k_norm"].dense(torch.float32, dev), eps), cos, sin)
    v = ops.linear(a, w[p + "attn.v"], w.get(p + "attn.v_bias")).reshape(L, hkv, hd)
    state.k = torch.cat([state.k, k])
    state.v = torch.cat([state.v, v])

    group = hq // hkv
    keys = state.k.repeat_interleave(group, dim=1).transpose(0, 1)  # (hq, T, hd)
    vals = state.v.repeat_interleave(group, dim=1).transpose(0, 1)
    scores = (q.transpose(0, 1) @ keys.transpose(-1, -2)) * hd ** -0.5  # (hq, L, T)
    scores = scores.masked_fill(~allowed.unsqueeze(0), float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(dt)
    o = (probs @ vals).transpose(0, 1).reshape(L, hq * hd)
    o = o * torch.sigmoid(gate)
    return ops.linear(o, w[p + "attn.o"], w.get(p + "attn.o_bias"))
