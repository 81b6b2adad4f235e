"""One token's QSA cache writes in one launch: the twin of `strata.model.qsa.qsa_store_ref` for L == 1.

A decode step's QSA layer writes three cache rows at its position (the raw indexer key, K after k_norm and
RoPE, V) and, when the position completes a block of c tokens, that block's pooled key (fp32 mean of the c raw
keys, cast, k_layernorm, RoPE at the block's first position). The reference spends ~20 small kernels on this
(three index_copy, the norm and rotation of K, and the static pooling: index arithmetic, a gather, a mean, a
norm and rotation, a select and a scatter); at a few microseconds each inside the captured step that is ~30 us
per QSA layer for ~4 KB of data. Here one program does it all, reading the position from device memory, and
writes the pooled key only when the block completes (the reference's static form rewrites the old value there
otherwise: the same result).

Roundings are the reference's: the pooled mean in fp32 then cast, and `norm_rope.normed_rotated` for both
rotations (fp32 statistics, the rotation's products and sum in fp32 of rounded operands, rounded once).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from strata.kernels import pdl
from strata.kernels.norm_rope import TL_DTYPES, normed_rotated, partner
from strata.runtime.state import QSAState


@triton.jit
def _qsa_store_kernel(pos_ptr, ki_ptr, k_ptr, v_ptr, raw_ptr, blk_ptr, kc_ptr, vc_ptr,
                      inorm_ptr, knorm_ptr, cos_ptr, sin_ptr, bcos_ptr, bsin_ptr, eps,
                      s_raw, s_blk, s_kr, s_kh, s_vr, s_vh,
                      DI: tl.constexpr, HKV: tl.constexpr, HD: tl.constexpr, R: tl.constexpr, C: tl.constexpr,
                      BDI: tl.constexpr, HP: tl.constexpr, BHD: tl.constexpr, CP: tl.constexpr,
                      DT: tl.constexpr, GDC: tl.constexpr = False, LATE: tl.constexpr = False):
    pdl.enter(GDC, LATE)
    pos = tl.load(pos_ptr).to(tl.int64)

    # raw indexer key and V, as projected
    di = tl.arange(0, BDI)
    dim = di < DI
    kiv = tl.load(ki_ptr + di, mask=dim, other=0.0)
    tl.store(raw_ptr + pos * s_raw + di, kiv, mask=dim)
    h = tl.arange(0, HP)[:, None]
    d = tl.arange(0, BHD)[None, :]
    hm = (h < HKV) & (d < HD)
    tl.store(vc_ptr + pos * s_vr + h * s_vh + d, tl.load(v_ptr + h * HD + d, mask=hm, other=0.0), mask=hm)

    # K: per-head k_norm and RoPE at the token's position
    x = tl.load(k_ptr + h * HD + d, mask=hm, other=0.0).to(tl.float32)
    xp = tl.load(k_ptr + h * HD + partner(d, R), mask=(h < HKV) & (d < R), other=0.0).to(tl.float32)
    rs = tl.rsqrt(tl.sum(x * x, axis=1) / HD + eps)[:, None]
    kn = normed_rotated(x, xp, rs, knorm_ptr, cos_ptr, sin_ptr, d, d < HD, R, DT)
    tl.store(kc_ptr + pos * s_kr + h * s_kh + d, kn.to(DT), mask=hm)

    # the pooled key of the block this token completes: its c - 1 earlier raw keys from the cache, this one
    if (pos + 1) % C == 0:
        j = tl.arange(0, CP)[:, None]
        first = pos - (C - 1)
        rows = raw_ptr + (first + j) * s_raw
        earlier = j < C - 1
        d2 = di[None, :]
        pd2 = partner(d2, R)
        kif = kiv.to(tl.float32)[None, :]
        kip = tl.load(ki_ptr + pd2, mask=d2 < R, other=0.0).to(tl.float32)
        blk = tl.load(rows + d2, mask=earlier & (d2 < DI), other=0.0).to(tl.float32)
        blk = tl.where(j == C - 1, kif, blk)
        blp = tl.load(rows + pd2, mask=earlier & (d2 < R), other=0.0).to(tl.float32)
        blp = tl.where(j == C - 1, kip, blp)
        pooled = (tl.sum(blk, axis=0) / C).to(DT).to(tl.float32)[None, :]
        pooled_p = (tl.sum(blp, axis=0) / C).to(DT).to(tl.float32)[None, :]
        prs = tl.rsqrt(tl.sum(pooled * pooled, axis=1) / DI + eps)[:, None]
        pk = normed_rotated(pooled, pooled_p, prs, inorm_ptr, bcos_ptr, bsin_ptr, d2, d2 < DI, R, DT)
        tl.store(blk_ptr + (pos // C) * s_blk + d2, pk.to(DT), mask=d2 < DI)


def supported(state: QSAState, positions: torch.Tensor, ki: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              idx_norm: torch.Tensor, k_norm: torch.Tensor) -> bool:
    """One token, one dtype the kernel knows for the inputs and the caches, rows with unit inner strides."""
    dt = ki.dtype
    return (positions.numel() == 1 and ki.shape[0] == 1 and dt in TL_DTYPES
            and all(t.dtype == dt for t in (k, v, state.k, state.v, state.idx_raw, state.idx_blocks))
            and all(t.is_contiguous() for t in (state.idx_raw, state.idx_blocks))
            and state.k.stride(-1) == 1 and state.v.stride(-1) == 1
            and idx_norm.dtype == k_norm.dtype == torch.float32)


def qsa_store(state: QSAState, positions: torch.Tensor, ki: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              rope, idx_norm: torch.Tensor, k_norm: torch.Tensor, eps: float) -> None:
    """The cache writes of one token (see the module docstring): ki (1, Di) the raw indexer key, k / v (1, Hkv*hd)
    as projected, `rope` the call's `strata.model.qsa.Rope`, idx_norm / k_norm the fp32 (1 + w) scales."""
    hkv, hd = state.k.shape[1], state.k.shape[2]
    di = state.idx_raw.shape[1]
    r = rope.cos.shape[-1]
    c = state.ratio
    ki, k, v = ki.contiguous(), k.contiguous(), v.contiguous()
    cos, sin, bcos, bsin = (t.contiguous() for t in (rope.cos, rope.sin, rope.block_cos, rope.block_sin))
    _qsa_store_kernel[(1,)](
        positions, ki, k, v, state.idx_raw, state.idx_blocks, state.k, state.v,
        idx_norm.contiguous(), k_norm.contiguous(), cos, sin, bcos, bsin, eps,
        state.idx_raw.stride(0), state.idx_blocks.stride(0), state.k.stride(0), state.k.stride(1),
        state.v.stride(0), state.v.stride(1),
        DI=di, HKV=hkv, HD=hd, R=r, C=c, BDI=triton.next_power_of_2(di), HP=triton.next_power_of_2(hkv),
        BHD=triton.next_power_of_2(hd), CP=triton.next_power_of_2(c), DT=TL_DTYPES[ki.dtype],
        **pdl.launch(ki.device, "qsa_store"))
