"""Fused Gated DeltaNet decode step (one token): the twin of `strata.model.gdn.gdn_core_ref` for L == 1.

Decode at batch 1 is memory-bound, and the recurrent state (nv, dk, dv) fp32 (3 MiB per layer at the real
geometry) is by far the largest thing this op touches, so the state is read and written exactly once, in
place, and the small per-token work (conv, gates, l2 norms) is recomputed where it is needed rather than
round-tripped through memory.

Two launches, because two things need every program of the first one to have finished:

1. `_gdn_step_kernel`, grid (nv, dv / BV): each program owns a (dk, BV) column slab of one value head's state.
   It computes the causal conv + activation of its q / k channels (the whole dk of its key head, recomputed
   by each program that shares the key head: 2 x 128 channels x 4 taps, negligible) and of its BV value
   channels, reading the *old* conv window, then runs the delta-rule step on its slab and writes the head's
   output slice (rounded to the model dtype, as the reference casts o before the norm). Splitting dv gives
   nv * dv / BV programs (192 at the real geometry), enough to keep the H200's memory system busy.
2. `_gdn_out_kernel`, grid (nv,): the gated RMSNorm needs the whole dv vector of a head, which spans
   programs of launch 1; and the conv window may only be shifted once nobody reads the old one any more.
   Each program normalises one head and shifts a 1/nv share of the conv window.

Roundings follow the reference op by op (conv and SiLU rounded to the model dtype, beta = sigmoid in the
model dtype, g and the delta rule in fp32, norm -> model dtype -> weight product in model dtype -> gate in
fp32), so in fp32 the kernel agrees with the reference to accumulation-order rounding and in bf16 to about
one bf16 ulp of the conv activations.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from strata.config import ModelConfig
from strata.kernels import pdl
from strata.model.gdn import GDNParams
from strata.runtime.state import GDNState

TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _conv_act(x_ptr, win_ptr, w_ptr, ch, cmask, K: tl.constexpr, KP: tl.constexpr, SILU: tl.constexpr,
              DT: tl.constexpr):
    """Causal depthwise conv of channels `ch` over [old window | x], activation; fp32 values that went
    through the same model-dtype roundings as the reference (conv output, then activation output)."""
    taps = tl.arange(0, KP)
    w = tl.load(w_ptr + ch[:, None] * K + taps[None, :], mask=cmask[:, None] & (taps[None, :] < K),
                other=0.0).to(tl.float32)
    h = tl.load(win_ptr + ch[:, None] * (K - 1) + taps[None, :],
                mask=cmask[:, None] & (taps[None, :] < K - 1), other=0.0).to(tl.float32)
    xv = tl.load(x_ptr + ch, mask=cmask, other=0.0).to(tl.float32)
    h = tl.where(taps[None, :] == K - 1, xv[:, None], h)
    u = tl.sum(w * h, axis=1).to(DT).to(tl.float32)
    if SILU:
        c = u * tl.sigmoid(u)
    else:
        c = tl.sigmoid(u)
    return c.to(DT).to(tl.float32)


@triton.jit
def _gdn_step_kernel(x_ptr, b_ptr, alpha_ptr, convw_ptr, win_ptr, A_ptr, dtb_ptr, S_ptr, o_ptr,
                     NK, DK, DV, KEY_DIM, REP, q_scale,
                     K: tl.constexpr, KP: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                     TILED: tl.constexpr, SILU: tl.constexpr, DT: tl.constexpr, GDC: tl.constexpr = False):
    pdl.started(GDC)
    pdl.wait(GDC)
    j = tl.program_id(0)  # value head
    vb = tl.program_id(1)  # dv block
    if TILED:
        kh = j % NK
    else:
        kh = j // REP
    i = tl.arange(0, BK)
    im = i < DK
    vcol = vb * BV + tl.arange(0, BV)
    vm = vcol < DV

    q = _conv_act(x_ptr, win_ptr, convw_ptr, kh * DK + i, im, K, KP, SILU, DT)
    k = _conv_act(x_ptr, win_ptr, convw_ptr, KEY_DIM + kh * DK + i, im, K, KP, SILU, DT)
    v = _conv_act(x_ptr, win_ptr, convw_ptr, 2 * KEY_DIM + j * DV + vcol, vm, K, KP, SILU, DT)
    q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * q_scale
    k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)

    # gates: beta in the model dtype, g in fp32 (softplus with PyTorch's threshold of 20)
    beta = tl.sigmoid(tl.load(b_ptr + j).to(tl.float32)).to(DT).to(tl.float32)
    sp_in = tl.load(alpha_ptr + j).to(tl.float32) + tl.load(dtb_ptr + j)
    sp = tl.where(sp_in > 20.0, sp_in, tl.log(1.0 + tl.exp(tl.minimum(sp_in, 20.0))))
    sp = tl.where(sp_in < -15.0, tl.exp(sp_in), sp)  # log1p(e) for tiny e, where log(1 + e) rounds to 0
    decay = tl.exp(tl.load(A_ptr + j) * sp)

    sp_ptrs = S_ptr + j * DK * DV + i[:, None] * DV + vcol[None, :]
    smask = im[:, None] & vm[None, :]
    S = tl.load(sp_ptrs, mask=smask, other=0.0) * decay
    r = tl.sum(S * k[:, None], axis=0)
    delta = (v - r) * beta
    S = S + k[:, None] * delta[None, :]
    o = tl.sum(S * q[:, None], axis=0)
    tl.store(sp_ptrs, S, mask=smask)
    tl.store(o_ptr + j * DV + vcol, o.to(DT), mask=vm)


@triton.jit
def _gdn_out_kernel(o_ptr, z_ptr, nw_ptr, out_ptr, x_ptr, win_ptr, DV, C, CH_PER, eps,
                    K: tl.constexpr, BD: tl.constexpr, BC: tl.constexpr, SILU_GATE: tl.constexpr,
                    DT: tl.constexpr, GDC: tl.constexpr = False):
    pdl.started(GDC)
    pdl.wait(GDC)
    j = tl.program_id(0)
    d = tl.arange(0, BD)
    dm = d < DV
    o = tl.load(o_ptr + j * DV + d, mask=dm, other=0.0).to(tl.float32)
    var = tl.sum(o * o, axis=0) / DV
    n = (o * tl.rsqrt(var + eps)).to(DT).to(tl.float32)
    w = tl.load(nw_ptr + d, mask=dm, other=0.0).to(DT).to(tl.float32)
    p = (w * n).to(DT).to(tl.float32)
    z = tl.load(z_ptr + j * DV + d, mask=dm, other=0.0).to(tl.float32)
    if SILU_GATE:
        gate = z * tl.sigmoid(z)
    else:
        gate = tl.sigmoid(z)
    tl.store(out_ptr + j * DV + d, (p * gate).to(DT), mask=dm)

    # shift this program's share of the conv window: new[:, t] = [old | x][:, t + 1]
    for c0 in range(0, CH_PER, BC):
        off = c0 + tl.arange(0, BC)
        ch = j * CH_PER + off
        cm = (off < CH_PER) & (ch < C)
        # in tap order: tap t + 1 is read before this same thread overwrites it in the next iteration
        for t in tl.static_range(K - 2):
            nxt = tl.load(win_ptr + ch * (K - 1) + t + 1, mask=cm, other=0.0)
            tl.store(win_ptr + ch * (K - 1) + t, nxt, mask=cm)
        xv = tl.load(x_ptr + ch, mask=cm, other=0.0)
        tl.store(win_ptr + ch * (K - 1) + K - 2, xv, mask=cm)


def supported(x: torch.Tensor, state: GDNState, cfg: ModelConfig) -> bool:
    """Shapes the fused step handles: one token, a conv of at least 2 taps, model dtype the kernel knows."""
    return (x.shape[0] == 1 and cfg.linear_conv_kernel_dim >= 2 and x.dtype in TL_DTYPES
            and state.recurrent.dtype == torch.float32 and state.recurrent.is_contiguous()
            and state.conv.is_contiguous())


def gdn_step(x: torch.Tensor, z: torch.Tensor, b: torch.Tensor, alpha: torch.Tensor, prm: GDNParams,
             state: GDNState, cfg: ModelConfig, block_v: int = 32) -> torch.Tensor:
    """One-token GDN core: x (1, C), z (1, nv*dv), b / alpha (1, nv) -> (1, nv*dv) in x's dtype; updates
    `state.conv` and `state.recurrent` in place. `block_v` is the dv slab per program (a tuning knob)."""
    dt = x.dtype
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    K = cfg.linear_conv_kernel_dim
    C = cfg.gdn_conv_dim
    x, z, b, alpha = x.contiguous(), z.contiguous(), b.contiguous(), alpha.contiguous()
    convw = prm.conv.to(dt).contiguous()
    A, dtb = prm.A.float().contiguous(), prm.dt_bias.float().contiguous()
    bv = min(block_v, triton.next_power_of_2(dv))
    o = torch.empty(nv * dv, dtype=dt, device=x.device)
    _gdn_step_kernel[(nv, triton.cdiv(dv, bv))](
        x, b, alpha, convw, state.conv, A, dtb, state.recurrent, o,
        nk, dk, dv, cfg.gdn_key_dim, nv // nk, dk ** -0.5,
        K=K, KP=triton.next_power_of_2(K), BK=triton.next_power_of_2(dk), BV=bv,
        TILED=prm.value_order == "tiled", SILU=cfg.hidden_act == "silu", DT=TL_DTYPES[dt],
        **pdl.launch(x.device))
    out = torch.empty(1, nv * dv, dtype=dt, device=x.device)
    ch_per = triton.cdiv(C, nv)
    _gdn_out_kernel[(nv,)](
        o, z, prm.norm.float().contiguous(), out, x, state.conv, dv, C, ch_per, cfg.rms_norm_eps,
        K=K, BD=triton.next_power_of_2(dv), BC=min(256, triton.next_power_of_2(ch_per)),
        SILU_GATE=cfg.gdn_gate_act == "silu", DT=TL_DTYPES[dt], **pdl.launch(x.device))
    return out
