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
  rather than an int-to-float convert, whose throughput on Hopper is a quarter of the FP32 rate and would cap a
  memory-bound GEMV below bandwidth. The code's zero offset (8 for Q4_0, 32 for Q6_K...) folds into the FADD.
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
def _ksigns(s7):
    """ggml's `ksigns_iq2xs[s7]`: the 7 stored sign bits plus an 8th that makes the count of minus signs even."""
    p = s7 ^ (s7 >> 4)
    p = p ^ (p >> 2)
    p = p ^ (p >> 1)
    return s7 | ((p & 1) << 7)


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
def _nibbles(blk, off: tl.constexpr):
    """The 16 nibble bytes at blk + off ([BN, NB] pointers) split into [BN, NB, 2 = low/high, 16] codes."""
    i = tl.arange(0, 16)
    nib = tl.arange(0, 2)
    qb = _u8(blk[:, :, None] + off + i[None, None, :])
    return (qb[:, :, None, :] >> (4 * nib)[None, None, :, None]) & 15


@triton.jit
def _xo_32(NB: tl.constexpr):
    """x offsets [NB, 2, 16] of a 32-weight block's nibble order: element 16 * nibble + i."""
    b = tl.arange(0, NB)
    nib = tl.arange(0, 2)
    i = tl.arange(0, 16)
    return b[:, None, None] * 32 + nib[None, :, None] * 16 + i[None, None, :]


@triton.jit
def _qh_bits(qh, NB: tl.constexpr):
    """Bit e of the 32-bit qh ([BN, NB]) for element e = 16 * nibble + i: [BN, NB, 2, 16], shifted to bit 4."""
    e = tl.arange(0, 2)[:, None] * 16 + tl.arange(0, 16)[None, :]
    return ((qh[:, :, None, None] >> e[None, None, :, :]) & 1) << 4


@triton.jit
def decode_q4_0(rp, tab, BN: tl.constexpr, NB: tl.constexpr):
    """Q4_0: {fp16 d; qs[16]}, element i low nibble of qs[i], 16+i high nibble; w = d (q - 8)."""
    blk = rp[:, None] + tl.arange(0, NB)[None, :] * 18
    q = _i2f(_nibbles(blk, 2), 8.0)
    return q * _f16(blk)[:, :, None, None], _xo_32(NB)


@triton.jit
def decode_q4_1(rp, tab, BN: tl.constexpr, NB: tl.constexpr):
    """Q4_1: {fp16 d, m; qs[16]}, w = d q + m."""
    blk = rp[:, None] + tl.arange(0, NB)[None, :] * 20
    q = _i2f(_nibbles(blk, 4), 0.0)
    return q * _f16(blk)[:, :, None, None] + _f16(blk + 2)[:, :, None, None], _xo_32(NB)


@triton.jit
def decode_q5_0(rp, tab, BN: tl.constexpr, NB: tl.constexpr):
    """Q5_0: {fp16 d; uint32 qh; qs[16]}, 5th bit of element e is bit e of qh; w = d (q - 16)."""
    blk = rp[:, None] + tl.arange(0, NB)[None, :] * 22
    qh = _u16(blk + 2) | (_u16(blk + 4) << 16)
    q = _i2f(_nibbles(blk, 6) | _qh_bits(qh, NB), 16.0)
    return q * _f16(blk)[:, :, None, None], _xo_32(NB)


@triton.jit
def decode_q5_1(rp, tab, BN: tl.constexpr, NB: tl.constexpr):
    """Q5_1: {fp16 d, m; uint32 qh; qs[16]}, w = d q + m."""
    blk = rp[:, None] + tl.arange(0, NB)[None, :] * 24
    qh = _u16(blk + 4) | (_u16(blk + 6) << 16)
    q = _i2f(_nibbles(blk, 8) | _qh_bits(qh, NB), 0.0)
    return q * _f16(blk)[:, :, None, None] + _f16(blk + 2)[:, :, None, None], _xo_32(NB)


@triton.jit
def decode_iq4_nl(rp, tab, BN: tl.constexpr, NB: tl.constexpr):
    """IQ4_NL: Q4_0's layout, but the nibble indexes a 16-value non-linear code (tab, fp32): w = d code[q]."""
    blk = rp[:, None] + tl.arange(0, NB)[None, :] * 18
    return tl.load(tab + _nibbles(blk, 2)) * _f16(blk)[:, :, None, None], _xo_32(NB)


