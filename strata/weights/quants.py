"""ggml tensor types (F32, F16, BF16 and every block quantization) and their dequantization in PyTorch.

GGUF checkpoints keep weights block-quantized: a row is a run of fixed-size blocks, each holding a few scales and
a packed code per weight. strata keeps them that way in memory (memory-mapped, as stored) and dequantizes a
tensor, or a few rows of it, only when it is used. That keeps a model in the few GB its file takes rather than
the many more its float weights would, costs no conversion at load, and works on any device torch supports.

`dequantize` is vectorised over all blocks at once (no Python loop over blocks, no numpy), so the same code runs
on CPU and CUDA tensors. Its arithmetic mirrors ggml's reference dequantizers step by step in float32 and is
bit-identical to them (tests/test_quants.py checks every type against the gguf package); the result is cast to
the requested dtype last. The block decoders themselves live in `quants_k` (legacy, k-, ternary and fp4
types) and `quants_iq` (i-quants and their codebooks).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from strata.errors import StrataError
from strata.weights import quants_iq as iq
from strata.weights import quants_k as k
from strata.weights import repack


class UnsupportedTypeError(StrataError, ValueError):
    """A ggml type id that strata cannot dequantize; the message names the id and, if known, the type."""


@dataclass(frozen=True)
class GGMLType:
    """One ggml tensor type: `block_size` weights are stored in `type_size` bytes."""

    id: int  # ggml type id, as in gguf.GGMLQuantizationType
    name: str  # "Q4_K", "F32", ...
    block_size: int  # weights per block (1 for F32/F16/BF16)
    type_size: int  # bytes per block


def _f32(blocks: Tensor) -> Tensor:
    return blocks.contiguous().view(torch.float32).clone()


def _f16(blocks: Tensor) -> Tensor:
    return blocks.contiguous().view(torch.float16).to(torch.float32)


def _bf16(blocks: Tensor) -> Tensor:
    """bf16 is the top half of a float32: shift the bits up (exact, NaN payloads included)."""
    return (blocks.contiguous().view(torch.int16).to(torch.int32) << 16).view(torch.float32)


Decoder = Callable[[Tensor], Tensor]  # (n, type_size) uint8 blocks -> (n, block_size) float32

_SUPPORTED: tuple[tuple[GGMLType, Decoder], ...] = (
    (GGMLType(0, "F32", 1, 4), _f32),
    (GGMLType(1, "F16", 1, 2), _f16),
    (GGMLType(2, "Q4_0", 32, 18), k.q4_0),
    (GGMLType(3, "Q4_1", 32, 20), k.q4_1),
    (GGMLType(6, "Q5_0", 32, 22), k.q5_0),
    (GGMLType(7, "Q5_1", 32, 24), k.q5_1),
    (GGMLType(8, "Q8_0", 32, 34), k.q8_0),
    (GGMLType(10, "Q2_K", 256, 84), k.q2_k),
    (GGMLType(11, "Q3_K", 256, 110), k.q3_k),
    (GGMLType(12, "Q4_K", 256, 144), k.q4_k),
    (GGMLType(13, "Q5_K", 256, 176), k.q5_k),
    (GGMLType(14, "Q6_K", 256, 210), k.q6_k),
    (GGMLType(16, "IQ2_XXS", 256, 66), iq.iq2_xxs),
    (GGMLType(17, "IQ2_XS", 256, 74), iq.iq2_xs),
    (GGMLType(18, "IQ3_XXS", 256, 98), iq.iq3_xxs),
    (GGMLType(19, "IQ1_S", 256, 50), iq.iq1_s),
    (GGMLType(20, "IQ4_NL", 32, 18), iq.iq4_nl),
    (GGMLType(21, "IQ3_S", 256, 110), iq.iq3_s),
    (GGMLType(22, "IQ2_S", 256, 82), iq.iq2_s),
    (GGMLType(23, "IQ4_XS", 256, 136), iq.iq4_xs),
    (GGMLType(29, "IQ1_M", 256, 56), iq.iq1_m),
    (GGMLType(30, "BF16", 1, 2), _bf16),
    (GGMLType(34, "TQ1_0", 256, 54), k.tq1_0),
    (GGMLType(35, "TQ2_0", 256, 66), k.tq2_0),
    (GGMLType(39, "MXFP4", 32, 17), k.mxfp4),
    (GGMLType(40, "NVFP4", 64, 36), k.nvfp4),
    (GGMLType(42, "Q2_0", 64, 18), k.q2_0),
    (GGMLType(repack.Q8_0_R8_ID, "Q8_0_R8", 256, 272), repack.q8_0_r8),  # in memory only: strata.weights.repack
    (GGMLType(repack.Q6_K_P_ID, "Q6_K_P", 256, 224), repack.q6_k_p),
    (GGMLType(repack.Q8_0_R_ID, "Q8_0_R", 256, 272), repack.q8_0_r),
    (GGMLType(repack.Q4_K_R_ID, "Q4_K_R", 256, 144), repack.q4_k_r),
    (GGMLType(repack.Q5_1_R_ID, "Q5_1_R", 128, 96), repack.q5_1_r),
    (GGMLType(repack.Q6_K_R_ID, "Q6_K_R", 256, 224), repack.q6_k_r),
    (GGMLType(repack.Q4_K_RT_ID, "Q4_K_RT", 256, 144), repack.q4_k_r),  # tile-major: see `dequantize`
    (GGMLType(repack.Q6_K_RT_ID, "Q6_K_RT", 256, 224), repack.q6_k_r),
)

GGML_TYPES: dict[int, GGMLType] = {t.id: t for t, _ in _SUPPORTED}
_DECODERS: dict[int, Decoder] = {t.id: f for t, f in _SUPPORTED}

# ggml type ids strata knows by name but does not dequantize (activation-only, integer, retired or too new).
_UNSUPPORTED_NAMES: dict[int, str] = {
    4: "Q4_2", 5: "Q4_3", 9: "Q8_1", 15: "Q8_K", 24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64",
    31: "Q4_0_4_4", 32: "Q4_0_4_8", 33: "Q4_0_8_8", 36: "IQ4_NL_4_4", 37: "IQ4_NL_4_8", 38: "IQ4_NL_8_8",
    41: "Q1_0",
}


def ggml_type(type_id: int) -> GGMLType:
    """The supported ggml type with this id; UnsupportedTypeError names any other."""
    found = GGML_TYPES.get(type_id)
    if found is not None:
        return found
    name = _UNSUPPORTED_NAMES.get(type_id)
    what = f"ggml type {type_id} ({name})" if name else f"unknown ggml type {type_id}"
    supported = ", ".join(t.name for t in GGML_TYPES.values() if t.id < repack.FIRST_REPACKED_ID)
    raise UnsupportedTypeError(f"{what} is not supported; strata dequantizes {supported}")


def file_type(type_id: int) -> GGMLType:
    """`ggml_type` for a type id read from a file: strata's in-memory repacked layouts are not file types."""
    if type_id >= repack.FIRST_REPACKED_ID:
        raise UnsupportedTypeError(f"unknown ggml type {type_id}")
    return ggml_type(type_id)


