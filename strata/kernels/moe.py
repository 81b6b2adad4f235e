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


@triton.jit
def _route_kernel(logits_ptr, idx_ptr, w_ptr, E, K, stride_l,
                  NORM: tl.constexpr, BE: tl.constexpr, BK: tl.constexpr, DT: tl.constexpr, GDC: tl.constexpr = False,
                  LATE: tl.constexpr = False):
    pdl.enter(GDC, LATE)
    row = tl.program_id(0)
    e = tl.arange(0, BE)
    em = e < E
    x = tl.load(logits_ptr + row * stride_l + e, mask=em, other=float("-inf")).to(tl.float32)
    m = tl.max(x, axis=0)
    ex = tl.where(em, tl.exp(x - m), 0.0)
    p = ex / tl.sum(ex, axis=0)
    p = tl.where(em, p, -1.0)  # padding lanes are never chosen (probabilities are >= 0)
    slots = tl.arange(0, BK)
    top_w = tl.zeros([BK], tl.float32)
    top_i = tl.zeros([BK], tl.int64)
    for j in range(K):
        v, i = tl.max(p, axis=0, return_indices=True, return_indices_tie_break_left=True)  # lowest index on ties
        top_w = tl.where(slots == j, v, top_w)
        top_i = tl.where(slots == j, i.to(tl.int64), top_i)
        p = tl.where(e == i, -2.0, p)
    if NORM:
        top_w = top_w / tl.sum(top_w, axis=0)  # unused slots hold 0
    sm = slots < K
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
    # one warp: the k dependent max-reductions stay in warp shuffles, with no barrier between warps
    _route_kernel[(L,)](logits, top_i, top_w, E, k, logits.stride(0), NORM=bool(norm_topk_prob),
                        BE=triton.next_power_of_2(E), BK=triton.next_power_of_2(k), DT=TL_DTYPES[logits.dtype],
                        num_warps=1, **pdl.launch(logits.device, "route"))
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
