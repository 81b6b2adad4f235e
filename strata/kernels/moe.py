"""Fused MoE decode kernels: the router's softmax/top-k/renormalise and the shared-expert combine.

At the real geometry (E = 512 experts, k = 10) the reference routing is ~6 launches per layer (cast, softmax,
topk, sum, divide, cast) and the combine three (sigmoid, multiply, add); at batch 1 inside a captured decode
graph each is a few microseconds of launch for a few KB of data. Here each is one launch:

* `route`: one program per token (L <= MAX_L) holds its E logits in registers, computes the fp32 softmax,
  picks the k largest by k rounds of argmax (k <= MAX_K, E <= MAX_E), renormalises and casts. Equal
  probabilities are taken lowest expert index first (torch.topk leaves their order undefined), so the chosen
  set is deterministic.
* `moe_combine`: routed + sigmoid(gate_logit) * shared, rounding to the model dtype where the reference rounds
  (the sigmoid, the product, the sum).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from strata.kernels import pdl
from strata.kernels.hyper import TL_DTYPES

MAX_L = 8  # tokens per call: decode and short verify batches
MAX_E = 1024
MAX_K = 16

ROUTE_TOPK = (False, 1)
"""How `route` picks the k largest probabilities: (bitonic, warps). (False, 1): k rounds of argmax in one warp,
the dependent max-reductions in warp shuffles; (True, W): a bitonic top-k network (`topk_keys`) in W warps."""


@triton.jit
def _bit(NDIM: tl.constexpr, b: tl.constexpr):
    """0/1 by bit b of the flat index, shaped to broadcast over a hypercube of NDIM axes (bit b = axis NDIM-1-b)."""
    return tl.reshape(tl.arange(0, 2), [1] * (NDIM - 1 - b) + [2] + [1] * b)


@triton.jit
def _cas(h, NDIM: tl.constexpr, b: tl.constexpr, want_max):
    """Compare-exchange of every element with its partner across bit b: the larger where want_max, else the
    smaller (want_max broadcasts over h)."""
    other = h ^ tl.xor_sum(h, axis=NDIM - 1 - b, keep_dims=True)
    return tl.where(want_max, tl.maximum(h, other), tl.minimum(h, other))


@triton.jit
def _merge(h, NDIM: tl.constexpr, LOGR: tl.constexpr, desc):
    """Bitonic runs of 2**LOGR (the innermost bits) into sorted runs: descending where desc, else ascending."""
    for i in tl.static_range(LOGR):  # bits LOGR - 1 .. 0
        h = _cas(h, NDIM, LOGR - 1 - i, desc ^ (_bit(NDIM, LOGR - 1 - i) == 1))
    return h


@triton.jit
def topk_keys(keys, LOGN: tl.constexpr, LOGK: tl.constexpr):
    """The 2**LOGK largest of 2**LOGN int64 keys, descending ([2**LOGK]). Runs of 2**LOGK are sorted with
    alternating directions; then, level by level, each pair of neighbouring runs (one descending, one ascending)
    is folded by an elementwise max into one bitonic run that holds the pair's 2**LOGK largest, and merged."""
    if LOGK == 0:
        return tl.max(keys, axis=0, keep_dims=True)
    h = tl.reshape(keys, [2] * LOGN)
    for s in tl.static_range(1, LOGK + 1):  # sorted runs of 2**s, descending where bit s is 0
        if s < LOGN:
            h = _merge(h, LOGN, s, _bit(LOGN, s) == 0)
        else:  # one run: the result
            h = _merge(h, LOGN, s, True)
    for f in tl.static_range(LOGN - LOGK):  # fold f: the hypercube has LOGN - f axes, then one fewer
        h = tl.max(h, axis=LOGN - f - 1 - LOGK)  # bit LOGK: runs 2m (descending) and 2m+1 (ascending)
        if f + 1 < LOGN - LOGK:
            h = _merge(h, LOGN - f - 1, LOGK, _bit(LOGN - f - 1, LOGK) == 0)
        else:
            h = _merge(h, LOGN - f - 1, LOGK, True)
    return tl.reshape(h, [2 ** LOGK])


