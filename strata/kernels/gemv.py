"""Matrix-vector products straight from stored (ggml block-quantized or dense) weights, in Triton.

Decode at batch 1 is memory-bound: every weight byte is read once per token, so the GEMV reads the packed blocks
as they are stored, decodes them in registers and never writes a dequantized copy. Each block type has one
decoder (`gemv_blocks.py`); one loop (`_tile`) runs any of them over a tile of rows, looping over K in chunks,
with fp32 accumulation. Two kernels wrap it (the plain one, and the GLU one for gate/up pairs):

    gemv(x (T, K), w_data (N, row_bytes) uint8, type_id, K)                -> (T, N)
    gemv_experts(x (k|1, K), w_data (E, N, row_bytes), expert_ids (k,), type_id, K) -> (k, N)
    gemv_experts_sum(x (k|1, K), w_data (E, N, rb), expert_ids (k,), slot_weights (k,), type_id, K) -> (1, N)
    gemv_glu(x (T, K), gate_data (I, rb), up_data (I, rb), type_id, K)      -> (T, I)  silu(x G^T) * (x U^T)
    gemv_experts_glu(x (k|1, K), gate_data (E, I, rb), up_data (E, I, rb), expert_ids (k,), type_id, K) -> (k, I)

The GLU ones exist to cut launches at decode: gate, up and SiLU of an MLP (or of all k routed experts) in one.
A kernel that also summed the k routed experts' down projections inside each program (looping over the slots)
measured 8x slower on an H200 than one launch over all slots plus `strata.kernels.moe.slot_sum`: each program
then runs k dependent K loops.
Outputs are float32, bfloat16 or float16 (`out=` or `out_dtype=`), rounded once from fp32 at the store.

`gemv_experts*` run the k routed experts of a MoE layer in one launch: the expert ids are read on the device, so
the router's output never travels to the host. No function synchronizes with the host or allocates anything but
its output (pass `out=` to avoid even that), so all can be captured in a CUDA graph, once compiled and once
`prepare(device)` has placed the i-quant tables: run each shape once before capturing.

Dense weights (F32, F16, BF16) go through the same kernel with one "block" per element; their `w_data` may be the
typed tensor itself or its uint8 view.

Speed (tools/gemv_lab.py, H200, one token, fraction of the device copy rate; docs/performance.md): the GEMV is
bound by load traffic through L1 (x gathers, scale loads, layout conversions), not by DRAM. Q8_0 0.36-0.42,
Q8_0_R8 0.55 (16432 x 2560), Q4_K 0.23 (10240 x 2560), Q5_1/Q6_K 0.2-0.3; launches of a few MB are latency-bound
(routed-expert GLU 0.20). The per-type rows/warps defaults below are the fastest of the lab's sweeps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from strata.errors import StrataError
from strata.kernels import gemv_blocks as gb
from strata.kernels import gemv_rr, pdl
from strata.kernels.gemv_tables import device_table
from strata.weights import repack

MAX_TOKENS = 8
"""Tokens per launch: each has its own accumulator tile (unrolled in the kernel), so more tokens go in groups of 8."""

SMALL_LAUNCH_ROWS = 4096
"""Rows (matrix rows x slots) up to which a one-token launch uses its type's `small` shape."""

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
    small: (rows, warps) for one token when a launch covers at most SMALL_LAUNCH_ROWS rows in all: there too few
        programs stream too few bytes each, so fewer rows per program (more programs) win.
    small_form: another decoder of the same bytes used for those small launches, where it measured faster.
    small_split: (plain, GLU) K splits for those small launches (split-K: more programs with shorter loops).
    small_by_id: whether `small` and `small_split` apply to launches by expert id too.
    slots_block_n: rows per program of one-token expert launches (several matrices chosen by id), if not block_n.
    load, unpack: `decode` split in its loads and its arithmetic (decode = unpack(load(...))), for the GEMV's
        software-pipelined K loop (`_tile`); None: the loop calls `decode` whole.
    tile: (rows, step bytes) of a tile-major type (`repack.TILE_LAYOUTS`): every kernel addresses its rows and
        chunks through `gemv_blocks.row_offsets` and `chunk_at`; a chunk never spans two steps.
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
    small: tuple[int, int] | None = None
    dense_dtype: torch.dtype | None = None
    f16_fields: tuple[int, ...] = ()
    small_form: GemvType | None = None
    small_split: tuple[int, int] = (1, 1)
    small_by_id: bool = True
    slots_block_n: int | None = None
    load: Any = None
    unpack: Any = None
    tile: tuple[int, int] | None = None


_Q4_K_BYTES = GemvType("Q4_K", 12, 256, 144, gb.decode_q4_k, 5, 2, block_n=8, num_warps=8, small=(2, 4),
                       f16_fields=(0, 2))
"""Q4_K read byte by byte, two super-blocks per step: the faster form for small one-token launches (640 x 2560:
5.8 us against 10.5 for the word-wise decoder, tools/gemv_lab.py on an H200)."""

def _tile_layout(type_id: int) -> tuple[int, int]:
    """(rows, step bytes) of a tile-major type, as `repack.TILE_LAYOUTS` defines it."""
    layout = repack.TILE_LAYOUTS[type_id]
    return layout.tile, layout.step


