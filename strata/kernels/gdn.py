"""Fused Gated DeltaNet decode step (one token): the twin of `strata.model.gdn.gdn_core_ref` for L == 1.

Decode at batch 1 is memory-bound, and the recurrent state (nv, dk, dv) fp32 (3 MiB per layer at the real
geometry) is by far the largest thing this op touches, so the state is read and written exactly once, in
place, and the small per-token work (conv, gates, l2 norms) is recomputed where it is needed rather than
round-tripped through memory.

One launch, `_gdn_step_kernel`, grid (nv, dv / BV): each program owns a (dk, BV) column slab of one value
head's state. It computes the causal conv + activation of its q / k channels (the whole dk of its key head,
recomputed by each program that shares the key head: 2 x 128 channels x 4 taps, negligible) and of its BV value
channels, reading the *old* conv window, then runs the delta-rule step on its slab and writes the head's output
slice (rounded to the model dtype, as the reference casts o before the norm). Splitting dv gives
nv * dv / BV programs (192 at the real geometry), enough to keep the H200's memory system busy.

Two things need other programs to have finished, and tickets (`strata.kernels.gemv.tickets`, as in split-K)
hand each to the last program to get there instead of to a second launch (~3.5 us per layer on an H200):

- the gated RMSNorm needs the whole dv vector of a head: each program stores its o slice, then draws a ticket on
  its value head's counter; the one drawing the last reads the siblings' slices back (from L2) and normalises.
- the conv window may only be shifted once nobody reads the old one. A program's value channels are read by it
  alone, so it shifts them itself after a barrier. The q / k channels of a key head are read by the REP x
  dv / BV programs of its value heads, so each draws a ticket on the key head's counter after its reads, and the
  last shifts them (from values every program loaded before its ticket, so no load follows the ticket).

Tickets are drawn after a barrier with acq_rel: everything a program read or wrote before is ordered before what
the last one does after its ticket. A program draws its two tickets in one two-element atomic: each acq_rel atomic
is a fence and a round trip to L2 on the layer's critical path, and drawn one after the other the two made a GDN
layer's path ~0.85 us longer (H100: a replay 4.552-4.556 against 4.523-4.524 ms,
bench/results/2026-12-06-h100-step-variants-gdn-tickets-a42b503.json). The last one puts each counter back to 0,
so a graph replay finds zeros.
Norm and shift are the same ops as the two-launch path (`_gdn_out_kernel`, kept for a stream without a ticket
region), so the two give the same bits.

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
from strata.kernels import gemv_q8x, gemv_rr, pdl
from strata.kernels.gemv import tickets
from strata.kernels.gemv_rr import store_q8x_runs
from strata.model.gdn import GDNParams
from strata.runtime.state import GDNState

TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}

PREFETCH_STATE = True
"""Whether each step program asks L2 for its state slab before its PDL wait (`pdl.prefetch_l2`), so that its loads
after the wait find it there; the same values either way (A/B: `tools/step_variants.py gdn-prefetch:0`). In the 4K
step on an H100: 4.449 / 4.449 against 4.460-4.462 ms per replay without, the step's share of a GDN layer's path
9.1-9.2 us against 9.7-9.8, while the projection group before it streams
(bench/results/2026-12-07-h100-step-variants-l2pf-a9e9663.json); again 4.452-4.453 against 4.464-4.465
(*-l2pf2-c7249b5.json). Its channels' conv windows as well: 4.457-4.458 (branch `wip/l2-prefetch-groups`)."""

EARLY_LOADS = True
"""Whether the step kernel loads its stored weights (conv taps, A, dt bias, norm weight) before its PDL wait and
every program its head's gate inputs right after it (`_gdn_step_kernel`'s EARLY), so that the program that
normalises a head finds them in registers after its ticket instead of loading them then. The same values either
way; False for A/B runs (`tools/step_variants.py gdn-early:0`)."""


@triton.jit
def _conv_weights(w_ptr, ch, cmask, K: tl.constexpr, KP: tl.constexpr):
    """The conv taps of channels `ch` (stored weights: a load that may precede the PDL wait)."""
    taps = tl.arange(0, KP)
    return tl.load(w_ptr + ch[:, None] * K + taps[None, :], mask=cmask[:, None] & (taps[None, :] < K),
                   other=0.0).to(tl.float32)


