"""Row-register GEMV: one token's products with the word-ordered layouts Q4_K_R, Q5_1_R, Q8_0_R, Q6_K_R
(`weights/repack.py`).

The generic GEMV (`gemv.py`) decodes a chunk of every row of a tile into a tile of weights and loads x at offsets
the decoder returns; Triton then lays the tile out one row per thread and the K loop re-reads x and decodes each
weight in ~8.5 (Q4_K) or ~6.5 (Q8_0_R8) SASS instructions (`tools/gemv_sass.py`). Here the layouts are made for
the kernel instead: a thread owns 16-byte vectors of one row's words, and byte b of every word it holds
multiplies one contiguous run of x, which it loads as 16-byte vectors too (`repack.py` puts weight 8b + w, for
Q5_1_R 4b + w, at byte b of word w). Each byte becomes an fp32 with one byte permute (PRMT) into a constant, and
one FMA turns that into the weight:

* Q8_0_R stores q + 128 as u: f = 1 + u / 2^15 (u in byte 1 of 0x3F800000), and fma(f, 2^15 d, -(2^15 + 128) d)
  is exactly d q (the product is exact inside the FMA and d q has at most 19 significant bits);
* Q4_K_R: f = 0.5 + q / 256 (the nibble in byte 2 of 0x3F000000), and fma(f, 256 S, -(128 S + M)) with
  S = d sc, M = dmin m is S q - M up to the one rounding of the constant 128 S + M (|error| <= 2^-24 (128 S + M),
  about 1e-7 of the weight's scale); Q5_1_R likewise, fma(f, 256 d, m - 128 d), its fifth bits put on bit 4 of
  each byte by one shift and one masked OR;
* Q6_K_R: the top two bits put on bits 4-5 of each nibble byte by one shift and one mask, then
  fma(f, 256 S, -160 S) = S (q - 32) with S = d sc, rounded once as Q6_K's decoder rounds (160 S is exact). The
  head (248320 x 2560) in 224 us on an H200 against 333 for Q6_K_P with the generic kernel.

That is ~4.9 (Q4_K_R, Q5_1_R) and ~4.0 (Q8_0_R) SASS instructions per weight in the K loop with fp32 x, ~6.4 and
~5.8 with bf16 x, which each thread converts (bench/results/2026-12-04-cpu-gemv-sass-rr.json). The
launch shapes (`launch_shape`) keep one row per thread and few rows per program, and split long K loops over
programs when the row tiles are few: the launches are latency-bound, so more programs with short K loops win.
H200, each launch alone against the generic kernel (bench/results/2026-12-04-h200-gemv-rr-lab-3bf6ca4.json):
Q8_0 16432 x 2560 18.6 (as Q8_0_R8) -> 16.7 us, 2560 x 6144 10.3 -> 8.7, the shared expert's GLU 8.1 -> 5.2, the
routed experts' gate/up GLU (Q4_K) 19.5 -> 13.0, their down projections with the weighted slot sum (Q5_1) 12.5
-> 9.1.

Covered: one token (T = 1), plain or by expert id, plain or GLU (gate and up rows in one tile), K split or the
slots summed (split-K tickets, `gemv._split_sum`). The launcher in `gemv.py` sends the other launches of these
types (several tokens, explicit launch shapes, rows not 16-byte aligned) to the generic kernel, which reads them
through `gemv_blocks.decode_*_r`. Under Triton's interpreter (the CPU tests) the byte permute is written as shifts
and masks with the same result.

With XQ the same loops read Q8 activations (`gemv_q8x`: x rounded to int8 runs of 32) and take each word's
products in one `dp4a` against a word of x, the scales applied once per run (`_*_q8x_fma`; 1-3.8 instructions
per weight instead of 5-6.4, bench/results/2026-12-05-cpu-gemv-sass-q8x.json).
"""

from __future__ import annotations

import weakref

import torch
import triton
import triton.language as tl

from strata.errors import StrataError
from strata.kernels import gemv_blocks as gb
from strata.kernels import pdl
from strata.weights import quants, repack

try:  # the probe's timer and SM id (`PROBE`); the kernels compile without them where PROBE is off
    from triton.language.extra.cuda import globaltimer, smid
except ImportError:  # pragma: no cover - a Triton without them: no probe
    globaltimer = smid = None

TILE_MAJOR = {quants.GGML_TYPES[i].name: (quants.GGML_TYPES[t.base].name, t.tile, t.step)
              for i, t in repack.TILE_LAYOUTS.items()}
"""The tile-major types (`repack.TILE_LAYOUTS`) by name: (the row-major type whose blocks they hold, rows per tile,
bytes of a row per step). The kernel reads them with TILE; a launch must step through a tile's steps whole."""

ROW_REGISTER_TYPES = ("Q4_K_R", "Q8_0_R", "Q5_1_R", "Q6_K_R", *TILE_MAJOR)

_BASE = {"Q4_K_R": 0x3F000000, "Q8_0_R": 0x3F800000, "Q5_1_R": 0x3F000000, "Q6_K_R": 0x3F000000}
"""The fp32 bits each type's bytes are permuted into (see the module docstring)."""
_BASE.update({kind: _BASE[base] for kind, (base, _, _) in TILE_MAJOR.items()})


