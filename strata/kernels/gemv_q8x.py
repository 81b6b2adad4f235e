"""GEMVs with Q8 activations: x rounded to int8 runs (`strata.model.act_quant`), the dot products in integers.

The row-register GEMVs (`gemv_rr`) spend ~5-6 SASS instructions per weight (a byte permute into a float, the
dequantizing FMA, x's widening, the product's FMA), so a decode GEMV is bound by instruction issue long before the
memory. With x rounded to int8 in runs of 32 (the rounding llama.cpp's GPU matmuls apply), the stored weights'
integers multiply x's in `dp4a` (four byte products and their sum per instruction), and the scales are applied
once per run: Q4_K's x_d S (q . qx) - M s, Q5_1's x_d d (q . qx) + m s, Q8_0_R's (stored q + 128)
dw (x_d (u . qx) - 128 s), s = x_d sum(qx) being the run's sum; Q6_K's x_d S (q . qx - 32 sum(qx)) per half
run (its scales cover 16 weights). The weights are read as stored; only x changes.

`quantize` writes x as the kernels read it: units of 128 values (`gemv_rr.Q8X_UNIT`), 128 int8 then four (d, s)
fp32 pairs, each run's bytes ordered as its consumer's words hold their weights (byte b of word w multiplies
weight 8b + w for Q4_K_R, Q6_K_R and Q8_0_R, weight 4b + w and 16 + 4b + w for Q5_1_R: `ORDER`), so each 4-byte word of
weights meets one 4-byte word of x. Everything else (launch shapes, K split, expert ids, the GLU and the slot sum,
PDL) is the row-register kernel's, which takes these units in place of float x (`gemv_rr._rr_kernel`'s XQ).
Kernels that produce a GEMV input can write its units as well (`gemv_rr.store_q8x_runs`) and record them
(`gemv_rr.record_q8x`); `quantize` returns recorded units instead of launching.

Numerics: the integer dot products are exact, so a launch computes the stored weights times `round_q8(x)` up to
fp32 summation order, which the tests check against float64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from strata.kernels import gemv as G
from strata.kernels import gemv_rr, pdl
from strata.model.act_quant import RUN

ORDER = gemv_rr.Q8X_ORDER

UNIT_VALUES, UNIT_BYTES = gemv_rr.Q8X_UNIT
RUNS_PER_PROGRAM = 16

UNITS_SPAN = ORDER["Q8_0_R"]
"""The word span of the Q8 units the producers of GEMV inputs write in the Q8-activation mode (HC read, GDN step,
attention merge): that of every matrix GPU placement stores to read those outputs (the Q8_0_R projections and
shared expert, the Q4_K_R routed experts, the Q6_K_R head)."""


def row_bytes(k: int) -> int:
    """Bytes of one row of Q8 activations of k values (k a multiple of 128)."""
    if k % UNIT_VALUES:
        raise ValueError(f"Q8 activations: K = {k} is not a multiple of {UNIT_VALUES}")
    return k // UNIT_VALUES * UNIT_BYTES


def source_index(span: int) -> torch.Tensor:
    """[32] int64: the run value each byte of a quantized run holds, for words of span `span` (`ORDER`)."""
    p = torch.arange(RUN)
    w, b = p // 4, p % 4
    return 8 * b + w if span == 8 else (w // 4) * 16 + 4 * b + w % 4


@triton.jit
def _quantize_kernel(x_ptr, q_ptr, RUNS, x_slot_stride, q_slot_stride, SPAN: tl.constexpr, RB: tl.constexpr,
                     GDC: tl.constexpr = False, LATE: tl.constexpr = False):
    """RB runs of one row of x (program (i, row)) as Q8 units (`gemv_rr.store_q8x_runs`). The GEMV after it is let
    in first (it loads its weights meanwhile), or with LATE after the wait (`pdl.LATE_RELEASE["quantize"]`)."""
    pdl.enter(GDC, LATE)
    slot = tl.program_id(1).to(tl.int64)
    run = tl.program_id(0) * RB + tl.arange(0, RB)[:, None]
    gemv_rr.store_q8x_runs(x_ptr + slot * x_slot_stride, q_ptr + slot * q_slot_stride, run, run < RUNS, SPAN,
                           RB)


def quantize(x: torch.Tensor, kind: str, out: torch.Tensor | None = None) -> torch.Tensor:
    """x (rows, K) float, rows contiguous, as Q8 activations for weights of `kind` (a `gemv_rr.Q8X_ORDER` type):
    (rows, `row_bytes(K)`) int8, in one launch (PDL: it waits for the kernel before, which may write x); without
    `out`, the units x's producer wrote (`gemv_rr.record_q8x`) where there are some, with no launch."""
    if kind not in ORDER:
        raise ValueError(f"{kind}: no GEMV with Q8 activations (those are {', '.join(ORDER)})")
    if x.dim() != 2 or x.stride(-1) != 1 or not x.dtype.is_floating_point:
        raise ValueError(f"Q8 activations: x must be a 2-D float tensor with contiguous rows, got "
                         f"{tuple(x.shape)} {x.dtype} strides {x.stride()}")
    rows, k = x.shape
    shape = (rows, row_bytes(k))
    if out is None:
        units = gemv_rr.recorded_q8x(x, ORDER[kind])
        if units is not None:
            return units
        out = torch.empty(shape, dtype=torch.int8, device=x.device)
    elif tuple(out.shape) != shape or out.dtype != torch.int8 or out.stride(-1) != 1 or out.device != x.device:
        raise ValueError(f"Q8 activations: out must be {shape} int8 with contiguous rows on {x.device}, got "
                         f"{tuple(out.shape)} {out.dtype} on {out.device}")
    runs = k // RUN
    if rows and runs:
        _quantize_kernel[(triton.cdiv(runs, RUNS_PER_PROGRAM), rows)](
            x, out, runs, x.stride(0), out.stride(0), SPAN=ORDER[kind], RB=RUNS_PER_PROGRAM, num_warps=4,
            LATE=pdl.LATE_RELEASE["quantize"], **pdl.launch(x.device))
    return out


