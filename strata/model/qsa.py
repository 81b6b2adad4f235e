"""QSA layer (spec 5): gated GQA attention restricted, per query, to the top-k key blocks chosen by a small
indexer over mean-pooled block keys, plus the incomplete tail block.

The indexer's raw keys are cached, and each block's pooled key (mean -> k_layernorm -> RoPE at the block's
first position) is computed once, when the block completes, and cached; the reference recomputes all of
them every step, with identical results. Selection produces token *indices* (at most B + c - 1 per query,
like the reference's index buffer), and attention reads only those rows of the KV cache, so a decode step
costs the same at 4K and 128K context. Every shape depends on capacities and call length, never on data,
so the same code runs inside a captured CUDA graph.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from strata.config import ModelConfig
from strata.model import topk
from strata.model.norms import rms_norm
from strata.runtime.state import QSAState
from strata.weights.schema import Weights

if TYPE_CHECKING:
    from strata.model.ops import Ops


def inv_freq(cfg: ModelConfig, device: torch.device) -> torch.Tensor:
    """RoPE's inverse frequencies (r/2,) fp32: 1 / theta^(2i / r)."""
    r = cfg.rotary_dim
    return 1.0 / (cfg.rope_theta ** (torch.arange(0, r, 2, dtype=torch.float32, device=device) / r))