@triton.jit
def _conv_act(x_ptr, win_ptr, w, ch, cmask, K: tl.constexpr, KP: tl.constexpr, SILU: tl.constexpr,
              DT: tl.constexpr):
    """Causal depthwise conv of channels `ch` over [old window | x] with taps w (`_conv_weights`), activation;
    fp32 values that went through the same model-dtype roundings as the reference (conv output, then activation
    output)."""
    taps = tl.arange(0, KP)
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
def _window_next(x_ptr, win_ptr, ch, n, K: tl.constexpr, KP: tl.constexpr):
    """The conv window of channels `ch` (those with ch < n) after this token, in the window's dtype: new tap
    t = old tap t + 1, the last tap = x. A load of the *old* window: call it before anyone shifts it."""
    taps = tl.arange(0, KP)
    nxt = tl.load(win_ptr + ch[:, None] * (K - 1) + taps[None, :] + 1,
                  mask=(ch[:, None] < n) & (taps[None, :] < K - 2), other=0.0)
    xv = tl.load(x_ptr + ch, mask=ch < n, other=0.0).to(win_ptr.dtype.element_ty)
    return tl.where(taps[None, :] == K - 2, xv[:, None], nxt)


@triton.jit
def _window_store(win_ptr, ch, n, nxt, K: tl.constexpr, KP: tl.constexpr):
    """Store `_window_next`'s values of channels `ch` (those with ch < n)."""
    taps = tl.arange(0, KP)
    tl.store(win_ptr + ch[:, None] * (K - 1) + taps[None, :], nxt,
             mask=(ch[:, None] < n) & (taps[None, :] < K - 1))


@triton.jit
def _gated_norm(o_ptr, z, w, out_ptr, j, n, DV, eps, BD: tl.constexpr, SILU_GATE: tl.constexpr,
                DT: tl.constexpr):
    """out[j] = RMSNorm(o[j]) * w * gate(z) for value head j, with the reference's roundings (z: the head's gate
    inputs, `_gate_inputs`; w: the norm weight, `_norm_weight`); elements d < n only (n = DV, or 0 for a program
    that is not to store). o is read past L1 (`.cg`): other programs of the launch may have written
    it."""
    d = tl.arange(0, BD)
    dm = d < n
    o = tl.load(o_ptr + j * DV + d, mask=dm, other=0.0, cache_modifier=".cg").to(tl.float32)
    var = tl.sum(o * o, axis=0) / DV
    nrm = (o * tl.rsqrt(var + eps)).to(DT).to(tl.float32)
    p = (w * nrm).to(DT).to(tl.float32)
    if SILU_GATE:
        gate = z * tl.sigmoid(z)
    else:
        gate = tl.sigmoid(z)
    tl.store(out_ptr + j * DV + d, (p * gate).to(DT), mask=dm)


@triton.jit
def _norm_weight(nw_ptr, n, DT: tl.constexpr, BD: tl.constexpr):
    """The gated norm's weight, rounded to the model dtype, fp32 [BD] (elements d < n loaded, else 0)."""
    d = tl.arange(0, BD)
    return tl.load(nw_ptr + d, mask=d < n, other=0.0).to(DT).to(tl.float32)


@triton.jit
def _gate_inputs(z_ptr, j, n, DV, BD: tl.constexpr):
    """Value head j's gate inputs z, fp32 [BD] (elements d < n loaded, else 0)."""
    d = tl.arange(0, BD)
    return tl.load(z_ptr + j * DV + d, mask=d < n, other=0.0).to(tl.float32)


@triton.jit
def _step_weights(convw_ptr, A_ptr, dtb_ptr, j, kh, i, im, vcol, vm, DK, DV, KEY_DIM, K: tl.constexpr,
                  KP: tl.constexpr):
    """The stored weights a program of value head j (key head kh) uses: the conv taps of its q, k and v channels,
    A and the dt bias (loads that may precede the PDL wait)."""
    return (_conv_weights(convw_ptr, kh * DK + i, im, K, KP),
            _conv_weights(convw_ptr, KEY_DIM + kh * DK + i, im, K, KP),
            _conv_weights(convw_ptr, 2 * KEY_DIM + j * DV + vcol, vm, K, KP), tl.load(A_ptr + j), tl.load(dtb_ptr + j))