@triton.jit
def _round_kernel(x_ptr, y_ptr, RUNS, x_row_stride, y_row_stride, RB: tl.constexpr, GDC: tl.constexpr = False):
    """RB runs of one row of x (program (i, row)) rounded to Q8 and back: y = d q in y's dtype, as
    `act_quant.round_q8` then the cast (`gemv_rr.q8x_round`)."""
    pdl.enter(GDC, False)
    row = tl.program_id(1).to(tl.int64)
    run = tl.program_id(0) * RB + tl.arange(0, RB)[:, None]
    p = tl.arange(0, 32)[None, :]
    ok = run < RUNS
    v = tl.load(x_ptr + row * x_row_stride + run * 32 + p, mask=ok, other=0.0).to(tl.float32)
    q, d = gemv_rr.q8x_round(v, RB)
    tl.store(y_ptr + row * y_row_stride + run * 32 + p, (q.to(tl.float32) * d).to(y_ptr.dtype.element_ty), mask=ok)


def round_rows(x: torch.Tensor) -> torch.Tensor:
    """`act_quant.round_q8(x).to(x.dtype)` in one launch, for products whose weights have no Q8-activation GEMV
    (the reference's PyTorch ops would be ~15 launches per call); x (..., K) float, K a multiple of 32."""
    k = x.shape[-1]
    if k % RUN or not x.dtype.is_floating_point:
        raise ValueError(f"Q8 activations: expected float rows of a multiple of {RUN} values, got "
                         f"{tuple(x.shape)} {x.dtype}")
    x2 = x.reshape(-1, k)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.numel():
        _round_kernel[(triton.cdiv(k // RUN, RUNS_PER_PROGRAM), x2.shape[0])](
            x2, y, k // RUN, x2.stride(0), y.stride(0), RB=RUNS_PER_PROGRAM, num_warps=4, **pdl.launch(x.device))
    return y.reshape(x.shape)


def unpack(xq: torch.Tensor, kind: str, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [rows, k] int8 in value order, d, s [rows, k / 32] fp32) of `quantize`'s output: the layout, read back."""
    rows = xq.shape[0]
    units = xq.view(rows, k // UNIT_VALUES, UNIT_BYTES)
    runs = units[..., :UNIT_VALUES].reshape(rows, k // RUN, RUN)
    q = torch.empty_like(runs)
    q[..., source_index(ORDER[kind])] = runs
    ds = units[..., UNIT_VALUES:].contiguous().view(torch.float32).reshape(rows, k // RUN, 2)
    return q.reshape(rows, k), ds[..., 0], ds[..., 1]


def _check(xq: torch.Tensor, kind: str, k: int, w: torch.Tensor, rows: tuple[int, ...]) -> None:
    if kind not in ORDER:
        raise ValueError(f"{kind}: no GEMV with Q8 activations (those are {', '.join(ORDER)})")
    if xq.dtype != torch.int8 or xq.dim() != 2 or xq.shape[0] not in rows or xq.shape[1] != row_bytes(k) \
            or xq.stride(-1) != 1 or xq.device != w.device:
        raise ValueError(f"Q8 activations: expected int8 ({' or '.join(map(str, rows))}, {row_bytes(k)}) with "
                         f"contiguous rows on {w.device} (`quantize`), got {tuple(xq.shape)} {xq.dtype} on "
                         f"{xq.device}")


def _run(kind: str, xq: torch.Tensor, w: torch.Tensor, ids: torch.Tensor | None, out: torch.Tensor, n: int, k: int,
         slots: int, w_slot_stride: int, x_slot_stride: int, out_slot_stride: int, up: torch.Tensor | None = None,
         up_slot_stride: int = 0, split_k: int | None = None, slot_weights: torch.Tensor | None = None,
         ids_settled: bool = False, q_out: tuple[torch.Tensor, int] | None = None) -> None:
    if not gemv_rr.covers(kind, 1, w, up, (w_slot_stride, up_slot_stride)):
        raise ValueError(f"{kind}: Q8 activations need uint8 rows starting 16-byte aligned")
    if n == 0 or slots == 0:
        return
    t = G.gemv_type(kind)
    if not G._launch_rr(t, xq, w, ids, out, n, k, slots, w_slot_stride, x_slot_stride, out_slot_stride, up,
                        up_slot_stride, split_k, slot_weights, ids_settled=ids_settled, q8x=True, q_out=q_out):
        raise RuntimeError("Q8 activations: no split-K ticket counters left for the slot sum on this stream")


def gemv(xq: torch.Tensor, w_data: torch.Tensor, kind: str, K: int, out: torch.Tensor | None = None,
         out_dtype: torch.dtype = torch.float32, *, split_k: int | None = None) -> torch.Tensor:
    """y = round_q8(x) W^T for one token (`G.gemv` with xq = `quantize(x, kind)` of shape (1, ...))."""
    w = G._weights(G.gemv_type(kind), w_data, K, 2)
    _check(xq, kind, K, w, (1,))
    out = G._out(out, (1, w.shape[0]), w.device, out_dtype)
    _run(kind, xq, w, None, out, w.shape[0], K, 1, 0, 0, 0, split_k=split_k)
    return out


def gemv_glu(xq: torch.Tensor, gate_data: torch.Tensor, up_data: torch.Tensor, kind: str, K: int,
             out: torch.Tensor | None = None, out_dtype: torch.dtype = torch.float32, *,
             split_k: int | None = None) -> torch.Tensor:
    """silu(round_q8(x) G^T) * (round_q8(x) U^T) for one token, rounded as `G.gemv_glu` rounds."""
    g, u = G._glu_weights(G.gemv_type(kind), gate_data, up_data, K, 2)
    _check(xq, kind, K, g, (1,))
    out = G._out(out, (1, g.shape[0]), g.device, out_dtype)
    _run(kind, xq, g, None, out, g.shape[0], K, 1, 0, 0, 0, u, 0, split_k=split_k)
    return out


def gemv_experts_glu(xq: torch.Tensor, gate_data: torch.Tensor, up_data: torch.Tensor, expert_ids: torch.Tensor,
                     kind: str, K: int, out: torch.Tensor | None = None,
                     out_dtype: torch.dtype = torch.float32, *, units_for: str | None = None) -> torch.Tensor:
    """`G.gemv_experts_glu` with Q8 activations: xq has one row (every slot) or one per slot. units_for (an
    `ORDER` type): the launch also writes its output as Q8 activations for that type's GEMV where it can, and
    records them (`gemv_rr.record_q8x`: `quantize` of the output then launches nothing)."""
    g, u = G._glu_weights(G.gemv_type(kind), gate_data, up_data, K, 3)
    k_sel, x_slot_stride = G._slots(xq, expert_ids, g)
    _check(xq, kind, K, g, (1, k_sel))
    n = g.shape[1]
    out = G._out(out, (k_sel, n), g.device, out_dtype)
    q_out = None
    if units_for is not None and n % UNIT_VALUES == 0 and out.is_contiguous():
        q_out = (torch.empty(k_sel, row_bytes(n), dtype=torch.int8, device=g.device), ORDER[units_for])
    _run(kind, xq, g, expert_ids, out, n, K, k_sel, g.stride(0), x_slot_stride, out.stride(0), u,
         u.stride(0), q_out=q_out)
    return out


def gemv_experts_sum(xq: torch.Tensor, w_data: torch.Tensor, expert_ids: torch.Tensor, slot_weights: torch.Tensor,
                     kind: str, K: int, out: torch.Tensor | None = None, out_dtype: torch.dtype = torch.float32, *,
                     ids_settled: bool = False) -> torch.Tensor:
    """`G.gemv_experts_sum` with Q8 activations (one row of xq per slot, or one for all)."""
    w = G._weights(G.gemv_type(kind), w_data, K, 3)
    k_sel, x_slot_stride = G._slots(xq, expert_ids, w)
    _check(xq, kind, K, w, (1, k_sel))
    G._check_slot_weights(slot_weights, k_sel, w)
    out = G._out(out, (1, w.shape[1]), w.device, out_dtype)
    _run(kind, xq, w, expert_ids, out, w.shape[1], K, k_sel, w.stride(0), x_slot_stride, 0,
         slot_weights=slot_weights, ids_settled=ids_settled)
    return out
