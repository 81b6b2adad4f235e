"""Matrix-vector products straight from stored (ggml block-quantized or dense) weights, in Triton.

Decode at batch 1 is memory-bound: every weight byte is read once per token, so the GEMV reads the packed blocks
as they are stored, decodes them in registers and never writes a dequantized copy. Each block type has one
decoder (`gemv_blocks.py`); one kernel skeleton (`_gemv_kernel`) runs any of them over a tile of BN rows, looping
over K in chunks, with fp32 accumulation.

    gemv(x (T, K), w_data (N, row_bytes) uint8, type_id, K)                -> (T, N) fp32
    gemv_experts(x (k|1, K), w_data (E, N, row_bytes), expert_ids (k,), type_id, K) -> (k, N) fp32

`gemv_experts` runs the k routed experts of a MoE layer in one launch: the expert ids are read on the device, so
the router's output never travels to the host. Neither function synchronizes with the host or allocates anything
but its output (pass `out=` to avoid even that), so both can be captured in a CUDA graph, once compiled and once
`prepare(device)` has placed the i-quant tables: run each shape once before capturing.

Dense weights (F32, F16, BF16) go through the same kernel with one "block" per element; their `w_data` may be the
typed tensor itself or its uint8 view.

Speed (tools/gpu_check_gemv.py, H200, K=2560, N=8192, one token, as a fraction of the device copy rate): dense
rows 0.8-0.9; the quantized types decode about 1.2-1.9e12 weights/s whatever their size, i.e. they are bound by
per-weight instructions, not by memory: Q8_0 0.40, Q5_1/Q4_1/Q4_0/Q6_K/Q5_0 0.22-0.27, Q4_K/Q5_K/IQ4_* 0.19-0.20,
the 2-3 bit types 0.07-0.13. Several tokens per launch share the decode but not the x loads and FMAs. The
per-type rows/warps defaults below are the fastest of a sweep; `--sweep` in the tool repeats it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from strata.kernels import gemv_blocks as gb
from strata.kernels.gemv_tables import device_table

MAX_TOKENS = 8
"""Tokens per launch: each has its own accumulator tile (unrolled in the kernel), so more tokens go in groups of 8."""

MULTI_TOKEN_ROWS = 8
MULTI_TOKEN_WARPS = 8
"""Launch shape for 2-8 tokens: max(8, block_n / T) rows, 8 warps. Each token adds an accumulator tile, so fewer
rows per program keep registers in check, but each x element loaded must still serve several rows: at 8 tokens
8 rows and 8 warps measured fastest (2, 4 and 8 rows tried, H200)."""


@dataclass(frozen=True)
class GemvType:
    """How the GEMV reads one storage type.

    block_elems/block_bytes: ggml's block geometry (1 element of 2 or 4 bytes for dense rows).
    decode, rank: the `gemv_blocks` decoder and the rank of the weight tile it returns.
    max_chunk_blocks: blocks decoded per loop step (a power of two; fewer when K/block_elems is not a multiple).
    table: the lookup table the decode gathers from (`gemv_tables.device_table`), if any.
    block_n, num_warps: launch defaults for one token, rows and warps per program (several tokens: see
        MULTI_TOKEN_ROWS).
    dense_dtype: the element type of dense rows (None for block types).
    f16_fields: byte offsets of the fp16 scale fields in a block (for making random blocks with sane scales).
    """

    name: str
    type_id: int
    block_elems: int
    block_bytes: int
    decode: Any
    rank: int
    max_chunk_blocks: int
    table: str | None = None
    block_n: int = 16
    num_warps: int = 4
    dense_dtype: torch.dtype | None = None
    f16_fields: tuple[int, ...] = ()


_TYPE_LIST: tuple[GemvType, ...] = (
    # name, ggml id, block elems, block bytes, decoder, tile rank, max blocks per chunk, then rows/warps per program
    # where not 16/4 (the fastest of a sweep at K=2560, N=8192, one token, on an H200)
    GemvType("F32", 0, 1, 4, gb.decode_dense, 2, 256, dense_dtype=torch.float32),
    GemvType("F16", 1, 1, 2, gb.decode_dense, 2, 512, dense_dtype=torch.float16),
    GemvType("BF16", 30, 1, 2, gb.decode_dense, 2, 512, dense_dtype=torch.bfloat16),
    GemvType("Q4_0", 2, 32, 18, gb.decode_q4_0, 4, 8, block_n=8, f16_fields=(0,)),
    GemvType("Q4_1", 3, 32, 20, gb.decode_q4_1, 6, 8, num_warps=8, f16_fields=(0, 2)),
    GemvType("Q5_0", 6, 32, 22, gb.decode_q5_0, 5, 8, f16_fields=(0,)),
    GemvType("Q5_1", 7, 32, 24, gb.decode_q5_1, 6, 8, block_n=8, f16_fields=(0, 2)),
    GemvType("Q8_0", 8, 32, 34, gb.decode_q8_0, 3, 8, block_n=8, f16_fields=(0,)),
    GemvType("IQ4_NL", 20, 32, 18, gb.decode_iq4_nl, 4, 8, table="IQ4", f16_fields=(0,)),
    GemvType("Q2_0", 42, 64, 18, gb.decode_q2_0, 6, 4, f16_fields=(0,)),
    GemvType("Q2_K", 10, 256, 84, gb.decode_q2_k, 5, 1, f16_fields=(80, 82)),
    GemvType("Q3_K", 11, 256, 110, gb.decode_q3_k, 5, 1, num_warps=8, f16_fields=(108,)),
    GemvType("Q4_K", 12, 256, 144, gb.decode_q4_k, 4, 1, block_n=32, num_warps=8, f16_fields=(0, 2)),
    GemvType("Q5_K", 13, 256, 176, gb.decode_q5_k, 6, 1, block_n=8, f16_fields=(0, 2)),
    GemvType("Q6_K", 14, 256, 210, gb.decode_q6_k, 5, 1, block_n=8, f16_fields=(208,)),
    GemvType("IQ2_XXS", 16, 256, 66, gb.decode_iq2_xxs, 5, 1, table="IQ2_XXS", block_n=8, f16_fields=(0,)),
    GemvType("IQ2_XS", 17, 256, 74, gb.decode_iq2_xs, 5, 1, table="IQ2_XS", block_n=8, f16_fields=(0,)),
    GemvType("IQ3_XXS", 18, 256, 98, gb.decode_iq3_xxs, 5, 1, table="IQ3_XXS", block_n=8, f16_fields=(0,)),
    GemvType("IQ3_S", 21, 256, 110, gb.decode_iq3_s, 5, 1, table="IQ3_S", block_n=8, f16_fields=(0,)),
    GemvType("IQ2_S", 22, 256, 82, gb.decode_iq2_s, 5, 1, table="IQ2_S", block_n=8, f16_fields=(0,)),
    GemvType("IQ4_XS", 23, 256, 136, gb.decode_iq4_xs, 4, 1, table="IQ4", f16_fields=(0,)),
)

GEMV_TYPES: dict[int, GemvType] = {t.type_id: t for t in _TYPE_LIST}
"""Supported storage types by ggml type id."""

GEMV_TYPE_NAMES: dict[str, GemvType] = {t.name: t for t in _TYPE_LIST}
"""Supported storage types by name (StoredTensor.kind)."""


def gemv_type(type_id: int | str) -> GemvType:
    """The GEMV description of a ggml type id or name; ValueError names what is supported otherwise."""
    t = GEMV_TYPES.get(type_id) if isinstance(type_id, int) else GEMV_TYPE_NAMES.get(type_id)
    if t is None:
        names = ", ".join(sorted(GEMV_TYPE_NAMES))
        raise ValueError(f"no Triton GEMV for storage type {type_id!r}; supported: {names}")
    return t


def row_bytes(type_id: int | str, k: int) -> int:
    """Bytes of one stored row of k elements."""
    t = gemv_type(type_id)
    if k % t.block_elems:
        raise ValueError(f"{t.name}: row length {k} is not a multiple of the block size {t.block_elems}")
    return k // t.block_elems * t.block_bytes


def prepare(device: torch.device | str) -> None:
    """Place every lookup table on `device` now, so no later call copies anything (needed before CUDA-graph
    capture)."""
    dev = torch.device(device)
    for t in _TYPE_LIST:
        if t.table is not None:
            device_table(t.table, dev)


@triton.jit
def _x(xc, xo, xs, t: tl.constexpr):
    """x[t] at offsets xo from the chunk start, as fp32, broadcast over the row dimension."""
    return tl.load(xc + t * xs + xo).to(tl.float32)[None]


@triton.jit
def _rowsum(a, RANK: tl.constexpr):
    """Sum over every dimension but the first (rows)."""
    if RANK >= 6:
        a = tl.sum(a, axis=5)
    if RANK >= 5:
        a = tl.sum(a, axis=4)
    if RANK >= 4:
        a = tl.sum(a, axis=3)
    if RANK >= 3:
        a = tl.sum(a, axis=2)
    return tl.sum(a, axis=1)


@triton.jit
def _put(res, a, t: tl.constexpr, T: tl.constexpr, T_PAD: tl.constexpr, RANK: tl.constexpr):
    """res[:, t] = the row sums of accumulator a, for a token that exists."""
    if t < T:
        col = tl.arange(0, T_PAD)
        res = tl.where(col[None, :] == t, _rowsum(a, RANK)[:, None], res)
    return res


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, ids_ptr, tab_ptr, out_ptr,
    N, n_chunks,
    w_row_stride, w_slot_stride, x_tok_stride, x_slot_stride, out_tok_stride, out_slot_stride,
    DECODE: tl.constexpr, RANK: tl.constexpr, CHUNK_W: tl.constexpr, CHUNK_X: tl.constexpr, NB: tl.constexpr,
    BN: tl.constexpr, T: tl.constexpr, T_PAD: tl.constexpr, HAS_IDS: tl.constexpr,
):
    """out[slot, t, rows] = W[slot's matrix][rows] . x[slot, t] for BN rows, T <= 8 tokens.

    Program (i, slot): rows i*BN .. i*BN+BN-1 of the matrix of `slot` (expert ids[slot] when HAS_IDS, else the one
    matrix). Rows past N are clamped to N-1 (so no load needs a mask) and not stored. Strides are in elements of
    the respective pointer (bytes for packed rows).

    Each chunk is decoded once into a weight tile and multiplied by each token's x into that token's accumulator,
    a tile of the same shape and layout (so no data moves between threads inside the loop); the tiles are summed
    over their K dimensions once, after the loop. The first chunk initialises the accumulators (their shape is the
    decoder's); the accumulators of tokens past T are compile-time placeholders that generate no code."""
    pid = tl.program_id(0)
    slot = tl.program_id(1)
    rows = pid * BN + tl.arange(0, BN)
    rows_c = tl.minimum(rows, N - 1).to(tl.int64)
    if HAS_IDS:
        mat = tl.load(ids_ptr + slot).to(tl.int64)
    else:
        mat = slot.to(tl.int64) * 0
    rp = w_ptr + mat * w_slot_stride + rows_c * w_row_stride
    xp = x_ptr + slot.to(tl.int64) * x_slot_stride
    xs = x_tok_stride
    w, xo = DECODE(rp, tab_ptr, BN, NB)
    a0 = w * _x(xp, xo, xs, 0)
    a1 = 0.0
    a2 = 0.0
    a3 = 0.0
    a4 = 0.0
    a5 = 0.0
    a6 = 0.0
    a7 = 0.0
    if T > 1:
        a1 = w * _x(xp, xo, xs, 1)
    if T > 2:
        a2 = w * _x(xp, xo, xs, 2)
    if T > 3:
        a3 = w * _x(xp, xo, xs, 3)
    if T > 4:
        a4 = w * _x(xp, xo, xs, 4)
    if T > 5:
        a5 = w * _x(xp, xo, xs, 5)
    if T > 6:
        a6 = w * _x(xp, xo, xs, 6)
    if T > 7:
        a7 = w * _x(xp, xo, xs, 7)
    for c in range(1, n_chunks):
        xc = xp + c * CHUNK_X
        w, xo = DECODE(rp + c * CHUNK_W, tab_ptr, BN, NB)
        a0 += w * _x(xc, xo, xs, 0)
        if T > 1:
            a1 += w * _x(xc, xo, xs, 1)
        if T > 2:
            a2 += w * _x(xc, xo, xs, 2)
        if T > 3:
            a3 += w * _x(xc, xo, xs, 3)
        if T > 4:
            a4 += w * _x(xc, xo, xs, 4)
        if T > 5:
            a5 += w * _x(xc, xo, xs, 5)
        if T > 6:
            a6 += w * _x(xc, xo, xs, 6)
        if T > 7:
            a7 += w * _x(xc, xo, xs, 7)
    res = tl.zeros([BN, T_PAD], dtype=tl.float32)
    res = _put(res, a0, 0, T, T_PAD, RANK)
    res = _put(res, a1, 1, T, T_PAD, RANK)
    res = _put(res, a2, 2, T, T_PAD, RANK)
    res = _put(res, a3, 3, T, T_PAD, RANK)
    res = _put(res, a4, 4, T, T_PAD, RANK)
    res = _put(res, a5, 5, T, T_PAD, RANK)
    res = _put(res, a6, 6, T, T_PAD, RANK)
    res = _put(res, a7, 7, T, T_PAD, RANK)
    tcol = tl.arange(0, T_PAD)
    optr = out_ptr + slot.to(tl.int64) * out_slot_stride + tcol[None, :] * out_tok_stride + rows[:, None]
    tl.store(optr, res, mask=(rows[:, None] < N) & (tcol[None, :] < T))


def _chunk_blocks(t: GemvType, k: int) -> int:
    """Blocks per loop step: the largest power of two <= max_chunk_blocks dividing the row's block count."""
    n_blocks = k // t.block_elems
    nb = t.max_chunk_blocks
    while n_blocks % nb:
        nb //= 2
    return nb


def _weights(t: GemvType, w_data: torch.Tensor, k: int, dims: int) -> torch.Tensor:
    """w_data as the kernel reads it: uint8 for packed rows, the element type for dense ones (a uint8 view of
    dense rows is reinterpreted, not copied)."""
    if w_data.dim() != dims:
        raise ValueError(f"{t.name} weights: expected {dims} dims, got shape {tuple(w_data.shape)}")
    if w_data.stride(-1) != 1:
        raise ValueError(f"{t.name} weights: rows must be contiguous")
    if t.dense_dtype is not None and w_data.dtype == torch.uint8:
        w_data = w_data.view(t.dense_dtype)
    want = t.dense_dtype or torch.uint8
    if w_data.dtype != want:
        raise ValueError(f"{t.name} weights: dtype {w_data.dtype}, expected {want}")
    width = k if t.dense_dtype is not None else row_bytes(t.type_id, k)
    if w_data.shape[-1] != width:
        raise ValueError(f"{t.name} weights: rows of {w_data.shape[-1]}, expected {width} for K={k}")
    return w_data


def _check_x(x: torch.Tensor, k: int, w: torch.Tensor) -> None:
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x: expected (tokens, {k}), got {tuple(x.shape)}")
    if x.stride(1) != 1:
        raise ValueError("x: rows must be contiguous")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"x: dtype {x.dtype} is not float32/float16/bfloat16")
    if x.device != w.device:
        raise ValueError(f"x on {x.device}, weights on {w.device}")


def _out(out: torch.Tensor | None, shape: tuple[int, int], device: torch.device) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=torch.float32, device=device)
    if tuple(out.shape) != shape or out.dtype != torch.float32 or out.device != device or out.stride(1) != 1:
        raise ValueError(f"out: expected contiguous-row float32 {shape} on {device}, got "
                         f"{out.dtype} {tuple(out.shape)} on {out.device}")
    return out