@triton.jit
def _route_kernel(logits_ptr, idx_ptr, w_ptr, E, K, stride_l,
                  NORM: tl.constexpr, BE: tl.constexpr, BK: tl.constexpr, DT: tl.constexpr,
                  BITONIC: tl.constexpr = False, LOGBE: tl.constexpr = 0, LOGBK: tl.constexpr = 0,
                  GDC: tl.constexpr = False, LATE: tl.constexpr = False):
    pdl.enter(GDC, LATE)
    row = tl.program_id(0)
    e = tl.arange(0, BE)
    em = e < E
    x = tl.load(logits_ptr + row * stride_l + e, mask=em, other=float("-inf")).to(tl.float32)
    m = tl.max(x, axis=0)
    ex = tl.where(em, tl.exp(x - m), 0.0)
    p = ex / tl.sum(ex, axis=0)
    slots = tl.arange(0, BK)
    sm = slots < K
    if BITONIC:
        # one int64 key per expert, larger for a larger probability and, among equal ones, a lower index (the
        # probability's bits order as the probability, since it is >= 0); padding -1, below every key
        key = tl.where(em, (p.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (BE - 1 - e).to(tl.int64), -1)
        top = topk_keys(key, LOGBE, LOGBK)
        top_i = (BE - 1) - (top & 0xFFFFFFFF)
        top_w = tl.where(sm, (top >> 32).to(tl.int32).to(tl.float32, bitcast=True), 0.0)
    else:  # k rounds of argmax
        p = tl.where(em, p, -1.0)  # padding lanes are never chosen (probabilities are >= 0)
        top_w = tl.zeros([BK], tl.float32)
        top_i = tl.zeros([BK], tl.int64)
        for j in range(K):
            v, i = tl.max(p, axis=0, return_indices=True, return_indices_tie_break_left=True)  # lowest index on ties
            top_w = tl.where(slots == j, v, top_w)
            top_i = tl.where(slots == j, i.to(tl.int64), top_i)
            p = tl.where(e == i, -2.0, p)
    if NORM:
        top_w = top_w / tl.sum(top_w, axis=0)  # unused slots hold 0
    tl.store(idx_ptr + row * K + slots, top_i, mask=sm)
    tl.store(w_ptr + row * K + slots, top_w.to(DT), mask=sm)


def route_supported(logits: torch.Tensor, k: int) -> bool:
    return (logits.dim() == 2 and 1 <= logits.shape[0] <= MAX_L and 1 <= k <= min(MAX_K, logits.shape[1])
            and logits.shape[1] <= MAX_E and logits.dtype in TL_DTYPES and logits.stride(1) == 1)


def route(logits: torch.Tensor, k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The twin of `strata.model.moe.route_ref` (ties: lowest expert index first), one launch."""
    L, E = logits.shape
    top_i = torch.empty(L, k, dtype=torch.int64, device=logits.device)
    top_w = torch.empty(L, k, dtype=logits.dtype, device=logits.device)
    be, bk = triton.next_power_of_2(E), triton.next_power_of_2(k)
    bitonic, warps = ROUTE_TOPK
    _route_kernel[(L,)](logits, top_i, top_w, E, k, logits.stride(0), NORM=bool(norm_topk_prob), BE=be, BK=bk,
                        DT=TL_DTYPES[logits.dtype], BITONIC=bitonic, LOGBE=be.bit_length() - 1,
                        LOGBK=bk.bit_length() - 1, num_warps=warps, **pdl.launch(logits.device, "route"))
    return top_i, top_w


@triton.jit
def _combine_kernel(routed_ptr, gate_ptr, shared_ptr, out_ptr, H, BH: tl.constexpr, DT: tl.constexpr,
                    GDC: tl.constexpr = False, LATE: tl.constexpr = False):
    pdl.enter(GDC, LATE)
    row = tl.program_id(0)
    h = tl.program_id(1) * BH + tl.arange(0, BH)
    hm = h < H
    g = tl.load(gate_ptr + row).to(tl.float32)
    sig = (1.0 / (1.0 + tl.exp(-g))).to(DT).to(tl.float32)
    r = tl.load(routed_ptr + row * H + h, mask=hm, other=0.0).to(tl.float32)
    s = tl.load(shared_ptr + row * H + h, mask=hm, other=0.0).to(tl.float32)
    prod = (sig * s).to(DT).to(tl.float32)
    tl.store(out_ptr + row * H + h, (r + prod).to(DT), mask=hm)


def combine_supported(routed: torch.Tensor, gate_logit: torch.Tensor, shared: torch.Tensor) -> bool:
    L = routed.shape[0] if routed.dim() == 2 else 0
    return (1 <= L <= MAX_L and shared.shape == routed.shape and gate_logit.shape == (L, 1)
            and routed.dtype == shared.dtype == gate_logit.dtype and routed.dtype in TL_DTYPES
            and routed.is_contiguous() and shared.is_contiguous() and gate_logit.is_contiguous())


def moe_combine(routed: torch.Tensor, gate_logit: torch.Tensor, shared: torch.Tensor, bh: int = 1024,
                ) -> torch.Tensor:
    """The twin of `strata.model.moe.moe_combine_ref`, one launch."""
    L, H = routed.shape
    out = torch.empty_like(routed)
    _combine_kernel[(L, triton.cdiv(H, bh))](routed, gate_logit, shared, out, H, BH=bh, DT=TL_DTYPES[routed.dtype],
                                             **pdl.launch(routed.device, "combine"))
    return out


@triton.jit
def _slot_sum_kernel(y_ptr, w_ptr, out_ptr, N, K, BN: tl.constexpr, DT: tl.constexpr, GDC: tl.constexpr = False):
    pdl.started(GDC)
    pdl.wait(GDC)
    tok = tl.program_id(0)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    nm = n < N
    acc = tl.zeros([BN], tl.float32)
    for j in range(K):
        s = tok * K + j
        acc += tl.load(y_ptr + s * N + n, mask=nm, other=0.0) * tl.load(w_ptr + s).to(tl.float32)
    tl.store(out_ptr + tok * N + n, acc.to(DT), mask=nm)


def slot_sum(y: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype, bn: int = 512) -> torch.Tensor:
    """out[t] = sum_j weights[t, j] * y[t*k + j] in fp32, slots added in order j = 0..k-1, cast once to dtype:
    the routed experts' weighted combine after a per-slot down projection. y (T*k, N) fp32 contiguous, weights
    (T, k). One launch; no atomics, so the result is the same on every run (a graph replay equals the eager
    step)."""
    T, k = weights.shape
    N = y.shape[1]
    if y.shape[0] != T * k or y.dtype != torch.float32 or not y.is_contiguous():
        raise ValueError(f"y: expected contiguous float32 ({T * k}, N), got {y.dtype} {tuple(y.shape)}")
    w = weights.contiguous()
    out = torch.empty(T, N, dtype=dtype, device=y.device)
    _slot_sum_kernel[(T, triton.cdiv(N, bn))](y, w, out, N, k, BN=bn, DT=TL_DTYPES[dtype],
                                             **pdl.launch(y.device))
    return out
