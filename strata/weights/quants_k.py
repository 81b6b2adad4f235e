"""Block decoders for the legacy (Q4_0 … Q8_0), k-quant (Q2_K … Q6_K), ternary (TQ1_0, TQ2_0) and 4-bit float
(MXFP4, NVFP4) ggml types, and the bit-field helpers that the i-quant decoders in `quants_iq` share.

Every decoder maps a (n, type_size) uint8 tensor of blocks to (n, block_size) float32. The arithmetic follows
ggml's reference dequantizers (as mirrored by the gguf package's numpy code) operation for operation in float32,
so results are bit-identical to them. All index and bit work is done on int32/int64 tensors (torch has no
shifts on uint16/uint32), and multi-byte integer fields are assembled from their little-endian bytes.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

QK_K = 256  # weights per k-quant super-block

# --- bit-field helpers ------------------------------------------------------------------------------------------


def ints(blocks: Tensor, start: int, stop: int) -> Tensor:
    """Bytes [start, stop) of each block as int32, shape (n, stop - start)."""
    return blocks[:, start:stop].to(torch.int32)


def f16_at(blocks: Tensor, offset: int) -> Tensor:
    """The fp16 at byte `offset` of each block, as float32 of shape (n, 1)."""
    return blocks[:, offset:offset + 2].contiguous().view(torch.float16).to(torch.float32)


def u16_at(blocks: Tensor, offset: int, count: int) -> Tensor:
    """`count` little-endian uint16 fields from byte `offset`, as int32 of shape (n, count)."""
    b = ints(blocks, offset, offset + 2 * count).reshape(blocks.shape[0], count, 2)
    return b[..., 0] | (b[..., 1] << 8)


def u32_at(blocks: Tensor, offset: int, count: int) -> Tensor:
    """`count` little-endian uint32 fields from byte `offset`, as int64 of shape (n, count)."""
    b = blocks[:, offset:offset + 4 * count].to(torch.int64).reshape(blocks.shape[0], count, 4)
    return b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)


def bits(x: Tensor, shifts: Sequence[int], mask: int, dim: int) -> Tensor:
    """(x >> s) & mask for each shift s, stacked along a new axis `dim` (-1: after x's last axis, -2: before)."""
    return torch.stack([(x >> s) & mask for s in shifts], dim=dim)


def f16_from_bits(v: Tensor) -> Tensor:
    """int32 tensor of fp16 bit patterns (0..65535) -> float32 values."""
    signed = torch.where(v >= 0x8000, v - 0x10000, v)
    return signed.to(torch.int16).view(torch.float16).to(torch.float32)


@functools.cache
def on_device(build: Callable[[], Tensor], device: torch.device) -> Tensor:
    """The constant table that `build` makes (on the CPU), moved to `device`; built once per device."""
    return build().to(device)


def lookup(build: Callable[[], Tensor], index: Tensor) -> Tensor:
    """build()[index], with the table on index's device."""
    return on_device(build, index.device)[index.long()]


# --- constant tables --------------------------------------------------------------------------------------------


def iq4nl_values() -> Tensor:
    """The 16 non-linear 4-bit levels of IQ4_NL / IQ4_XS."""
    levels = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
    return torch.tensor(levels, dtype=torch.float32)


def iq4nl_byte_levels() -> Tensor:
    """(256, 2): the IQ4_NL levels of a byte's low and high nibble."""
    b = torch.arange(256)
    return iq4nl_values()[torch.stack([b & 15, b >> 4], 1)]


def fp4_values() -> Tensor:
    """The 16 e2m1 values, doubled (ggml's kvalues_mxfp4)."""
    return torch.tensor((0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12), dtype=torch.float32)


def ue4m3_half() -> Tensor:
    """All 256 unsigned e4m3 (bias 7) scale bytes decoded and halved (NVFP4 uses doubled e2m1 values).
    The top bit is ignored; 0 and 0x7F decode to 0. Every value is exact in float32."""
    values = []
    for x in range(256):
        exp, man = (x >> 3) & 0xF, x & 7
        raw = math.ldexp(man, -9) if exp == 0 else math.ldexp(1.0 + man / 8.0, exp - 7)
        values.append(0.0 if x in (0, 0x7F) else raw * 0.5)
    return torch.tensor(values, dtype=torch.float32)


# --- legacy 32-weight blocks ------------------------------------------------------------------------------------


def _low_high(x: Tensor) -> Tensor:
    """(n, k) bytes -> (n, 2k): the k low nibbles, then the k high nibbles."""
    return bits(x, (0, 4), 0xF, dim=-2).reshape(x.shape[0], 2 * x.shape[1])


def _fifth_bits(blocks: Tensor, offset: int) -> Tensor:
    """The 32 high bits of a Q5 block (a little-endian uint32 at `offset`), shape (n, 32)."""
    return bits(ints(blocks, offset, offset + 4), range(8), 1, dim=-1).reshape(blocks.shape[0], 32)


def q4_0(blocks: Tensor) -> Tensor:
    """d (f16), 16 bytes of nibbles; w = d * (q - 8)."""
    q = _low_high(ints(blocks, 2, 18)) - 8
    return f16_at(blocks, 0) * q.to(torch.float32)


def q4_1(blocks: Tensor) -> Tensor:
    """d, m (f16), 16 bytes of nibbles; w = d * q + m."""
    q = _low_high(ints(blocks, 4, 20))
    return f16_at(blocks, 0) * q.to(torch.float32) + f16_at(blocks, 2)


def q5_0(blocks: Tensor) -> Tensor:
    """d (f16), 32 high bits, 16 bytes of low nibbles; w = d * (q - 16)."""
    q = (_low_high(ints(blocks, 6, 22)) | (_fifth_bits(blocks, 2) << 4)) - 16
    return f16_at(blocks, 0) * q.to(torch.float32)


def q5_1(blocks: Tensor) -> Tensor:
    """d, m (f16), 32 high bits, 16 bytes of low nibbles; w = d * q + m."""
    q = _low_high(ints(blocks, 8, 24)) | (_fifth_bits(blocks, 4) << 4)
    return f16_at(blocks, 0) * q.to(torch.float32) + f16_at(blocks, 2)


def q8_0(blocks: Tensor) -> Tensor:
    """d (f16), 32 int8; w = q * d."""
    return blocks[:, 2:34].view(torch.int8).to(torch.float32) * f16_at(blocks, 0)


def q2_0(blocks: Tensor) -> Tensor:
    """d (f16), 16 bytes of 2-bit codes, weight j at bits 2*(j%4) of byte j//4; w = d * (q - 1).
    (Mainline ggml's Q2_0, type 42: blocks of 64; not in the gguf 0.19 package, checked against the fixtures.)"""
    q = bits(ints(blocks, 2, 18), (0, 2, 4, 6), 3, dim=-1).reshape(blocks.shape[0], 64) - 1
    return f16_at(blocks, 0) * q.to(torch.float32)


# --- k-quants (256-weight super-blocks) -------------------------------------------------------------------------


def q2_k(blocks: Tensor) -> Tensor:
    """16 bytes of 4-bit (scale, min) pairs, 64 bytes of 2-bit q, d, dmin; w = d*sc*q - dmin*m per 16 weights."""
    n = blocks.shape[0]
    scales = ints(blocks, 0, 16)
    dl = (f16_at(blocks, 80) * (scales & 0xF).to(torch.float32)).reshape(n, 16, 1)
    ml = (f16_at(blocks, 82) * (scales >> 4).to(torch.float32)).reshape(n, 16, 1)
    q = bits(ints(blocks, 16, 80).reshape(n, 2, 32), (0, 2, 4, 6), 3, dim=-2)
    return (dl * q.reshape(n, 16, 16).to(torch.float32) - ml).reshape(n, QK_K)


def _q3_k_scales(packed: Tensor) -> Tensor:
    """12 bytes -> 16 signed 6-bit scales: low nibbles from bytes 0-7, high 2 bits from bytes 8-11."""
    n = packed.shape[0]
    low = bits(packed[:, :8], (0, 4), 0xF, dim=-2).reshape(n, 16)
    high = bits(packed[:, 8:12], (0, 2, 4, 6), 3, dim=-2).reshape(n, 16)
    return (low | (high << 4)) - 32


def q3_k(blocks: Tensor) -> Tensor:
    """32 bytes of high-bit mask, 64 bytes of 2-bit q, 12 bytes of scales, d; w = d*sc*(q - 4*!hbit)."""
    n = blocks.shape[0]
    sc = _q3_k_scales(ints(blocks, 96, 108)).to(torch.float32)
    dl = (f16_at(blocks, 108) * sc).reshape(n, 16, 1)
    low = bits(ints(blocks, 32, 96).reshape(n, 2, 32), (0, 2, 4, 6), 3, dim=-2).reshape(n, 16, 16)
    high = bits(ints(blocks, 0, 32).reshape(n, 1, 32), range(8), 1, dim=-2).reshape(n, 16, 16)
    q = low - ((high ^ 1) << 2)
    return (dl * q.to(torch.float32)).reshape(n, QK_K)


def _k_scale_min(packed: Tensor) -> tuple[Tensor, Tensor]:
    """12 bytes -> 8 6-bit scales and 8 6-bit mins (Q4_K/Q5_K packing), each (n, 8) int32."""
    d, m, md = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    sc = torch.cat([d & 0x3F, (md & 0xF) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _k_scaled(blocks: Tensor, q: Tensor) -> Tensor:
    """d*sc*q - dmin*m for Q4_K/Q5_K: d, dmin at bytes 0, 2, packed scales at 4..16, q (n, 8, 32)."""
    n = blocks.shape[0]
    sc, mn = _k_scale_min(ints(blocks, 4, 16))
    d = (f16_at(blocks, 0) * sc.to(torch.float32)).reshape(n, 8, 1)
    dm = (f16_at(blocks, 2) * mn.to(torch.float32)).reshape(n, 8, 1)
    return (d * q.to(torch.float32) - dm).reshape(n, QK_K)


def q4_k(blocks: Tensor) -> Tensor:
    """d, dmin, 12 bytes of scales/mins, 128 bytes of nibbles (32 low, then 32 high, per 64 weights)."""
    n = blocks.shape[0]
    q = bits(ints(blocks, 16, 144).reshape(n, 4, 32), (0, 4), 0xF, dim=-2).reshape(n, 8, 32)
    return _k_scaled(blocks, q)


def q5_k(blocks: Tensor) -> Tensor:
    """Q4_K plus 32 bytes of fifth bits (bit j of byte i belongs to weight 32*j + i)."""
    n = blocks.shape[0]
    low = bits(ints(blocks, 48, 176).reshape(n, 4, 32), (0, 4), 0xF, dim=-2).reshape(n, 8, 32)
    high = bits(ints(blocks, 16, 48).reshape(n, 1, 32), range(8), 1, dim=-2).reshape(n, 8, 32)
    return _k_scaled(blocks, low | (high << 4))


def q6_k_values(blocks: Tensor) -> Tensor:
    """The 6-bit values q (0..63) of Q6_K blocks in weight order, (n, 256) int32: the nibble of ql with two bits
    of qh on top (the weight is d*sc*(q - 32))."""
    n = blocks.shape[0]
    low = bits(ints(blocks, 0, 128).reshape(n, 2, 64), (0, 4), 0xF, dim=-2).reshape(n, 8, 32)
    high = bits(ints(blocks, 128, 192).reshape(n, 2, 32), (0, 2, 4, 6), 3, dim=-2).reshape(n, 8, 32)
    return (low | (high << 4)).reshape(n, QK_K)


def q6_k(blocks: Tensor) -> Tensor:
    """128 bytes of low nibbles, 64 bytes of 2-bit highs, 16 int8 scales, d; w = d*sc*(q - 32)."""
    n = blocks.shape[0]
    sc = blocks[:, 192:208].view(torch.int8).to(torch.float32)
    d = (f16_at(blocks, 208) * sc).reshape(n, 16, 1)
    q = (q6_k_values(blocks) - 32).reshape(n, 16, 16)
    return (d * q.to(torch.float32)).reshape(n, QK_K)


# --- ternary ----------------------------------------------------------------------------------------------------


def _trits(x: Tensor, count: int) -> Tensor:
    """Base-3 digits packed as fixed-point fractions: byte*3^i (mod 256), then *3 >> 8; (n, count, k)."""
    powers = torch.stack([(x * 3**i) & 0xFF for i in range(count)], dim=-2)
    return (powers * 3) >> 8


def tq1_0(blocks: Tensor) -> Tensor:
    """48 bytes of 5 trits, 4 bytes of 4 trits, d; w = d * (t - 1)."""
    n = blocks.shape[0]
    t = torch.cat([
        _trits(ints(blocks, 0, 32), 5).reshape(n, 160),
        _trits(ints(blocks, 32, 48), 5).reshape(n, 80),
        _trits(ints(blocks, 48, 52), 4).reshape(n, 16),
    ], dim=-1)
    return f16_at(blocks, 52) * (t - 1).to(torch.float32)


def tq2_0(blocks: Tensor) -> Tensor:
    """64 bytes of 2-bit q, d; w = d * (q - 1)."""
    n = blocks.shape[0]
    q = bits(ints(blocks, 0, 64).reshape(n, 2, 32), (0, 2, 4, 6), 3, dim=-2).reshape(n, QK_K)
    return f16_at(blocks, 64) * (q - 1).to(torch.float32)


# --- 4-bit floats -----------------------------------------------------------------------------------------------


def _e8m0_half(e: Tensor) -> Tensor:
    """e8m0 exponent bytes (int32) -> 2^(e - 128) as float32 (subnormal for e < 2)."""
    as_bits = torch.where(e < 2, torch.full_like(e, 0x00200000) << e.clamp(max=1), (e - 1) << 23)
    return as_bits.view(torch.float32)


def mxfp4(blocks: Tensor) -> Tensor:
    """e8m0 exponent byte, 16 bytes of e2m1 nibbles; w = 2^(e-128) * 2*e2m1(q)."""
    q = lookup(fp4_values, _low_high(ints(blocks, 1, 17)))
    return _e8m0_half(ints(blocks, 0, 1)) * q


def nvfp4(blocks: Tensor) -> Tensor:
    """4 ue4m3 scale bytes, then per 16 weights 8 bytes of e2m1 nibbles (8 low, then 8 high)."""
    n = blocks.shape[0]
    d = lookup(ue4m3_half, ints(blocks, 0, 4)).reshape(n, 4, 1)
    qs = ints(blocks, 4, 36).reshape(n, 4, 8)
    q = lookup(fp4_values, torch.cat([qs & 0xF, qs >> 4], dim=-1))
    return (d * q).reshape(n, 64)