def _launch(t: GemvType, x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor | None, out: torch.Tensor,
            n: int, k: int, slots: int, n_tok: int, w_slot_stride: int, x_slot_stride: int,
            out_slot_stride: int, block_n: int | None, num_warps: int | None) -> None:
    if n == 0 or slots == 0 or n_tok == 0:
        return
    nb = _chunk_blocks(t, k)
    t_pad = triton.next_power_of_2(n_tok)
    if block_n is not None:
        bn = max(2, block_n // t_pad)
    elif n_tok == 1:
        bn = t.block_n
    else:
        bn = max(MULTI_TOKEN_ROWS, t.block_n // t_pad)
    nw = num_warps or (t.num_warps if n_tok == 1 else MULTI_TOKEN_WARPS)
    tab = device_table(t.table, w.device) if t.table is not None else w
    grid = (triton.cdiv(n, bn), slots)
    _gemv_kernel[grid](
        x, w, ids if ids is not None else w, tab, out,
        n, k // (nb * t.block_elems),
        w.stride(-2), w_slot_stride, x.stride(0), x_slot_stride, out.stride(0), out_slot_stride,
        DECODE=t.decode, RANK=t.rank, CHUNK_W=nb if t.dense_dtype is not None else nb * t.block_bytes,
        CHUNK_X=nb * t.block_elems, NB=nb, BN=bn, T=n_tok, T_PAD=t_pad,
        HAS_IDS=ids is not None, num_warps=nw,
    )


def gemv(x: torch.Tensor, w_data: torch.Tensor, type_id: int | str, K: int, out: torch.Tensor | None = None,
         *, block_n: int | None = None, num_warps: int | None = None) -> torch.Tensor:
    """y = x W^T in fp32, W read from its stored rows.

    x: (T, K) float32/float16/bfloat16, rows contiguous. w_data: (N, row_bytes) uint8 ggml blocks, or for
    F32/F16/BF16 the (N, K) typed tensor (or its uint8 view). type_id: ggml type id (or its name). out: optional
    (T, N) float32 to write into. block_n, num_warps: rows (for one token; divided by T, rounded up to a power
    of two, for more) and warps per program, to override the defaults (for tuning).
    Tokens go 8 per launch."""
    t = gemv_type(type_id)
    w = _weights(t, w_data, K, 2)
    _check_x(x, K, w)
    n, n_tok = w.shape[0], x.shape[0]
    out = _out(out, (n_tok, n), w.device)
    for t0 in range(0, n_tok, MAX_TOKENS):
        t1 = min(n_tok, t0 + MAX_TOKENS)
        _launch(t, x[t0:t1], w, None, out[t0:t1], n, K, 1, t1 - t0, 0, 0, 0, block_n, num_warps)
    return out


def gemv_experts(x: torch.Tensor, w_data: torch.Tensor, expert_ids: torch.Tensor, type_id: int | str, K: int,
                 out: torch.Tensor | None = None, *, block_n: int | None = None, num_warps: int | None = None,
                 ) -> torch.Tensor:
    """out[i] = W[expert_ids[i]] x[i] (or x[0] for every i when x has one row), all k experts in one launch.

    w_data: (E, N, row_bytes) uint8 expert stack (or (E, N, K) typed for dense types). expert_ids: (k,) int32/int64
    on the weights' device, read by the kernel (no host sync); ids are trusted to lie in [0, E). x: (k, K) or
    (1, K). out: optional (k, N) float32. block_n, num_warps: as for `gemv`."""
    t = gemv_type(type_id)
    w = _weights(t, w_data, K, 3)
    _check_x(x, K, w)
    if expert_ids.dim() != 1 or expert_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"expert_ids: expected a 1-D int32/int64 tensor, got {expert_ids.dtype} "
                         f"{tuple(expert_ids.shape)}")
    if expert_ids.device != w.device:
        raise ValueError(f"expert_ids on {expert_ids.device}, weights on {w.device}")
    k_sel, n = expert_ids.shape[0], w.shape[1]
    if x.shape[0] not in (1, k_sel):
        raise ValueError(f"x: {x.shape[0]} rows for {k_sel} experts (expected 1 or {k_sel})")
    if expert_ids.stride(0) != 1:
        raise ValueError("expert_ids: must be contiguous")
    out = _out(out, (k_sel, n), w.device)
    if k_sel == 0:
        return out
    x_slot_stride = 0 if x.shape[0] == 1 else x.stride(0)
    _launch(t, x, w, expert_ids, out, n, K, k_sel, 1, w.stride(0), x_slot_stride, out.stride(0), block_n,
            num_warps)
    return out
