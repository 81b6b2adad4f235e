"""strata's repacked block layouts: the bytes of a ggml type rearranged so a GPU loads them as aligned vectors.

A ggml Q8_0 block is {fp16 d; int8 q[32]}, 34 bytes, so the quants of most blocks sit at 2-byte alignment and the
GEMV must read them byte by byte. Q8_0_R8 regroups every 8 consecutive blocks of a row as {fp16 d[8]; q[8][32]}
(272 = 17 x 16 bytes): the same bytes, each group's quants 16-byte aligned. It is made from Q8_0 rows whose length
is a multiple of 256 when the weights are placed on a GPU (`repack_rows`) and exists only in memory: no file holds
it (the GGUF reader refuses its id). `quants.dequantize` reads it like any other type, so every path that reads
weights (the reference ops, prefill's dequantize-then-matmul) works on it unchanged.

A Q6_K block is {ql[128]; qh[64]; int8 scales[16]; fp16 d}, 210 bytes, so the blocks of a row sit at 2-byte
alignment and the GEMV reads them byte by byte. Q6_K_P pads every block to 224 = 14 x 16 bytes (the same fields at
the same offsets, then 14 zero bytes): every field of every block is 16-byte aligned and loads as int32 words,
for 6.7% more bytes. Made for 2-D Q6_K matrices placed on a GPU (the output head of most releases).

Q4_K_R and Q8_0_R order each block's quants for the row-register GEMV (`strata.kernels.gemv_rr`), which reads
16-byte vectors of words and multiplies the k-th byte of every word by one contiguous run of x:
* Q4_K_R: the Q4_K block with, in each 32-byte group c of nibbles, byte 4w + b taken from byte 8b + w (w < 8, b < 4;
  nibbles unchanged): the low (high) nibble of byte b of word w is weight 64c + 8b + w (+ 32) of group c. The
  groups' words are then stored word-half first: words 4h..4h+3 of group c at byte 16 + 64h + 16c, so the 16-byte
  vectors that four threads (one per group) load side by side fill whole 32-byte sectors.
* Q8_0_R: Q8_0_R8's groups {fp16 d[8]; q[8][32]} with every quant stored as q + 128 (an unsigned byte) and, in
  each block, byte 4w + b taken from byte 8b + w: byte b of word w is weight 8b + w of the block.
* Q5_1_R: four Q5_1 blocks regrouped as {(fp16 d, fp16 m)[4]; qh[4]; qs[4][16]} (96 bytes); in each block's 16
  nibble bytes byte 4w + b is taken from byte 4b + w (its low nibble is weight 4b + w, its high one 16 + 4b + w),
  and the fifth bits are moved so that bit 4 of byte b of (qh >> w) is weight 4b + w's and bit 4 of byte b of
  (qh << (4 - w)) weight 16 + 4b + w's: qh bit 8b + 4 + w, and bit 8b + w.
* Q6_K_R: a Q6_K block as {int8 scales[16]; nibbles[128]; highs[64]; fp16 d; 14 zero bytes}, 224 bytes like
  Q6_K_P. Group c < 4 holds weights 64c..64c+63 (sub-blocks 4c..4c+3, whose scales are word c of the header), in
  8 nibble words and 4 high words: byte b of nibble word w has weight 8b + w of the group in its low nibble and
  weight 32 + 8b + w in its high one, as Q4_K_R; bits 2i..2i+1 of byte b of high word w are the top two bits of
  weight 8b + w + 4 (i % 2) + 32 (i // 2), so one shift and one mask put them on bits 4-5 of the nibble bytes they
  belong to. Side by side as in Q4_K_R: nibble words 4h..4h+3 of group c at byte 16 + 64h + 16c, high words of
  group c at 144 + 16c.
All but Q6_K_R keep the bytes and the size of their ggml type.

Q4_K_RT and Q6_K_RT hold Q4_K_R and Q6_K_R blocks tile-major (`TILE_LAYOUTS`, `tile_major`): a matrix's rows in
tiles of `tile` rows, each tile stored step by step, [N / tile, row bytes / step, tile, step], so that the words a
row-register program loads in one K-loop step (its tile's rows, one step of bytes each) lie together instead of
`tile` pieces a row apart. The blocks are the same; only whole tiles are stored together, so such a tensor has no
row of its own: `QuantTensor` keeps its bytes as (..., N / tile, tile, row bytes) and refuses to read rows one by
one, and `quants.dequantize` takes whole tiles only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from strata.weights.quants_k import q4_k, q5_1, q6_k, q6_k_values, q8_0

Q8_0_ID = 8
Q8_0_R8_ID = 1008
Q8_0_R_ID = 1009
Q4_K_ID = 12
Q4_K_R_ID = 1012
Q5_1_ID = 7
Q5_1_R_ID = 1007
Q6_K_ID = 14
Q6_K_P_ID = 1014
Q6_K_R_ID = 1114
Q4_K_RT_ID = 1013
Q6_K_RT_ID = 1115
Q6_K_BYTES, Q6_K_P_BYTES = 210, 224
FIRST_REPACKED_ID = 1000
"""Ids of strata's repacked types start here, far above ggml's."""


@dataclass(frozen=True)
class TileLayout:
    """How a tile-major type stores its `base` type's rows: tiles of `tile` rows, `step` bytes of each row per
    step (the row-register GEMV's rows of one matrix per program and bytes per row per K-loop step)."""

    base: int
    tile: int
    step: int


TILE_LAYOUTS = {Q4_K_RT_ID: TileLayout(Q4_K_R_ID, 4, 2 * 144), Q6_K_RT_ID: TileLayout(Q6_K_R_ID, 16, 224)}
"""The tile-major types by id. Q4_K_RT: the routed experts' gate/up stacks as their GLU launch reads them (4 rows
of each matrix per program, two super-blocks per step); Q6_K_RT: the head as its launch reads it (16 rows, one
super-block per step). In the 4K step on an H100 the two together 4.562-4.563 -> 4.493-4.494 ms per replay
against their row-major twins (bench/results/2026-12-06-h100-step-variants-tiled-1ed74c8.json)."""


def tile_major(rows: Tensor, tile: int, step: int, undo: bool = False) -> Tensor:
    """(..., N, row bytes) rows reordered into tiles of `tile` rows, each tile step by step: (..., N / tile, steps,
    tile, step) flattened back to the same shape, the same bytes; a new tensor. undo: the reverse."""
    n, row_bytes = rows.shape[-2:]
    if n % tile or row_bytes % step:
        raise ValueError(f"tile-major: {n} rows of {row_bytes} bytes do not split into tiles of {tile} rows and "
                         f"steps of {step} bytes")
    lead, steps = rows.shape[:-2], row_bytes // step
    inner = (steps, tile) if undo else (tile, steps)
    t = rows.reshape(*lead, n // tile, *inner, step)
    return t.transpose(-3, -2).contiguous().reshape(rows.shape)


def tile_major_(rows: Tensor, tile: int, step: int, undo: bool = False, chunk_bytes: int = 64 << 20) -> Tensor:
    """`tile_major` in place, a run of whole tiles at a time (a tile never spans two matrices of a stack, so a
    stack is re-laid as one tall matrix): no copy of the whole tensor is made. Returns rows."""
    n, row_bytes = rows.shape[-2:]
    if n % tile or row_bytes % step or not rows.is_contiguous():
        raise ValueError(f"tile-major: {n} contiguous rows of {row_bytes} bytes do not split into tiles of {tile} "
                         f"rows and steps of {step} bytes")
    flat = rows.view(-1, row_bytes)
    run = max(1, chunk_bytes // (tile * row_bytes)) * tile
    for r0 in range(0, flat.shape[0], run):
        part = flat[r0:r0 + run]
        part.copy_(tile_major(part, tile, step, undo))
    return rows


def q8_0_r8(blocks: Tensor) -> Tensor:
    """(n, 272) Q8_0_R8 groups -> (n, 256) float32: back to eight Q8_0 blocks, then Q8_0's decoder."""
    n = blocks.shape[0]
    d = blocks[:, :16].reshape(n, 8, 2)
    q = blocks[:, 16:].reshape(n, 8, 32)
    return q8_0(torch.cat([d, q], -1).reshape(n * 8, 34)).reshape(n, 256)


def regroup_q8_0(rows: Tensor, k: int) -> Tensor:
    """(..., k/32*34) Q8_0 rows -> the same bytes as Q8_0_R8 rows (k a multiple of 256); a new tensor."""
    lead = rows.shape[:-1]
    b = rows.reshape(*lead, k // 256, 8, 34)
    return torch.cat([b[..., :2].reshape(*lead, k // 256, 16), b[..., 2:].reshape(*lead, k // 256, 256)],
                     -1).reshape(*lead, -1)


def _transpose_words(q: Tensor) -> Tensor:
    """(..., 32) bytes of 32-byte runs -> byte 4w + b taken from byte 8b + w (w < 8, b < 4)."""
    return q.reshape(*q.shape[:-1], 4, 8).transpose(-1, -2).reshape(q.shape)


def _untranspose_words(q: Tensor) -> Tensor:
    """The inverse of `_transpose_words`."""
    return q.reshape(*q.shape[:-1], 8, 4).transpose(-1, -2).reshape(q.shape)


def q4_k_r(blocks: Tensor) -> Tensor:
    """(n, 144) Q4_K_R blocks -> (n, 256) float32: the nibble bytes back in Q4_K order, then Q4_K's decoder."""
    n = blocks.shape[0]
    groups = blocks[:, 16:].reshape(n, 2, 4, 16).transpose(1, 2).reshape(n, 4, 32)
    qs = _untranspose_words(groups).reshape(n, 128)
    return q4_k(torch.cat([blocks[:, :16], qs], -1))


def reorder_q4_k(rows: Tensor, k: int) -> Tensor:
    """(..., k/256*144) Q4_K rows -> the same blocks as Q4_K_R rows; a new tensor."""
    return _by_row_chunks(_reorder_q4_k, rows, k)


def _reorder_q4_k(rows: Tensor, k: int) -> Tensor:
    lead = rows.shape[:-1]
    b = rows.reshape(*lead, k // 256, 144)
    qs = _transpose_words(b[..., 16:].reshape(*lead, k // 256, 4, 32))
    qs = qs.reshape(*lead, k // 256, 4, 2, 16).transpose(-2, -3).reshape(*lead, k // 256, 128)
    return torch.cat([b[..., :16], qs], -1).reshape(*lead, -1)


def q8_0_r(blocks: Tensor) -> Tensor:
    """(n, 272) Q8_0_R groups -> (n, 256) float32: each block's quants back in order, less 128, times its d."""
    n = blocks.shape[0]
    d = blocks[:, :16].contiguous().view(torch.float16).to(torch.float32)
    q = (_untranspose_words(blocks[:, 16:].reshape(n, 8, 32)) ^ 0x80).view(torch.int8).to(torch.float32)
    return (q * d[:, :, None]).reshape(n, 256)


def reorder_q8_0(rows: Tensor, k: int) -> Tensor:
    """(..., k/32*34) Q8_0 rows -> the same values as Q8_0_R rows (k a multiple of 256); a new tensor."""
    return _by_row_chunks(_reorder_q8_0, rows, k)


def _reorder_q8_0(rows: Tensor, k: int) -> Tensor:
    lead = rows.shape[:-1]
    g = regroup_q8_0(rows, k).reshape(*lead, k // 256, 272)
    q = _transpose_words(g[..., 16:].reshape(*lead, k // 256, 8, 32) ^ 0x80)
    return torch.cat([g[..., :16], q.reshape(*lead, k // 256, 256)], -1).reshape(*lead, -1)


_Q5_1_QH = [8 * (e // 4) + 4 + e % 4 for e in range(16)] + [8 * (e // 4) + e % 4 for e in range(16)]
"""Q5_1_R's fifth-bit positions: bit _Q5_1_QH[e] of its qh holds weight e's (see the module docstring)."""
_Q5_1_QH_BACK = sorted(range(32), key=_Q5_1_QH.__getitem__)
"""The inverse: bit p of Q5_1_R's qh is weight _Q5_1_QH_BACK[p]'s (Q5_1's bit _Q5_1_QH_BACK[p])."""


def _move_bits(words: Tensor, to: list[int]) -> Tensor:
    """(..., 4) uint8 little-endian words with bit e moved to bit to[e] (or, with `to` inverted, back)."""
    w = words.to(torch.int64)
    v = w[..., 0] | (w[..., 1] << 8) | (w[..., 2] << 16) | (w[..., 3] << 24)
    out = torch.zeros_like(v)
    for e, pos in enumerate(to):
        out |= ((v >> e) & 1) << pos
    return torch.stack([(out >> (8 * i)) & 255 for i in range(4)], -1).to(torch.uint8)


def _by_row_chunks(fn, rows: Tensor, k: int, chunk_bytes: int = 64 << 20, out_cols: int | None = None) -> Tensor:
    """fn(row chunk, k) over chunks of at most ~chunk_bytes of `rows` ((..., row_bytes) uint8), into one new
    tensor of rows of `out_cols` bytes (default: as many as the input's): a reorder of a stack of many GB needs
    only a chunk's temporaries."""
    flat = rows.reshape(-1, rows.shape[-1])
    out = flat.new_empty(flat.shape[0], out_cols or flat.shape[1])
    step = max(1, chunk_bytes // max(1, flat.shape[1]))
    for i in range(0, flat.shape[0], step):
        out[i:i + step] = fn(flat[i:i + step], k)
    return out.reshape(*rows.shape[:-1], out.shape[1])


def q5_1_r(blocks: Tensor) -> Tensor:
    """(n, 96) Q5_1_R groups -> (n, 128) float32: back to four Q5_1 blocks, then Q5_1's decoder."""
    n = blocks.shape[0]
    dm = blocks[:, :16].reshape(n, 4, 4)
    qh = _move_bits(blocks[:, 16:32].reshape(n, 4, 4), _Q5_1_QH_BACK)
    qs = blocks[:, 32:].reshape(n, 4, 4, 4).transpose(-1, -2).reshape(n, 4, 16)
    return q5_1(torch.cat([dm, qh, qs], -1).reshape(n * 4, 24)).reshape(n, 128)


def _reorder_q5_1(rows: Tensor, k: int) -> Tensor:
    n = rows.shape[0]
    b = rows.reshape(n, k // 128, 4, 24)
    qh = _move_bits(b[..., 4:8], _Q5_1_QH)
    qs = b[..., 8:].reshape(n, k // 128, 4, 4, 4).transpose(-1, -2).reshape(n, k // 128, 4, 16)
    return torch.cat([b[..., :4].reshape(n, k // 128, 16), qh.reshape(n, k // 128, 16),
                      qs.reshape(n, k // 128, 64)], -1).reshape(n, -1)


def reorder_q5_1(rows: Tensor, k: int) -> Tensor:
    """(..., k/32*24) Q5_1 rows -> the same weights as Q5_1_R rows (k a multiple of 128); a new tensor."""
    return _by_row_chunks(_reorder_q5_1, rows, k)


def q6_k_p(blocks: Tensor) -> Tensor:
    """(n, 224) Q6_K_P blocks -> (n, 256) float32: the first 210 bytes are the Q6_K block."""
    return q6_k(blocks[:, :Q6_K_BYTES].contiguous())


def pad_q6_k(rows: Tensor, k: int) -> Tensor:
    """(..., k/256*210) Q6_K rows -> the same blocks as Q6_K_P rows (each padded to 224 bytes); a new tensor."""
    lead = rows.shape[:-1]
    b = rows.reshape(*lead, k // 256, Q6_K_BYTES)
    pad = b.new_zeros(*lead, k // 256, Q6_K_P_BYTES - Q6_K_BYTES)
    return torch.cat([b, pad], -1).reshape(*lead, -1)


def _reorder_q6_k(rows: Tensor, k: int) -> Tensor:
    n = rows.shape[0]
    nb = k // 256
    blocks = rows.reshape(n * nb, Q6_K_BYTES)
    q = q6_k_values(blocks).reshape(-1, 4, 2, 32)  # [block, group c, low/high half of the group, 8b + w]
    nib = _transpose_words((q[:, :, 0] & 15) | ((q[:, :, 1] & 15) << 4))  # byte 4w + b = weights 8b + w, 32 + 8b + w
    hi = (q >> 4).reshape(-1, 4, 2, 4, 2, 4)  # [.., half, b, w4 = w // 4, w % 4]
    high = (hi[:, :, 0, :, 0] | (hi[:, :, 0, :, 1] << 2) | (hi[:, :, 1, :, 0] << 4) | (hi[:, :, 1, :, 1] << 6))
    high = high.transpose(-1, -2).reshape(-1, 4, 16)  # byte 4w + b of the high words
    nib = nib.reshape(-1, 4, 2, 16).transpose(1, 2).reshape(-1, 128)
    quants = torch.cat([nib, high.reshape(-1, 64)], -1).to(torch.uint8)
    pad = blocks.new_zeros(blocks.shape[0], Q6_K_P_BYTES - Q6_K_BYTES)
    out = torch.cat([blocks[:, 192:208], quants, blocks[:, 208:210], pad], -1)
    return out.reshape(n, nb * Q6_K_P_BYTES)


def reorder_q6_k(rows: Tensor, k: int) -> Tensor:
    """(..., k/256*210) Q6_K rows -> the same weights as Q6_K_R rows (224 bytes per block); a new tensor."""
    # int32 temporaries: ~8x a chunk's bytes
    return _by_row_chunks(_reorder_q6_k, rows, k, 8 << 20, out_cols=k // 256 * Q6_K_P_BYTES)


def q6_k_r(blocks: Tensor) -> Tensor:
    """(n, 224) Q6_K_R blocks -> (n, 256) float32: w = d sc (q - 32), as Q6_K's decoder computes it."""
    n = blocks.shape[0]
    b = blocks.to(torch.int32)
    sc = blocks[:, :16].view(torch.int8).to(torch.float32)
    d = blocks[:, 208:210].contiguous().view(torch.float16).to(torch.float32)
    nib = _untranspose_words(b[:, 16:144].reshape(n, 2, 4, 16).transpose(1, 2).reshape(n, 4, 32))
    # nib: byte 8b + w of group c holds weights 8b + w (low nibble), 32 + 8b + w (high)
    high = b[:, 144:208].reshape(n, 4, 4, 4).transpose(-1, -2)  # [c, b, w4]: bits of weights 8b + w4 (+4, +32, +36)
    top = torch.stack([(high >> (2 * i)) & 3 for i in range(4)], -1).reshape(n, 4, 4, 4, 2, 2)  # [.., b, w4, h, a]
    top = top.permute(0, 1, 4, 2, 5, 3).reshape(n, 4, 2, 32)  # [c, h, 8b + 4a + w4]
    q = torch.stack([nib & 15, nib >> 4], 2) | (top << 4)  # [c, h, 8b + w]
    return (d * sc.repeat_interleave(16, 1)) * (q.reshape(n, 256) - 32).to(torch.float32)


def repack_rows(data: Tensor, type_id: int, k: int) -> tuple[Tensor, int]:
    """(rows, type id) to store: `data` ((..., row_bytes) uint8 of ggml type `type_id`, rows of k weights) in its
    repacked layout when there is one, else unchanged."""
    if type_id == Q8_0_ID and k % 256 == 0:
        return reorder_q8_0(data, k), Q8_0_R_ID
    if type_id == Q4_K_ID:
        return reorder_q4_k(data, k), Q4_K_R_ID
    return data, type_id