@triton.jit
def _permute(v, base, SEL: tl.constexpr, B: tl.constexpr, POS: tl.constexpr, ASM: tl.constexpr):
    """fp32 with base's bits and byte POS replaced by byte B of v (one PRMT, SEL its selector; base's byte POS is
    0)."""
    if ASM:
        return tl.inline_asm_elementwise(f"prmt.b32 $0, $1, $2, {SEL};", "=r,r,r", [v, base], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return ((((v >> (8 * B)) & 255) << (8 * POS)) | base).to(tl.float32, bitcast=True)


@triton.jit
def _xf(v, XA: tl.constexpr):
    """x as fp32. With XA (bf16 x on the GPU, `WIDEN_X_ASM`) each loaded register of two bf16 values widens in one
    shift (the low one) and one mask (the high one); `.to(tl.float32)` takes a byte permute and a shift for the
    high one. XA == "free" (a timing probe, `tools/step_variants.py x-widen:free`): the register's bits taken as
    fp32 unconverted (no instruction, wrong values), for what the widening costs a step."""
    if XA == "free" and v.dtype == tl.bfloat16:
        return tl.inline_asm_elementwise("{ mov.b32 $0, $2; mov.b32 $1, $2; }", "=r,=r,r", [v],
                                         dtype=tl.float32, is_pure=True, pack=2)
    elif XA and v.dtype == tl.bfloat16:
        return tl.inline_asm_elementwise("{ shl.b32 $0, $2, 16; and.b32 $1, $2, 0xFFFF0000; }", "=r,=r,r", [v],
                                         dtype=tl.float32, is_pure=True, pack=2)
    else:
        return v.to(tl.float32)


@triton.jit
def _nibble(v, base, B: tl.constexpr, ASM: tl.constexpr):
    """0.5 + (byte B of v) / 256 for bytes < 16 (base = 0x3F000000: the byte lands in byte 2)."""
    return _permute(v, base, 0x7054 | (B << 8), B, 2, ASM)


@triton.jit
def _byte(v, base, B: tl.constexpr, ASM: tl.constexpr):
    """1 + (byte B of v) / 2^15 (base = 0x3F800000: the byte lands in byte 1)."""
    return _permute(v, base, 0x7604 | (B << 4), B, 1, ASM)


@triton.jit
def _int_f32(q):
    """int32 q in [0, 2^23) as fp32, without a convert instruction."""
    return (q | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _f16_lo(w):
    return (w & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _k4_scale_min(h1, h2, h3, sh, LOWC):
    """Q4_K's 6-bit scale and min of sub-block j from header words 1-3 (the 12 scale bytes), sh = 8 (j & 3),
    LOWC = j < 4: ggml's get_scale_min_k4, as int32."""
    b1 = (h1 >> sh) & 255
    b2 = (h2 >> sh) & 255
    b3 = (h3 >> sh) & 255
    return (tl.where(LOWC, b1 & 63, (b3 & 15) | ((b1 >> 6) << 4)),
            tl.where(LOWC, b2 & 63, (b3 >> 4) | ((b2 >> 6) << 4)))


@triton.jit
def _q4_k_r_load(wp, sb, c, k):
    """One chunk of Q4_K_R rows: words k and 4 + k of group c (the four groups' words 0-3 side by side, then
    their words 4-7), and the 4 header words, of super-blocks sb (wp: int32 pointers to the rows)."""
    bp = wp + sb * 36
    return (tl.load(bp + 4 + c * 4 + k), tl.load(bp + 20 + c * 4 + k), tl.load(bp), tl.load(bp + 1),
            tl.load(bp + 2), tl.load(bp + 3))


@triton.jit
def _q4_k_r_fma(acc, raw, xb, c, base, ASM: tl.constexpr, XA: tl.constexpr):
    """acc += the chunk's weights times x (xb: x at the first weight of each thread's words)."""
    v0, v1, h0, h1, h2, h3 = raw
    d = _f16_lo(h0)
    dm = _f16_lo(h0 >> 16)
    lowc = c < 2
    sh = (16 * c) % 32  # sub-block 2c (the low nibbles): byte (2c) & 3 of the scale words; 2c + 1: the next byte
    sc_lo, mn_lo = _k4_scale_min(h1, h2, h3, sh, lowc)
    sc_hi, mn_hi = _k4_scale_min(h1, h2, h3, sh + 8, lowc)
    s_lo = d * _int_f32(sc_lo)
    s_hi = d * _int_f32(sc_hi)
    c_lo = 128.0 * s_lo + dm * _int_f32(mn_lo)  # w = 256 S f - (128 S + M), f = 0.5 + q / 256
    c_hi = 128.0 * s_hi + dm * _int_f32(mn_hi)
    s_lo = 256.0 * s_lo
    s_hi = 256.0 * s_hi
    l0 = v0 & 0x0F0F0F0F
    u0 = (v0 >> 4) & 0x0F0F0F0F
    l1 = v1 & 0x0F0F0F0F
    u1 = (v1 >> 4) & 0x0F0F0F0F
    for b in tl.static_range(4):
        acc += tl.fma(_nibble(l0, base, b, ASM), s_lo, -c_lo) * _xf(tl.load(xb + 8 * b), XA)
        acc += tl.fma(_nibble(l1, base, b, ASM), s_lo, -c_lo) * _xf(tl.load(xb + 8 * b + 4), XA)
        acc += tl.fma(_nibble(u0, base, b, ASM), s_hi, -c_hi) * _xf(tl.load(xb + 32 + 8 * b), XA)
        acc += tl.fma(_nibble(u1, base, b, ASM), s_hi, -c_hi) * _xf(tl.load(xb + 36 + 8 * b), XA)
    return acc


@triton.jit
def _q8_0_r_load(wp, hp, g, blk, k, D_STRIDE):
    """One chunk of Q8_0_R rows: words 4k..4k+3 and 4k+4..4k+7 of block blk of groups g, and the block's fp16 d
    (read with a stride the compiler cannot see, so its load takes the words' thread layout)."""
    gp = wp + g * 68
    return tl.load(gp + 4 + blk * 8 + k), tl.load(gp + 8 + blk * 8 + k), tl.load(hp + g * 136 + blk * D_STRIDE)


@triton.jit
def _q8_0_r_fma(acc, raw, xp, sb, s, blk, k, base, ASM: tl.constexpr, XA: tl.constexpr):
    """acc += one Q8_0_R chunk's weights (of groups sb + s) times x."""
    v0, v1, d = raw
    d = d.to(tl.float32)
    scale = 32768.0 * d
    shift = 32896.0 * d
    xb = xp + (sb + s) * 256 + blk * 32 + k
    for b in tl.static_range(4):
        acc += tl.fma(_byte(v0, base, b, ASM), scale, -shift) * _xf(tl.load(xb + 8 * b), XA)
        acc += tl.fma(_byte(v1, base, b, ASM), scale, -shift) * _xf(tl.load(xb + 8 * b + 4), XA)
    return acc


@triton.jit
def _q8_0_r_step_load(wp, g, blk, k, D_STRIDE):
    return _q8_0_r_load(wp, wp.to(tl.pointer_type(tl.float16)), g, blk, k, D_STRIDE)


@triton.jit
def _q8_0_r_rows(rp, xp, base, D_STRIDE, NCH: tl.constexpr, SBC: tl.constexpr, BR: tl.constexpr,
                 ASM: tl.constexpr, GDC: tl.constexpr, REL: tl.constexpr = False, XA: tl.constexpr = False,
                 PRE: tl.constexpr = 1, XQ: tl.constexpr = False, SS: tl.constexpr = 0):
    """`_super_block_rows` for Q8_0_R rows: NCH groups of 256 weights."""
    wp = rp.to(tl.pointer_type(tl.int32))[:, None, None, None]
    s = tl.arange(0, SBC)[None, :, None, None]
    blk = tl.arange(0, 8)[None, None, :, None]
    k = tl.arange(0, 4)[None, None, None, :]
    if XQ:
        return _k_loop(wp, xp, s, blk, k, base, D_STRIDE, NCH // SBC, SBC, BR, _q8_0_r_step_load, _q8_0_r_q8x_fma,
                       ASM, XA, GDC, REL, PRE, 8, 1, SS)
    else:
        return _k_loop(wp, xp, s, blk, k, base, D_STRIDE, NCH // SBC, SBC, BR, _q8_0_r_step_load, _q8_0_r_fma, ASM,
                       XA, GDC, REL, PRE, 8, 4, SS)


@triton.jit
def _q5_1_r_load(wp, g, blk, k, D_STRIDE):
    """One chunk of Q5_1_R rows: block blk's 4 nibble words, its (d, m) word and its qh word, of groups g."""
    gp = wp + g * 24
    return tl.load(gp + 8 + blk * 4 + k), tl.load(gp + blk * D_STRIDE), tl.load(gp + 4 + blk * D_STRIDE)


@triton.jit
def _q5_1_r_fma(acc, raw, xp, sb, s, blk, k, base, ASM: tl.constexpr, XA: tl.constexpr):
    """acc += one Q5_1_R chunk's weights (of groups sb + s) times x."""
    v, dmw, qh = raw
    d = _f16_lo(dmw)
    m = _f16_lo(dmw >> 16)
    scale = 256.0 * d
    shift = m - 128.0 * d
    lo = (v & 0x0F0F0F0F) | ((qh >> k) & 0x10101010)
    hi = ((v >> 4) & 0x0F0F0F0F) | ((qh << (4 - k)) & 0x10101010)
    xb = xp + (sb + s) * 128 + blk * 32 + k
    for b in tl.static_range(4):
        acc += tl.fma(_nibble(lo, base, b, ASM), scale, shift) * _xf(tl.load(xb + 4 * b), XA)
        acc += tl.fma(_nibble(hi, base, b, ASM), scale, shift) * _xf(tl.load(xb + 16 + 4 * b), XA)
    return acc


@triton.jit
def _q5_1_r_rows(rp, xp, base, D_STRIDE, NCH: tl.constexpr, SBC: tl.constexpr, BR: tl.constexpr,
                 ASM: tl.constexpr, GDC: tl.constexpr, PRE: tl.constexpr = 1, REL: tl.constexpr = False,
                 XA: tl.constexpr = False, XQ: tl.constexpr = False, SS: tl.constexpr = 0):
    """`_super_block_rows` for Q5_1_R rows: NCH groups of 128 weights (four blocks; a thread takes one block's 16 nibble
    bytes). The fifth bits land on bit 4 of each byte by one shift and one masked OR (`repack.py` placed them),
    and w = d q + m = fma(0.5 + q / 256, 256 d, m - 128 d). The first PRE loop steps' words (up to 6) are in
    flight before `pdl.wait(GDC)`."""
    wp = rp.to(tl.pointer_type(tl.int32))[:, None, None, None]
    s = tl.arange(0, SBC)[None, :, None, None]
    blk = tl.arange(0, 4)[None, None, :, None]
    k = tl.arange(0, 4)[None, None, None, :]
    if XQ:
        return _k_loop(wp, xp, s, blk, k, base, D_STRIDE, NCH // SBC, SBC, BR, _q5_1_r_load, _q5_1_r_q8x_fma, ASM,
                       XA, GDC, REL, PRE, 4, 1, SS)
    else:
        return _k_loop(wp, xp, s, blk, k, base, D_STRIDE, NCH // SBC, SBC, BR, _q5_1_r_load, _q5_1_r_fma, ASM, XA,
                       GDC, REL, PRE, 4, 4, SS)


@triton.jit
def _q6_k_r_load(wp, sb, c, k):
    """One chunk of Q6_K_R rows: group c's nibble words k and 4 + k and high word k (each stored beside the other
    groups' same word), the four scale words and the word of d, of super-blocks sb. The scale words are loaded
    whole per super-block, as Q4_K_R's header, and chosen by c in registers: a load indexed by c alone got a
    layout of its own that Triton 3.6 converted through shared memory in the loop (head 623 us)."""
    bp = wp + sb * 56
    return (tl.load(bp + 4 + c * 4 + k), tl.load(bp + 20 + c * 4 + k), tl.load(bp + 36 + c * 4 + k),
            tl.load(bp), tl.load(bp + 1), tl.load(bp + 2), tl.load(bp + 3), tl.load(bp + 52))


@triton.jit
def _q6_k_r_fma(acc, raw, xb, c, base, ASM: tl.constexpr, XA: tl.constexpr):
    """acc += the chunk's weights times x (xb: x at the first weight of each thread's words). The top two bits
    land on bits 4-5 of each nibble byte by one shift and one mask, and w = S (q - 32) = fma(0.5 + q / 256, 256 S,
    -160 S) with S = d sc: 160 S is exact (S has at most 19 significant bits), so the FMA rounds S (q - 32) once,
    as Q6_K's decoder does."""
    v0, v1, vh, w0, w1, w2, w3, dw = raw
    sw = tl.where(c == 0, w0, tl.where(c == 1, w1, tl.where(c == 2, w2, w3)))
    d = _f16_lo(dw)
    s0 = d * ((sw << 24) >> 24).to(tl.float32)  # the int8 scales of sub-blocks 4c .. 4c + 3
    s1 = d * ((sw << 16) >> 24).to(tl.float32)
    s2 = d * ((sw << 8) >> 24).to(tl.float32)
    s3 = d * (sw >> 24).to(tl.float32)
    l0 = (v0 & 0x0F0F0F0F) | ((vh << 4) & 0x30303030)
    l1 = (v1 & 0x0F0F0F0F) | ((vh << 2) & 0x30303030)
    u0 = ((v0 >> 4) & 0x0F0F0F0F) | (vh & 0x30303030)
    u1 = ((v1 >> 4) & 0x0F0F0F0F) | ((vh >> 2) & 0x30303030)
    for b in tl.static_range(4):
        s_lo = s0 if b < 2 else s1
        s_hi = s2 if b < 2 else s3
        acc += tl.fma(_nibble(l0, base, b, ASM), 256.0 * s_lo, -160.0 * s_lo) * _xf(tl.load(xb + 8 * b), XA)
        acc += tl.fma(_nibble(l1, base, b, ASM), 256.0 * s_lo, -160.0 * s_lo) * _xf(tl.load(xb + 8 * b + 4), XA)
        acc += tl.fma(_nibble(u0, base, b, ASM), 256.0 * s_hi, -160.0 * s_hi) * _xf(tl.load(xb + 32 + 8 * b), XA)
        acc += tl.fma(_nibble(u1, base, b, ASM), 256.0 * s_hi, -160.0 * s_hi) * _xf(tl.load(xb + 36 + 8 * b), XA)
    return acc


@triton.jit
def _q4_k_r_step_load(wp, sb, c, k, D_STRIDE):
    return _q4_k_r_load(wp, sb, c, k)


@triton.jit
def _q6_k_r_step_load(wp, sb, c, k, D_STRIDE):
    return _q6_k_r_load(wp, sb, c, k)


@triton.jit
def _q4_k_r_step_fma(acc, raw, xp, sb0, s, c, k, base, ASM: tl.constexpr, XA: tl.constexpr):
    """acc += one step's super-blocks (sb0 + s) times x."""
    return _q4_k_r_fma(acc, raw, xp + (sb0 + s) * 256 + c * 64 + k, c, base, ASM, XA)


@triton.jit
def _q6_k_r_step_fma(acc, raw, xp, sb0, s, c, k, base, ASM: tl.constexpr, XA: tl.constexpr):
    return _q6_k_r_fma(acc, raw, xp + (sb0 + s) * 256 + c * 64 + k, c, base, ASM, XA)


@triton.jit
def _dp4a(a, b, c, UA: tl.constexpr, ASM: tl.constexpr):
    """c + the sum of the four byte products of a and b (b's bytes signed, a's unsigned with UA, else signed): one
    `dp4a` on the GPU."""
    if ASM:
        return tl.inline_asm_elementwise("dp4a.u32.s32 $0, $1, $2, $3;" if UA else "dp4a.s32.s32 $0, $1, $2, $3;",
                                         "=r,r,r,r", [a, b, c], dtype=tl.int32, is_pure=True, pack=1)
    else:
        r = c
        for j in tl.static_range(4):
            if UA:
                aj = (a >> (8 * j)) & 255
            else:
                aj = (a << (24 - 8 * j)) >> 24
            r += aj * ((b << (24 - 8 * j)) >> 24)
        return r


@triton.jit
def _dot8(a0, x0, a1, x1, UA: tl.constexpr, ASM: tl.constexpr):
    """The integer dot product of the 8 bytes of words a0, a1 with those of x0, x1 (two `dp4a`)."""
    return _dp4a(a1, x1, _dp4a(a0, x0, a0 * 0, UA, ASM), UA, ASM)


@triton.jit
def _i2f(i):
    """int32 i with |i| < 2^22 as fp32, exactly, in an integer add and a float add (no quarter-rate convert)."""
    return (i + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0


@triton.jit
def _q8x_scales(uw, j):
    """(d, s) of run j of the Q8 activation unit at int32 word pointer uw (`Q8X_UNIT`)."""
    dp = (uw + 32 + 2 * j).to(tl.pointer_type(tl.float32))
    return tl.load(dp), tl.load(dp + 1)


@triton.jit
def _q4_k_r_q8x_fma(acc, raw, xp, sb0, s, c, k, base, ASM: tl.constexpr, XA: tl.constexpr):
    """acc += one step's Q4_K_R super-blocks (sb0 + s) times Q8 activations (xp: int32 pointer to the unit of the
    first super-block; group c's runs 2c and 2c + 1 are runs 2 (c % 2) and 2 (c % 2) + 1 of unit 2 sb + c // 2).
    Per run: x d S (q . qx) - M s, the dot product in integers."""
    v0, v1, h0, h1, h2, h3 = raw
    d = _f16_lo(h0)
    dm = _f16_lo(h0 >> 16)
    lowc = c < 2
    sh = (16 * c) % 32
    sc_lo, mn_lo = _k4_scale_min(h1, h2, h3, sh, lowc)
    sc_hi, mn_hi = _k4_scale_min(h1, h2, h3, sh + 8, lowc)
    uw = xp + ((sb0 + s) * 2 + c // 2) * 40
    xw = uw + (c % 2) * 16 + k
    i_lo = _dot8(v0 & 0x0F0F0F0F, tl.load(xw), v1 & 0x0F0F0F0F, tl.load(xw + 4), False, ASM)
    i_hi = _dot8((v0 >> 4) & 0x0F0F0F0F, tl.load(xw + 8), (v1 >> 4) & 0x0F0F0F0F, tl.load(xw + 12), False, ASM)
    xd_lo, xs_lo = _q8x_scales(uw, (c % 2) * 2)
    xd_hi, xs_hi = _q8x_scales(uw, (c % 2) * 2 + 1)
    a_lo = xd_lo * (d * _int_f32(sc_lo))
    a_hi = xd_hi * (d * _int_f32(sc_hi))
    off = dm * _int_f32(mn_lo) * xs_lo + dm * _int_f32(mn_hi) * xs_hi
    i_lo = tl.sum(i_lo, axis=3, keep_dims=True)  # the run's 32 products, in integers
    i_hi = tl.sum(i_hi, axis=3, keep_dims=True)
    return acc + (_i2f(i_lo) * a_lo + _i2f(i_hi) * a_hi - off)


@triton.jit
def _q6_half(q0, x0, q1, x1, ones, ASM: tl.constexpr):
    """(q - 32) . qx over the bytes x0, x1 keep (the others zeroed): q . qx - 32 sum(qx)."""
    return _dot8(q0, x0, q1, x1, False, ASM) - 32 * _dot8(x0, ones, x1, ones, False, ASM)


@triton.jit
def _q6_k_r_q8x_fma(acc, raw, xp, sb0, s, c, k, base, ASM: tl.constexpr, XA: tl.constexpr):
    """acc += one step's Q6_K_R super-blocks times Q8 activations (units as for Q4_K_R). Each run holds two
    sub-blocks of 16 (bytes 0-1 and 2-3 of every word), so each word's dot product is taken per half, and
    S (q - 32) . x = xd S (q . qx - 32 sum(qx)) with the half's sum of qx from `dp4a` against ones."""
    v0, v1, vh, w0, w1, w2, w3, dw = raw
    sw = tl.where(c == 0, w0, tl.where(c == 1, w1, tl.where(c == 2, w2, w3)))
    d = _f16_lo(dw)
    l0 = (v0 & 0x0F0F0F0F) | ((vh << 4) & 0x30303030)
    l1 = (v1 & 0x0F0F0F0F) | ((vh << 2) & 0x30303030)
    u0 = ((v0 >> 4) & 0x0F0F0F0F) | (vh & 0x30303030)
    u1 = ((v1 >> 4) & 0x0F0F0F0F) | ((vh >> 2) & 0x30303030)
    uw = xp + ((sb0 + s) * 2 + c // 2) * 40
    xw = uw + (c % 2) * 16 + k
    x0, x1, x2, x3 = tl.load(xw), tl.load(xw + 4), tl.load(xw + 8), tl.load(xw + 12)
    ones = x0 * 0 + 0x01010101
    i0 = _q6_half(l0, x0 & 0x0000FFFF, l1, x1 & 0x0000FFFF, ones, ASM)
    i1 = _q6_half(l0, x0 & -65536, l1, x1 & -65536, ones, ASM)  # -65536: 0xFFFF0000
    i2 = _q6_half(u0, x2 & 0x0000FFFF, u1, x3 & 0x0000FFFF, ones, ASM)
    i3 = _q6_half(u0, x2 & -65536, u1, x3 & -65536, ones, ASM)
    xd_lo, _ = _q8x_scales(uw, (c % 2) * 2)
    xd_hi, _ = _q8x_scales(uw, (c % 2) * 2 + 1)
    s0 = d * ((sw << 24) >> 24).to(tl.float32)  # the int8 scales of sub-blocks 4c .. 4c + 3
    s1 = d * ((sw << 16) >> 24).to(tl.float32)
    s2 = d * ((sw << 8) >> 24).to(tl.float32)
    s3 = d * (sw >> 24).to(tl.float32)
    i0 = _i2f(tl.sum(i0, axis=3, keep_dims=True))
    i1 = _i2f(tl.sum(i1, axis=3, keep_dims=True))
    i2 = _i2f(tl.sum(i2, axis=3, keep_dims=True))
    i3 = _i2f(tl.sum(i3, axis=3, keep_dims=True))
    return acc + (xd_lo * (s0 * i0 + s1 * i1) + xd_hi * (s2 * i2 + s3 * i3))


@triton.jit
def _q8_0_r_q8x_fma(acc, raw, xp, sb, s, blk, k, base, ASM: tl.constexpr, XA: tl.constexpr):
    """acc += one Q8_0_R chunk's weights (of groups sb + s) times Q8 activations: block blk of group g is run
    blk % 4 of unit 2 g + blk // 4; the stored bytes are q + 128, so dw (xd (u . qx) - 128 s)."""
    v0, v1, dw = raw
    dw = dw.to(tl.float32)
    uw = xp + ((sb + s) * 2 + blk // 4) * 40
    xw = uw + (blk % 4) * 8 + k
    i = _dot8(v0, tl.load(xw), v1, tl.load(xw + 4), True, ASM)
    xd, xs = _q8x_scales(uw, blk % 4)
    return acc + (_i2f(tl.sum(i, axis=3, keep_dims=True)) * (dw * xd) - (128.0 * dw) * xs)


@triton.jit
def _q5_1_r_q8x_fma(acc, raw, xp, sb, s, blk, k, base, ASM: tl.constexpr, XA: tl.constexpr):
    """acc += one Q5_1_R chunk's weights (of groups sb + s) times Q8 activations (group g is unit g, block blk its
    run blk): d xd (q . qx) + m s."""
    v, dmw, qh = raw
    d = _f16_lo(dmw)
    m = _f16_lo(dmw >> 16)
    lo = (v & 0x0F0F0F0F) | ((qh >> k) & 0x10101010)
    hi = ((v >> 4) & 0x0F0F0F0F) | ((qh << (4 - k)) & 0x10101010)
    uw = xp + (sb + s) * 40
    xw = uw + blk * 8 + k
    i = _dot8(lo, tl.load(xw), hi, tl.load(xw + 4), False, ASM)
    xd, xs = _q8x_scales(uw, blk)
    return acc + (_i2f(tl.sum(i, axis=3, keep_dims=True)) * (d * xd) + m * xs)


@triton.jit
def _super_block_rows(rp, xp, base, NCH: tl.constexpr, SBC: tl.constexpr, BR: tl.constexpr, ASM: tl.constexpr,
                      GDC: tl.constexpr, Q6: tl.constexpr, REL: tl.constexpr = False, XA: tl.constexpr = False,
                      PRE: tl.constexpr = 1, XQ: tl.constexpr = False, SS: tl.constexpr = 0):
    """[BR] fp32: the Q4_K_R rows (Q6_K_R with Q6) at byte pointers rp (16-byte aligned) times x at xp ([BR, 1, 1,
    1] pointers, one x), NCH super-blocks, SBC per loop step (`_k_loop`, SS)."""
    wp = rp.to(tl.pointer_type(tl.int32))[:, None, None, None]
    s = tl.arange(0, SBC)[None, :, None, None]
    c = tl.arange(0, 4)[None, None, :, None]
    k = tl.arange(0, 4)[None, None, None, :]
    if Q6 and XQ:
        return _k_loop(wp, xp, s, c, k, base, 0, NCH // SBC, SBC, BR, _q6_k_r_step_load, _q6_k_r_q8x_fma, ASM, XA,
                       GDC, REL, PRE, 4, 1, SS)
    elif Q6:
        return _k_loop(wp, xp, s, c, k, base, 0, NCH // SBC, SBC, BR, _q6_k_r_step_load, _q6_k_r_step_fma, ASM, XA,
                       GDC, REL, PRE, 4, 4, SS)
    elif XQ:
        return _k_loop(wp, xp, s, c, k, base, 0, NCH // SBC, SBC, BR, _q4_k_r_step_load, _q4_k_r_q8x_fma, ASM, XA,
                       GDC, REL, PRE, 4, 1, SS)
    else:
        return _k_loop(wp, xp, s, c, k, base, 0, NCH // SBC, SBC, BR, _q4_k_r_step_load, _q4_k_r_step_fma, ASM, XA,
                       GDC, REL, PRE, 4, 4, SS)


@triton.jit
def _k_loop(wp, xp, s, a, k, base, D_STRIDE, NIT: tl.constexpr, SBC: tl.constexpr, BR: tl.constexpr,
            LOAD: tl.constexpr, FMA: tl.constexpr, ASM: tl.constexpr, XA: tl.constexpr, GDC: tl.constexpr,
            REL: tl.constexpr, PRE: tl.constexpr, NA: tl.constexpr = 4, AK: tl.constexpr = 4, SS: tl.constexpr = 0):
    """[BR] fp32: a [BR, SBC, NA, 4] tile's K loop of NIT steps, LOAD(wp, step's groups, a, k, D_STRIDE) giving a
    step's words and FMA(acc, words, xp, first group, s, a, k, base, ASM, XA) adding their products, the next
    step's words loaded before this one's arithmetic. The first PRE steps' words (up to 6) are in flight before
    `pdl.wait(GDC)` (`PRELOAD`); the steps' sums are added in the same order whatever PRE is, so the result is
    the same. AK: the accumulator's last dimension (4, or 1 where FMA sums the 4 words itself). SS: chunks from one
    step's words of a row to the next step's (0: SBC, rows stored whole; `TILE`)."""
    tl.static_assert(1 <= PRE and PRE <= 6 and PRE <= NIT, "preloaded steps: 1 .. min(6, loop steps)")
    LS: tl.constexpr = SS if SS > 0 else SBC
    if PRE == 1:
        nxt = LOAD(wp, s, a, k, D_STRIDE)
        pdl.wait(GDC)
        if REL:
            pdl.started(GDC)
        acc = tl.zeros([BR, SBC, NA, AK], tl.float32)
        for it in tl.range(0, NIT):
            cur = nxt
            nxt = LOAD(wp, tl.minimum(it + 1, NIT - 1) * LS + s, a, k, D_STRIDE)
            acc = FMA(acc, cur, xp, it * SBC, s, a, k, base, ASM, XA)
    else:
        c0 = LOAD(wp, s, a, k, D_STRIDE)
        c1 = LOAD(wp, LS + s, a, k, D_STRIDE)
        c2 = LOAD(wp, 2 * LS + s, a, k, D_STRIDE) if PRE > 2 else c0
        c3 = LOAD(wp, 3 * LS + s, a, k, D_STRIDE) if PRE > 3 else c0
        c4 = LOAD(wp, 4 * LS + s, a, k, D_STRIDE) if PRE > 4 else c0
        c5 = LOAD(wp, 5 * LS + s, a, k, D_STRIDE) if PRE > 5 else c0
        pdl.wait(GDC)
        if REL:
            pdl.started(GDC)
        acc = tl.zeros([BR, SBC, NA, AK], tl.float32)
        if PRE < NIT:  # the next step's words go out before the preloaded steps' arithmetic
            nxt = LOAD(wp, PRE * LS + s, a, k, D_STRIDE)
        acc = FMA(acc, c0, xp, 0, s, a, k, base, ASM, XA)
        acc = FMA(acc, c1, xp, SBC, s, a, k, base, ASM, XA)
        if PRE > 2:
            acc = FMA(acc, c2, xp, 2 * SBC, s, a, k, base, ASM, XA)
        if PRE > 3:
            acc = FMA(acc, c3, xp, 3 * SBC, s, a, k, base, ASM, XA)
        if PRE > 4:
            acc = FMA(acc, c4, xp, 4 * SBC, s, a, k, base, ASM, XA)
        if PRE > 5:
            acc = FMA(acc, c5, xp, 5 * SBC, s, a, k, base, ASM, XA)
        if PRE < NIT:
            for it in tl.range(PRE, NIT):
                cur = nxt
                nxt = LOAD(wp, tl.minimum(it + 1, NIT - 1) * LS + s, a, k, D_STRIDE)
                acc = FMA(acc, cur, xp, it * SBC, s, a, k, base, ASM, XA)
    return tl.sum(tl.sum(tl.sum(acc, axis=3), axis=2), axis=1)


@triton.jit
def _store(optr, v, rows, N):
    """out[rows] = v, rounded once to out's element type (`gemv_blocks.cast`)."""
    tl.store(optr + rows, gb.cast(v, optr.dtype.element_ty), mask=rows < N)


@triton.jit
def q8x_round(v, RB: tl.constexpr):
    """(q int32, d fp32 [RB, 1]) of RB runs of 32 fp32 values v [RB, 32]: `act_quant.quantize_q8`'s integers and
    scales, with the same correctly rounded divisions."""
    amax = tl.max(tl.abs(v), axis=1)[:, None]
    d = tl.div_rn(amax, tl.full([RB, 1], 127.0, tl.float32))
    pos = d > 0
    r = tl.where(pos, tl.div_rn(v, tl.where(pos, d, 1.0) + tl.zeros([RB, 32], tl.float32)), 0.0)
    q = (r + tl.where(r < 0, -0.5, 0.5)).to(tl.int32)
    return tl.minimum(tl.maximum(q, -127), 127), d


@triton.jit
def store_q8x_runs(x_ptr, q_ptr, run, ok, SPAN: tl.constexpr, RB: tl.constexpr, CG: tl.constexpr = False):
    """Runs `run` ([RB, 1] run indices, `ok` those that exist) of one row of x (`x_ptr`, float) rounded to Q8
    (`act_quant.quantize_q8`, the same divisions) and stored as that row's units (`q_ptr`, `Q8X_UNIT`),
    each run's bytes in the order of SPAN (`Q8X_ORDER`). CG: x is loaded past L1 (other programs of the launch
    wrote it). Quantize launches (`strata.kernels.gemv_q8x`) and producers that write their output's units too
    (the HC read, the GDN step) share it."""
    p = tl.arange(0, 32)[None, :]
    w = p // 4
    b = p % 4
    if SPAN == 8:
        src = 8 * b + w
    else:
        src = (w // 4) * 16 + 4 * b + w % 4
    if CG:
        v = tl.load(x_ptr + run * 32 + src, mask=ok, other=0.0, cache_modifier=".cg").to(tl.float32)
    else:
        v = tl.load(x_ptr + run * 32 + src, mask=ok, other=0.0).to(tl.float32)
    q, d = q8x_round(v, RB)
    s = d * tl.sum(q, axis=1)[:, None].to(tl.float32)
    base = q_ptr + (run // 4) * 160
    tl.store(base + (run % 4) * 32 + p, q.to(tl.int8), mask=ok)
    dp = (base + 128 + (run % 4) * 8).to(tl.pointer_type(tl.float32))
    tl.store(dp, d, mask=ok)
    tl.store(dp + 1, s, mask=ok)


@triton.jit(do_not_specialize=["D_STRIDE"])
def _rr_kernel(x_ptr, g_ptr, u_ptr, ids_ptr, out_ptr, part_ptr, cnt_ptr, sw_ptr, q_ptr, probe_ptr, N, g_row_stride,
               u_row_stride,
               g_slot_stride, u_slot_stride, x_slot_stride, out_slot_stride, q_slot_stride, BASE, X_ROW_STRIDE,
               D_STRIDE, KIND: tl.constexpr, CHUNK_ELEMS: tl.constexpr, CHUNK_BYTES: tl.constexpr,
               NCH: tl.constexpr, SBC: tl.constexpr, BR: tl.constexpr, GLU: tl.constexpr,
               HAS_IDS: tl.constexpr, ASM: tl.constexpr, SPLIT_SUM: tl.constexpr, SPLIT: tl.constexpr = 1,
               SLOT_SUM: tl.constexpr = 0, IDS_EARLY: tl.constexpr = False, RELEASE: tl.constexpr = 0,
               PRE: tl.constexpr = 1, XW: tl.constexpr = False, XQ: tl.constexpr = False, QOUT: tl.constexpr = 0,
               PROBE: tl.constexpr = False, TILE: tl.constexpr = 0, GDC: tl.constexpr = False):
    """out[slot, rows] = W[slot's matrix][rows] . x[slot], or with GLU act(G . x) * (U . x), for one token.

    Program (i, slot, s): BR rows of the matrix of `slot` (expert ids[slot] when HAS_IDS), or with GLU BR / 2 rows
    of the gate matrix and the same rows of the up matrix in one tile, over the s-th of SPLIT equal runs of the
    row's NCH chunks (of CHUNK_ELEMS weights in CHUNK_BYTES bytes, `CHUNK`). Rows past N are clamped to N - 1 and
    not stored. Byte strides; every row starts 16-byte aligned (the launcher checks). X_ROW_STRIDE is 0: x is
    addressed per tile row so its loads take the weight words' thread layout (one row per thread, so no load is
    repeated). With GDC (PDL) the first PRE chunks' words (`PRELOAD`) are in flight before the wait, unless the
    matrix depends on expert ids that the previous kernel may still be waiting for: IDS_EARLY says they are settled
    (written before the previous kernel passed its own wait, see `gemv.gemv_experts_sum`), so they are read from L2
    and the first chunk loaded before the wait as well.

    SPLIT > 1: the SPLIT partial sums of a row tile are added in program order by the last program to finish
    (SPLIT_SUM, `gemv._split_sum`: ticket counters, no atomics on the sums). SLOT_SUM = k > 0 (no split): out[0,
    rows] = sum over the k slots in order of sw[slot] * (the slot's product), by the same tickets over the slots:
    the routed experts' down projections and their weighted sum in one launch.

    PDL: RELEASE says where the next kernel is let in (`pdl.started`, see `RELEASE`): AFTER_LOOP once every
    program is past its K loop, AT_WAIT right after this kernel's PDL wait, FIRST before its first load (for a
    launch by unsettled expert ids, which waits first, FIRST is AT_WAIT).

    QOUT (GLU, no split; a word span of `Q8X_ORDER`, 0: none): each slot's output is also stored as Q8 units to
    q (`store_q8x_runs`), each run of 32 outputs by the last of its 32 / (BR / 2) programs to draw a ticket from
    cnt (one counter per slot and run), for the Q8 GEMV that reads it (the routed down projections).

    PROBE (GPU only, `Probe`): the program stores its SM and the global timer when it starts, passes its PDL wait
    (launches by unsettled ids; else 0), ends its K loop and ends, as one row of probe.

    TILE > 0 (a `TILE_MAJOR` type, `repack.tile_major`): the matrices are stored in tiles of TILE rows, each tile
    step by step: [N / TILE, loop steps, TILE, SBC chunks], so that the words of one step of a tile's rows lie
    together; row strides are then ignored."""
    if PROBE:
        t_start = globaltimer()
    if HAS_IDS and not IDS_EARLY:
        pdl.wait(GDC)
        if RELEASE != 0:
            pdl.started(GDC)
    elif RELEASE == 2:
        pdl.started(GDC)
    if PROBE:
        t_waited = globaltimer() if HAS_IDS and not IDS_EARLY else t_start * 0
    REL: tl.constexpr = RELEASE == 1 and (IDS_EARLY or not HAS_IDS)  # started by the K loop's helper, at its wait
    XA: tl.constexpr = XW if ASM else False
    pid = tl.program_id(0)
    slot = tl.program_id(1).to(tl.int64)
    part = tl.program_id(2)
    if HAS_IDS:
        mat = tl.load(ids_ptr + slot, cache_modifier=".cg").to(tl.int64)
    else:
        mat = slot * 0
    r = tl.arange(0, BR)
    if GLU:
        HB: tl.constexpr = BR // 2
        rows_c = tl.minimum(pid * HB + r % HB, N - 1).to(tl.int64)
    else:
        rows_c = tl.minimum(pid * BR + r, N - 1).to(tl.int64)
    if TILE > 0:  # rows of NCH chunks, stored in tiles of steps of SBC chunks (`gemv_blocks.row_offsets`)
        g_off = gb.row_offsets(rows_c, NCH * CHUNK_BYTES, TILE, SBC * CHUNK_BYTES)
        u_off = g_off
    else:
        g_off = rows_c * g_row_stride
        u_off = rows_c * u_row_stride
    if GLU:
        rp = tl.where(r < HB, g_ptr + mat * g_slot_stride + g_off, u_ptr + mat * u_slot_stride + u_off)
    else:
        rp = g_ptr + mat * g_slot_stride + g_off
    NC: tl.constexpr = NCH // SPLIT
    rp = tl.multiple_of(rp + part * (NC * CHUNK_BYTES * (TILE if TILE > 0 else 1)), 16)
    if XQ:  # Q8 activations (`Q8X_UNIT`): int32 words of units of 128 values
        xp = (x_ptr + slot * x_slot_stride + part * (NC * CHUNK_ELEMS // 128 * 160) + r * X_ROW_STRIDE)
        xp = xp.to(tl.pointer_type(tl.int32))[:, None, None, None]
    else:
        xp = (x_ptr + slot * x_slot_stride + part * (NC * CHUNK_ELEMS) + r * X_ROW_STRIDE)[:, None, None, None]
    if KIND == "Q4_K_R" or KIND == "Q6_K_R":
        res = _super_block_rows(rp, xp, tl.full([BR, SBC, 4, 4], 0, tl.int32) + BASE, NC, SBC, BR, ASM,
                                GDC and (IDS_EARLY or not HAS_IDS), KIND == "Q6_K_R", REL, XA, PRE, XQ, SBC * TILE)
    elif KIND == "Q8_0_R":
        res = _q8_0_r_rows(rp, xp, tl.full([BR, SBC, 8, 4], 0, tl.int32) + BASE, D_STRIDE, NC, SBC, BR, ASM,
                           GDC and (IDS_EARLY or not HAS_IDS), REL, XA, PRE, XQ, SBC * TILE)
    else:
        res = _q5_1_r_rows(rp, xp, tl.full([BR, SBC, 4, 4], 0, tl.int32) + BASE, D_STRIDE, NC, SBC, BR, ASM,
                           GDC and (IDS_EARLY or not HAS_IDS), PRE, REL, XA, XQ, SBC * TILE)
    if RELEASE == 0:
        pdl.started(GDC)
    if PROBE:
        t_looped = globaltimer()
    last = 1
    optr = out_ptr + slot * out_slot_stride
    if SLOT_SUM > 0:
        res = res * tl.load(sw_ptr + slot).to(tl.float32)
        res2, last = SPLIT_SUM(res[:, None], part_ptr + pid * (SLOT_SUM * BR), cnt_ptr + pid, slot, SLOT_SUM, BR, 1)
        res = tl.sum(res2, axis=1)
        optr = out_ptr
    elif SPLIT > 1:
        tile = slot * tl.num_programs(0) + pid
        res2, last = SPLIT_SUM(res[:, None], part_ptr + tile * (SPLIT * BR), cnt_ptr + tile, part, SPLIT, BR, 1)
        res = tl.sum(res2, axis=1)
    if GLU:
        g, u = tl.split(tl.permute(tl.reshape(res, [2, BR // 2]), (1, 0)))
        dt: tl.constexpr = out_ptr.dtype.element_ty
        g = gb.rounded(g, dt)
        y = gb.rounded(g / (1.0 + tl.exp(-g)), dt) * gb.rounded(u, dt)  # torch's silu, rounded as the model rounds
        _store(optr, y, pid * (BR // 2) + tl.arange(0, BR // 2), N * last)
        if QOUT > 0:
            tl.debug_barrier()  # every thread's outputs are stored before the ticket is drawn
            PPR: tl.constexpr = 32 // (BR // 2)
            run = pid // PPR
            qc = cnt_ptr + slot * (N // 32) + run
            if tl.atomic_add(qc, 1, sem="acq_rel", scope="gpu") == PPR - 1:
                rr = run + tl.zeros([1, 1], tl.int32)
                store_q8x_runs(optr, q_ptr + slot * q_slot_stride, rr, rr >= 0, QOUT, 1, CG=True)
                tl.atomic_xchg(qc, 0, sem="relaxed", scope="gpu")  # back to 0 for the next launch
    else:
        _store(optr, res, pid * BR + r, N * last)
    if PROBE:
        row = probe_ptr + ((slot * tl.num_programs(0) + pid) * tl.num_programs(2) + part) * 5
        tl.store(row, smid().to(tl.int64))
        tl.store(row + 1, t_start)
        tl.store(row + 2, t_waited)
        tl.store(row + 3, t_looped)
        tl.store(row + 4, globaltimer())


Q8X_ORDER = {"Q4_K_R": 8, "Q8_0_R": 8, "Q5_1_R": 4, "Q6_K_R": 8}
"""The types with a K loop for Q8 activations (`XQ`), and the span S of a word's bytes in a run of x as each
type's words hold their weights (`repack.py`): byte b of word w holds value S b + w (S = 8), or for S = 4 value
4 b + w of the run's first 16 (words 0-3) and 16 + 4 b + (w - 4) of its last 16 (words 4-7)."""
Q8X_ORDER.update({kind: Q8X_ORDER[base] for kind, (base, _, _) in TILE_MAJOR.items()})

Q8X_UNIT = (128, 160)
"""(values, bytes) of a unit of Q8 activations as the kernel reads them (`strata.kernels.gemv_q8x.quantize`): the
128 int8 values of four runs of 32, each run's bytes in its consumer's order, then each run's (d, s) as fp32."""

_Q8X_RECORDS: dict[int, tuple[weakref.ref, int, int, torch.Tensor]] = {}


def record_q8x(x: torch.Tensor, units: torch.Tensor, span: int) -> None:
    """Record that x's producer also wrote x as Q8 units for words of `span` (`Q8X_ORDER`) into `units`, in the
    launch that wrote x: `gemv_q8x.quantize` of x (or of a view of all of it) then returns them and launches
    nothing. The record dies with x and no longer applies once x is changed in place by torch (its version counter
    moves; inference tensors have none, and the model changes no op's output in place)."""
    key = x.data_ptr()

    def forget(ref: weakref.ref, key: int = key) -> None:
        if _Q8X_RECORDS.get(key, (None,))[0] is ref:
            del _Q8X_RECORDS[key]

    _Q8X_RECORDS[key] = (weakref.ref(x, forget), _version(x), span, units)


def _version(x: torch.Tensor) -> int | None:
    return None if x.is_inference() else x._version


def recorded_q8x(x: torch.Tensor, span: int) -> torch.Tensor | None:
    """The units `record_q8x` recorded for x (rows, K) and `span`, or None."""
    e = _Q8X_RECORDS.get(x.data_ptr())
    t = e[0]() if e is not None else None
    if (t is None or e[2] != span or _version(x) != e[1] or _version(t) != e[1] or x.dtype != t.dtype
            or x.numel() != t.numel() or not x.is_contiguous()
            or x.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()
            or tuple(e[3].shape) != (x.shape[0], x.shape[1] // Q8X_UNIT[0] * Q8X_UNIT[1])):
        return None
    return e[3]


CHUNK = {"Q4_K_R": (256, 144), "Q8_0_R": (256, 272), "Q5_1_R": (128, 96), "Q6_K_R": (256, 224)}
"""(weights, bytes) of one loop chunk of each type: a super-block, or a group of 8 (Q8_0_R) or 4 (Q5_1_R)
blocks."""
CHUNK.update({kind: CHUNK[base] for kind, (base, _, _) in TILE_MAJOR.items()})


def launch_shape(kind: str, n_chunks: int, tiles: int = 1 << 30) -> tuple[int, int, int, int]:
    """(rows per program, chunks per loop step, warps, K split) of a launch of `tiles` row tiles (all slots) over
    rows of n_chunks chunks. One row per thread: a warp covers 4 rows per step of 2 Q4_K_R super-blocks (8 per
    step of one, for an odd count), 4 Q8_0_R rows, 8 Q5_1_R rows. The launches are latency-bound, so the K loop is
    split over more programs when there are few row tiles and many chunks. 2 or 4 rows per thread, or
    prefetching a further chunk, measured slower or equal (bench/results/2026-12-04-h200-gemv-rr-lab*.json).
    A tile-major type (`TILE_MAJOR`) steps through its tiles' steps: Q4_K_RT two super-blocks per step in the
    Q4_K_R shape, Q6_K_RT one in the big Q6_K_R launches' shape."""
    if kind in TILE_MAJOR:
        base, tile, step = TILE_MAJOR[kind]
        br, sbc, warps = (8, 2, 2) if base == "Q4_K_R" else (16, 1, 2)
        assert sbc * CHUNK[kind][1] == step, kind
    elif kind == "Q6_K_R" and tiles >= BIG_LAUNCH_TILES:
        br, sbc, warps = 16, 1, 2
    elif kind in ("Q4_K_R", "Q6_K_R"):
        br, sbc, warps = (8, 2, 2) if n_chunks % 2 == 0 else (16, 1, 2)
    elif kind == "Q8_0_R":
        br, sbc, warps = 4, 1, 1
    else:
        br, sbc, warps = 8, 1, 1
    split = 1
    while tiles * split < SPLIT_MIN_PROGRAMS and n_chunks % (2 * split * sbc) == 0 and n_chunks // (2 * split) >= 4:
        split *= 2
    return br, sbc, warps, split


AFTER_LOOP, AT_WAIT, FIRST = 0, 1, 2

RELEASE = {"plain": AT_WAIT, "ids": AT_WAIT, "settled-ids": AFTER_LOOP}
"""Where a launch lets the next kernel be scheduled, by launch class: without expert ids ("plain"), by expert ids
it waits for ("ids": the routed GLU), by settled expert ids ("settled-ids": the routed down projections, which
read them before their wait). Measured in the 4K step on an H200 (`tools/step_variants.py`):

* "ids" AT_WAIT against AFTER_LOOP: the routed down projections then read their expert ids and first weights while
  the routed GLU runs, 4.643 -> 4.604 ms per replay (bench/results/2026-12-04-h200-step-variants-release-router.json);
* "plain" AT_WAIT against AFTER_LOOP: the next kernel is launched and loads its weights while this one streams
  (the HC read after an out projection 7.1 -> 4.6 us of a layer's path), with the QSA cache-write kernel letting
  its own successors in only after its wait (`pdl.LATE_RELEASE`): 4.527-4.541 -> 4.384-4.387 ms
  (bench/results/2026-12-04-h200-step-variants-release-plain.json). FIRST was slower than either (4.567-4.570):
  the chain of kernels behind it is launched while this one still waits for its predecessor. Alone, back to back
  with itself, a launch that lets the next one in early is slower (Q4_K_R 10240 x 2560 11.3 us without PDL, 15.8
  with FIRST): its successor's programs hold SM slots; in the step the successors are other, smaller launches."""

PRELOAD = {"Q5_1_R": 5, "Q8_0_R/6": 6, "q8:Q8_0_R/6": 2}
"""Loop steps of a launch's K loop whose words are loaded before its PDL wait, by type, or by type and loop steps
as "Q8_0_R/6" (`preload_steps`; at most `MAX_PRELOAD`; the other types load one): more of the weights in flight
while the kernel before runs, for more registers. In the 4K step on an H200
(bench/results/2026-12-04-h200-step-variants-preload.json): the routed down projections (Q5_1_R, five steps) with
all five, 4.598-4.609 -> 4.568 ms per replay (their share of a layer's path 9.4 -> 7.2 us). Two or more for every
Q8_0_R launch (the same code, measured on 53861cb), the projection groups among them, made the step slower
(4.67-4.72 ms: their early programs slow the HC read before them); all six for the launches of six steps only (the
GDN and QSA out projections, K split in 4) made it faster: 4.299-4.306 -> 4.236-4.241 ms on an H200
(bench/results/2026-12-05-h200-step-variants-7423ce2.json), 4.686-4.694 -> 4.641 on an H100.

Entries "q8:KIND" and "q8:KIND/STEPS" apply to launches with Q8 activations (`--activations q8`) and come first
there, where a deep preload measured slower. The q8 mode's out projections with two steps: 4.622-4.624 ms per
replay against 4.640-4.643 with one and 4.678-4.680 with six on an H100 80GB
(bench/results/2026-12-05-h100-step-variants-q8-preload-5f861f0.json, three processes on one machine); on an H200
six against one was 4.111-4.113 against 4.104-4.105 (*-h200-step-variants-preload-de27516.json)."""


WIDEN_X_ASM = True
"""Whether bf16 x is widened to fp32 by inline PTX on the GPU (`_xf`: one shift or one mask per element, against a
byte permute and a shift for every second element by `.to(tl.float32)`), the same values either way. Compiled for
sm_90 (`tools/gemv_sass.py --x-widen`), the K loops' instructions per weight fall Q4_K_R 6.25 -> 5.89 (its GLU 6.41
-> 5.89), Q8_0_R 5.81 -> 5.03, Q5_1_R 6.38 -> 5.88, Q6_K_R 6.31 -> 5.83 with the same loads
(bench/results/2026-12-04-cpu-gemv-sass-x-widen.json). In the step on an H200 the 4K replay fell 4.369-4.382 ->
4.310-4.316 ms (bench/results/2026-12-05-h200-step-variants-c3cce2d.json, `x-widen:1`), and the row-register
GEMVs give the same outputs both ways there (`tools/gpu_check_gemv.py`: bf16_widen_differing 0). "free" is a
timing probe only (`_xf`: no widening, wrong values): on an H100 the 4K replay 4.608-4.613 -> 4.542-4.543 ms
(bench/results/2026-12-06-h100-step-variants-fe85101.json), what the widening costs at most."""


def preload_steps(kind: str, steps: int, q8x: bool = False) -> int:
    """The K-loop steps of a `kind` launch of `steps` steps loaded before its PDL wait (`PRELOAD`: the entry
    "KIND/STEPS" for launches of that many steps, else "KIND", each first with the prefix "q8:" for launches with
    Q8 activations; one where none applies; at most `MAX_PRELOAD`)."""
    keys = (f"{kind}/{steps}", kind)
    if q8x:
        keys = tuple(f"q8:{k}" for k in keys) + keys
    pre = next((PRELOAD[k] for k in keys if k in PRELOAD), 1)
    return max(1, min(pre, steps, MAX_PRELOAD))


class Probe:
    """Where probed launches (`PROBE`) write one row per program: (SM, start, PDL wait passed, K loop ended, end),
    global-timer nanoseconds. Each launch takes the next region in call order, so the regions of a captured graph
    stay its launches' (`launches` lists them: label, launch class, first row, grid)."""

    FIELDS = ("sm", "start", "waited", "looped", "end")

    def __init__(self, device: torch.device | str, rows: int = 1 << 20) -> None:
        if torch.device(device).type != "cuda" or globaltimer is None:
            raise StrataError("the launch probe needs a CUDA device and a Triton with triton.language.extra.cuda")
        self.buf = torch.zeros(rows, len(self.FIELDS), dtype=torch.int64, device=device)
        self.used = 0
        self.launches: list[tuple[str, str, int, tuple[int, int, int]]] = []

    def region(self, label: str, cls: str, grid: tuple[int, int, int]) -> torch.Tensor:
        n = grid[0] * grid[1] * grid[2]
        if self.used + n > self.buf.shape[0]:
            raise StrataError(f"probe buffer of {self.buf.shape[0]} rows full: give it more rows")
        self.launches.append((label, cls, self.used, grid))
        self.used += n
        return self.buf[self.used - n:self.used]


PROBE: dict[str, Probe] = {}
"""Launch classes ("plain", "ids", "settled-ids", as `RELEASE`) whose launches record their programs (`Probe`):
`tools/step_probe.py` sets it while it captures a step. Empty: nothing is recorded and the kernels compile as
without it."""

MAX_PRELOAD = 6
"""The most loop steps a launch can load before its wait (`_k_loop`)."""

SPLIT_MIN_PROGRAMS = 2048
"""Programs below which `launch_shape` splits K (in halves, while each part keeps 4 chunks or more)."""

BIG_LAUNCH_TILES = 4096
"""Row tiles from which a Q6_K_R launch steps one super-block at a time: the head (248320 x 2560) 252 -> 224 us
(Q6_K_P with the generic kernel: 333 us; bench/results/2026-12-04-h200-gemv-rr-lab-3a28ac7.json)."""


def covers(kind: str, n_tok: int, w: torch.Tensor, up: torch.Tensor | None = None, strides: tuple[int, ...] = (),
           ) -> bool:
    """Whether this kernel takes a launch: a row-register type, one token, rows 16-byte aligned."""
    if kind not in ROW_REGISTER_TYPES or n_tok != 1 or w.dtype != torch.uint8:
        return False
    ptrs = [w.data_ptr(), w.stride(-2)] + ([up.data_ptr(), up.stride(-2)] if up is not None else [])
    return all(v % 16 == 0 for v in (*ptrs, *strides))


def launch(kind: str, x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor | None, out: torch.Tensor, n: int,
           k: int, slots: int, w_slot_stride: int, x_slot_stride: int, out_slot_stride: int,
           up: torch.Tensor | None, up_slot_stride: int, shape: tuple[int, int, int, int], split_sum,
           part: torch.Tensor, cnt: torch.Tensor, slot_weights: torch.Tensor | None, gdc: dict,
           ids_early: bool = False, q8x: bool = False, q_out: tuple[torch.Tensor, int] | None = None) -> None:
    """One launch over `slots` matrices (by `ids` when given) of n rows of k weights, in `shape`
    (`launch_shape`); `up` makes it the GLU (w is then the gate); `slot_weights` sums the slots into out's one row.
    Strides in elements of each tensor (bytes for the weights). The caller (`gemv._launch`) checked `covers`
    and gives the split-K scratch (`part`, `cnt`: tickets) and `gemv._split_sum`; `ids_early`: the ids are
    settled (`_rr_kernel`'s IDS_EARLY); `q8x`: x holds Q8 activations (`strata.kernels.gemv_q8x`, strides in bytes
    of its units), which `Q8X_ORDER`'s types take; `q_out` = (units (slots, n / 128 * 160) int8, span): a GLU
    also writes its output as Q8 units (`writes_q8x_out` says when it can; cnt: its tickets). A tile-major kind
    (`TILE_MAJOR`) is read as its row-major twin with the kernel's TILE; its launch must step through whole steps
    of its tiles and its matrices must be whole tiles."""
    if q8x and kind not in Q8X_ORDER:
        raise ValueError(f"{kind}: no GEMV with Q8 activations (those are {', '.join(Q8X_ORDER)})")
    br, sbc, warps, split = shape
    glu = up is not None
    base, tile, step = TILE_MAJOR.get(kind, (kind, 0, 0))
    if tile and (sbc * CHUNK[kind][1] != step or n % tile):
        raise ValueError(f"{kind}: tile-major rows ({tile} rows, {step}-byte steps) read {sbc} chunks of "
                         f"{CHUNK[kind][1]} bytes per step over {n} rows: not whole steps and tiles")
    if q_out is not None and not writes_q8x_out(glu, n, slots, shape, slot_weights is not None, cnt):
        raise ValueError(f"this launch cannot write Q8 units of its output (GLU {glu}, {n} rows, shape {shape})")
    u = up if glu else w
    grid = (triton.cdiv(n, br // 2 if glu else br), slots, split)
    cls = "plain" if ids is None else "settled-ids" if ids_early else "ids"
    probe = PROBE.get(cls)
    rows = probe.region(f"{kind}{' glu' if glu else ''} {n}x{k}", cls, grid) if probe is not None else None
    _rr_kernel[grid](
        x, w, u, ids if ids is not None else w, out, part, cnt, slot_weights if slot_weights is not None else out,
        q_out[0] if q_out is not None else out, rows if rows is not None else out, n, w.stride(-2), u.stride(-2),
        w_slot_stride,
        up_slot_stride if glu else w_slot_stride, x_slot_stride, out_slot_stride,
        q_out[0].stride(0) if q_out is not None else 0, _BASE[kind], 0, 1,
        KIND=base, CHUNK_ELEMS=CHUNK[kind][0], CHUNK_BYTES=CHUNK[kind][1], NCH=k // CHUNK[kind][0], SBC=sbc, BR=br,
        GLU=glu, HAS_IDS=ids is not None, ASM=x.device.type == "cuda", SPLIT_SUM=split_sum, SPLIT=split,
        SLOT_SUM=slots if slot_weights is not None else 0, IDS_EARLY=ids_early and ids is not None,
        RELEASE=RELEASE[cls], PRE=preload_steps(kind, k // CHUNK[kind][0] // (split * sbc), q8x), XW=WIDEN_X_ASM,
        XQ=q8x, QOUT=q_out[1] if q_out is not None else 0, PROBE=rows is not None, TILE=tile,
        num_warps=warps, **gdc)


def writes_q8x_out(glu: bool, n: int, slots: int, shape: tuple[int, int, int, int], summed: bool,
                   cnt: torch.Tensor | None) -> bool:
    """Whether a launch can also write its output as Q8 units (`launch`'s q_out): a GLU without K split or slot
    sum, whose programs tile runs of 32 outputs, with a ticket counter for every slot's run in `cnt`."""
    half = shape[0] // 2
    return (glu and not summed and shape[3] == 1 and n % Q8X_UNIT[0] == 0 and 0 < half <= 32 and 32 % half == 0
            and cnt is not None and cnt.numel() >= slots * n // 32)