@triton.jit
def decode_q2_0(rp, tab, BN: tl.constexpr, NB: tl.constexpr):
    """Q2_0 (ggml type 42): 64 weights {fp16 d; qs[16]}, weight j = bits 2(j%4) of qs[j/4]; w = d (q - 1).
    [BN, NB, 16 = byte, 4 = plane]."""
    b = tl.arange(0, NB)
    i = tl.arange(0, 16)
    sh = tl.arange(0, 4)
    blk = rp[:, None] + b[None, :] * 18
    qb = _u8(blk[:, :, None] + 2 + i[None, None, :])
    q = _i2f((qb[:, :, :, None] >> (2 * sh)[None, None, None, :]) & 3, 1.0)
    xo = b[:, None, None] * 64 + i[None, :, None] * 4 + sh[None, None, :]
    return q * _f16(blk)[:, :, None, None], xo


# ---------------------------------------------------------------------------------------------------------------
# k-quants: one 256-weight super-block per chunk


@triton.jit
def _k4_scale_min(sp, s):
    """The 6-bit scale and min of sub-blocks `s` (2-D tile of 0..7) packed in the 12 bytes at sp ([BN] pointers):
    ggml's get_scale_min_k4. Two [BN, *s.shape] fp32 tiles."""
    j = (s & 3)[None, :, :]
    low = (s < 4)[None, :, :]
    p = sp[:, None, None] + j
    b0 = _u8(p)
    b4 = _u8(p + 4)
    b8 = _u8(p + 8)
    sc = tl.where(low, b0 & 63, (b8 & 15) | ((b0 >> 6) << 4))
    mn = tl.where(low, b4 & 63, (b8 >> 4) | ((b4 >> 6) << 4))
    return _i2f(sc, 0.0), _i2f(mn, 0.0)


@triton.jit
def _k4_parts(rp, qs_off: tl.constexpr):
    """Shared by Q4_K and Q5_K: the nibble codes [BN, 4 = c, 2 = nibble, 32 = i] of the 128 bytes at rp + qs_off
    (element 64c + 32 nibble + i, sub-block 2c + nibble), the per-sub-block d*sc and dmin*m [BN, 4, 2], and x
    offsets."""
    c = tl.arange(0, 4)
    nib = tl.arange(0, 2)
    i = tl.arange(0, 32)
    qb = _u8(rp[:, None, None] + qs_off + (c[:, None] * 32 + i[None, :])[None, :, :])
    q = (qb[:, :, None, :] >> (4 * nib)[None, None, :, None]) & 15
    s = 2 * c[:, None] + nib[None, :]
    sc, mn = _k4_scale_min(rp + 4, s)
    dsc = _f16(rp)[:, None, None] * sc
    dmn = _f16(rp + 2)[:, None, None] * mn
    xo = c[:, None, None] * 64 + nib[None, :, None] * 32 + i[None, None, :]
    return q, dsc, dmn, s, xo


@triton.jit
def decode_q4_k(rp, tab, BN: tl.constexpr, NB: tl.constexpr):
    """Q4_K: {fp16 d, dmin; scales[12]; qs[128]}; 32-byte group c holds sub-block 2c (low nibbles) and 2c+1
    (high); w = d sc q - dmin m."""
    q, dsc, dmn, _s, xo = _k4_parts(rp, 16)
    return _i2f(q, 0.0) * dsc[:, :, :, None] - dmn[:, :, :, None], xo


@triton.jit
def decode_q5_k(rp, tab, BN: tl.constexpr, NB: tl.constexpr):
    """Q5_K: Q4_K plus qh[32] at 16: the 5th bit of sub-block s, element i, is bit s of qh[i]."""
    q, dsc, dmn, s, xo = _k4_parts(rp, 48)
    qh = _u8(rp[:, None] + 16 + tl.arange(0, 32)[None, :])
    q = q | (((qh[:, None, None, :] >> s[None, :, :, None]) & 1) << 4)
    return _i2f(q, 0.0) * dsc[:, :, :, None] - dmn[:, :, :, None], xo


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
    blk = rp[:, None] + s[None, :] * 16
    code = tl.load(tab + _nibbles(blk, 8))
    return code * (ls * _f16(rp)[:, None])[:, :, None, None], _xo_32(8)


