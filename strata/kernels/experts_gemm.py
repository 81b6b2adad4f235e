"""Routed experts of many tokens (prefill) as grouped matrix products on the tensor cores, from the stored blocks.

The one-token GEMV (`gemv.gemv_experts_glu`, `gemv_experts`) gives every (token, expert) slot its own pass over
the expert's weights: for a 512-token prefill chunk at k = 10 that is 5,120 decodes of an expert's matrices per
layer, ~10 per expert. Here the slots are sorted by expert and cut into tiles of up to BM slots of one expert
(`expert_tiles`, computed on the device: no host synchronisation); a program decodes a [BN, chunk] tile of its
expert's rows once per K step with the GEMV's decoders (`gemv_blocks`), rounds it to the model dtype as the
reference's `StoredTensor.dense(dtype)` does, and multiplies it with the tile's BM rows of x by `tl.dot` (fp32
accumulation). So each expert's weights are decoded once per tile instead of once per slot.

Two launches per layer: gate/up/SiLU over every tile (`experts_gemm_glu`, the output in sorted slot order),
then down (`experts_gemm`, each product stored at its slot's original row); `ops.experts_blocks` adds the
weighted sum over a token's slots (`moe.slot_sum`). Rounding follows the reference: g and u rounded to the model
dtype, SiLU in fp32 on the rounded gate and rounded, the product rounded; the down products stay fp32 for the
slot sum, as the GEMV path keeps them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from strata.kernels import gemv_blocks as gb
from strata.kernels import pdl
from strata.kernels.gemv import (GemvType, _act, _check_act, _check_x, _glu_weights, _out, _table, _weights,
                                 gemv_type, tile_args)

CHUNK_ELEMS = 256
"""x elements per K step (fewer where a type's block is larger or the row is shorter): a [BN, 256] fp32 tile is
64 registers per thread at BN = 32 over four warps."""

BLOCK_N = 32
"""Weight rows per program (each of gate and up in the GLU launch)."""

NUM_WARPS = 4


def decoder(t: GemvType) -> tuple:
    """(LOAD, UNPACK) of type t's weight tiles: the GEMV's decoder, whole."""
    return t.load or gb.load_pointer, t.unpack or t.decode


def tile_rows(slots: int, experts: int) -> int:
    """Slots per tile (BM, the MMA's M): 16 (the smallest `tl.dot` takes) unless the experts average more."""
    avg = slots / max(1, min(experts, slots))
    return 64 if avg > 48 else 32 if avg > 24 else 16


def expert_tiles(ids_sorted: torch.Tensor, n_experts: int, bm: int) -> torch.Tensor:
    """The tile table of slots sorted by expert: (3, T) int32 rows (expert, first slot, end slot) of tile t, or
    expert -1 for the tiles past the last. T = ceil(S / bm) + min(E, S) bounds the tile count without reading it
    back: each expert's slots are cut into ceil(count / bm) tiles. Torch ops on the ids' device, no host sync."""
    dev = ids_sorted.device
    s = ids_sorted.numel()
    ids = ids_sorted.to(torch.int64)
    experts = torch.arange(n_experts, device=dev)
    start = torch.searchsorted(ids, experts)
    end = torch.searchsorted(ids, experts, right=True)
    n_tiles = (end - start + bm - 1) // bm
    last = n_tiles.cumsum(0)  # one past each expert's last tile
    t = torch.arange(triton.cdiv(s, bm) + min(n_experts, s), device=dev)
    e = torch.searchsorted(last, t, right=True).clamp_(max=n_experts - 1)
    first = start[e] + (t - (last[e] - n_tiles[e])) * bm
    valid = t < last[-1]
    return torch.stack([torch.where(valid, e, -1), first, torch.minimum(first + bm, end[e])]).to(torch.int32)


def _chunk(t: GemvType, k: int) -> tuple[int, int, int]:
    """(blocks per K step, x elements per step, stored units per step: elements of dense rows, bytes of packed
    ones): the largest power of two of blocks dividing the row's block count (and a tile-major type's step) with
    at most CHUNK_ELEMS elements (at least one block)."""
    n_blocks = k // t.block_elems
    nb = max(1, CHUNK_ELEMS // t.block_elems)
    while n_blocks % nb or (t.tile is not None and t.tile[1] % (nb * t.block_bytes)):
        nb //= 2
    return nb, nb * t.block_elems, nb if t.dense_dtype is not None else nb * t.block_bytes


@triton.jit
def _dot_chunk(acc, xg, rp, tab_ptr, LOAD: tl.constexpr, UNPACK: tl.constexpr, NB: tl.constexpr,
               BN: tl.constexpr, CX: tl.constexpr, DT: tl.constexpr, F32: tl.constexpr):
    """acc + xg . W^T for one K step: W the [BN, CX] chunk decoded at row pointers rp (rounded to DT, the
    reference's dense weights), xg [BM, CX] x at the decoder's offsets (`_x_offsets`). F32: the product in
    IEEE fp32 (W rounded to DT first, then held in fp32)."""
    w, xo = UNPACK(LOAD(rp, tab_ptr, BN, NB), tab_ptr, BN, NB)
    w = tl.reshape(w, [BN, CX])
    if F32:  # rounded on the bits (`gemv_blocks.cast`: the interpreter truncates a cast to bfloat16)
        return tl.dot(xg, tl.trans(gb.cast(w, DT).to(tl.float32)), acc, input_precision="ieee")
    return tl.dot(xg, tl.trans(w.to(DT)), acc)  # the GPU's cast rounds to nearest even, as `gemv_blocks.cast`


@triton.jit
def _x_offsets(rp, tab_ptr, LOAD: tl.constexpr, UNPACK: tl.constexpr, NB: tl.constexpr, BN: tl.constexpr,
               CX: tl.constexpr):
    """The x offsets of a chunk's decoded elements in the flattened order `_dot_chunk` multiplies (the same for
    every chunk: decoders return them relative to the chunk's start)."""
    w, xo = UNPACK(LOAD(rp, tab_ptr, BN, NB), tab_ptr, BN, NB)
    return tl.reshape(xo, [CX])


@triton.jit
def _experts_gemm_kernel(x_ptr, w_ptr, u_ptr, tab_ptr, tiles_ptr, x_rows_ptr, out_rows_ptr, out_ptr,
                         N, n_chunks, n_tiles, x_stride, w_row_stride, w_expert_stride, out_stride,
                         LOAD: tl.constexpr, UNPACK: tl.constexpr, CHUNK_W: tl.constexpr, CX: tl.constexpr,
                         NB: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, GLU: tl.constexpr,
                         X_ROWS: tl.constexpr, OUT_ROWS: tl.constexpr, ACT: tl.constexpr, F32_DOT: tl.constexpr,
                         GDC: tl.constexpr = False, TILE: tl.constexpr = 0, STEP: tl.constexpr = 0):
    """Program (t, i): rows i*BN.. of tile t's expert times the tile's slots m in [first, end) (`expert_tiles`).
    x row of slot m: x_rows[m] (X_ROWS) or m; output row: out_rows[m] (OUT_ROWS) or m. GLU: u_ptr is the up
    stack (same strides) and out = act(g) * u rounded as `gemv._glu_kernel`; else out = the fp32 product.
    F32_DOT: the products in IEEE fp32 (fp32 x; and off CUDA, where Triton's interpreter multiplies 16-bit
    floats as their integer bits): the same products as a 16-bit dot with fp32 accumulation, whose operands
    fp32 holds exactly. TILE, STEP: tile-major stacks (`gemv_blocks.row_offsets`, `chunk_at`)."""
    pdl.started(GDC)
    pdl.wait(GDC)
    t = tl.program_id(0)
    e = tl.load(tiles_ptr + t)
    if e < 0:
        return
    first = tl.load(tiles_ptr + n_tiles + t)
    end = tl.load(tiles_ptr + 2 * n_tiles + t)
    m = first + tl.arange(0, BM)
    mm = m < end
    if X_ROWS:
        xr = tl.load(x_rows_ptr + m, mask=mm, other=0).to(tl.int64)
    else:
        xr = m.to(tl.int64)
    rows = tl.program_id(1) * BN + tl.arange(0, BN)
    rows_c = tl.minimum(rows, N - 1).to(tl.int64)
    rp = w_ptr + e.to(tl.int64) * w_expert_stride + gb.row_offsets(rows_c, w_row_stride, TILE, STEP)
    up = u_ptr + e.to(tl.int64) * w_expert_stride + gb.row_offsets(rows_c, w_row_stride, TILE, STEP)
    dt: tl.constexpr = x_ptr.dtype.element_ty
    xo = _x_offsets(rp, tab_ptr, LOAD, UNPACK, NB, BN, CX)
    xp = x_ptr + xr[:, None] * x_stride + xo[None, :]
    acc = tl.zeros([BM, BN], tl.float32)
    acc_u = tl.zeros([BM, BN], tl.float32)
    for c in range(n_chunks):
        xg = tl.load(xp + c * CX, mask=mm[:, None], other=0.0)
        if F32_DOT:
            xg = xg.to(tl.float32)
        acc = _dot_chunk(acc, xg, gb.chunk_at(rp, c * CHUNK_W, TILE, STEP), tab_ptr, LOAD, UNPACK, NB, BN, CX, dt,
                         F32_DOT)
        if GLU:
            acc_u = _dot_chunk(acc_u, xg, gb.chunk_at(up, c * CHUNK_W, TILE, STEP), tab_ptr, LOAD, UNPACK, NB, BN, CX,
                               dt, F32_DOT)
    if GLU:
        acc = gb.rounded(_act(gb.rounded(acc, dt), ACT), dt) * gb.rounded(acc_u, dt)
    if OUT_ROWS:
        orow = tl.load(out_rows_ptr + m, mask=mm, other=0).to(tl.int64)
    else:
        orow = m.to(tl.int64)
    od: tl.constexpr = out_ptr.dtype.element_ty
    tl.store(out_ptr + orow[:, None] * out_stride + rows[None, :], gb.cast(acc, od),
             mask=mm[:, None] & (rows < N)[None, :])


def _launch(t: GemvType, x: torch.Tensor, w: torch.Tensor, u: torch.Tensor | None, tiles: torch.Tensor,
            x_rows: torch.Tensor | None, out_rows: torch.Tensor | None, out: torch.Tensor, k: int, bm: int,
            act: str = "silu") -> None:
    nb, cx, chunk_w = _chunk(t, k)
    load, unpack = decoder(t)
    n = w.shape[1]
    n_tiles = tiles.shape[1]
    _experts_gemm_kernel[(n_tiles, triton.cdiv(n, BLOCK_N))](
        x, w, w if u is None else u, _table(t, w), tiles, out if x_rows is None else x_rows,
        out if out_rows is None else out_rows, out, n, k // cx, n_tiles, x.stride(0), w.stride(1), w.stride(0),
        out.stride(0), LOAD=load, UNPACK=unpack, CHUNK_W=chunk_w, CX=cx, NB=nb,
        BM=bm, BN=BLOCK_N, GLU=u is not None, X_ROWS=x_rows is not None, OUT_ROWS=out_rows is not None, ACT=act,
        F32_DOT=x.dtype == torch.float32 or x.device.type != "cuda", **tile_args(t, k, chunk_w, n),
        num_warps=NUM_WARPS, **pdl.launch(w.device))


def _check_tiles(tiles: torch.Tensor, w: torch.Tensor) -> None:
    if tiles.dim() != 2 or tiles.shape[0] != 3 or tiles.dtype != torch.int32 or tiles.device != w.device:
        raise ValueError(f"tiles: expected int32 (3, T) on {w.device} from expert_tiles, got {tiles.dtype} "
                         f"{tuple(tiles.shape)} on {tiles.device}")


def experts_gemm_glu(x: torch.Tensor, gate_data: torch.Tensor, up_data: torch.Tensor, tiles: torch.Tensor,
                     x_rows: torch.Tensor, type_id: int | str, K: int, bm: int, out_dtype: torch.dtype,
                     act: str = "silu") -> torch.Tensor:
    """out[m] = act(G[e] x[x_rows[m]]) * (U[e] x[x_rows[m]]) for every slot m of every tile (expert e) of
    `tiles` (`expert_tiles(ids_sorted, E, bm)`): the gate/up half of the routed experts in sorted slot order.

    gate_data, up_data: (E, I, row_bytes) stacks (typed (E, I, K) for dense types). x: (tokens, K) in the model
    dtype. x_rows: (S,) int32/int64, the x row of each sorted slot. out: (S, I) of out_dtype."""
    t = gemv_type(type_id)
    _check_act(act)
    g, u = _glu_weights(t, gate_data, up_data, K, 3)
    _check_x(x, K, g)
    _check_tiles(tiles, g)
    out = _out(None, (x_rows.shape[0], g.shape[1]), g.device, out_dtype)
    if out.shape[0]:
        _launch(t, x, g, u, tiles, x_rows, None, out, K, bm, act)
    return out


def experts_gemm(x: torch.Tensor, w_data: torch.Tensor, tiles: torch.Tensor, out_rows: torch.Tensor,
                 type_id: int | str, K: int, bm: int) -> torch.Tensor:
    """out[out_rows[m]] = W[e] x[m] (fp32) for every slot m of every tile (expert e) of `tiles`: the routed
    experts' down projections, x in sorted slot order (`experts_gemm_glu`'s output), each product stored at its
    slot's original row. w_data: (E, N, row_bytes) (typed for dense types); out_rows: (S,) int32/int64."""
    t = gemv_type(type_id)
    w = _weights(t, w_data, K, 3)
    _check_x(x, K, w)
    _check_tiles(tiles, w)
    out = _out(None, (x.shape[0], w.shape[1]), w.device, torch.float32)
    if out.shape[0]:
        _launch(t, x, w, None, tiles, None, out_rows, out, K, bm)
    return out