def row_bytes(type_id: int, cols: int) -> int:
    """Bytes taken by one row of `cols` weights; `cols` must be a positive whole number of blocks."""
    qtype = ggml_type(type_id)
    if cols <= 0 or cols % qtype.block_size:
        raise ValueError(f"a {qtype.name} row of {cols} weights is not a positive whole number of "
                         f"{qtype.block_size}-weight blocks")
    return cols // qtype.block_size * qtype.type_size


def dequantize(data: Tensor, type_id: int, cols: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """Decode uint8 `data`, shape (rows, row_bytes) or flat (rows * row_bytes,), of type `type_id` into a
    (rows, cols) tensor of `dtype` on data's device. `data` is not modified and the result never shares its memory.
    A tile-major type (`repack.TILE_LAYOUTS`) takes whole tiles only: (rows, row_bytes) with rows a multiple of its
    tile, the rows of those tiles in order."""
    qtype = ggml_type(type_id)
    width = row_bytes(type_id, cols)
    if data.dtype != torch.uint8:
        raise ValueError(f"{qtype.name} data must be a uint8 tensor of raw bytes, not {data.dtype}")
    flat_ok = data.dim() == 1 and data.numel() % width == 0
    if not (flat_ok or (data.dim() == 2 and data.shape[1] == width)):
        raise ValueError(f"{qtype.name} data of shape {tuple(data.shape)} is not rows of {width} bytes "
                         f"({cols} weights)")
    rows = data.numel() // width
    layout = repack.TILE_LAYOUTS.get(type_id)
    if layout is not None:
        if data.dim() != 2 or rows % layout.tile:
            raise ValueError(f"{qtype.name} data of shape {tuple(data.shape)}: tile-major bytes decode in whole "
                             f"tiles of {layout.tile} rows of {width} bytes")
        data = repack.tile_major(data, layout.tile, layout.step, undo=True)
    blocks = data.reshape(rows * width // qtype.type_size, qtype.type_size)
    return _DECODERS[type_id](blocks).reshape(rows, cols).to(dtype)
