"""Fused PLE mix for one token: the twin of `strata.model.ple.ple_mix_ref` for L == 1, in two launches; and the
n-gram hash and row gather of a step whose PLE tables are in device memory (`ple_gather`, the twin of
`strata.model.ple.ple_gather_ref`).

1. `_ple_gate_kernel`, grid (S,): one program per hyper-connection stream computes the stream's grouped
   RMSNorms of the key projection and of the state (Q), the gate score s = sum(K.Q) / sqrt(H),
   s' = sign(s) sqrt(max(|s|, 1e-6)), G = sigmoid(s') * value, and G's own grouped norm (its group is exactly
   this stream's H features), writing G and G-hat (model dtype) to a scratch buffer.
2. `_ple_conv_kernel`, grid (S*H / BC,): each program owns BC channels: the dilated causal depthwise conv over
   [old window | G-hat], SiLU, the residual add G + SiLU(conv), and the shift of its channels' window. Every
   load and store of one channel's window is issued by the same thread (1-d vectors of the same layout), taps
   read before the shift overwrites them and the shift in increasing tap order (tap t + 1 is read before it is
   overwritten), so no thread overwrites a window value another thread still has to read.

Roundings follow the reference op by op: normed K and Q, the K*Q products, their sum, the scaled score, the
square root, the sigmoid and G, G-hat, the conv output, the SiLU and the sum are each rounded to the model
dtype; norm statistics and the conv accumulation are fp32.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from strata.config import ModelConfig
from strata.kernels import pdl
from strata.kernels.host_pages import page_locked
from strata.model.ple import NgramTables

TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _ple_gate_kernel(x_ptr, k_ptr, v_ptr, nk_ptr, nq_ptr, nc_ptr, g_ptr, gn_ptr, H, sqrt_h, eps, smin,
                     BH: tl.constexpr, DT: tl.constexpr, GDC: tl.constexpr = False):
    pdl.started(GDC)
    pdl.wait(GDC)
    s = tl.program_id(0)
    h = tl.arange(0, BH)
    m = h < H
    base = s * H + h
    xv = tl.load(x_ptr + base, mask=m, other=0.0).to(tl.float32)
    q = xv * tl.rsqrt(tl.sum(xv * xv, axis=0) / H + eps)
    q = (q * tl.load(nq_ptr + base, mask=m, other=0.0)).to(DT).to(tl.float32)
    kv = tl.load(k_ptr + base, mask=m, other=0.0).to(tl.float32)
    k = kv * tl.rsqrt(tl.sum(kv * kv, axis=0) / H + eps)
    k = (k * tl.load(nk_ptr + base, mask=m, other=0.0)).to(DT).to(tl.float32)
    prod = (k * q).to(DT).to(tl.float32)
    sc = tl.sum(prod, axis=0).to(DT).to(tl.float32)
    sc = (sc / sqrt_h).to(DT).to(tl.float32)
    mag = tl.sqrt(tl.maximum(tl.abs(sc), smin)).to(DT).to(tl.float32)
    sgn = tl.where(sc > 0, 1.0, tl.where(sc < 0, -1.0, 0.0))
    sig = tl.sigmoid(mag * sgn).to(DT).to(tl.float32)
    v = tl.load(v_ptr + h, mask=m, other=0.0).to(tl.float32)
    g = (sig * v).to(DT).to(tl.float32)
    gn = g * tl.rsqrt(tl.sum(g * g, axis=0) / H + eps)
    gn = gn * tl.load(nc_ptr + base, mask=m, other=0.0)
    tl.store(g_ptr + base, g.to(DT), mask=m)
    tl.store(gn_ptr + base, gn.to(DT), mask=m)


@triton.jit
def _ple_conv_kernel(g_ptr, gn_ptr, w_ptr, win_ptr, out_ptr, C, KP: tl.constexpr, NG: tl.constexpr,
                     BC: tl.constexpr, DT: tl.constexpr, GDC: tl.constexpr = False):
    pdl.started(GDC)
    pdl.wait(GDC)
    W: tl.constexpr = (KP - 1) * NG
    ch = tl.program_id(0) * BC + tl.arange(0, BC)
    m = ch < C
    gn = tl.load(gn_ptr + ch, mask=m, other=0.0)
    # dilated taps: window columns 0, NG, 2 NG, ... then the current G-hat (all reads of the old window first)
    acc = tl.zeros([BC], dtype=tl.float32)
    for j in tl.static_range(KP - 1):
        wj = tl.load(w_ptr + ch * KP + j, mask=m, other=0.0).to(tl.float32)
        acc += wj * tl.load(win_ptr + ch * W + j * NG, mask=m, other=0.0).to(tl.float32)
    acc += tl.load(w_ptr + ch * KP + KP - 1, mask=m, other=0.0).to(tl.float32) * gn.to(tl.float32)
    c = acc.to(DT).to(tl.float32)
    act = (c * tl.sigmoid(c)).to(DT).to(tl.float32)
    g = tl.load(g_ptr + ch, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + ch, (g + act).to(DT), mask=m)
    # shift the window: new[:, t] = [old | G-hat][:, t + 1], same thread per channel, in tap order
    for t in tl.static_range(W - 1):
        nxt = tl.load(win_ptr + ch * W + t + 1, mask=m, other=0.0)
        tl.store(win_ptr + ch * W + t, nxt, mask=m)
    tl.store(win_ptr + ch * W + W - 1, gn, mask=m)


def supported(x: torch.Tensor, key: torch.Tensor, value: torch.Tensor, conv_w: torch.Tensor,
              window: torch.Tensor, cfg: ModelConfig) -> bool:
    """One token, a dtype the kernel knows shared by the activations, conv weight and window, a conv of at
    least 2 taps, and a contiguous window of the expected shape."""
    S, H = cfg.hc_count, cfg.hidden_size
    dt = x.dtype
    C = S * H
    return (x.dim() == 2 and x.shape == (1, C) and dt in TL_DTYPES and key.dtype == dt and value.dtype == dt
            and tuple(key.shape) == (1, C) and tuple(value.shape) == (1, H) and conv_w.dtype == dt
            and window.dtype == dt and window.is_contiguous() and conv_w.dim() == 2 and conv_w.shape[0] == C
            and conv_w.shape[1] >= 2 and tuple(window.shape) == (C, (conv_w.shape[1] - 1) * cfg.ngram_size))


def ple_mix(x: torch.Tensor, key: torch.Tensor, value: torch.Tensor, norm_key: torch.Tensor,
            norm_query: torch.Tensor, norm_conv: torch.Tensor, conv_w: torch.Tensor, window: torch.Tensor,
            cfg: ModelConfig, block_c: int = 1024) -> torch.Tensor:
    """One-token PLE mix: (1, S*H) in x's dtype; shifts `window` in place. `block_c` is the channels per
    program of the conv launch (a tuning knob)."""
    S, H, eps = cfg.hc_count, cfg.hidden_size, cfg.rms_norm_eps
    C, dt = S * H, x.dtype
    x, key, value, conv_w = x.contiguous(), key.contiguous(), value.contiguous(), conv_w.contiguous()
    nk, nq, nc = (t.float().contiguous() for t in (norm_key, norm_query, norm_conv))
    smin = float(torch.tensor(1e-6, dtype=dt))  # clamp_min's bound, as the reference rounds it
    scratch = torch.empty(2, C, dtype=dt, device=x.device)  # G, G-hat
    _ple_gate_kernel[(S,)](x, key, value, nk, nq, nc, scratch[0], scratch[1], H, math.sqrt(H), eps, smin,
                           BH=triton.next_power_of_2(H), DT=TL_DTYPES[dt], **pdl.launch(x.device))
    out = torch.empty(1, C, dtype=dt, device=x.device)
    bc = min(block_c, triton.next_power_of_2(C))
    _ple_conv_kernel[(triton.cdiv(C, bc),)](scratch[0], scratch[1], conv_w, window, out, C,
                                             KP=conv_w.shape[1], NG=cfg.ngram_size, BC=bc, DT=TL_DTYPES[dt],
                                             **pdl.launch(x.device))
    return out


@triton.jit
def _ple_gather_kernel(hist_ptr, mult_ptr, prime_ptr, off_ptr, table_ptr, out_ptr, eos, RB,
                       N: tl.constexpr, HPN: tl.constexpr, NH: tl.constexpr, BH: tl.constexpr, BB: tl.constexpr,
                       GDC: tl.constexpr = False):
    """One program: the hashes of the n-grams ending at hist[N - 1] (orders 2..N; ids older than an EOS hash as
    EOS), lane j the row of head j (order j // HPN + 2), and its RB stored bytes copied to out[j]."""
    pdl.enter(GDC)
    j = tl.arange(0, BH)
    jm = j < NH
    order = j // HPN + 1  # the n-gram's oldest id is `order` back
    acc = tl.load(hist_ptr + N - 1) * tl.load(mult_ptr)
    sel = tl.zeros([BH], dtype=tl.int64)
    dead = 0  # EOS ids seen among those 1 .. k-1 back
    for k in tl.static_range(1, N):
        idk = tl.load(hist_ptr + N - 1 - k)
        acc = acc ^ (tl.where(dead == 0, idk, eos) * tl.load(mult_ptr + k))
        dead += (idk == eos).to(tl.int32)
        sel = tl.where(order == k, acc, sel)
    prime = tl.load(prime_ptr + j, mask=jm, other=1)
    rem = sel % prime  # truncated: the sign of sel
    row = tl.where(rem < 0, rem + prime, rem) + tl.load(off_ptr + j, mask=jm, other=0)
    b = tl.arange(0, BB)
    m = jm[:, None] & (b < RB)[None, :]
    data = tl.load(table_ptr + row[:, None] * RB + b[None, :], mask=m, other=0)
    tl.store(out_ptr + j[:, None] * RB + b[None, :], data, mask=m)


def gather_supported(hist: torch.Tensor, table: torch.Tensor, tables: NgramTables, out: torch.Tensor) -> bool:
    """The layouts the gather kernel reads: hist (n,) int64, the table (rows, row bytes) and out (heads, row
    bytes) uint8, contiguous, and the geometry tensors on one device, which holds the table too or, for a GPU,
    reads it from page-locked host memory (`--ple-table pinned`)."""
    nh = tables.primes.numel()
    readable = table.device == hist.device or (hist.is_cuda and page_locked(table))
    return (hist.dtype == torch.int64 and hist.dim() == 1 and hist.is_contiguous()
            and table.dtype == torch.uint8 and table.dim() == 2 and table.is_contiguous()
            and out.dtype == torch.uint8 and out.is_contiguous() and tuple(out.shape) == (nh, table.shape[1])
            and tables.multipliers.numel() == hist.numel() and nh == (hist.numel() - 1) * tables.heads_per_ngram
            and len({t.device for t in (hist, out, tables.multipliers, tables.primes, tables.offsets)}) == 1
            and readable)


def ple_gather(hist: torch.Tensor, table: torch.Tensor, tables: NgramTables, out: torch.Tensor) -> None:
    """`Ops.ple_gather` in one launch: the n-gram rows of hist's last id gathered from `table` into `out`."""
    nh, rb = out.shape
    _ple_gather_kernel[(1,)](hist, tables.multipliers, tables.primes, tables.offsets, table, out, tables.eos, rb,
                             N=hist.numel(), HPN=tables.heads_per_ngram, NH=nh, BH=triton.next_power_of_2(nh),
                             BB=triton.next_power_of_2(rb), **pdl.launch(hist.device))