@triton.jit
def _gdn_step_kernel(x_ptr, b_ptr, alpha_ptr, convw_ptr, win_ptr, A_ptr, dtb_ptr, S_ptr, o_ptr,
                     z_ptr, nw_ptr, out_ptr, cnt_ptr, xq_ptr,
                     NK, NV, DK, DV, KEY_DIM, REP, NVB, q_scale, eps,
                     K: tl.constexpr, KP: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BD: tl.constexpr,
                     TILED: tl.constexpr, SILU: tl.constexpr, SILU_GATE: tl.constexpr, DT: tl.constexpr,
                     FUSED: tl.constexpr, Q8: tl.constexpr = 0, GDC: tl.constexpr = False,
                     LATE: tl.constexpr = False, EARLY: tl.constexpr = True, PFS: tl.constexpr = False):
    """The step of one (dk, BV) state slab; with FUSED also the gated norm and the conv window shift (tickets
    in cnt: NV value-head counters, then NK key-head counters), else `_gdn_out_kernel` does those. Q8 (with
    FUSED; a word span of `gemv_q8x.ORDER`, 0: none): the program that normalises a head also stores it as Q8
    units to xq (`gemv_rr.store_q8x_runs`; DV a multiple of 32). EARLY (`EARLY_LOADS`): the stored weights (conv
    taps, A, dt bias, norm weight) are loaded before the PDL wait and the head's gate inputs z right after it,
    with the state, instead of by the last program after its tickets; the same values either way. PFS
    (`PREFETCH_STATE`, GPU only): the slab's lines are asked of L2 before the PDL wait."""
    if not LATE:
        pdl.started(GDC)
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
    if EARLY:
        wq, wk, wv, a_log, dtb = _step_weights(convw_ptr, A_ptr, dtb_ptr, j, kh, i, im, vcol, vm, DK, DV, KEY_DIM,
                                               K, KP)
        if FUSED:
            nw = _norm_weight(nw_ptr, DV, DT, BD)
    if PFS:  # one 128-byte line per 32 value columns of each slab row
        lcol = vb * BV + 32 * tl.arange(0, (BV + 31) // 32)
        pdl.prefetch_l2(S_ptr + j * DK * DV + i[:, None] * DV + lcol[None, :], im[:, None] & (lcol < DV)[None, :])
    pdl.wait(GDC)
    if LATE:
        pdl.started(GDC)
    if EARLY and FUSED:
        z = _gate_inputs(z_ptr, j, DV, DV, BD)
    if not EARLY:
        wq, wk, wv, a_log, dtb = _step_weights(convw_ptr, A_ptr, dtb_ptr, j, kh, i, im, vcol, vm, DK, DV, KEY_DIM,
                                               K, KP)

    q = _conv_act(x_ptr, win_ptr, wq, kh * DK + i, im, K, KP, SILU, DT)
    k = _conv_act(x_ptr, win_ptr, wk, KEY_DIM + kh * DK + i, im, K, KP, SILU, DT)
    v = _conv_act(x_ptr, win_ptr, wv, 2 * KEY_DIM + j * DV + vcol, vm, K, KP, SILU, DT)
    if FUSED:  # the next window, loaded while the old one is intact (channel bounds as masks: see _window_next)
        qn = _window_next(x_ptr, win_ptr, kh * DK + i, kh * DK + DK, K, KP)
        kn = _window_next(x_ptr, win_ptr, KEY_DIM + kh * DK + i, KEY_DIM + kh * DK + DK, K, KP)
        vn = _window_next(x_ptr, win_ptr, 2 * KEY_DIM + j * DV + vcol, 2 * KEY_DIM + j * DV + DV, K, KP)
    q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * q_scale
    k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)

    # gates: beta in the model dtype, g in fp32 (softplus with PyTorch's threshold of 20)
    beta = tl.sigmoid(tl.load(b_ptr + j).to(tl.float32)).to(DT).to(tl.float32)
    sp_in = tl.load(alpha_ptr + j).to(tl.float32) + dtb
    sp = tl.where(sp_in > 20.0, sp_in, tl.log(1.0 + tl.exp(tl.minimum(sp_in, 20.0))))
    sp = tl.where(sp_in < -15.0, tl.exp(sp_in), sp)  # log1p(e) for tiny e, where log(1 + e) rounds to 0
    decay = tl.exp(a_log * sp)

    sp_ptrs = S_ptr + j * DK * DV + i[:, None] * DV + vcol[None, :]
    smask = im[:, None] & vm[None, :]
    S = tl.load(sp_ptrs, mask=smask, other=0.0) * decay
    r = tl.sum(S * k[:, None], axis=0)
    delta = (v - r) * beta
    S = S + k[:, None] * delta[None, :]
    o = tl.sum(S * q[:, None], axis=0)
    tl.store(sp_ptrs, S, mask=smask)
    tl.store(o_ptr + j * DV + vcol, o.to(DT), mask=vm)

    if FUSED:
        # every thread of this program has read the old window and stored its o before any ticket is drawn
        # and before this program's value channels are overwritten (they are read by no other program)
        tl.debug_barrier()
        _window_store(win_ptr, 2 * KEY_DIM + j * DV + vcol, 2 * KEY_DIM + j * DV + DV, vn, K, KP)

        # both tickets in one atomic instruction (each acq_rel atomic is a fence and a round trip to L2): the key
        # head's (q / k window shift by the last of its REP * NVB readers) and the value head's (gated norm by the
        # last of its NVB programs)
        two = tl.arange(0, 2)
        drawn = tl.atomic_add(cnt_ptr + tl.where(two == 0, NV + kh, j), tl.full([2], 1, tl.int32), sem="acq_rel",
                              scope="gpu")
        klast = tl.where(tl.sum(tl.where(two == 0, drawn, 0), axis=0) == REP * NVB - 1, 1, 0)
        vlast = tl.where(tl.sum(tl.where(two == 1, drawn, 0), axis=0) == NVB - 1, 1, 0)
        # (masks are bounds, not boolean ands: the interpreter rejects the latter)
        _window_store(win_ptr, kh * DK + i, kh * DK + DK * klast, qn, K, KP)
        _window_store(win_ptr, KEY_DIM + kh * DK + i, KEY_DIM + kh * DK + DK * klast, kn, K, KP)
        tl.atomic_add(cnt_ptr + NV + kh, -REP * NVB * klast, sem="relaxed", scope="gpu")  # back to 0

        if not EARLY:  # loaded by the last program only
            nw = _norm_weight(nw_ptr, DV * vlast, DT, BD)
            z = _gate_inputs(z_ptr, j, DV * vlast, DV, BD)
        _gated_norm(o_ptr, z, nw, out_ptr, j, DV * vlast, DV, eps, BD, SILU_GATE, DT)
        tl.atomic_add(cnt_ptr + j, -NVB * vlast, sem="relaxed", scope="gpu")
        if Q8 > 0:
            tl.debug_barrier()  # the head's outputs are stored before they are read back
            rr = j * (DV // 32) + tl.arange(0, BD // 32)[:, None]
            store_q8x_runs(out_ptr, xq_ptr, rr, rr < j * (DV // 32) + (DV // 32) * vlast, Q8, BD // 32, CG=True)


@triton.jit
def _gdn_out_kernel(o_ptr, z_ptr, nw_ptr, out_ptr, x_ptr, win_ptr, DV, C, CH_PER, eps,
                    K: tl.constexpr, KP: tl.constexpr, BD: tl.constexpr, BC: tl.constexpr, SILU_GATE: tl.constexpr,
                    DT: tl.constexpr, GDC: tl.constexpr = False):
    """The two-launch path's second launch (a stream without ticket counters): the gated norm of head j and
    the shift of a 1/nv share of the conv window, once every program of the step kernel has finished."""
    pdl.started(GDC)
    pdl.wait(GDC)
    j = tl.program_id(0)
    _gated_norm(o_ptr, _gate_inputs(z_ptr, j, DV, DV, BD), _norm_weight(nw_ptr, DV, DT, BD), out_ptr, j, DV, DV,
                eps, BD, SILU_GATE, DT)

    # shift this program's share of the conv window (channels j * CH_PER .. up to C)
    end = tl.minimum(j * CH_PER + CH_PER, C)
    for c0 in range(0, CH_PER, BC):
        ch = j * CH_PER + c0 + tl.arange(0, BC)
        nxt = _window_next(x_ptr, win_ptr, ch, end, K, KP)
        tl.debug_barrier()  # every thread has read this chunk's old taps before any is overwritten
        _window_store(win_ptr, ch, end, nxt, K, KP)


def supported(x: torch.Tensor, state: GDNState, cfg: ModelConfig) -> bool:
    """Shapes the fused step handles: one token, a conv of at least 2 taps, model dtype the kernel knows."""
    return (x.shape[0] == 1 and cfg.linear_conv_kernel_dim >= 2 and x.dtype in TL_DTYPES
            and state.recurrent.dtype == torch.float32 and state.recurrent.is_contiguous()
            and state.conv.is_contiguous())


def gdn_step(x: torch.Tensor, z: torch.Tensor, b: torch.Tensor, alpha: torch.Tensor, prm: GDNParams,
             state: GDNState, cfg: ModelConfig, block_v: int = 32, q8_span: int | None = None,
             num_warps: int = 4) -> torch.Tensor:
    """One-token GDN core: x (1, C), z (1, nv*dv), b / alpha (1, nv) -> (1, nv*dv) in x's dtype; updates
    `state.conv` and `state.recurrent` in place. `block_v` is the dv slab per program (a tuning knob).
    q8_span (a word span of `gemv_q8x.ORDER`): the output is also written as Q8 activations for words of that
    span and recorded (`gemv_rr.record_q8x`) for the out projection's Q8 GEMV (`--activations q8`), where the
    one-launch path runs and dv is a multiple of 32. `num_warps`: warps per program (a tuning knob; with one,
    the reductions over dk stay within a warp)."""
    dt = x.dtype
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    K = cfg.linear_conv_kernel_dim
    C = cfg.gdn_conv_dim
    x, z, b, alpha = x.contiguous(), z.contiguous(), b.contiguous(), alpha.contiguous()
    convw = prm.conv.to(dt).contiguous()
    A, dtb = prm.A.float().contiguous(), prm.dt_bias.float().contiguous()
    assert C == 2 * cfg.gdn_key_dim + nv * dv and nv % nk == 0 and x.shape[-1] == C, "GDN geometry"
    bv = min(block_v, triton.next_power_of_2(dv))
    nvb = triton.cdiv(dv, bv)
    bd = triton.next_power_of_2(dv)
    nw = prm.norm.float().contiguous()
    silu_gate = cfg.gdn_gate_act == "silu"
    cnt = tickets(x.device)
    if cnt is not None and nv + nk > cnt.numel():
        cnt = None
    o = torch.empty(nv * dv, dtype=dt, device=x.device)
    out = torch.empty(1, nv * dv, dtype=dt, device=x.device)
    emit = q8_span is not None and cnt is not None and dv % 32 == 0 and nv * dv % gemv_q8x.UNIT_VALUES == 0
    xq = torch.empty(1, gemv_q8x.row_bytes(nv * dv), dtype=torch.int8, device=x.device) if emit else None
    # one launch: the q / k / v channels of the step's programs cover all C = 2 * key_dim + nv * dv channels
    # once each (asserted above), so each is shifted once
    _gdn_step_kernel[(nv, nvb)](
        x, b, alpha, convw, state.conv, A, dtb, state.recurrent, o, z, nw, out, cnt if cnt is not None else o,
        xq if emit else o, nk, nv, dk, dv, cfg.gdn_key_dim, nv // nk, nvb, dk ** -0.5, cfg.rms_norm_eps,
        K=K, KP=triton.next_power_of_2(K), BK=triton.next_power_of_2(dk), BV=bv, BD=bd,
        TILED=prm.value_order == "tiled", SILU=cfg.hidden_act == "silu", SILU_GATE=silu_gate, DT=TL_DTYPES[dt],
        FUSED=cnt is not None, Q8=q8_span if emit else 0, EARLY=EARLY_LOADS,
        PFS=PREFETCH_STATE and x.device.type == "cuda", num_warps=num_warps, **pdl.launch(x.device, "gdn_step"))
    if emit:
        gemv_rr.record_q8x(out, xq, q8_span)
    if cnt is None:  # no ticket counters on this stream: the norm and shift in a second launch
        ch_per = triton.cdiv(C, nv)
        _gdn_out_kernel[(nv,)](
            o, z, nw, out, x, state.conv, dv, C, ch_per, cfg.rms_norm_eps,
            K=K, KP=triton.next_power_of_2(K), BD=bd, BC=min(256, triton.next_power_of_2(ch_per)),
            SILU_GATE=silu_gate, DT=TL_DTYPES[dt], **pdl.launch(x.device))
    return out
