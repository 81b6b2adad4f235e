"""Matrix-vector products of K-quant and 32-block weights on the tensor cores, for one token.

The CUDA-core GEMV (`gemv.py`) spends ~8 instructions per weight: decode to fp32, scale, multiply by x. Here the
block scales leave the inner product. A block type stores w = d_s q - m_s for the weights of sub-block s (q small
integers), so

    W[r] . x = sum_s d[r, s] (q[r, s] . x_s) - m[r, s] (1 . x_s)

and every q[r, s] . x_s of a chunk of K is one matrix product: Q (rows x K, the integers q, exact in bfloat16)
times X (K x S, x placed block-diagonally: column s holds x_s on sub-block s's rows and zeros elsewhere). The
tensor cores compute Q X with products exact in fp32 (a 4- or 8-bit integer times a bfloat16) and an fp32 sum,
and the scales apply once per (row, sub-block) instead of once per weight. So the weights pass as integers
through one conversion each, and x enters exactly as the model stores it (bfloat16 or float16): the result
differs from the fp32 CUDA-core one only by the order of the fp32 sums.

A chunk is S = 16 sub-blocks (two 256-weight Q4_K super-blocks): the narrowest product the tensor cores take
is 16 columns, and all 16 carry a sub-block.

    gemv_tc_experts_glu(x (1, K), gate (E, I, rb), up (E, I, rb), ids (k,), type, K) -> (k, I)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from strata.errors import StrataError
from strata.kernels import gemv as G
from strata.kernels import pdl

TC_TYPES = ("Q4_K",)
"""Storage types the tensor-core GEMV reads."""

CHUNK = 512
"""Weights per row per loop step: two Q4_K super-blocks, 16 sub-blocks."""


@triton.jit
def _q4k_chunk(wp, c, R: tl.constexpr):
    """Loads of chunk c (super-blocks 2c, 2c+1) of the rows at int32 pointers wp [R]: each super-block's nibble
    words [R, 32], and the header words w0..w3 [R, 2] ({fp16 d, dmin}, scale bytes 0-3, 4-7, 8-11)."""
    s = tl.arange(0, 2)
    w = tl.arange(0, 32)
    cp = wp + c * 72
    bp = cp[:, None] + s[None, :] * 36
    v0 = tl.load(cp[:, None] + 4 + w[None, :])
    v1 = tl.load(cp[:, None] + 40 + w[None, :])
    return v0, v1, tl.load(bp), tl.load(bp + 1), tl.load(bp + 2), tl.load(bp + 3)


@triton.jit
def _nib(v, sh: tl.constexpr):
    """Nibble at bit sh of int32 words v, exactly, as fp32."""
    return (((v >> sh) & 15) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _join4(c0, c1, c2, c3):
    """[..., 4] (as [..., 2, 2]) whose flattened last index e holds c_e, inside each thread."""
    return tl.join(tl.join(c0, c2), tl.join(c1, c3))


_NIBBLES_ASM = """{
.reg .b32 t, one, bias;
mov.b32 one, ONE;
mov.b32 bias, BIAS;
lop3.b32 $0, $4, 0x000F000F, MAGIC, 0xea;
shr.u32 t, $4, 4;
lop3.b32 $1, t, 0x000F000F, MAGIC, 0xea;
shr.u32 t, $4, 8;
lop3.b32 $2, t, 0x000F000F, MAGIC, 0xea;
shr.u32 t, $4, 12;
lop3.b32 $3, t, 0x000F000F, MAGIC, 0xea;
fma.rn.TY $0, $0, one, bias;
fma.rn.TY $1, $1, one, bias;
fma.rn.TY $2, $2, one, bias;
fma.rn.TY $3, $3, one, bias;
}"""
"""The 8 nibbles of a word as 16-bit floats, two per instruction: a nibble pair masked into the mantissas of
(magic, magic) and the magic subtracted (exact: 128 + q in bfloat16, 1024 + q in float16). Output e is the
nibble at bit 16 (e % 2) + 4 (e // 2)."""
_BF16_NIBBLES = tl.constexpr(_NIBBLES_ASM.replace("ONE", "0x3F803F80").replace("BIAS", "0xC300C300")
                 .replace("MAGIC", "0x43004300").replace("TY", "bf16x2"))
_F16_NIBBLES = tl.constexpr(_NIBBLES_ASM.replace("ONE", "0x3C003C00").replace("BIAS", "0xE400E400")
                .replace("MAGIC", "0x64006400").replace("TY", "f16x2"))


@triton.jit
def _nibbles(v, DT: tl.constexpr):
    """[..., 8] DT: the nibbles of int32 words v, output e the nibble at bit 16 (e % 2) + 4 (e // 2)."""
    if DT == tl.float32:  # the interpreter
        return tl.reshape(tl.join(_join4(_nib(v, 0), _nib(v, 4), _nib(v, 8), _nib(v, 12)),
                                  _join4(_nib(v, 16), _nib(v, 20), _nib(v, 24), _nib(v, 28))),
                          [v.shape[0], v.shape[1], 8])
    else:
        v8 = tl.reshape(_join4(tl.join(v, v), tl.join(v, v), tl.join(v, v), tl.join(v, v)),
                        [v.shape[0], v.shape[1], 8])
        if DT == tl.bfloat16:
            return tl.inline_asm_elementwise(_BF16_NIBBLES, "=r,=r,=r,=r,r,r,r,r,r,r,r,r", [v8], dtype=tl.bfloat16,
                                             is_pure=True, pack=8)
        else:
            return tl.inline_asm_elementwise(_F16_NIBBLES, "=r,=r,=r,=r,r,r,r,r,r,r,r,r", [v8], dtype=tl.float16,
                                             is_pure=True, pack=8)


@triton.jit
def _q4k_scales(w0, w1, w2, w3, R: tl.constexpr):
    """d*sc and dmin*m per (row, sub-block) of a chunk's two super-blocks, as [R, 16] fp32 (sub-block 8 s + j)."""
    j = tl.arange(0, 8)
    sh = ((j & 3) * 8)[None, None, :]
    low = (j < 4)[None, None, :]
    b0 = (w1[:, :, None] >> sh) & 255
    b4 = (w2[:, :, None] >> sh) & 255
    b8 = (w3[:, :, None] >> sh) & 255
    sc, mn = G.gb._k4_unpack(b0, b4, b8, low)
    d = (w0 & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)[:, :, None]
    dm = ((w0 >> 16) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)[:, :, None]
    return tl.reshape(d * G.gb._i2f(sc, 0.0), [R, 16]), tl.reshape(dm * G.gb._i2f(mn, 0.0), [R, 16])


@triton.jit
def _q4k_x(xc, S: tl.constexpr, DT: tl.constexpr):
    """x of super-block S of a chunk (at xc), block-diagonally as [256, 16] DT in the tile's k' = 8 w + e order
    (nibble e, `_nibbles`, of word w): column 8 S + sub-block; and each of its sub-blocks' sums [8] in fp32."""
    kk = tl.arange(0, 256)
    w = kk // 8
    e = kk % 8
    j = 2 * (e % 2) + e // 4  # the byte of the word, and its nibble
    h = (e // 2) % 2
    pos = S * 256 + (w // 8) * 64 + h * 32 + (w % 8) * 4 + j
    sub = S * 8 + (w // 8) * 2 + h
    xv = tl.load(xc + pos).to(tl.float32)
    n = tl.arange(0, 16)
    xb = tl.where(sub[:, None] == n[None, :], xv[:, None], 0.0)
    # k' = 8 (8 c + b) + 4 (e // 4) + 2 h + e % 2 lies in sub-block 2 c + h: sum over b, e // 4, e % 2
    xs = tl.sum(tl.sum(tl.sum(tl.reshape(xv, [4, 8, 2, 2, 2]), axis=4), axis=2), axis=1)
    return xb.to(DT), tl.reshape(xs, [8])


@triton.jit
def _dot(a, b, acc, DT: tl.constexpr):
    """acc + a b on the tensor cores; exact fp32 products under the interpreter (its dot mishandles 16-bit tiles)."""
    if DT == tl.float32:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _tc_rows(xp, xg, xsp, wp, n_chunks, R: tl.constexpr, DT: tl.constexpr, PIPE: tl.constexpr, XG: tl.constexpr,
             GDC: tl.constexpr):
    """[R] fp32: (the Q4_K row at int32 pointer wp[r]) . x, x at xp. PIPE: chunk c + 1's loads are issued before
    chunk c is decoded. XG: the block-diagonal x tiles and sub-block sums are read from xg and xsp (`_tc_x_kernel`)
    instead of built by every program."""
    raw = _q4k_chunk(wp, 0, R)
    pdl.wait(GDC)
    acc = tl.zeros([R, 16], dtype=tl.float32)
    for c in range(n_chunks):
        if PIPE:
            ahead = _q4k_chunk(wp, tl.minimum(c + 1, n_chunks - 1), R)
        elif c > 0:
            raw = _q4k_chunk(wp, c, R)
        v0, v1, w0, w1, w2, w3 = raw
        if XG:
            kk = tl.arange(0, 256)
            n = tl.arange(0, 16)
            tp = xg + c * 8192 + kk[:, None] * 16 + n[None, :]
            x0 = tl.load(tp)
            x1 = tl.load(tp + 4096)
            xs = tl.load(xsp + c * 16 + n)
        else:
            xc = xp + c * 512
            x0, s0 = _q4k_x(xc, 0, DT)
            x1, s1 = _q4k_x(xc, 1, DT)
            xs = tl.reshape(tl.join(s0, s1).trans(), [16])
        prod = _dot(tl.reshape(_nibbles(v0, DT), [R, 256]), x0, tl.zeros([R, 16], dtype=tl.float32), DT)
        prod = _dot(tl.reshape(_nibbles(v1, DT), [R, 256]), x1, prod, DT)
        scale, mins = _q4k_scales(w0, w1, w2, w3, R)
        acc += prod * scale - mins * xs[None, :]
        if PIPE:
            raw = ahead
    return tl.sum(acc, axis=1)


@triton.jit
def _tc_glu_kernel(x_ptr, xg_ptr, xs_ptr, g_ptr, u_ptr, ids_ptr, out_ptr, part_ptr, cnt_ptr, N, n_chunks, row_words, g_slot_words, u_slot_words,
                   out_slot_stride, BN: tl.constexpr, DT: tl.constexpr, PIPE: tl.constexpr,
                   XG: tl.constexpr, SPLIT: tl.constexpr, GDC: tl.constexpr = False):
    """out[slot, rows] = silu(G[rows] . x) * (U[rows] . x), G and U expert ids[slot]'s gate and up: one tile of 2*BN
    rows (BN of G, the same BN of U), rounded as `gemv._glu_kernel` rounds. SPLIT: program_id(2) takes 1/SPLIT of
    the chunks, and the last of a tile's programs sums the partials (`gemv._split_sum`, in program order)."""
    pdl.started(GDC)
    pdl.wait(GDC)
    pid = tl.program_id(0)
    slot = tl.program_id(1)
    mat = tl.load(ids_ptr + slot).to(tl.int64)
    r = tl.arange(0, 2 * BN)
    rows_c = tl.minimum(pid * BN + r % BN, N - 1).to(tl.int64)
    gw = g_ptr.to(tl.pointer_type(tl.int32))
    uw = u_ptr.to(tl.pointer_type(tl.int32))
    wp = tl.where(r < BN, gw + mat * g_slot_words + rows_c * row_words, uw + mat * u_slot_words + rows_c * row_words)
    sk = tl.program_id(2)
    wp = tl.multiple_of(wp + sk * (n_chunks * 72), 16)
    res = _tc_rows(x_ptr + sk * (n_chunks * 512), xg_ptr + sk * (n_chunks * 8192), xs_ptr + sk * (n_chunks * 16), wp,
                   n_chunks, 2 * BN, DT, PIPE, XG, False)
    last = 1
    if SPLIT > 1:
        tile = slot * tl.num_programs(0) + pid
        tot, last = G._split_sum(res[:, None], part_ptr + tile * (SPLIT * 2 * BN), cnt_ptr + tile, sk, SPLIT, 2 * BN, 1)
        res = tl.reshape(tot, [2 * BN])
    g, u = tl.split(tl.permute(tl.reshape(res, [2, BN]), (1, 0)))
    dt: tl.constexpr = out_ptr.dtype.element_ty
    y = G._rounded(G._act(G._rounded(g, dt), "silu"), dt) * G._rounded(u, dt)
    rows = pid * BN + tl.arange(0, BN)
    tl.store(out_ptr + slot * out_slot_stride + rows, y.to(dt), mask=rows < N * last)


@triton.jit
def _tc_gemv_kernel(x_ptr, xg_ptr, xs_ptr, w_ptr, out_ptr, N, n_chunks, row_words, BN: tl.constexpr, DT: tl.constexpr,
                    PIPE: tl.constexpr, XG: tl.constexpr, GDC: tl.constexpr = False):
    """out[rows] = W[rows] . x for one token."""
    pdl.started(GDC)
    pid = tl.program_id(0)
    rows = pid * BN + tl.arange(0, BN)
    wp = w_ptr.to(tl.pointer_type(tl.int32)) + tl.minimum(rows, N - 1).to(tl.int64) * row_words
    wp = tl.multiple_of(wp, 16)
    res = _tc_rows(x_ptr, xg_ptr, xs_ptr, wp, n_chunks, BN, DT, PIPE, XG, GDC)
    dt: tl.constexpr = out_ptr.dtype.element_ty
    tl.store(out_ptr + rows, G._rounded(res, dt).to(dt), mask=rows < N)


@triton.jit
def _tc_x_kernel(x_ptr, xg_ptr, xs_ptr, DT: tl.constexpr, GDC: tl.constexpr = False):
    """Chunk program_id(0)'s block-diagonal x tiles [2, 256, 16] and sub-block sums [16], as `_q4k_x` builds them."""
    pdl.started(GDC)
    pdl.wait(GDC)
    c = tl.program_id(0)
    kk = tl.arange(0, 256)
    n = tl.arange(0, 16)
    x0, s0 = _q4k_x(x_ptr + c * 512, 0, DT)
    x1, s1 = _q4k_x(x_ptr + c * 512, 1, DT)
    tp = xg_ptr + c * 8192 + kk[:, None] * 16 + n[None, :]
    tl.store(tp, x0)
    tl.store(tp + 4096, x1)
    tl.store(xs_ptr + c * 16 + n, tl.reshape(tl.join(s0, s1).trans(), [16]))


def _x_tiles(x: torch.Tensor, k: int, prebuilt: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The block-diagonal x tiles and sub-block sums (`_tc_x_kernel`), or placeholders when each program builds
    its own."""
    if not prebuilt:
        return x, x
    dt = x.dtype if x.is_cuda else torch.float32
    xg = torch.empty(k // CHUNK, 2, 256, 16, device=x.device, dtype=dt)
    xs = torch.empty(k // CHUNK, 16, device=x.device, dtype=torch.float32)
    _tc_x_kernel[(k // CHUNK,)](x, xg, xs, DT=_mma_dtype(x), num_warps=4, **pdl.launch(x.device))
    return xg, xs


_DT = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def _mma_dtype(x: torch.Tensor) -> tl.dtype:
    """The tiles' element type: x's own on CUDA; fp32 off it (the interpreter's dot mishandles 16-bit tiles; the
    integers and x are exact in fp32 too)."""
    return _DT[x.dtype] if x.is_cuda else tl.float32


def _check(type_id: int | str, x: torch.Tensor, k: int, w: torch.Tensor) -> None:
    t = G.gemv_type(type_id)
    if t.name not in TC_TYPES:
        raise StrataError(f"tensor-core GEMV: type {t.name} not supported (supported: {', '.join(TC_TYPES)})")
    if x.dtype not in _DT:
        raise StrataError(f"tensor-core GEMV: x must be bfloat16 or float16 (exact in the product), got {x.dtype}")
    if x.dim() != 2 or x.shape[0] != 1 or x.shape[1] != k or not x.is_contiguous():
        raise StrataError(f"tensor-core GEMV: x must be one contiguous row of {k}, got {tuple(x.shape)}")
    if k % CHUNK:
        raise StrataError(f"tensor-core GEMV: K={k} is not a multiple of {CHUNK}")
    rb = k // 256 * 144
    if w.dtype != torch.uint8 or w.shape[-1] != rb or w.stride(-1) != 1 or w.stride(-2) % 16:
        raise StrataError(f"tensor-core GEMV: weights must be uint8 rows of {rb} bytes, 16-byte aligned; got "
                          f"{w.dtype} {tuple(w.shape)} strides {w.stride()}")


def gemv_tc(x: torch.Tensor, w_data: torch.Tensor, type_id: int | str, K: int, out: torch.Tensor | None = None,
            out_dtype: torch.dtype = torch.float32, *, block_n: int = 32, num_warps: int = 4, pipe: bool = True,
            num_stages: int = 1, x_prebuilt: bool = False) -> torch.Tensor:
    """out (1, N) = x (1, K) W^T, W the (N, row_bytes) rows, on the tensor cores."""
    _check(type_id, x, K, w_data)
    n = w_data.shape[0]
    out = torch.empty(1, n, device=x.device, dtype=out_dtype) if out is None else out
    xg, xs = _x_tiles(x, K, x_prebuilt)
    _tc_gemv_kernel[(triton.cdiv(n, block_n),)](
        x, xg, xs, w_data, out, n, K // CHUNK, w_data.stride(0) // 4, BN=block_n, DT=_mma_dtype(x), PIPE=pipe, XG=x_prebuilt,
        num_warps=num_warps, num_stages=num_stages, **pdl.launch(x.device))
    return out


def gemv_tc_experts_glu(x: torch.Tensor, gate_data: torch.Tensor, up_data: torch.Tensor, expert_ids: torch.Tensor,
                        type_id: int | str, K: int, out: torch.Tensor | None = None,
                        out_dtype: torch.dtype = torch.float32, *, block_n: int = 16,
                        num_warps: int = 4, pipe: bool = True, num_stages: int = 1, x_prebuilt: bool = False,
                        split_k: int = 1) -> torch.Tensor:
    """out[i] = silu(G[e] x) * (U[e] x), e = expert_ids[i]: `gemv.gemv_experts_glu` for one token on the tensor
    cores."""
    _check(type_id, x, K, gate_data)
    _check(type_id, x, K, up_data)
    if gate_data.shape != up_data.shape or gate_data.dim() != 3:
        raise StrataError(f"tensor-core GLU: gate {tuple(gate_data.shape)} and up {tuple(up_data.shape)} must be "
                          f"equal (E, I, row_bytes) stacks")
    k_sel = expert_ids.shape[0]
    n = gate_data.shape[1]
    out = torch.empty(k_sel, n, device=x.device, dtype=out_dtype) if out is None else out
    xg, xs = _x_tiles(x, K, x_prebuilt)
    tiles = triton.cdiv(n, block_n) * k_sel
    sk = G._split(split_k, K // CHUNK, tiles)
    cnt = G.tickets(x.device) if sk > 1 else None
    if cnt is None:
        sk = 1
        part = cnt = out
    else:
        part = torch.empty(tiles * sk * 2 * block_n, dtype=torch.float32, device=x.device)
    _tc_glu_kernel[(triton.cdiv(n, block_n), k_sel, sk)](
        x, xg, xs, gate_data, up_data, expert_ids, out, part, cnt, n, K // CHUNK // sk, gate_data.stride(1) // 4, gate_data.stride(0) // 4,
        up_data.stride(0) // 4, out.stride(0), BN=block_n, DT=_mma_dtype(x), PIPE=pipe, XG=x_prebuilt, SPLIT=sk,
        num_warps=num_warps, num_stages=num_stages, **pdl.launch(x.device))
    return out