def rope_tables(positions: torch.Tensor, cfg: ModelConfig, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (L, r) for integer positions, computed in fp32 and cast to the model dtype."""
    freqs = positions.float()[:, None] * inv_freq(cfg, positions.device)
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


def norm_rope_ref(x: torch.Tensor, scale: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float,
                  ) -> torch.Tensor:
    """Per-head RMSNorm then RoPE: x (L, heads, d) model dtype, scale (d,) fp32, cos/sin (L, r) -> (L, heads, d).
    The norm's statistics and scale multiply are fp32, cast to x's dtype; the rotation is in x's dtype."""
    return apply_rope(rms_norm(x, scale, eps), cos, sin)


def norm_ropes_ref(xs: Sequence[torch.Tensor], scales: Sequence[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor,
                   eps: float, norm_rope: Callable = norm_rope_ref) -> list[torch.Tensor]:
    """`norm_rope` of several tensors at the same positions (a QSA layer's indexer and attention queries), each
    with its scale: one op, so that a fast backend can run them in one launch."""
    return [norm_rope(x, s, cos, sin, eps) for x, s in zip(xs, scales, strict=True)]


@dataclass
class Rope:
    """The RoPE tables of one call, shared by every QSA layer: cos/sin (L, r) at the call's positions and at
    the first position of the block each of them lies in (where a completing block's pooled key rotates)."""

    cos: torch.Tensor
    sin: torch.Tensor
    block_cos: torch.Tensor
    block_sin: torch.Tensor

    @classmethod
    def at(cls, positions: torch.Tensor, cfg: ModelConfig, dtype: torch.dtype) -> Rope:
        c = cfg.indexer_compress_ratio
        return cls(*rope_tables(positions, cfg, dtype), *rope_tables(positions // c * c, cfg, dtype))


def pool_blocks(raw: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, norm: torch.Tensor, cfg: ModelConfig,
                norm_rope: Callable = norm_rope_ref) -> torch.Tensor:
    """Pooled block keys: fp32 mean of c raw keys, cast, k_layernorm, RoPE at the block's first position
    (`cos`/`sin` of that position). raw (n, c, Di) -> (n, Di). `norm_rope` is the op table's entry."""
    pooled = raw.float().mean(1).to(raw.dtype)
    return norm_rope(pooled.unsqueeze(1), norm, cos, sin, cfg.rms_norm_eps).squeeze(1)


def update_blocks(state: QSAState, positions: torch.Tensor, rope: Rope, norm: torch.Tensor, cfg: ModelConfig,
                  static: bool, norm_rope: Callable = norm_rope_ref) -> None:
    """Pool every block that completes at one of `positions` (position p completes block p // c when
    (p + 1) % c == 0), reading raw keys already written. `static` keeps shapes data-independent (compute for
    every position, write only where a block completes) for a captured step."""
    c = cfg.indexer_compress_ratio
    done = (positions + 1) % c == 0
    cos, sin = rope.block_cos, rope.block_sin
    if not static:
        positions, cos, sin = positions[done], cos[done], sin[done]
        if positions.numel() == 0:
            return
    blocks = positions // c
    rows = blocks[:, None] * c + torch.arange(c, device=positions.device)
    pooled = pool_blocks(state.idx_raw[rows], cos, sin, norm, cfg, norm_rope)
    if static:
        pooled = torch.where(done[:, None], pooled, state.idx_blocks[blocks])
    state.idx_blocks.index_copy_(0, blocks, pooled)


def qsa_store_ref(state: QSAState, positions: torch.Tensor, ki: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  rope: Rope, idx_norm: torch.Tensor, k_norm: torch.Tensor, cfg: ModelConfig, static: bool,
                  norm_rope: Callable = norm_rope_ref) -> None:
    """Write one call's rows into the QSA cache at `positions`: the raw indexer keys ki (L, Di), K (L, Hkv*hd)
    after k_norm and RoPE, V (L, Hkv*hd); then pool the blocks the call completes (`update_blocks`).
    idx_norm / k_norm: the fp32 (1 + w) scales of the indexer's and the attention's key norms; `norm_rope` is
    the op table's entry."""
    L = ki.shape[0]
    hkv, hd = cfg.num_key_value_heads, cfg.head_dim
    state.idx_raw.index_copy_(0, positions, ki)
    update_blocks(state, positions, rope, idx_norm, cfg, static, norm_rope)
    k = norm_rope(k.reshape(L, hkv, hd), k_norm, rope.cos, rope.sin, cfg.rms_norm_eps)
    state.k.index_copy_(0, positions, k)
    state.v.index_copy_(0, positions, v.reshape(L, hkv, hd))


def select_tokens(q_idx: torch.Tensor, blocks: torch.Tensor, positions: torch.Tensor, cfg: ModelConfig,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Token indices (L, W) each query attends to, and their validity (L, W); W <= B + c - 1.

    Query t sees the keys of its top-k complete blocks (by the head sum of ReLU'd dot products with the pooled
    block keys) plus its tail (the incomplete block, including itself when (t+1) % c != 0). Exactly dense while
    a query has no more complete blocks than k. `blocks` (nb, Di) may include blocks not yet complete for
    some queries; they are masked by position.
    """
    c, kb = cfg.indexer_compress_ratio, cfg.block_topk
    dev = q_idx.device
    nb_q = (positions + 1) // c  # complete blocks visible to each query
    tail = nb_q[:, None] * c + torch.arange(c - 1, device=dev)  # (L, c-1)
    tail_ok = tail <= positions[:, None]
    nb = blocks.shape[0]
    k = min(kb, nb)
    if k == 0:
        return tail, tail_ok
    scores = torch.relu(torch.einsum("lhd,md->lhm", q_idx.float(), blocks.float())).sum(1)
    scores = scores / cfg.indexer_head_dim ** 0.5
    visible = torch.arange(nb, device=dev)[None, :] < nb_q[:, None]
    scores = scores.masked_fill(~visible, float("-inf"))
    top_v, top_b = topk.select(scores, k)  # (L, k)
    chosen = (top_b[:, :, None] * c + torch.arange(c, device=dev)).flatten(1)  # (L, k*c)
    chosen_ok = torch.isfinite(top_v).repeat_interleave(c, dim=1)
    return torch.cat([chosen, tail], 1), torch.cat([chosen_ok, tail_ok], 1)


def qsa_layer(a: torch.Tensor, positions: torch.Tensor, rope: Rope, n_keys: int, w: Weights, layer: int,
              cfg: ModelConfig, state: QSAState, ops: Ops, static: bool = False) -> torch.Tensor:
    """One QSA mixer over L tokens at `positions` (continuing the cache); `n_keys` bounds the positions any
    query can see (the state's capacity in a captured step). Writes this call's rows into `state`."""
    p = f"L{layer}."
    dev = a.device
    L = a.shape[0]
    hq, hkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    hi, di, c = cfg.indexer_n_heads, cfg.indexer_head_dim, cfg.indexer_compress_ratio
    eps = cfg.rms_norm_eps
    state.reserve(n_keys)
    cos, sin = rope.cos, rope.sin

    # The five projections of `a` in one `linears` call (one launch where they are stored side by side).
    names = ("idx.q", "idx.k", "attn.q", "attn.k", "attn.v")
    biases = [None, None] + [w.get(p + n + "_bias") for n in ("attn.q", "attn.k", "attn.v")]
    qi, ki, qg, k, v = ops.linears(a, [w[p + n] for n in names], biases, ops.linear)

    # This call's rows into the cache (raw indexer keys, K normed and rotated, V; pooled keys of the blocks it
    # completes), then the indexer's selection and the gated attention over the selected rows.
    ops.qsa_store(state, positions, ki, k, v, rope, w[p + "idx.k_norm"].dense(torch.float32, dev),
                  w[p + "attn.k_norm"].dense(torch.float32, dev), cfg, static, ops.norm_rope)
    qg = qg.reshape(L, hq, 2 * hd)
    q, gate = qg[..., :hd], qg[..., hd:]  # per head [query | gate]
    qi, q = ops.norm_ropes([qi.reshape(L, hi, di), q], [w[p + "idx.q_norm"].dense(torch.float32, dev),
                                                         w[p + "attn.q_norm"].dense(torch.float32, dev)],
                           cos, sin, eps, ops.norm_rope)
    idx, ok = ops.select_tokens(qi, state.idx_blocks[: n_keys // c], positions, cfg)
    o = ops.attend(q, state, idx, ok, cfg, gate)
    return ops.linear(o, w[p + "attn.o"], w.get(p + "attn.o_bias"))