@triton.jit
def _grid8(idx, sign8, db, tab):
    """The 2-bit i-quants' weights: 32 groups of 8, group g = grid row idx[:, g] (2 int32 words of 4 byte values
    in tab), sign bits sign8[:, g], scale db[:, g]. [BN, 32 = g, 2 = word, 4 = byte], x element 8g + 4w + j."""
    g = tl.arange(0, 32)
    w = tl.arange(0, 2)
    j = tl.arange(0, 4)
    word = tl.load(tab + idx[:, :, None] * 2 + w[None, None, :])
    gv = _i2f((word[:, :, :, None] >> (8 * j)[None, None, None, :]) & 255, 0.0)
    k = (w[:, None] * 4 + j[None, :])[None, None, :, :]
    v = gv * db[:, :, None, None]
    w4 = tl.where(((sign8[:, :, None, None] >> k) & 1) != 0, -v, v)
    return w4, g[:, None, None] * 8 + w[None, :, None] * 4 + j[None, None, :]


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
def _grid4(word, neg, db):
    """The 3-bit i-quants' weights: [BN, 8 = sub-block, 8 = grid row, 4 = value]; word = the grid rows (int32 of
    4 byte values), neg = sign bits, db = sub-block scales; x element 32 ib + 4 p + j."""
    ib = tl.arange(0, 8)
    p = tl.arange(0, 8)
    j = tl.arange(0, 4)
    v = _i2f((word[:, :, :, None] >> (8 * j)[None, None, None, :]) & 255, 0.0) * db[:, :, None, None]
    return tl.where(neg, -v, v), ib[:, None, None] * 32 + p[None, :, None] * 4 + j[None, None, :]


@triton.jit
def decode_iq3_xxs(rp, tab, BN: tl.constexpr, NB: tl.constexpr):
    """IQ3_XXS: {fp16 d; qs[64] (8-bit grid indices, 4 values each); 8 x uint32 (4x7 sign bits | 4-bit scale)};
    w = d (0.5 + s) / 2 grid sign."""
    ib = tl.arange(0, 8)
    p = tl.arange(0, 8)
    j = tl.arange(0, 4)
    idx = _u8(rp[:, None, None] + 2 + (ib[:, None] * 8 + p[None, :])[None])
    word = tl.load(tab + idx)
    ab = rp[:, None] + 66 + (ib * 4)[None, :]
    aux = _u16(ab) | (_u16(ab + 2) << 16)
    sign8 = _ksigns((aux[:, :, None] >> (7 * (p // 2))[None, None, :]) & 127)
    bit = ((p % 2) * 4)[:, None] + j[None, :]
    neg = ((sign8[:, :, :, None] >> bit[None, None]) & 1) != 0
    db = (_f16(rp) * 0.25)[:, None] * _i2f(2 * ((aux >> 28) & 15) + 1, 0.0)
    return _grid4(word, neg, db)


@triton.jit
def decode_iq3_s(rp, tab, BN: tl.constexpr, NB: tl.constexpr):
    """IQ3_S: {fp16 d; qs[64]; qh[8] (9th index bits); signs[32] (one bit per weight); scales[4] (4 bit per
    32 weights)}; w = d (1 + 2 s) grid sign."""
    ib = tl.arange(0, 8)
    p = tl.arange(0, 8)
    j = tl.arange(0, 4)
    lo = _u8(rp[:, None, None] + 2 + (ib[:, None] * 8 + p[None, :])[None])
    qh = _u8(rp[:, None] + 66 + ib[None, :])
    idx = lo | (((qh[:, :, None] >> p[None, None, :]) & 1) << 8)
    word = tl.load(tab + idx)
    sg = _u8(rp[:, None, None] + 74 + (ib[:, None] * 4 + p[None, :] // 2)[None])
    bit = ((p % 2) * 4)[:, None] + j[None, :]
    neg = ((sg[:, :, :, None] >> bit[None, None]) & 1) != 0
    sb = _u8(rp[:, None] + 106 + (ib // 2)[None, :])
    db = _f16(rp)[:, None] * _i2f(2 * ((sb >> (4 * (ib % 2))[None, :]) & 15) + 1, 0.0)
    return _grid4(word, neg, db)
