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
"""

from __future__ import annotations

import torch
from torch import Tensor

from strata.weights.quants_k import q6_k, q8_0

Q8_0_ID = 8
Q8_0_R8_ID = 1008
Q6_K_ID = 14
Q6_K_P_ID = 1014
Q6_K_BYTES, Q6_K_P_BYTES = 210, 224
FIRST_REPACKED_ID = 1000
"""Ids of strata's repacked types start here, far above ggml's."""


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


def q6_k_p(blocks: Tensor) -> Tensor:
    """(n, 224) Q6_K_P blocks -> (n, 256) float32: the first 210 bytes are the Q6_K block."""
    return q6_k(blocks[:, :Q6_K_BYTES].contiguous())


def pad_q6_k(rows: Tensor, k: int) -> Tensor:
    """(..., k/256*210) Q6_K rows -> the same blocks as Q6_K_P rows (each padded to 224 bytes); a new tensor."""
    lead = rows.shape[:-1]
    b = rows.reshape(*lead, k // 256, Q6_K_BYTES)
    pad = b.new_zeros(*lead, k // 256, Q6_K_P_BYTES - Q6_K_BYTES)
    return torch.cat([b, pad], -1).reshape(*lead, -1)


def repack_rows(data: Tensor, type_id: int, k: int) -> tuple[Tensor, int]:
    """(rows, type id) to store: `data` ((..., row_bytes) uint8 of ggml type `type_id`, rows of k weights) in its
    repacked layout when there is one, else unchanged."""
    if type_id == Q8_0_ID and k % 256 == 0:
        return regroup_q8_0(data, k), Q8_0_R8_ID
    return data, type_id
