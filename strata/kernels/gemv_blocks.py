"""Per-block-type decoders of the quantized GEMV (Triton device functions).

Each `decode_<type>` turns one *chunk* of every row in a tile of BN rows (one 256-weight super-block for the k- and
i-quants, NB consecutive blocks for the 32/64-weight types, NB elements of a dense row) into fp32 weights, and says
which x element each weight multiplies. They share one signature, so the single kernel skeleton in `gemv.py`
takes any of them as a compile-time argument:

    w, xo = decode(rp, tab, BN, NB)

    rp   [BN] pointers to the chunk's first byte in each row (uint8; typed for dense rows)
    tab  the family's lookup table (IQ4 code values as fp32, i-quant grids as int32 words), else unused
    w    fp32 weights, shape [BN, *S]: the chunk's elements in whatever order the block layout makes natural
    xo   int offsets [*S] of the matching x elements from the chunk's start

The skeleton multiplies w by x and accumulates elementwise over the chunks, reducing across the tile only once at
the end: a cross-thread reduction per chunk (or per sub-block) costs as much as the decode itself.

How the decoders are built, and why:
* The packed bytes are loaded once each, in a tile shaped like the block layout (e.g. [BN, 4, 32] for the 128
  nibble bytes of Q4_K), and the bit fields are split off into an extra dimension (nibble, 2-bit plane) rather than
  reassembled into element order; `xo` follows the same order.
* Small unsigned codes become fp32 with the exponent trick `bits(0x4B000000 | q) - 2^23` (an OR and an FADD)
  rather than an int-to-float convert, whose throughput on Hopper is a quarter of the FP32 rate. (Q8_0_R8 is
  the exception: its bytes are whole codes, and loading them along K as int8 lets x load as vectors too, which
  measured faster: the GEMV is bound by load traffic through L1 more than by instructions.) The code's zero offset (8 for Q4_0, 32 for Q6_K...) folds into the FADD.
* Scales are combined per block or sub-block first (d * sc, dmin * m) and applied with one multiply or FMA per
  weight. Only fp32 rounding order differs from "dequantize, then dot".
* fp16 scales are read through a 2-byte pointer (every scale in every ggml block sits at an even offset).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _f16(p):
    """fp16 at (2-byte aligned) byte pointers p, as fp32."""
    return tl.load(p.to(tl.pointer_type(tl.float16))).to(tl.float32)


@triton.jit
def _u16(p):
    """Little-endian uint16 at (2-byte aligned) byte pointers p, as int32."""
    return tl.load(p.to(tl.pointer_type(tl.int16))).to(tl.int32) & 0xFFFF


@triton.jit
def _u8(p):
    """Bytes at p, as int32."""
    return tl.load(p).to(tl.int32)


@triton.jit
def _i2f(q, OFF: tl.constexpr):
    """`q - OFF` as fp32 for int32 q in [0, 2^23): exact, and no int-to-float convert instruction."""
    return (q | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + OFF)


@triton.jit
def rounded(v, DT: tl.constexpr):
    """fp32 v rounded (to nearest even) to DT, still held as fp32.

    bfloat16 is rounded on the bits (torch's formula) rather than by a cast: the same on every backend, and
    Triton's interpreter truncates fp32 -> bfloat16 casts. bfloat16 has fp32's exponent range, so the integer add
    also rounds subnormals and overflows to inf correctly."""
    if DT == tl.bfloat16:
        u = v.to(tl.int32, bitcast=True)
        return ((u + 0x7FFF + ((u >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
    elif DT == tl.float16:
        return v.to(tl.float16).to(tl.float32)
    else:
        return v


@triton.jit
def cast(v, dt: tl.constexpr):
    """fp32 v cast once to dt (bfloat16 rounded to nearest even by `rounded`, the same on every backend)."""
    if dt == tl.bfloat16:
        return (rounded(v, dt).to(tl.int32, bitcast=True) >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        return v.to(dt)


@triton.jit
def _ksigns(s7):
    """ggml's `ksigns_iq2xs[s7]`: the 7 stored sign bits plus an 8th that makes the count of minus signs even."""
    p = s7 ^ (s7 >> 4)
    p = p ^ (p >> 2)
    p = p ^ (p >> 1)
    return s7 | ((p & 1) << 7)


@triton.jit
def _j4(a, b, c, d):
    """[..., 2, 2] with [..., x, y] = (a, b, c, d)[x + 2y]: a new pair of dimensions held inside each thread."""
    return tl.join(tl.join(a, b), tl.join(c, d))


@triton.jit
def _j8(c0, c1, c2, c3, c4, c5, c6, c7):
    """[..., 2, 2, 2] with [..., x, y, z] = c[x + 2y + 4z], inside each thread."""
    return tl.join(_j4(c0, c1, c2, c3), _j4(c4, c5, c6, c7))


@triton.jit
def _i32(p):
    """int32 words at (4-byte aligned) byte pointers p."""
    return tl.load(p.to(tl.pointer_type(tl.int32)))


@triton.jit
def load_pointer(rp, tab, BN: tl.constexpr, NB: tl.constexpr):
    """The `load` of a decoder not split in two: the chunk's row pointers, which its `decode` then loads from."""
    return rp


# ---------------------------------------------------------------------------------------------------------------
# dense rows


@triton.jit
def decode_dense(rp, tab, BN: tl.constexpr, NB: tl.constexpr):
    """F32 / F16 / BF16 rows: NB consecutive elements. [BN, NB]."""
    k = tl.arange(0, NB)
    return tl.load(rp[:, None] + k[None, :]).to(tl.float32), k


# ---------------------------------------------------------------------------------------------------------------
# 32- and 64-weight blocks: NB blocks per chunk


@triton.jit
def decode_q8_0(rp, tab, BN: tl.constexpr, NB: tl.constexpr):
    """Q8_0: {fp16 d; int8 q[32]}, w = d q. [BN, NB, 32]."""
    b = tl.arange(0, NB)
    i = tl.arange(0, 32)
    blk = rp[:, None] + b[None, :] * 34
    q = _i2f(_u8(blk[:, :, None] + 2 + i[None, None, :]) ^ 0x80, 128.0)
    return q * _f16(blk)[:, :, None], b[:, None] * 32 + i[None, :]


@triton.jit
def decode_q4_0(rp, tab, BN: tl.constexpr, NB: tl.constexpr):
    """Q4_0: {fp16 d; qs[16]}, element i low nibble of qs[i], 16+i high nibble; w = d (q - 8).
    [BN, NB, 16, 2 = nibble]."""
    b = tl.arange(0, NB)
    i = tl.arange(0, 16)
    blk = rp[:, None] + b[None, :] * 18
    qb = _u8(blk[:, :, None] + 2 + i[None, None, :])
    d = _f16(blk)[:, :, None]
    base = b[:, None] * 32 + i[None, :]
    return tl.join(_i2f(qb & 15, 8.0) * d, _i2f(qb >> 4, 8.0) * d), tl.join(base, base + 16)


@triton.jit
def decode_q4_1(rp, tab, BN: tl.constexpr, NB: tl.constexpr):
    """Q4_1: {fp16 d, m; qs[16]}, w = d q + m. The 20-byte blocks keep qs 4-byte aligned: read as 4 int32 words,
    byte j of word k = qs[4k + j]. [BN, NB, 4, 2, 2 = byte, 2 = nibble]."""
    b = tl.arange(0, NB)
    k = tl.arange(0, 4)
    blk = rp[:, None] + b[None, :] * 20
    d = _f16(blk)[:, :, None]
    m = _f16(blk + 2)[:, :, None]
    v = tl.load((blk + 4).to(tl.pointer_type(tl.int32))[:, :, None] + k[None, None, :])
    lo = _j4(_i2f(v & 15, 0.0) * d + m, _i2f((v >> 8) & 15, 0.0) * d + m,
             _i2f((v >> 16) & 15, 0.0) * d + m, _i2f((v >> 24) & 15, 0.0) * d + m)
    hi = _j4(_i2f((v >> 4) & 15, 0.0) * d + m, _i2f((v >> 12) & 15, 0.0) * d + m,
             _i2f((v >> 20) & 15, 0.0) * d + m, _i2f((v >> 28) & 15, 0.0) * d + m)
    base = b[:, None] * 32 + 4 * k[None, :]
    xl = _j4(base, base + 1, base + 2, base + 3)
    return tl.join(lo, hi), tl.join(xl, xl + 16)


@triton.jit
def decode_q5_0(rp, tab, BN: tl.constexpr, NB: tl.constexpr):
    """Q5_0: {fp16 d; uint32 qh; qs[16]}, 5th bit of element e is bit e of qh; w = d (q - 16). qs read as 8
    uint16 (the block is only 2-byte aligned). [BN, NB, 8, 2 = nibble, 2 = byte]."""
    b = tl.arange(0, NB)
    j = tl.arange(0, 8)
    blk = rp[:, None] + b[None, :] * 22
    d = _f16(blk)[:, :, None]
    qh = (_u16(blk + 2) | (_u16(blk + 4) << 16))[:, :, None]
    v = _u16(blk[:, :, None] + 6 + 2 * j[None, None, :])
    e = 2 * j[None, None, :]
    w = _j4(_i2f((v & 15) | (((qh >> e) & 1) << 4), 16.0) * d,
            _i2f(((v >> 8) & 15) | (((qh >> (e + 1)) & 1) << 4), 16.0) * d,
            _i2f(((v >> 4) & 15) | (((qh >> (e + 16)) & 1) << 4), 16.0) * d,
            _i2f(((v >> 12) & 15) | (((qh >> (e + 17)) & 1) << 4), 16.0) * d)
    base = b[:, None] * 32 + 2 * j[None, :]
    return w, _j4(base, base + 1, base + 16, base + 17)


@triton.jit
def _spread4(h):
    """Bits 0-3 of int32 h moved to bit 4 of bytes 0-3 (one multiply: the four shifted copies do not overlap)."""
    return ((h & 15) * 0x02040810) & 0x10101010


@triton.jit
def load_q5_1(rp, tab, BN: tl.constexpr, NB: tl.constexpr):
    """The loads of `decode_q5_1`: d and m (fp16), qh and the qs words."""
    b = tl.arange(0, NB)
    k = tl.arange(0, 4)
    blk = rp[:, None] + b[None, :] * 24
    d = tl.load(blk.to(tl.pointer_type(tl.float16)))
    m = tl.load((blk + 2).to(tl.pointer_type(tl.float16)))
    qh = _i32(blk + 4)
    v = tl.load((blk + 8).to(tl.pointer_type(tl.int32))[:, :, None] + k[None, None, :])
    return d, m, qh, v


@triton.jit
def unpack_q5_1(raw, tab, BN: tl.constexpr, NB: tl.constexpr):
    """The arithmetic of `decode_q5_1` on what `load_q5_1` loaded."""
    d, m, qh, v = raw
    d = d.to(tl.float32)[:, :, None]
    m = m.to(tl.float32)[:, :, None]
    qh = qh[:, :, None]
    b = tl.arange(0, NB)
    k = tl.arange(0, 4)
    e = 4 * k[None, None, :]
    lo = (v & 0x0F0F0F0F) | _spread4(qh >> e)
    hi = ((v >> 4) & 0x0F0F0F0F) | _spread4(qh >> (e + 16))
    wl = _j4(_byte(lo, 0), _byte(lo, 8), _byte(lo, 16), _byte(lo, 24))
    wh = _j4(_byte(hi, 0), _byte(hi, 8), _byte(hi, 16), _byte(hi, 24))
    base = b[:, None] * 32 + 4 * k[None, :]
    xl = _j4(base, base + 1, base + 2, base + 3)
    return (tl.join(_i2f(wl, 0.0) * d[:, :, :, None, None] + m[:, :, :, None, None],
                    _i2f(wh, 0.0) * d[:, :, :, None, None] + m[:, :, :, None, None]),
            tl.join(xl, xl + 16))


@triton.jit
def decode_q5_1(rp, tab, BN: tl.constexpr, NB: tl.constexpr):
    """Q5_1: {fp16 d, m; uint32 qh; qs[16]}, w = d q + m; qh and qs are 4-byte aligned (24-byte blocks): int32
    words. The low (high) nibbles of qs word k are elements 4k + j (16 + 4k + j), whose 5th bits are bits 4k + j
    (16 + 4k + j) of qh; `_spread4` puts the four of a word at bit 4 of its bytes, so each byte then holds a whole
    5-bit code (18% fewer instructions per weight than merging bit by bit; 10 expert down projections of 2560 x
    640: 12.2 -> 10.4 us on an H200). [BN, NB, 4, 2, 2 = byte, 2 = nibble]."""
    return unpack_q5_1(load_q5_1(rp, tab, BN, NB), tab, BN, NB)


@triton.jit
def decode_iq4_nl(rp, tab, BN: tl.constexpr, NB: tl.constexpr):
    """IQ4_NL: Q4_0's layout, but the nibble indexes a 16-value non-linear code (tab, fp32): w = d code[q].
    [BN, NB, 2 = nibble, 16]."""
    b = tl.arange(0, NB)
    i = tl.arange(0, 16)
    nib = tl.arange(0, 2)
    blk = rp[:, None] + b[None, :] * 18
    qb = _u8(blk[:, :, None] + 2 + i[None, None, :])
    q = (qb[:, :, None, :] >> (4 * nib)[None, None, :, None]) & 15
    xo = b[:, None, None] * 32 + nib[None, :, None] * 16 + i[None, None, :]
    return tl.load(tab + q) * _f16(blk)[:, :, None, None], xo


@triton.jit
def decode_q2_0(rp, tab, BN: tl.constexpr, NB: tl.constexpr):
    """Q2_0 (ggml type 42): 64 weights {fp16 d; qs[16]}, weight j = bits 2(j%4) of qs[j/4]; w = d (q - 1).
    qs read as 8 uint16, each holding 8 consecutive weights. [BN, NB, 8, 2, 2, 2]."""
    b = tl.arange(0, NB)
    j = tl.arange(0, 8)
    blk = rp[:, None] + b[None, :] * 18
    v = _u16(blk[:, :, None] + 2 + 2 * j[None, None, :])
    d = _f16(blk)[:, :, None]
    w = _j8(_i2f(v & 3, 1.0) * d, _i2f((v >> 2) & 3, 1.0) * d, _i2f((v >> 4) & 3, 1.0) * d,
            _i2f((v >> 6) & 3, 1.0) * d, _i2f((v >> 8) & 3, 1.0) * d, _i2f((v >> 10) & 3, 1.0) * d,
            _i2f((v >> 12) & 3, 1.0) * d, _i2f((v >> 14) & 3, 1.0) * d)
    base = b[:, None] * 64 + 8 * j[None, :]
    return w, _j8(base, base + 1, base + 2, base + 3, base + 4, base + 5, base + 6, base + 7)


# ---------------------------------------------------------------------------------------------------------------
# k-quants: one 256-weight super-block per chunk


@triton.jit
def _k4_scales(rp, c):
    """d*sc and dmin*m of sub-blocks 2c (low nibbles) and 2c+1 (high) of a Q4_K/Q5_K super-block: four [BN, 4, 1]
    tiles."""
    # one super-block: the NB form over a size-1 NB dimension, summed away
    sc_lo, mn_lo = _k4_scale_min_nb(rp[:, None] + 4, 2 * c)
    sc_hi, mn_hi = _k4_scale_min_nb(rp[:, None] + 4, 2 * c + 1)
    sc_lo = tl.sum(sc_lo, axis=1)
    mn_lo = tl.sum(mn_lo, axis=1)
    sc_hi = tl.sum(sc_hi, axis=1)
    mn_hi = tl.sum(mn_hi, axis=1)
    d = _f16(rp)[:, None, None]
    dm = _f16(rp + 2)[:, None, None]
    return d * sc_lo, dm * mn_lo, d * sc_hi, dm * mn_hi


@triton.jit
def _k4_scale_min_nb(sp, s):
    """The 6-bit scales and mins of sub-blocks `s` (a [4] tile of 0..7) packed in the 12 bytes at sp ([BN, NB]
    pointers, one per super-block): ggml's get_scale_min_k4. Two [BN, NB, 4, 1] fp32 tiles."""
    j = (s & 3)[None, None, :, None]
    low = (s < 4)[None, None, :, None]
    p = sp[:, :, None, None] + j
    sc, mn = _k4_unpack(_u8(p), _u8(p + 4), _u8(p + 8), low)
    return _i2f(sc, 0.0), _i2f(mn, 0.0)


@triton.jit
def _k4_unpack(b0, b4, b8, low):
    """Scale and min (int32) of K-quant sub-block j from bytes j, j + 4 and j + 8 of its 12 packed bytes (j & 3
    for sub-blocks 4-7, flagged by `low` False): ggml's get_scale_min_k4."""
    sc = tl.where(low, b0 & 63, (b8 & 15) | ((b0 >> 6) << 4))
    mn = tl.where(low, b4 & 63, (b8 >> 4) | ((b4 >> 6) << 4))
    return sc, mn


@triton.jit
def _q4_k_bytes(rp, NB: tl.constexpr, WORD_ORDER: tl.constexpr):
    """Q4_K super-blocks read byte by byte (NB per chunk); with WORD_ORDER the nibble bytes are Q4_K_R's (byte b of
    word w of group c holds weight 8b + w, the words stored side by side, `strata.weights.repack`).
    [BN, NB, 4 = c, 32, 2 = nibble]."""
    s = tl.arange(0, NB)
    c = tl.arange(0, 4)
    i = tl.arange(0, 32)
    bp = rp[:, None] + s[None, :] * 144
    if WORD_ORDER:  # word w of group c at byte 64 (w // 4) + 16 c + 4 (w % 4)
        off = c[:, None] * 16 + (i // 16 * 64 + i % 16)[None, :]
    else:
        off = c[:, None] * 32 + i[None, :]
    qb = _u8(bp[:, :, None, None] + 16 + off[None, None, :, :])
    sl, ml = _k4_scale_min_nb(bp + 4, 2 * c)
    sh, mh = _k4_scale_min_nb(bp + 4, 2 * c + 1)
    d = _f16(bp)[:, :, None, None]
    dm = _f16(bp + 2)[:, :, None, None]
    if WORD_ORDER:
        pos = _word_order(i)
    else:
        pos = i
    base = s[:, None, None] * 256 + c[None, :, None] * 64 + pos[None, None, :]
    return (tl.join(_i2f(qb & 15, 0.0) * (d * sl) - dm * ml, _i2f(qb >> 4, 0.0) * (d * sh) - dm * mh),
            tl.join(base, base + 32))


@triton.jit
def decode_q4_k(rp, tab, BN: tl.constexpr, NB: tl.constexpr):
    """Q4_K: {fp16 d, dmin; scales[12]; qs[128]}; 32-byte group c holds sub-block 2c (low nibbles) and 2c+1
    (high); w = d sc q - dmin m. NB super-blocks per chunk (more bytes in flight per loop step: the K loop of a
    short matrix is latency-bound otherwise). [BN, NB, 4 = c, 32, 2 = nibble]."""
    return _q4_k_bytes(rp, NB, False)


@triton.jit
def _byte(w, sh):
    """Byte at bit offset sh of int32 words w, as int32 in [0, 256)."""
    return (w >> sh) & 255


@triton.jit
def load_q4_k_hw(rp, tab, BN: tl.constexpr, NB: tl.constexpr):
    """The loads of `decode_q4_k_hw`: the 128 nibble bytes as [BN, 4, 8] int32 words and the header's 4 words."""
    c = tl.arange(0, 4)
    k = tl.arange(0, 8)
    wp = rp.to(tl.pointer_type(tl.int32))
    v = tl.load((wp + 4)[:, None, None] + (c[:, None] * 8 + k[None, :])[None, :, :])
    return v, tl.load(wp), tl.load(wp + 1), tl.load(wp + 2), tl.load(wp + 3)


@triton.jit
def unpack_q4_k_hw(raw, tab, BN: tl.constexpr, NB: tl.constexpr):
    """The arithmetic of `decode_q4_k_hw` on the words `load_q4_k_hw` loaded."""
    tl.static_assert(NB == 1, "decode_q4_k_hw: one super-block per chunk")
    v, w0, w1, w2, w3 = raw
    w0 = w0[:, None]
    w1 = w1[:, None]
    w2 = w2[:, None]
    w3 = w3[:, None]
    c = tl.arange(0, 4)
    k = tl.arange(0, 8)
    d = (w0 & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    dm = ((w0 >> 16) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    low = (c < 2)[None, :]
    s_lo = (16 * c % 32)[None, :]  # byte (2c) & 3 of a scale word
    s_hi = s_lo + 8  # byte (2c + 1) & 3
    sc_lo, mn_lo = _k4_unpack(_byte(w1, s_lo), _byte(w2, s_lo), _byte(w3, s_lo), low)
    sc_hi, mn_hi = _k4_unpack(_byte(w1, s_hi), _byte(w2, s_hi), _byte(w3, s_hi), low)
    sl = (d * _i2f(sc_lo, 0.0))[:, :, None, None, None]
    ml = (dm * _i2f(mn_lo, 0.0))[:, :, None, None, None]
    sh = (d * _i2f(sc_hi, 0.0))[:, :, None, None, None]
    mh = (dm * _i2f(mn_hi, 0.0))[:, :, None, None, None]
    lo = _j4(_i2f(v & 15, 0.0), _i2f((v >> 8) & 15, 0.0), _i2f((v >> 16) & 15, 0.0), _i2f((v >> 24) & 15, 0.0))
    hi = _j4(_i2f((v >> 4) & 15, 0.0), _i2f((v >> 12) & 15, 0.0), _i2f((v >> 20) & 15, 0.0),
             _i2f((v >> 28) & 15, 0.0))
    base = c[:, None] * 64 + k[None, :] * 4
    xl = _j4(base, base + 1, base + 2, base + 3)
    return tl.join(lo * sl - ml, hi * sh - mh), tl.join(xl, xl + 32)


@triton.jit
def decode_q4_k_hw(rp, tab, BN: tl.constexpr, NB: tl.constexpr):
    """Q4_K as int32 words throughout: the 16-byte header {fp16 d, dmin; scales[12]} as 4 words (instead of ten
    1- and 2-byte loads per row) and the 128 nibble bytes, 16-byte aligned at offset 16 of the 144-byte block, as
    16-byte vectors (`decode_q4_k` issues one load per byte). One super-block per chunk.
    [BN, 4 = c, 8 = word, 2, 2 = byte, 2 = nibble]: byte 4k + j of group c holds elements 64c + 4k + j (low nibble,
    sub-block 2c) and 64c + 32 + 4k + j (high, 2c + 1)."""
    return unpack_q4_k_hw(load_q4_k_hw(rp, tab, BN, NB), tab, BN, NB)


@triton.jit
def decode_q5_k(rp, tab, BN: tl.constexpr, NB: tl.constexpr):
    """Q5_K: Q4_K plus qh[32] at 16 (the 5th bit of sub-block s, element i, is bit s of qh[i]); qs at 48. Both
    are 16-byte aligned in the 176-byte blocks: int32 words, byte j of word k = byte 4k + j.
    [BN, 4 = c, 8 = k, 2, 2 = byte, 2 = nibble]."""
    c = tl.arange(0, 4)
    k = tl.arange(0, 8)
    v = tl.load((rp + 48).to(tl.pointer_type(tl.int32))[:, None, None] + (c[:, None] * 8 + k[None, :])[None, :, :])
    qh = tl.load((rp + 16).to(tl.pointer_type(tl.int32))[:, None, None] + k[None, None, :])
    sl, ml, sh, mh = _k4_scales(rp, c)
    c2 = 2 * c[None, :, None]
    h0 = qh >> c2
    h1 = qh >> (c2 + 1)
    lo = _j4(_i2f((v & 15) | ((h0 & 1) << 4), 0.0) * sl - ml,
             _i2f(((v >> 8) & 15) | (((h0 >> 8) & 1) << 4), 0.0) * sl - ml,
             _i2f(((v >> 16) & 15) | (((h0 >> 16) & 1) << 4), 0.0) * sl - ml,
             _i2f(((v >> 24) & 15) | (((h0 >> 24) & 1) << 4), 0.0) * sl - ml)
    hi = _j4(_i2f(((v >> 4) & 15) | ((h1 & 1) << 4), 0.0) * sh - mh,
             _i2f(((v >> 12) & 15) | (((h1 >> 8) & 1) << 4), 0.0) * sh - mh,
             _i2f(((v >> 20) & 15) | (((h1 >> 16) & 1) << 4), 0.0) * sh - mh,
             _i2f(((v >> 28) & 15) | (((h1 >> 24) & 1) << 4), 0.0) * sh - mh)
    base = c[:, None] * 64 + k[None, :] * 4
    xl = _j4(base, base + 1, base + 2, base + 3)
    return tl.join(lo, hi), tl.join(xl, xl + 32)


@triton.jit
def decode_q6_k(rp, tab, BN: tl.constexpr, NB: tl.constexpr):
    """Q6_K: {ql[128]; qh[64]; int8 scales[16]; fp16 d}; w = d sc (q - 32), one scale per 16 weights.

    Element e = 128h + 64n + 32a + 16l + m takes nibble n of ql[64h + 32a + 16l + m] and bits 2(2n+a) of
    qh[32h + 16l + m]. Tile [BN, 4 = (h, a), 2 = n, 2 = l, 16 = m]."""
    g = tl.arange(0, 4)[:, None, None, None]
    n = tl.arange(0, 2)[None, :, None, None]
    lh = tl.arange(0, 2)[None, None, :, None]
    m = tl.arange(0, 16)[None, None, None, :]
    h = g // 2
    a = g % 2
    rp5 = rp[:, None, None, None, None]
    ql = _u8(rp5 + (g * 32 + lh * 16 + m)[None])
    qh = _u8(rp5 + (128 + h * 32 + lh * 16 + m)[None])
    q = ((ql >> (4 * n)[None]) & 15) | (((qh >> (4 * n + 2 * a)[None]) & 3) << 4)
    s = h * 8 + n * 4 + a * 2 + lh  # [4, 2, 2, 1]
    sc = _i2f(_u8(rp5 + 192 + s[None]) ^ 0x80, 128.0)
    xo = h * 128 + n * 64 + a * 32 + lh * 16 + m
    return _i2f(q, 32.0) * (sc * _f16(rp + 208)[:, None, None, None, None]), xo


@triton.jit
def _k2_tile():
    """Index tiles of the 2-bit k-quants' [BN, 2 = h, 4 = plane, 2 = l, 16 = m] order: element
    128h + 32 plane + 16l + m, byte 32h + 16l + m of the 64 plane-packed bytes, scale 8h + 2 plane + l."""
    h = tl.arange(0, 2)[:, None, None, None]
    sh = tl.arange(0, 4)[None, :, None, None]
    lh = tl.arange(0, 2)[None, None, :, None]
    m = tl.arange(0, 16)[None, None, None, :]
    return h, sh, lh, m


@triton.jit
def decode_q3_k(rp, tab, BN: tl.constexpr, NB: tl.constexpr):
    """Q3_K: {hmask[32]; qs[64]; scales[12] (16 x 6 bit, -32); fp16 d}; q = 2-bit plane - 4 unless the hmask bit
    (bit 4h + plane of hmask[16l + m]) is set; w = d sc q."""
    h, sh, lh, m = _k2_tile()
    rp5 = rp[:, None, None, None, None]
    qs = _u8(rp5 + (32 + h * 32 + lh * 16 + m)[None])
    hm = _u8(rp5 + (lh * 16 + m)[None])
    q = ((qs >> (2 * sh)[None]) & 3) | (((hm >> (4 * h + sh)[None]) & 1) << 2)
    s = h * 8 + sh * 2 + lh  # [2, 4, 2, 1]
    lo = (_u8(rp5 + 96 + (s % 8)[None]) >> (4 * (s // 8))[None]) & 15
    hi = (_u8(rp5 + 104 + (s % 4)[None]) >> (2 * (s // 4))[None]) & 3
    sc = _i2f(lo | (hi << 4), 32.0)
    xo = h * 128 + sh * 32 + lh * 16 + m
    return _i2f(q, 4.0) * (sc * _f16(rp + 108)[:, None, None, None, None]), xo


@triton.jit
def decode_q2_k(rp, tab, BN: tl.constexpr, NB: tl.constexpr):
    """Q2_K: {scales[16] (4-bit scale | 4-bit min << 4); qs[64]; fp16 d, dmin}; w = d sc q - dmin m per 16."""
    h, sh, lh, m = _k2_tile()
    rp5 = rp[:, None, None, None, None]
    q = (_u8(rp5 + (16 + h * 32 + lh * 16 + m)[None]) >> (2 * sh)[None]) & 3
    sb = _u8(rp5 + (h * 8 + sh * 2 + lh)[None])
    dsc = _i2f(sb & 15, 0.0) * _f16(rp + 80)[:, None, None, None, None]
    dmn = _i2f(sb >> 4, 0.0) * _f16(rp + 82)[:, None, None, None, None]
    return _i2f(q, 0.0) * dsc - dmn, h * 128 + sh * 32 + lh * 16 + m


# ---------------------------------------------------------------------------------------------------------------
# i-quants: one 256-weight super-block per chunk


@triton.jit
def decode_iq4_xs(rp, tab, BN: tl.constexpr, NB: tl.constexpr):
    """IQ4_XS: {fp16 d; uint16 scales_h; scales_l[4]; qs[128]}; 8 sub-blocks of 32 like IQ4_NL's blocks, each
    with a 6-bit scale - 32; w = d sc code[q]. [BN, 8, 2, 16]."""
    s = tl.arange(0, 8)
    sl = _u8(rp[:, None] + 4 + (s // 2)[None, :])
    sh = _u16(rp + 2)
    ls = _i2f(((sl >> (4 * (s % 2))[None, :]) & 15) | (((sh[:, None] >> (2 * s)[None, :]) & 3) << 4), 32.0)
    nib = tl.arange(0, 2)
    i = tl.arange(0, 16)
    qb = _u8(rp[:, None, None] + 8 + (s[:, None] * 16 + i[None, :])[None])
    q = (qb[:, :, None, :] >> (4 * nib)[None, None, :, None]) & 15
    xo = s[:, None, None] * 32 + nib[None, :, None] * 16 + i[None, None, :]
    return tl.load(tab + q) * (ls * _f16(rp)[:, None])[:, :, None, None], xo


@triton.jit
def _gbyte(word, sign8, db, SH: tl.constexpr, BIT: tl.constexpr):
    """Byte SH/8 of grid words `word`, scaled by db, negated where bit BIT of sign8 is set."""
    v = _i2f((word >> SH) & 255, 0.0) * db
    return tl.where(((sign8 >> BIT) & 1) != 0, -v, v)


@triton.jit
def _grid8(idx, sign8, db, tab):
    """The 2-bit i-quants' weights: 32 groups of 8, group g = grid row idx[:, g] (2 int32 words of 4 byte values
    in tab), sign bits sign8[:, g], scale db[:, g]. [BN, 32, 2, 2, 2], x element 8g + (index within the row)."""
    g = tl.arange(0, 32)
    w0 = tl.load(tab + idx * 2)
    w1 = tl.load(tab + idx * 2 + 1)
    w = _j8(_gbyte(w0, sign8, db, 0, 0), _gbyte(w0, sign8, db, 8, 1), _gbyte(w0, sign8, db, 16, 2),
            _gbyte(w0, sign8, db, 24, 3), _gbyte(w1, sign8, db, 0, 4), _gbyte(w1, sign8, db, 8, 5),
            _gbyte(w1, sign8, db, 16, 6), _gbyte(w1, sign8, db, 24, 7))
    base = g * 8
    return w, _j8(base, base + 1, base + 2, base + 3, base + 4, base + 5, base + 6, base + 7)


@triton.jit
def decode_iq2_xxs(rp, tab, BN: tl.constexpr, NB: tl.constexpr):
    """IQ2_XXS: {fp16 d; 8 x (4 grid indices; uint32 4x7 sign bits | 4-bit scale)}; w = d (0.5 + s) / 4 grid
    sign."""
    g = tl.arange(0, 32)
    base = rp[:, None] + 2 + (g // 4 * 8)[None, :]
    idx = _u8(base + (g % 4)[None, :])
    aux = _u16(base + 4) | (_u16(base + 6) << 16)
    sign8 = _ksigns((aux >> (7 * (g % 4))[None, :]) & 127)
    db = (_f16(rp) * 0.125)[:, None] * _i2f(2 * ((aux >> 28) & 15) + 1, 0.0)
    return _grid8(idx, sign8, db, tab)


@triton.jit
def decode_iq2_xs(rp, tab, BN: tl.constexpr, NB: tl.constexpr):
    """IQ2_XS: {fp16 d; uint16 qs[32] (9-bit grid index | 7 sign bits); scales[8] (4 bit per 16 weights)}."""
    g = tl.arange(0, 32)
    v = _u16(rp[:, None] + 2 + (g * 2)[None, :])
    sb = _u8(rp[:, None] + 66 + (g // 4)[None, :])
    s4 = (sb >> (4 * ((g // 2) % 2))[None, :]) & 15
    db = (_f16(rp) * 0.125)[:, None] * _i2f(2 * s4 + 1, 0.0)
    return _grid8(v & 511, _ksigns(v >> 9), db, tab)


@triton.jit
def decode_iq2_s(rp, tab, BN: tl.constexpr, NB: tl.constexpr):
    """IQ2_S: {fp16 d; qs[32] (grid index low 8 bits); signs[32]; qh[8] (2 high index bits per group);
    scales[8]}."""
    g = tl.arange(0, 32)
    lo = _u8(rp[:, None] + 2 + g[None, :])
    sign8 = _u8(rp[:, None] + 34 + g[None, :])
    qh = _u8(rp[:, None] + 66 + (g // 4)[None, :])
    idx = lo | (((qh >> (2 * (g % 4))[None, :]) & 3) << 8)
    sb = _u8(rp[:, None] + 74 + (g // 4)[None, :])
    s4 = (sb >> (4 * ((g // 2) % 2))[None, :]) & 15
    db = (_f16(rp) * 0.125)[:, None] * _i2f(2 * s4 + 1, 0.0)
    return _grid8(idx, sign8, db, tab)


@triton.jit
def _grid4(word, sg, db):
    """The 3-bit i-quants' weights: [BN, 8 = sub-block, 8 = grid row, 2, 2]; word = the grid rows (int32 of
    4 byte values), sg = their 4 sign bits in bits 0-3, db = sub-block scales [BN, 8, 1]; x element
    32 ib + 4 p + j."""
    ib = tl.arange(0, 8)
    p = tl.arange(0, 8)
    w = _j4(_gbyte(word, sg, db, 0, 0), _gbyte(word, sg, db, 8, 1), _gbyte(word, sg, db, 16, 2),
            _gbyte(word, sg, db, 24, 3))
    base = ib[:, None] * 32 + p[None, :] * 4
    return w, _j4(base, base + 1, base + 2, base + 3)


@triton.jit
def decode_iq3_xxs(rp, tab, BN: tl.constexpr, NB: tl.constexpr):
    """IQ3_XXS: {fp16 d; qs[64] (8-bit grid indices, 4 values each); 8 x uint32 (4x7 sign bits | 4-bit scale)};
    w = d (0.5 + s) / 2 grid sign."""
    ib = tl.arange(0, 8)
    p = tl.arange(0, 8)
    idx = _u8(rp[:, None, None] + 2 + (ib[:, None] * 8 + p[None, :])[None])
    word = tl.load(tab + idx)
    ab = rp[:, None] + 66 + (ib * 4)[None, :]
    aux = _u16(ab) | (_u16(ab + 2) << 16)
    sign8 = _ksigns((aux[:, :, None] >> (7 * (p // 2))[None, None, :]) & 127)
    db = ((_f16(rp) * 0.25)[:, None] * _i2f(2 * ((aux >> 28) & 15) + 1, 0.0))[:, :, None]
    return _grid4(word, sign8 >> ((p % 2) * 4)[None, None, :], db)


@triton.jit
def decode_iq3_s(rp, tab, BN: tl.constexpr, NB: tl.constexpr):
    """IQ3_S: {fp16 d; qs[64]; qh[8] (9th index bits); signs[32] (one bit per weight); scales[4] (4 bit per
    32 weights)}; w = d (1 + 2 s) grid sign."""
    ib = tl.arange(0, 8)
    p = tl.arange(0, 8)
    lo = _u8(rp[:, None, None] + 2 + (ib[:, None] * 8 + p[None, :])[None])
    qh = _u8(rp[:, None] + 66 + ib[None, :])
    idx = lo | (((qh[:, :, None] >> p[None, None, :]) & 1) << 8)
    word = tl.load(tab + idx)
    sg = _u8(rp[:, None, None] + 74 + (ib[:, None] * 4 + p[None, :] // 2)[None])
    sb = _u8(rp[:, None] + 106 + (ib // 2)[None, :])
    db = (_f16(rp)[:, None] * _i2f(2 * ((sb >> (4 * (ib % 2))[None, :]) & 15) + 1, 0.0))[:, :, None]
    return _grid4(word, sg >> ((p % 2) * 4)[None, None, :], db)


@triton.jit
def _gbyte1(word, off, dl, SH: tl.constexpr):
    """Byte SH/8 of IQ1 grid words `word` (grid value + 1), less `off` (1 - delta: exact), times dl."""
    return (_i2f((word >> SH) & 255, 0.0) - off) * dl


@triton.jit
def _grid8_iq1(idx, dl, delta, tab):
    """The 1-bit i-quants' weights: 32 groups of 8, group g = row idx[:, g] of iq1s_grid (values -1, 0, 1, stored
    + 1 as 2 int32 words of 4 bytes in tab), w = dl (value + delta) with one rounding, as ggml's dequantisation:
    dl, delta [BN, 32]. [BN, 32, 2, 2, 2], x element 8g + (index within the row)."""
    g = tl.arange(0, 32)
    w0 = tl.load(tab + idx * 2)
    w1 = tl.load(tab + idx * 2 + 1)
    off = 1.0 - delta
    w = _j8(_gbyte1(w0, off, dl, 0), _gbyte1(w0, off, dl, 8), _gbyte1(w0, off, dl, 16), _gbyte1(w0, off, dl, 24),
            _gbyte1(w1, off, dl, 0), _gbyte1(w1, off, dl, 8), _gbyte1(w1, off, dl, 16), _gbyte1(w1, off, dl, 24))
    base = g * 8
    return w, _j8(base, base + 1, base + 2, base + 3, base + 4, base + 5, base + 6, base + 7)


@triton.jit
def decode_iq1_s(rp, tab, BN: tl.constexpr, NB: tl.constexpr):
    """IQ1_S: {fp16 d; qs[32] (grid index low 8 bits); uint16 qh[8], one per 32 weights: 4 x 3 index high bits,
    a 3-bit scale s, the delta's sign}; w = d (2 s + 1) (grid +- 1/8)."""
    g = tl.arange(0, 32)
    qh = _u16(rp[:, None] + 34 + (g // 4 * 2)[None, :])
    idx = _u8(rp[:, None] + 2 + g[None, :]) | (((qh >> (3 * (g % 4))[None, :]) & 7) << 8)
    dl = _f16(rp)[:, None] * _i2f(2 * ((qh >> 12) & 7) + 1, 0.0)
    return _grid8_iq1(idx, dl, tl.where((qh & 0x8000) != 0, -0.125, 0.125), tab)


@triton.jit
def decode_iq1_m(rp, tab, BN: tl.constexpr, NB: tl.constexpr):
    """IQ1_M: {qs[32] (grid index low 8 bits); qh[16], a nibble per 8 weights: 3 index high bits, the delta's
    sign; uint16 sc[4]: 4 x 3-bit scales (one per 16 weights) each, their top nibbles together the fp16 d};
    w = d (2 s + 1) (grid +- 1/8)."""
    g = tl.arange(0, 32)
    nib = (_u8(rp[:, None] + 32 + (g // 2)[None, :]) >> (4 * (g % 2))[None, :]) & 15
    idx = _u8(rp[:, None] + g[None, :]) | ((nib & 7) << 8)
    k = tl.arange(0, 4)
    dbits = tl.sum((_u16(rp[:, None] + 48 + (k * 2)[None, :]) >> 12) << (4 * k)[None, :], axis=1)
    d = dbits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    s3 = (_u16(rp[:, None] + 48 + (g // 8 * 2)[None, :]) >> (3 * ((g // 2) % 4))[None, :]) & 7
    dl = d[:, None] * _i2f(2 * s3 + 1, 0.0)
    return _grid8_iq1(idx, dl, tl.where((nib & 8) != 0, -0.125, 0.125), tab)


# ---------------------------------------------------------------------------------------------------------------
# strata's repacked layouts (made at placement from the ggml ones; same bytes, 16-byte aligned quants)


@triton.jit
def load_q8_0_r8(rp, tab, BN: tl.constexpr, NB: tl.constexpr):
    """The loads of `decode_q8_0_r8`: the groups' 8 fp16 scales and their int8 quants."""
    g = tl.arange(0, NB)
    b = tl.arange(0, 8)
    i = tl.arange(0, 32)
    gp = rp[:, None] + g[None, :] * 272
    d = tl.load((gp[:, :, None] + 2 * b[None, None, :]).to(tl.pointer_type(tl.float16)))
    q = tl.load((gp + 16)[:, :, None, None] + (b[:, None] * 32 + i[None, :])[None, None, :, :]).to(tl.int8)
    return d, q


@triton.jit
def unpack_q8_0_r8(raw, tab, BN: tl.constexpr, NB: tl.constexpr):
    """The arithmetic of `decode_q8_0_r8` on what `load_q8_0_r8` loaded."""
    d, q = raw
    g = tl.arange(0, NB)
    b = tl.arange(0, 8)
    i = tl.arange(0, 32)
    xo = g[:, None, None] * 256 + b[None, :, None] * 32 + i[None, None, :]
    return q.to(tl.float32) * d.to(tl.float32)[:, :, :, None], xo


@triton.jit
def decode_q8_0_r8(rp, tab, BN: tl.constexpr, NB: tl.constexpr):
    """Q8_0_R8: eight Q8_0 blocks regrouped as {fp16 d[8]; int8 q[8][32]} (272 bytes, so every group's quants are
    16-byte aligned). The quants load as int8 along a contiguous last dimension, so both they and x load as
    16-byte vectors (here the hardware int-to-float convert, whose quarter rate is not the limit: the GEMV is
    bound by load traffic through L1). NB groups per chunk. [BN, NB, 8 = block, 32]."""
    return unpack_q8_0_r8(load_q8_0_r8(rp, tab, BN, NB), tab, BN, NB)


@triton.jit
def _word_order(i):
    """The weight that byte i of a 32-byte run of a word-ordered layout (Q4_K_R, Q8_0_R) holds: byte 4w + b is
    weight 8b + w."""
    return 8 * (i % 4) + i // 4


@triton.jit
def decode_q4_k_r(rp, tab, BN: tl.constexpr, NB: tl.constexpr):
    """Q4_K_R (`strata.weights.repack`): Q4_K with each 32-byte group of nibbles in word order, byte by byte, for
    the launches the row-register GEMV (`gemv_rr`) does not take (several tokens, row decodes).
    [BN, NB, 4 = c, 32, 2 = nibble]."""
    return _q4_k_bytes(rp, NB, True)


@triton.jit
def decode_q8_0_r(rp, tab, BN: tl.constexpr, NB: tl.constexpr):
    """Q8_0_R (`strata.weights.repack`): Q8_0_R8's groups with the quants stored as q + 128 in word order, for the
    launches the row-register GEMV does not take. NB groups per chunk. [BN, NB, 8 = block, 32]."""
    g = tl.arange(0, NB)
    b = tl.arange(0, 8)
    i = tl.arange(0, 32)
    gp = rp[:, None] + g[None, :] * 272
    d = _f16(gp[:, :, None] + 2 * b[None, None, :])
    q = _u8((gp + 16)[:, :, None, None] + (b[:, None] * 32 + i[None, :])[None, None, :, :])
    xo = g[:, None, None] * 256 + b[None, :, None] * 32 + _word_order(i)[None, None, :]
    return _i2f(q, 128.0) * d[:, :, :, None], xo


@triton.jit
def decode_q5_1_r(rp, tab, BN: tl.constexpr, NB: tl.constexpr):
    """Q5_1_R (`strata.weights.repack`): groups of four Q5_1 blocks {(d, m)[4]; qh[4]; qs[4][16]} in word order,
    byte by byte, for the launches the row-register GEMV does not take. NB groups per chunk.
    [BN, NB, 4 = block, 16, 2 = nibble]."""
    g = tl.arange(0, NB)
    blk = tl.arange(0, 4)
    j = tl.arange(0, 16)
    gp = rp[:, None] + g[None, :] * 96
    bp = gp[:, :, None] + 4 * blk[None, None, :]
    d = _f16(bp)[:, :, :, None]
    m = _f16(bp + 2)[:, :, :, None]
    qh = _i32(bp + 16)[:, :, :, None]
    qb = _u8((gp + 32)[:, :, None, None] + (blk[:, None] * 16 + j[None, :])[None, None, :, :])
    b = (j % 4)[None, None, None, :]
    w = (j // 4)[None, None, None, :]
    lo = (qb & 15) | (((qh >> (8 * b + 4 + w)) & 1) << 4)
    hi = (qb >> 4) | (((qh >> (8 * b + w)) & 1) << 4)
    base = g[:, None, None] * 128 + blk[None, :, None] * 32 + (4 * (j % 4) + j // 4)[None, None, :]
    return tl.join(_i2f(lo, 0.0) * d + m, _i2f(hi, 0.0) * d + m), tl.join(base, base + 16)


@triton.jit
def load_q6_k_p(rp, tab, BN: tl.constexpr, NB: tl.constexpr):
    """The loads of `decode_q6_k_p`: ql as [BN, 4 = g, 8 = u] int32 words, qh as the same tile (word u of half
    g // 2, each loaded for both g of a half), the scale words of nibble 0 and 1 ([BN, 4, 1]) and the word of d."""
    g = tl.arange(0, 4)[:, None]
    u = tl.arange(0, 8)[None, :]
    wp = rp.to(tl.pointer_type(tl.int32))
    ql = tl.load(wp[:, None, None] + (g * 8 + u)[None])
    qh = tl.load(wp[:, None, None] + (32 + (g // 2) * 8 + u)[None])
    s0 = tl.load(wp[:, None, None] + (48 + (g // 2) * 2)[None])
    s1 = tl.load(wp[:, None, None] + (49 + (g // 2) * 2)[None])
    return ql, qh, s0, s1, tl.load(wp + 52)


@triton.jit
def _q6_nibbles(ql, qh, sc, a2, N: tl.constexpr):
    """The four weights of byte t = 0..3 of the ql and qh words for nibble N, as [..., 2, 2] (`_j4`)."""
    return _j4(_i2f(((ql >> (4 * N)) & 15) | (((qh >> (4 * N + a2)) & 3) << 4), 32.0) * sc,
               _i2f(((ql >> (8 + 4 * N)) & 15) | (((qh >> (8 + 4 * N + a2)) & 3) << 4), 32.0) * sc,
               _i2f(((ql >> (16 + 4 * N)) & 15) | (((qh >> (16 + 4 * N + a2)) & 3) << 4), 32.0) * sc,
               _i2f(((ql >> (24 + 4 * N)) & 15) | (((qh >> (24 + 4 * N + a2)) & 3) << 4), 32.0) * sc)


@triton.jit
def unpack_q6_k_p(raw, tab, BN: tl.constexpr, NB: tl.constexpr):
    """The arithmetic of `decode_q6_k_p` on the words `load_q6_k_p` loaded."""
    tl.static_assert(NB == 1, "decode_q6_k_p: one super-block per chunk")
    ql, qh, s0, s1, dw = raw
    g = tl.arange(0, 4)[:, None]
    u = tl.arange(0, 8)[None, :]
    a = g % 2
    d = (dw & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)[:, None, None]
    sh = (8 * (2 * a + u // 4))[None]  # the byte of scale 8h + 4n + 2a + u // 4 in word 2h + n
    sc0 = _i2f(((s0 >> sh) & 255) ^ 0x80, 128.0) * d
    sc1 = _i2f(((s1 >> sh) & 255) ^ 0x80, 128.0) * d
    a2 = (2 * a)[None]
    w = tl.join(_q6_nibbles(ql, qh, sc0, a2, 0), _q6_nibbles(ql, qh, sc1, a2, 1))
    base = 128 * (g // 2) + 32 * a + 4 * u
    xl = _j4(base, base + 1, base + 2, base + 3)
    return w, tl.join(xl, xl + 64)


@triton.jit
def decode_q6_k_p(rp, tab, BN: tl.constexpr, NB: tl.constexpr):
    """Q6_K_P: Q6_K blocks padded to 224 bytes, read as int32 words. Element 128h + 64n + 32a + l (l = 4u + t)
    is nibble n of ql[64h + 32a + l] with bits 4n + 2a of qh[32h + l] on top, scaled by scales[8h + 4n + 2a +
    l // 16] and d. [BN, 4 = g (h = g // 2, a = g % 2), 8 = u, 2, 2 = byte t, 2 = nibble n]; one super-block per
    chunk."""
    return unpack_q6_k_p(load_q6_k_p(rp, tab, BN, NB), tab, BN, NB)


@triton.jit
def decode_q6_k_r(rp, tab, BN: tl.constexpr, NB: tl.constexpr):
    """Q6_K_R (`strata.weights.repack`): {scales[16]; nibbles[128]; highs[64]; fp16 d; pad}, byte by byte, for the
    launches the row-register GEMV does not take. Nibble byte i = 4w + b of group c (at 16 + 64 (w // 4) + 16c +
    4 (w % 4) + b) holds weights 64c + 8b + w (low) and + 32 (high); their top bits are bits 2a and 4 + 2a
    (a = w // 4) of high byte 4 (w % 4) + b of group c (at 144 + 16c). [BN, 4 = c, 32 = i, 2 = nibble]; one
    super-block per chunk."""
    tl.static_assert(NB == 1, "decode_q6_k_r: one super-block per chunk")
    c = tl.arange(0, 4)[:, None]
    i = tl.arange(0, 32)[None, :]
    w = i // 4
    b = i % 4
    bp = rp[:, None, None]
    nb = _u8(bp + (16 + 64 * (i // 16) + 16 * c + i % 16)[None])
    hb = _u8(bp + (144 + 16 * c + 4 * (w % 4) + b)[None])
    a2 = (2 * (w // 4))[None]
    lo = (nb & 15) | (((hb >> a2) & 3) << 4)
    hi = (nb >> 4) | (((hb >> (4 + a2)) & 3) << 4)
    d = _f16(rp + 208)[:, None, None]
    sp = rp[:, None, None] + (4 * c + b // 2)[None]
    sc_lo = _i2f(_u8(sp) ^ 0x80, 128.0) * d
    sc_hi = _i2f(_u8(sp + 2) ^ 0x80, 128.0) * d
    xo = c * 64 + _word_order(i)
    return tl.join(_i2f(lo, 32.0) * sc_lo, _i2f(hi, 32.0) * sc_hi), tl.join(xo, xo + 32)


@triton.jit
def row_offsets(rows, row_stride, TILE: tl.constexpr, STEP: tl.constexpr):
    """Where stored rows start, in units of row_stride's: rows * row_stride, or for tile-major rows (TILE > 0,
    `GemvType.tile`) the start of their tile plus their STEP-unit piece of its first step."""
    if TILE > 0:
        return (rows // TILE) * (TILE * row_stride) + (rows % TILE) * STEP
    else:
        return rows * row_stride


@triton.jit
def chunk_at(rp, o, TILE: tl.constexpr, STEP: tl.constexpr):
    """The address o units into the rows at rp (`row_offsets`): rp + o, or for tile-major rows the piece of step
    o // STEP (a tile's steps lie TILE * STEP apart)."""
    if TILE > 0:
        return rp + (o // STEP) * (TILE * STEP) + o % STEP
    else:
        return rp + o