_TYPE_LIST: tuple[GemvType, ...] = (
    # name, ggml id, block elems, block bytes, decoder, tile rank, max blocks per chunk, then rows/warps per program
    # where not 16/4 (the fastest of a sweep at K=2560, N=8192, one token, on an H200; Q8_0 and Q4_K re-swept at
    # N x K = 10240x2560, 2560x6144 and 640x2560 by tools/gemv_lab.py: more blocks per loop step, fewer rows)
    # small_split / slots_block_n: bench/results/2026-12-02-h200-gemv-lab-7a3ad10.json (F32 router 513x2560 split
    # 5: 5.5 -> 3.6 us; Q8_0 shared-expert GLU 640x2560 split 5: 7.6 -> 5.3 us; Q5_1 expert down, 10 slots of
    # 2560x640, 16 rows per program: 12.1 -> 10.4 us)
    GemvType("F32", 0, 1, 4, gb.decode_dense, 2, 256, small=(2, 4), dense_dtype=torch.float32, small_split=(5, 1)),
    # F16 / BF16: the F32 router's small launches (the router group of a 16-bit model is stored in its dtype,
    # `placement.in_model_dtype`); without them (16 rows per program, no split) the BF16 router took 6.0 us of a
    # layer's path against 4.5 for F32 (bench/results/2026-12-04-h200-step-variants-release-router.json). Not
    # measured for expert stacks stored in them (an HF checkpoint's): those launches keep the plain shape.
    GemvType("F16", 1, 1, 2, gb.decode_dense, 2, 512, small=(2, 4), dense_dtype=torch.float16, small_split=(5, 1),
             small_by_id=False),
    GemvType("BF16", 30, 1, 2, gb.decode_dense, 2, 512, small=(2, 4), dense_dtype=torch.bfloat16,
             small_split=(5, 1), small_by_id=False),
    GemvType("Q4_0", 2, 32, 18, gb.decode_q4_0, 4, 8, block_n=8, f16_fields=(0,)),
    GemvType("Q4_1", 3, 32, 20, gb.decode_q4_1, 6, 8, num_warps=8, f16_fields=(0, 2)),
    GemvType("Q5_0", 6, 32, 22, gb.decode_q5_0, 5, 8, f16_fields=(0,)),
    GemvType("Q5_1", 7, 32, 24, gb.decode_q5_1, 6, 8, block_n=8, f16_fields=(0, 2), slots_block_n=16),
    GemvType("Q8_0", 8, 32, 34, gb.decode_q8_0, 3, 32, block_n=4, f16_fields=(0,), small_split=(1, 5)),
    GemvType("IQ4_NL", 20, 32, 18, gb.decode_iq4_nl, 4, 8, table="IQ4", f16_fields=(0,)),
    GemvType("Q2_0", 42, 64, 18, gb.decode_q2_0, 6, 4, f16_fields=(0,)),
    GemvType("Q2_K", 10, 256, 84, gb.decode_q2_k, 5, 1, f16_fields=(80, 82)),
    GemvType("Q3_K", 11, 256, 110, gb.decode_q3_k, 5, 1, num_warps=8, f16_fields=(108,)),
    GemvType("Q4_K", 12, 256, 144, gb.decode_q4_k_hw, 6, 1, small=(2, 4), f16_fields=(0, 2),
             small_form=_Q4_K_BYTES, load=gb.load_q4_k_hw, unpack=gb.unpack_q4_k_hw),
    GemvType("Q5_K", 13, 256, 176, gb.decode_q5_k, 6, 1, block_n=8, f16_fields=(0, 2)),
    GemvType("Q6_K", 14, 256, 210, gb.decode_q6_k, 5, 1, block_n=8, f16_fields=(208,)),
    GemvType("IQ2_XXS", 16, 256, 66, gb.decode_iq2_xxs, 5, 1, table="IQ2_XXS", block_n=8, f16_fields=(0,)),
    GemvType("IQ2_XS", 17, 256, 74, gb.decode_iq2_xs, 5, 1, table="IQ2_XS", block_n=8, f16_fields=(0,)),
    GemvType("IQ3_XXS", 18, 256, 98, gb.decode_iq3_xxs, 5, 1, table="IQ3_XXS", block_n=8, f16_fields=(0,)),
    GemvType("IQ3_S", 21, 256, 110, gb.decode_iq3_s, 5, 1, table="IQ3_S", block_n=8, f16_fields=(0,)),
    GemvType("IQ2_S", 22, 256, 82, gb.decode_iq2_s, 5, 1, table="IQ2_S", block_n=8, f16_fields=(0,)),
    GemvType("IQ4_XS", 23, 256, 136, gb.decode_iq4_xs, 4, 1, table="IQ4", f16_fields=(0,)),
    GemvType("IQ1_S", 19, 256, 50, gb.decode_iq1_s, 5, 1, table="IQ1_S", block_n=8, f16_fields=(0,)),
    GemvType("IQ1_M", 29, 256, 56, gb.decode_iq1_m, 5, 1, table="IQ1_S", block_n=8),  # d: the scales' top nibbles
    GemvType("Q8_0_R8", 1008, 256, 272, gb.decode_q8_0_r8, 4, 4, block_n=4, f16_fields=tuple(range(0, 16, 2))),
    GemvType("Q6_K_P", 1014, 256, 224, gb.decode_q6_k_p, 6, 1, block_n=16, f16_fields=(208,), load=gb.load_q6_k_p,
             unpack=gb.unpack_q6_k_p),
    GemvType("Q8_0_R", 1009, 256, 272, gb.decode_q8_0_r, 4, 1, block_n=4, f16_fields=tuple(range(0, 16, 2))),
    GemvType("Q4_K_R", 1012, 256, 144, gb.decode_q4_k_r, 5, 1, block_n=8, num_warps=8, f16_fields=(0, 2)),
    GemvType("Q5_1_R", 1007, 128, 96, gb.decode_q5_1_r, 5, 2, block_n=8, f16_fields=(0, 2, 4, 6, 8, 10, 12, 14)),
    GemvType("Q6_K_R", 1114, 256, 224, gb.decode_q6_k_r, 4, 1, block_n=8, f16_fields=(208,)),
    GemvType("Q4_K_RT", repack.Q4_K_RT_ID, 256, 144, gb.decode_q4_k_r, 5, 1, block_n=8, num_warps=8,
             f16_fields=(0, 2), tile=_tile_layout(repack.Q4_K_RT_ID)),
    GemvType("Q6_K_RT", repack.Q6_K_RT_ID, 256, 224, gb.decode_q6_k_r, 4, 1, block_n=8, f16_fields=(208,),
             tile=_tile_layout(repack.Q6_K_RT_ID)),
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
def _tile(xp, xs, rp, o0, tab_ptr, n_chunks,
          LOAD: tl.constexpr, UNPACK: tl.constexpr, PIPE: tl.constexpr, RANK: tl.constexpr, CHUNK_W: tl.constexpr, CHUNK_X: tl.constexpr,
          NB: tl.constexpr, ROWS: tl.constexpr, T: tl.constexpr, T_PAD: tl.constexpr, GDC: tl.constexpr,
          TILE: tl.constexpr = 0, STEP: tl.constexpr = 0):
    """[ROWS, T_PAD] fp32: res[r, t] = (the row at pointer rp[r], from o0 units in) . (x token t at xp + t*xs),
    for t < T <= 8 (TILE, STEP: tile-major rows, `chunk_at`).

    Each chunk is decoded once into a weight tile and multiplied by each token's x into that token's accumulator,
    a tile of the same shape and layout (so no data moves between threads inside the loop); the tiles are summed
    over their K dimensions once, after the loop. The first chunk initialises the accumulators (their shape is the
    decoder's); the accumulators of tokens past T are compile-time placeholders that generate no code. The rows
    need not belong to one matrix (the GLU kernel decodes gate and up rows in one tile).

    PIPE (decoders split in two, `GemvType.load`): the loop is software-pipelined by hand: chunk c + 1's loads are
    issued before chunk c is decoded, so each program keeps two chunks' bytes in flight for the registers of one more raw chunk
    (the last step re-loads the last chunk, from L1). Otherwise LOAD is `load_pointer` and UNPACK the decoder.

    GDC: the first chunk's weights are loaded before `pdl.wait`, overlapping the end of the previous kernel
    (weights are never written by a kernel launched with PDL, so no wait is needed for them)."""
    raw = LOAD(gb.chunk_at(rp, o0, TILE, STEP), tab_ptr, ROWS, NB)
    pdl.wait(GDC)
    if PIPE:
        ahead = LOAD(gb.chunk_at(rp, o0 + tl.minimum(1, n_chunks - 1) * CHUNK_W, TILE, STEP), tab_ptr, ROWS, NB)
    else:
        ahead = raw
    w, xo = UNPACK(raw, tab_ptr, ROWS, NB)
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
        if PIPE:
            raw = ahead
            ahead = LOAD(gb.chunk_at(rp, o0 + tl.minimum(c + 1, n_chunks - 1) * CHUNK_W, TILE, STEP), tab_ptr, ROWS,
                         NB)
        else:
            raw = LOAD(gb.chunk_at(rp, o0 + c * CHUNK_W, TILE, STEP), tab_ptr, ROWS, NB)
        w, xo = UNPACK(raw, tab_ptr, ROWS, NB)
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
    res = tl.zeros([ROWS, T_PAD], dtype=tl.float32)
    res = _put(res, a0, 0, T, T_PAD, RANK)
    res = _put(res, a1, 1, T, T_PAD, RANK)
    res = _put(res, a2, 2, T, T_PAD, RANK)
    res = _put(res, a3, 3, T, T_PAD, RANK)
    res = _put(res, a4, 4, T, T_PAD, RANK)
    res = _put(res, a5, 5, T, T_PAD, RANK)
    res = _put(res, a6, 6, T, T_PAD, RANK)
    res = _put(res, a7, 7, T, T_PAD, RANK)
    return res


@triton.jit
def _split_sum(res, part, cnt, s, SPLIT: tl.constexpr, ROWS: tl.constexpr, T_PAD: tl.constexpr):
    """Split-K: the sum of the SPLIT programs' partial tiles `res` of one row tile, in program order (so it does
    not depend on which finishes last), and 1 if this program is the one to store it (the last to arrive), else 0.

    Each program stores its partial to its slot of `part` ([SPLIT, ROWS, T_PAD] fp32), then takes a ticket from
    the tile's counter `cnt`; the program that draws SPLIT - 1 reads all partials back from L2 and resets the
    counter to 0 for the next launch. No atomics touch the sums, so a replay equals the eager call bit for bit."""
    r = tl.arange(0, ROWS)[:, None] * T_PAD + tl.arange(0, T_PAD)[None, :]
    tl.store(part + s * (ROWS * T_PAD) + r, res)
    tl.debug_barrier()  # every thread's partial is written before the ticket is drawn
    last = tl.where(tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu") == SPLIT - 1, 1, 0)
    total = tl.zeros([ROWS, T_PAD], tl.float32)
    for j in tl.static_range(SPLIT):  # (masks are bounds, not boolean ands: the interpreter rejects the latter)
        total += tl.load(part + j * (ROWS * T_PAD) + r, mask=r < ROWS * T_PAD * last, other=0.0,
                         cache_modifier=".cg")
    tl.atomic_add(cnt, -SPLIT * last, sem="relaxed", scope="gpu")  # the last one puts the counter back to 0
    return total, last


@triton.jit
def _store(optr, v, rows, N, tok_stride, T: tl.constexpr, T_PAD: tl.constexpr):
    """out[t, rows] = v[:, t] (fp32 [BN, T_PAD]) for t < T and rows < N, cast once to out's element type."""
    v = gb.cast(v, optr.dtype.element_ty)
    tcol = tl.arange(0, T_PAD)
    tl.store(optr + tcol[None, :] * tok_stride + rows[:, None], v, mask=(rows[:, None] < N) & (tcol[None, :] < T))


@triton.jit
def _matrix(ids_ptr, slot, HAS_IDS: tl.constexpr):
    """The (int64) index of the matrix that `slot` multiplies: ids[slot] when HAS_IDS, else 0."""
    if HAS_IDS:
        return tl.load(ids_ptr + slot).to(tl.int64)
    else:
        return slot.to(tl.int64) * 0


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, ids_ptr, tab_ptr, out_ptr, part_ptr, cnt_ptr, sw_ptr,
    N, n_chunks,
    w_row_stride, w_slot_stride, x_tok_stride, x_slot_stride, out_tok_stride, out_slot_stride,
    LOAD: tl.constexpr, UNPACK: tl.constexpr, PIPE: tl.constexpr, RANK: tl.constexpr, CHUNK_W: tl.constexpr,
    CHUNK_X: tl.constexpr, NB: tl.constexpr, BN: tl.constexpr, T: tl.constexpr, T_PAD: tl.constexpr,
    HAS_IDS: tl.constexpr, SPLIT: tl.constexpr = 1, SLOT_SUM: tl.constexpr = 0, GDC: tl.constexpr = False,
    TILE: tl.constexpr = 0, STEP: tl.constexpr = 0,
):
    """out[slot, t, rows] = W[slot's matrix][rows] . x[slot, t] for BN rows, T <= 8 tokens.

    Program (i, slot): rows i*BN .. i*BN+BN-1 of the matrix of `slot` (expert ids[slot] when HAS_IDS, else the one
    matrix). Rows past N are clamped to N-1 (so no load needs a mask) and not stored. Strides are in elements of
    the respective pointer (bytes for packed rows). With GDC (PDL) the weights of the first chunk are in flight
    before the wait, unless the matrix depends on the expert ids (written by the routing kernel).

    SPLIT > 1 (split-K): program (i, slot, s) covers the s-th of SPLIT equal runs of n_chunks chunks, and the
    last of the SPLIT to finish sums and stores (`_split_sum`): more programs with shorter K loops, for launches
    whose loop is latency-bound.

    SLOT_SUM = k > 0 (one token, no K split): the k slots' products are weighted by sw[slot] and summed into one
    output row, out[0, rows] = sum over slots in order of round_fp32(sw[slot] * y[slot, rows]), by the same ticket
    scheme over the slots of a row tile: the routed experts' down projection and their weighted sum in one launch
    (`moe.slot_sum`'s sum, without its launch)."""
    if HAS_IDS:  # released after the wait: the ids are then settled for the next kernel (`gemv_experts_sum`)
        pdl.wait(GDC)
    pdl.started(GDC)
    pid = tl.program_id(0)
    slot = tl.program_id(1).to(tl.int64)
    s = tl.program_id(2)
    rows = pid * BN + tl.arange(0, BN)
    rows_c = tl.minimum(rows, N - 1).to(tl.int64)
    rp = w_ptr + _matrix(ids_ptr, slot, HAS_IDS) * w_slot_stride + gb.row_offsets(rows_c, w_row_stride, TILE, STEP)
    xp = x_ptr + slot * x_slot_stride + s * (n_chunks * CHUNK_X)
    res = _tile(xp, x_tok_stride, rp, s * (n_chunks * CHUNK_W), tab_ptr, n_chunks,
                LOAD, UNPACK, PIPE, RANK, CHUNK_W, CHUNK_X, NB, BN, T, T_PAD, GDC and not HAS_IDS, TILE, STEP)
    if SLOT_SUM > 0:
        res = res * tl.load(sw_ptr + slot).to(tl.float32)
        res, last = _split_sum(res, part_ptr + pid * (SLOT_SUM * BN * T_PAD), cnt_ptr + pid, slot, SLOT_SUM, BN,
                               T_PAD)
        _store(out_ptr, res, rows, N * last, out_tok_stride, T, T_PAD)
    elif SPLIT > 1:
        tile = slot * tl.num_programs(0) + pid
        res, last = _split_sum(res, part_ptr + tile * (SPLIT * BN * T_PAD), cnt_ptr + tile, s, SPLIT, BN, T_PAD)
        _store(out_ptr + slot * out_slot_stride, res, rows, N * last, out_tok_stride, T, T_PAD)  # last stores
    else:
        _store(out_ptr + slot * out_slot_stride, res, rows, N, out_tok_stride, T, T_PAD)


@triton.jit
def _act(g, ACT: tl.constexpr):
    """The GLU's activation of the gate, in fp32."""
    tl.static_assert(ACT == "silu", "GLU activations: silu")
    return g / (1.0 + tl.exp(-g))  # torch's formula for silu


@triton.jit
def _glu_kernel(
    x_ptr, g_ptr, u_ptr, ids_ptr, tab_ptr, out_ptr, part_ptr, cnt_ptr,
    N, n_chunks,
    g_row_stride, u_row_stride, g_slot_stride, u_slot_stride, x_tok_stride, x_slot_stride,
    out_tok_stride, out_slot_stride,
    LOAD: tl.constexpr, UNPACK: tl.constexpr, PIPE: tl.constexpr, RANK: tl.constexpr, CHUNK_W: tl.constexpr,
    CHUNK_X: tl.constexpr, NB: tl.constexpr, BN: tl.constexpr, T: tl.constexpr, T_PAD: tl.constexpr,
    HAS_IDS: tl.constexpr, ACT: tl.constexpr, ALIGN: tl.constexpr, SPLIT: tl.constexpr = 1,
    GDC: tl.constexpr = False, TILE: tl.constexpr = 0, STEP: tl.constexpr = 0,
):
    """out[slot, t, rows] = act(G[rows] . x) * (U[rows] . x), G and U the gate and up matrices of `slot`.

    One tile of 2*BN rows: the first BN point into G, the last BN at the same rows of U, so one decode loop
    serves both and x is loaded once. The product is rounded as the model computes it in out's dtype: g and u
    rounded to it, act(g) computed in fp32 and rounded, the product (exact in fp32 for 16-bit inputs) rounded
    once more at the store; with an fp32 output every rounding is a no-op. GDC, SPLIT: as `_gemv_kernel` (the
    activation is applied to the summed splits)."""
    if HAS_IDS:  # released after the wait: the ids are then settled for the next kernel (`gemv_experts_sum`)
        pdl.wait(GDC)
    pdl.started(GDC)
    pid = tl.program_id(0)
    slot = tl.program_id(1).to(tl.int64)
    s = tl.program_id(2)
    r = tl.arange(0, 2 * BN)
    rows_c = tl.minimum(pid * BN + r % BN, N - 1).to(tl.int64)
    mat = _matrix(ids_ptr, slot, HAS_IDS)
    rp = tl.where(r < BN, g_ptr + mat * g_slot_stride + gb.row_offsets(rows_c, g_row_stride, TILE, STEP),
                  u_ptr + mat * u_slot_stride + gb.row_offsets(rows_c, u_row_stride, TILE, STEP))
    if ALIGN > 1:  # both matrices' rows (and a tile-major type's steps) start ALIGN-aligned: keep vector loads
        rp = tl.multiple_of(rp, ALIGN)
    xp = x_ptr + slot * x_slot_stride + s * (n_chunks * CHUNK_X)
    res = _tile(xp, x_tok_stride, rp, s * (n_chunks * CHUNK_W), tab_ptr, n_chunks,
                LOAD, UNPACK, PIPE, RANK, CHUNK_W, CHUNK_X, NB, 2 * BN, T, T_PAD, GDC and not HAS_IDS, TILE, STEP)
    last = 1
    if SPLIT > 1:
        tile = slot * tl.num_programs(0) + pid
        res, last = _split_sum(res, part_ptr + tile * (SPLIT * 2 * BN * T_PAD), cnt_ptr + tile, s, SPLIT, 2 * BN,
                               T_PAD)
    g, u = tl.split(tl.permute(tl.reshape(res, [2, BN, T_PAD]), (1, 2, 0)))
    dt: tl.constexpr = out_ptr.dtype.element_ty
    y = gb.rounded(_act(gb.rounded(g, dt), ACT), dt) * gb.rounded(u, dt)
    _store(out_ptr + slot * out_slot_stride, y, pid * BN + tl.arange(0, BN), N * last, out_tok_stride, T, T_PAD)


@triton.jit
def _trailing(v, RANK: tl.constexpr):
    """[BN] v as [BN, 1, ...] of rank RANK, to broadcast against a decoded tile."""
    if RANK == 2:
        return v[:, None]
    elif RANK == 3:
        return v[:, None, None]
    elif RANK == 4:
        return v[:, None, None, None]
    elif RANK == 5:
        return v[:, None, None, None, None]
    else:
        return v[:, None, None, None, None, None]


@triton.jit
def _dequant_kernel(w_ptr, tab_ptr, out_ptr, R, w_row_stride, out_row_stride,
                    DECODE: tl.constexpr, RANK: tl.constexpr, CHUNK_W: tl.constexpr, CHUNK_X: tl.constexpr,
                    NB: tl.constexpr, BN: tl.constexpr, GDC: tl.constexpr = False, TILE: tl.constexpr = 0,
                    STEP: tl.constexpr = 0):
    """out[rows, chunk c] = the decoded chunk c of BN stored rows (program (i, c)), rounded once to out's dtype.
    The same decoders as the GEMV, so a row decodes to the values the GEMV multiplies."""
    pdl.started(GDC)
    pdl.wait(GDC)
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    c = tl.program_id(1)
    rows_c = tl.minimum(rows, R - 1).to(tl.int64)
    rp = w_ptr + gb.row_offsets(rows_c, w_row_stride, TILE, STEP)
    w, xo = DECODE(gb.chunk_at(rp, c * CHUNK_W, TILE, STEP), tab_ptr, BN, NB)
    v = gb.cast(w, out_ptr.dtype.element_ty)
    off = _trailing(rows_c * out_row_stride, RANK) + c * CHUNK_X + xo[None]
    tl.store(out_ptr + off, v, mask=_trailing(rows < R, RANK))


def dequantize_rows(w_data: torch.Tensor, type_id: int | str, K: int, out_dtype: torch.dtype = torch.float32,
                    out: torch.Tensor | None = None, block_n: int = 2) -> torch.Tensor:
    """Rows (R, row_bytes) of a stored type decoded to (R, K) of `out_dtype` (fp32 values rounded once), in one
    launch with the GEMV's decoders: the device half of a table lookup whose rows the host gathered as stored
    (the PLE rows of a decode step). Dense rows are converted."""
    t = gemv_type(type_id)
    w = _weights(t, w_data, K, 2)
    n = w.shape[0]
    out = _out(out, (n, K), w.device, out_dtype)
    if n == 0:
        return out
    n_chunks, dec = _decode_args(t, K)
    tile_args(t, K, dec["CHUNK_W"], n)
    dec = {k: v for k, v in dec.items() if k in ("CHUNK_W", "CHUNK_X", "NB", "TILE", "STEP")}
    _dequant_kernel[(triton.cdiv(n, block_n), n_chunks)](
        w, _table(t, w), out, n, w.stride(0), out.stride(0), DECODE=t.decode, RANK=t.rank, BN=block_n, **dec,
        **pdl.launch(w.device))
    return out


def _chunk_blocks(t: GemvType, k: int) -> int:
    """Blocks per loop step: the largest power of two <= max_chunk_blocks dividing the row's block count (and a
    tile-major type's step)."""
    n_blocks = k // t.block_elems
    nb = t.max_chunk_blocks
    while n_blocks % nb or (t.tile is not None and t.tile[1] % (nb * t.block_bytes)):
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


OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""Output dtypes: the kernels accumulate in fp32 and round once, at the store (to nearest even)."""


def _out(out: torch.Tensor | None, shape: tuple[int, int], device: torch.device,
         out_dtype: torch.dtype) -> torch.Tensor:
    if out is None:
        if out_dtype not in OUT_DTYPES:
            raise ValueError(f"out_dtype: {out_dtype} is not float32/bfloat16/float16")
        return torch.empty(shape, dtype=out_dtype, device=device)
    if tuple(out.shape) != shape or out.dtype not in OUT_DTYPES or out.device != device or out.stride(1) != 1:
        raise ValueError(f"out: expected contiguous-row float32/bfloat16/float16 {shape} on {device}, got "
                         f"{out.dtype} {tuple(out.shape)} on {out.device}")
    return out


def _check_ids(ids: torch.Tensor, w: torch.Tensor, dims: tuple[int, ...] = (1,)) -> None:
    if ids.dim() not in dims or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"expert_ids: expected a {'/'.join(map(str, dims))}-D int32/int64 tensor, got "
                         f"{ids.dtype} {tuple(ids.shape)}")
    if ids.device != w.device:
        raise ValueError(f"expert_ids on {ids.device}, weights on {w.device}")
    if not ids.is_contiguous():
        raise ValueError("expert_ids: must be contiguous")


def _slots(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> tuple[int, int]:
    """(slots, x's stride between slots) for the expert launches: x has one row per slot, or one row for all."""
    _check_ids(ids, w)
    k_sel = ids.shape[0]
    if x.shape[0] not in (1, k_sel):
        raise ValueError(f"x: {x.shape[0]} rows for {k_sel} experts (expected 1 or {k_sel})")
    return k_sel, 0 if x.shape[0] == 1 else x.stride(0)


def _check_slot_weights(sw: torch.Tensor, k_sel: int, w: torch.Tensor) -> None:
    if tuple(sw.shape) != (k_sel,) or sw.device != w.device or not sw.is_contiguous():
        raise ValueError(f"slot_weights: expected contiguous ({k_sel},) on {w.device}, got {tuple(sw.shape)} on "
                         f"{sw.device}")


def _glu_weights(t: GemvType, gate_data: torch.Tensor, up_data: torch.Tensor, k: int,
                 dims: int) -> tuple[torch.Tensor, torch.Tensor]:
    g, u = _weights(t, gate_data, k, dims), _weights(t, up_data, k, dims)
    if g.shape[:-1] != u.shape[:-1] or g.device != u.device:
        raise ValueError(f"gate {tuple(g.shape)} on {g.device} and up {tuple(u.shape)} on {u.device}: expected "
                         "the same shape and device")
    return g, u


def _check_act(act: str) -> None:
    if act != "silu":
        raise ValueError(f"act: {act!r} is not supported (silu)")


def _decode_args(t: GemvType, k: int) -> tuple[int, dict[str, Any]]:
    """The chunk count of a row of k elements and the decoder's compile-time arguments (with the tile-major
    layout's TILE and STEP, `tile_args`)."""
    nb = _chunk_blocks(t, k)
    chunk_w = nb if t.dense_dtype is not None else nb * t.block_bytes  # elements of dense rows, bytes of packed
    return k // (nb * t.block_elems), {
        "LOAD": t.load or gb.load_pointer, "PIPE": t.load is not None, "UNPACK": t.unpack or t.decode, "RANK": t.rank,
        "CHUNK_W": chunk_w, "CHUNK_X": nb * t.block_elems, "NB": nb, **tile_args(t, k, chunk_w)}


def tile_args(t: GemvType, k: int, chunk_w: int, rows: int | None = None) -> dict[str, int]:
    """TILE, STEP of a kernel reading rows of k weights of type t in chunks of chunk_w bytes (0, 0: row-major).
    Raises where a tile-major type's chunks would span two steps, or where its rows (`rows`, when given) or its
    row bytes are not whole tiles and steps: read so, the kernel would multiply wrong weights."""
    if t.tile is None:
        return {"TILE": 0, "STEP": 0}
    tile, step = t.tile
    width = k // t.block_elems * t.block_bytes
    if step % chunk_w or width % step or (rows is not None and rows % tile):
        raise ValueError(f"{t.name}: tile-major rows ({tile} rows, {step}-byte steps) read in chunks of {chunk_w} "
                         f"bytes, rows of {width} bytes{f', {rows} rows' if rows is not None else ''}: not whole "
                         "steps and tiles")
    return {"TILE": tile, "STEP": step}


def _small(t: GemvType, n_tok: int, total_rows: int, by_id: bool = False) -> bool:
    return (n_tok == 1 and t.small is not None and total_rows <= SMALL_LAUNCH_ROWS
            and (t.small_by_id or not by_id))


def _rows(t: GemvType, n_tok: int, block_n: int | None, total_rows: int = 1 << 30, slots: bool = False) -> int:
    """Rows per program for n_tok tokens in a launch over total_rows rows (see MULTI_TOKEN_ROWS, `small`,
    `slots_block_n`)."""
    t_pad = triton.next_power_of_2(n_tok)
    if block_n is not None:
        return max(2, block_n // t_pad)
    if _small(t, n_tok, total_rows, slots):
        return t.small[0]
    if n_tok == 1 and slots and t.slots_block_n:
        return t.slots_block_n
    return t.block_n if n_tok == 1 else max(MULTI_TOKEN_ROWS, t.block_n // t_pad)


def _warps(t: GemvType, n_tok: int, num_warps: int | None, total_rows: int = 1 << 30, by_id: bool = False) -> int:
    if num_warps:
        return num_warps
    if _small(t, n_tok, total_rows, by_id):
        return t.small[1]
    return t.num_warps if n_tok == 1 else MULTI_TOKEN_WARPS


def _table(t: GemvType, w: torch.Tensor) -> torch.Tensor:
    return device_table(t.table, w.device) if t.table is not None else w


def _row_align(g: torch.Tensor, u: torch.Tensor, *strides: int) -> int:
    """16 when every gate and up row of packed (uint8) weights starts 16-byte aligned, else 1. The GLU kernel picks
    each row from one of two matrices, which hides the alignment the compiler sees in either; told, it loads the
    decoders' int32 words as 16-byte vectors."""
    if g.dtype != torch.uint8 or u.dtype != torch.uint8:
        return 1
    return 16 if all(v % 16 == 0 for v in (g.data_ptr(), u.data_ptr(), *strides)) else 1


SPLIT_COUNTERS = 1 << 16
"""Row tiles a split-K launch may have (one int32 ticket counter each)."""

COUNTER_REGIONS = 8
"""Streams that may run split-K launches on one device: each gets its own region of the ticket counters,
because launches on different streams (`Ops.branches`) run at the same time."""

_counters: dict[torch.device, torch.Tensor] = {}
_regions: dict[tuple[torch.device, int], int] = {}


def tickets(device: torch.device) -> torch.Tensor | None:
    """The split-K ticket counters of the current stream on `device` (None when every region is taken): zeros,
    and back to zero after every launch (the last program of each tile resets its counter). Kernels of one
    stream share them (`strata.kernels.hyper` too): each takes its tickets only after its `pdl.wait`, when the
    kernel before it has finished. One buffer per device,
    made on first use (a decode step's warm-up, before any capture) and kept, so every captured graph uses it.
    Streams keep their region for the life of the process: kernels run on the caller's stream and on the
    fixed side streams of `strata.runtime.streams`, never on one made per step."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    if device not in _counters:
        _counters[device] = torch.zeros(COUNTER_REGIONS, SPLIT_COUNTERS, dtype=torch.int32, device=device)
    key = (device, stream)
    if key not in _regions:
        taken = sum(d == device for d, _ in _regions)
        if taken >= COUNTER_REGIONS:
            if torch.cuda.is_current_stream_capturing():
                # the fallback launches differ from the warm-up's, so they would compile inside the capture
                raise StrataError(f"no split-K ticket region left for the capturing stream: {COUNTER_REGIONS} "
                                  "streams already hold one; run kernels on the fixed side streams of "
                                  "strata.runtime.streams.side_stream")
            return None
        _regions[key] = taken
    return _counters[device][_regions[key]]


def _split(split_k: int | None, n_chunks: int, tiles: int) -> int:
    """The K split of a launch: `split_k` (1 when None), lowered until it divides the chunk count; 1 when the
    tiles would not fit the counters."""
    sk = max(1, split_k or 1)
    while n_chunks % sk:
        sk -= 1
    return sk if tiles <= SPLIT_COUNTERS else 1


def _launch(t: GemvType, x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor | None, out: torch.Tensor,
            n: int, k: int, slots: int, n_tok: int, w_slot_stride: int, x_slot_stride: int,
            out_slot_stride: int, block_n: int | None, num_warps: int | None,
            up: torch.Tensor | None = None, up_slot_stride: int = 0, act: str = "silu",
            split_k: int | None = None, slot_weights: torch.Tensor | None = None, ids_settled: bool = False) -> None:
    """One launch of the plain kernel, or of the GLU kernel when `up` is given (w is then the gate). With
    `slot_weights` (plain kernel, one token; the caller checked that tickets are left) the slots are summed into
    out's one row. `ids_settled`: see `gemv_experts_sum` (used by the row-register kernel)."""
    if n == 0 or slots == 0 or n_tok == 0:
        return
    if (block_n is None and num_warps is None
            and gemv_rr.covers(t.name, n_tok, w, up, (w_slot_stride, up_slot_stride))
            and _launch_rr(t, x, w, ids, out, n, k, slots, w_slot_stride, x_slot_stride, out_slot_stride, up,
                           up_slot_stride, split_k, slot_weights, ids_settled=ids_settled)):
        return
    if t.small_form is not None and _small(t, n_tok, n * slots, ids is not None):
        t = t.small_form
    n_chunks, dec = _decode_args(t, k)
    tile_args(t, k, dec["CHUNK_W"], n)
    bn = _rows(t, n_tok, block_n, n * slots, ids is not None)
    if up is not None:
        bn = max(2, bn // 2)  # rows of each matrix: the tile of gate and up rows is the plain kernel's
    t_pad = triton.next_power_of_2(n_tok)
    tiles = triton.cdiv(n, bn) * slots
    if split_k is None and _small(t, n_tok, n * slots, ids is not None):
        split_k = t.small_split[up is not None]
    summed = slot_weights is not None
    sk = 1 if summed else _split(split_k, n_chunks, tiles)
    cnt = tickets(w.device) if sk > 1 or summed else None
    if cnt is None:
        sk = 1
    consts = dict(dec, T=n_tok, T_PAD=t_pad, HAS_IDS=ids is not None, SPLIT=sk,
                  num_warps=_warps(t, n_tok, num_warps, n * slots, ids is not None), **pdl.launch(x.device))
    ids = ids if ids is not None else w
    if sk > 1 or summed:
        part = torch.empty(tiles * sk * (bn if up is None else 2 * bn) * t_pad, dtype=torch.float32, device=w.device)
    else:
        part = cnt = out  # unused
    grid = (triton.cdiv(n, bn), slots, sk)
    if up is None:
        _gemv_kernel[grid](
            x, w, ids, _table(t, w), out, part, cnt, slot_weights if summed else out, n, n_chunks // sk,
            w.stride(-2), w_slot_stride, x.stride(0), x_slot_stride, out.stride(0), out_slot_stride,
            BN=bn, SLOT_SUM=slots if summed else 0, **consts)
    else:
        align = _row_align(w, up, w.stride(-2), up.stride(-2), w_slot_stride, up_slot_stride,
                           n_chunks // sk * dec["CHUNK_W"])
        _glu_kernel[grid](
            x, w, up, ids, _table(t, w), out, part, cnt, n, n_chunks // sk,
            w.stride(-2), up.stride(-2), w_slot_stride, up_slot_stride, x.stride(0), x_slot_stride,
            out.stride(0), out_slot_stride, BN=bn, ACT=act, ALIGN=align, **consts)


def _launch_rr(t: GemvType, x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor | None, out: torch.Tensor, n: int,
               k: int, slots: int, w_slot_stride: int, x_slot_stride: int, out_slot_stride: int,
               up: torch.Tensor | None, up_slot_stride: int, split_k: int | None,
               slot_weights: torch.Tensor | None, shape: tuple[int, int, int, int] | None = None,
               ids_settled: bool = False, q8x: bool = False, q_out: tuple[torch.Tensor, int] | None = None,
               ) -> bool:
    """One launch of the row-register kernel (`gemv_rr`) in its `launch_shape` (or `shape`; `split_k` overrides
    its K split, which is dropped where the row tiles outnumber the ticket counters): True, or False when a slot
    sum cannot have its tickets, for the generic kernel to run instead. q_out = (units, span): where the launch
    can (`gemv_rr.writes_q8x_out`), it also writes out as Q8 units and records them (`gemv_rr.record_q8x`)."""
    n_chunks = k // gemv_rr.CHUNK[t.name][0]
    glu = up is not None
    br = (shape or gemv_rr.launch_shape(t.name, n_chunks))[0]
    tiles = triton.cdiv(n, br // 2 if glu else br)  # an estimate: the shape may change with the tile count
    br, sbc, warps, split = shape or gemv_rr.launch_shape(t.name, n_chunks, tiles * slots)
    tiles = triton.cdiv(n, br // 2 if glu else br)
    if split_k is not None:
        split = max(1, split_k)
        while n_chunks % (split * sbc):
            split -= 1
    summed = slot_weights is not None
    if summed:
        split = 1
    if split > 1 and tiles * slots > SPLIT_COUNTERS:  # one ticket counter per row tile
        split = 1
    cnt = tickets(w.device) if split > 1 or summed else None
    if summed and (cnt is None or tiles > SPLIT_COUNTERS):
        return False
    if cnt is None:
        split = 1
        part = cnt = out  # unused
    else:
        part = torch.empty(tiles * (slots if summed else slots * split) * br, dtype=torch.float32, device=w.device)
    if q_out is not None:
        q_cnt = tickets(w.device)
        if gemv_rr.writes_q8x_out(glu, n, slots, (br, sbc, warps, split), summed, q_cnt):
            cnt = q_cnt  # a GLU without K split or slot sum takes no other tickets
        else:
            q_out = None
    gemv_rr.launch(t.name, x, w, ids, out, n, k, slots, w_slot_stride, x_slot_stride, out_slot_stride, up,
                   up_slot_stride, (br, sbc, warps, split), _split_sum, part, cnt, slot_weights,
                   pdl.launch(x.device), ids_early=ids_settled, q8x=q8x, q_out=q_out)
    if q_out is not None:
        gemv_rr.record_q8x(out, *q_out)
    return True


def gemv(x: torch.Tensor, w_data: torch.Tensor, type_id: int | str, K: int, out: torch.Tensor | None = None,
         out_dtype: torch.dtype = torch.float32, *, block_n: int | None = None, num_warps: int | None = None,
         split_k: int | None = None) -> torch.Tensor:
    """y = x W^T, accumulated in fp32, W read from its stored rows.

    x: (T, K) float32/float16/bfloat16, rows contiguous. w_data: (N, row_bytes) uint8 ggml blocks, or for
    F32/F16/BF16 the (N, K) typed tensor (or its uint8 view). type_id: ggml type id (or its name). out: optional
    (T, N) float32/bfloat16/float16 to write into; else one of out_dtype is made. Either way the result equals
    the fp32 result cast to out's dtype (one rounding, at the store). block_n, num_warps: rows (for one token;
    divided by T, rounded up to a power of two, for more) and warps per program, to override the defaults (for
    tuning); split_k: programs per row tile, each over 1/split_k of K (see `_gemv_kernel`; lowered to a divisor
    of the row's chunk count). Tokens go 8 per launch."""
    t = gemv_type(type_id)
    w = _weights(t, w_data, K, 2)
    _check_x(x, K, w)
    n, n_tok = w.shape[0], x.shape[0]
    out = _out(out, (n_tok, n), w.device, out_dtype)
    for t0 in range(0, n_tok, MAX_TOKENS):
        t1 = min(n_tok, t0 + MAX_TOKENS)
        _launch(t, x[t0:t1], w, None, out[t0:t1], n, K, 1, t1 - t0, 0, 0, 0, block_n, num_warps,
                split_k=split_k)
    return out


def gemv_experts(x: torch.Tensor, w_data: torch.Tensor, expert_ids: torch.Tensor, type_id: int | str, K: int,
                 out: torch.Tensor | None = None, out_dtype: torch.dtype = torch.float32, *,
                 block_n: int | None = None, num_warps: int | None = None, split_k: int | None = None,
                 ) -> torch.Tensor:
    """out[i] = W[expert_ids[i]] x[i] (or x[0] for every i when x has one row), all k experts in one launch.

    w_data: (E, N, row_bytes) uint8 expert stack (or (E, N, K) typed for dense types). expert_ids: (k,) int32/int64
    on the weights' device, read by the kernel (no host sync); ids are trusted to lie in [0, E). x: (k, K) or
    (1, K). out, out_dtype: (k, N), as for `gemv`. block_n, num_warps: as for `gemv`."""
    t = gemv_type(type_id)
    w = _weights(t, w_data, K, 3)
    _check_x(x, K, w)
    k_sel, x_slot_stride = _slots(x, expert_ids, w)
    n = w.shape[1]
    out = _out(out, (k_sel, n), w.device, out_dtype)
    _launch(t, x, w, expert_ids, out, n, K, k_sel, 1, w.stride(0), x_slot_stride, out.stride(0), block_n,
            num_warps, split_k=split_k)
    return out


def gemv_experts_sum(x: torch.Tensor, w_data: torch.Tensor, expert_ids: torch.Tensor, slot_weights: torch.Tensor,
                     type_id: int | str, K: int, out: torch.Tensor | None = None,
                     out_dtype: torch.dtype = torch.float32, *, block_n: int | None = None,
                     num_warps: int | None = None, ids_settled: bool = False) -> torch.Tensor:
    """out[0] = sum_i slot_weights[i] * W[expert_ids[i]] x[i] (or x[0]): one token's routed-expert down projections
    and their weighted sum in one launch. Each product is accumulated in fp32 and weighted, the slots are added in
    order 0..k-1 and the sum rounded once to out's dtype (`moe.slot_sum` of `gemv_experts`' rows, but without
    letting the compiler fuse the weighting into the addition). No atomics touch the sums: every run gives the
    same bits.

    slot_weights: (k,) contiguous on the weights' device (any float dtype). out, out_dtype: (1, N). Where the
    stream has no ticket counters left (`COUNTER_REGIONS`) it runs as `gemv_experts` then `slot_sum`.

    ids_settled: the ids were written before the launch just before this one in the stream passed its PDL wait,
    as when that launch is `gemv_experts_glu` over the same ids (every launch that reads expert ids lets the next
    kernel be scheduled only after its wait, so the routing that wrote them is complete). The launch then reads
    the ids and its weights' first K-loop steps (`gemv_rr.PRELOAD`) while that launch is still running (the
    row-register kernel; others ignore it). Not for ids written by the launch just before."""
    t = gemv_type(type_id)
    w = _weights(t, w_data, K, 3)
    _check_x(x, K, w)
    k_sel, x_slot_stride = _slots(x, expert_ids, w)
    _check_slot_weights(slot_weights, k_sel, w)
    n = w.shape[1]
    out = _out(out, (1, n), w.device, out_dtype)
    if tickets(w.device) is None or triton.cdiv(n, _rows(t, 1, block_n, n * k_sel, True)) > SPLIT_COUNTERS:
        from strata.kernels.moe import slot_sum

        y = gemv_experts(x, w_data, expert_ids, type_id, K, block_n=block_n, num_warps=num_warps)
        out.copy_(slot_sum(y, slot_weights[None], out.dtype))
        return out
    _launch(t, x, w, expert_ids, out, n, K, k_sel, 1, w.stride(0), x_slot_stride, 0, block_n, num_warps,
            slot_weights=slot_weights, ids_settled=ids_settled)
    return out


def gemv_glu(x: torch.Tensor, gate_data: torch.Tensor, up_data: torch.Tensor, type_id: int | str, K: int,
             out: torch.Tensor | None = None, out_dtype: torch.dtype = torch.float32, act: str = "silu", *,
             block_n: int | None = None, num_warps: int | None = None, split_k: int | None = None,
             ) -> torch.Tensor:
    """y = act(x G^T) * (x U^T), the gate/up half of a gated MLP, in one launch per 8 tokens (not three).

    gate_data, up_data: (I, row_bytes) each, of one storage type, as `gemv`'s w_data; two tensors or two views of
    one buffer (each has its own row stride). x: (T, K). out, out_dtype: (T, I), as for `gemv`. act: "silu".
    Rounding follows the model, which computes `act(linear(x, G)) * linear(x, U)` in its dtype dt (the output's):
    both products are accumulated in fp32 and rounded to dt, act is computed in fp32 on the rounded gate and
    rounded to dt, and their product rounded to dt, so the result is `F.silu(g.to(dt)) * u.to(dt)` evaluated in
    dt, g and u being `gemv`'s fp32 results (up to the last bits of exp and of the division, and on the GPU the
    fp32 summation order of the tile, which differs from `gemv`'s; under the interpreter g and u equal its).
    block_n: rows per program of gate and up together (each gets half)."""
    t = gemv_type(type_id)
    _check_act(act)
    g, u = _glu_weights(t, gate_data, up_data, K, 2)
    _check_x(x, K, g)
    n, n_tok = g.shape[0], x.shape[0]
    out = _out(out, (n_tok, n), g.device, out_dtype)
    for t0 in range(0, n_tok, MAX_TOKENS):
        t1 = min(n_tok, t0 + MAX_TOKENS)
        _launch(t, x[t0:t1], g, None, out[t0:t1], n, K, 1, t1 - t0, 0, 0, 0, block_n, num_warps, u, 0, act,
                split_k)
    return out


def gemv_experts_glu(x: torch.Tensor, gate_data: torch.Tensor, up_data: torch.Tensor, expert_ids: torch.Tensor,
                     type_id: int | str, K: int, out: torch.Tensor | None = None,
                     out_dtype: torch.dtype = torch.float32, act: str = "silu", *, block_n: int | None = None,
                     num_warps: int | None = None, split_k: int | None = None) -> torch.Tensor:
    """out[i] = act(G[e] x_i) * (U[e] x_i), e = expert_ids[i], x_i = x[i] (or x[0] when x has one row): the
    gate/up half of all k routed experts in one launch.

    gate_data, up_data: (E, I, row_bytes) stacks (or typed (E, I, K) for dense types) of one storage type.
    expert_ids: (k,), as for `gemv_experts` (read on the device). out, out_dtype: (k, I). Rounding: as `gemv_glu`."""
    t = gemv_type(type_id)
    _check_act(act)
    g, u = _glu_weights(t, gate_data, up_data, K, 3)
    _check_x(x, K, g)
    k_sel, x_slot_stride = _slots(x, expert_ids, g)
    n = g.shape[1]
    out = _out(out, (k_sel, n), g.device, out_dtype)
    _launch(t, x, g, expert_ids, out, n, K, k_sel, 1, g.stride(0), x_slot_stride, out.stride(0), block_n,
            num_warps, u, u.stride(0), act, split_k)
    return out
