"""strata.weights.quants against the gguf package's numpy dequantizers, bit for bit, on random blocks."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gq
from hypothesis import given, settings
from hypothesis import strategies as st

from strata.weights import quants_iq
from strata.weights.quants import (
    GGML_TYPES,
    UnsupportedTypeError,
    dequantize,
    ggml_type,
    row_bytes,
)

torch.set_num_threads(1)

# Types the gguf package (the oracle) knows; Q2_0 (type 42) is newer than gguf 0.19 and is checked below
# against a scalar transcription of ggml's dequantize_row_q2_0 and against the fixture file.
GGML_TYPES_BY_NAME = {t.name: t for t in GGML_TYPES.values() if t.id in GGMLQuantizationType._value2member_map_}
# Byte offsets of the fp16 scale fields (d, dmin, m) in one block of each type.
F16_FIELDS: dict[str, tuple[int, ...]] = {
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
    "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
    "IQ2_XXS": (0,), "IQ2_XS": (0,), "IQ2_S": (0,), "IQ3_XXS": (0,), "IQ3_S": (0,), "IQ1_S": (0,),
    "IQ4_NL": (0,), "IQ4_XS": (0,), "TQ1_0": (52,), "TQ2_0": (64,),
    "IQ1_M": (), "MXFP4": (), "NVFP4": (),  # IQ1_M: see _sanitize; MXFP4/NVFP4 scales are always finite
}
# Whole-tensor float types: (bytes per value, exponent mask, a bit that makes an all-ones exponent finite).
FLOAT_BITS: dict[str, tuple[int, int, int]] = {
    "F32": (4, 0x7F800000, 0x40000000), "F16": (2, 0x7C00, 0x4000), "BF16": (2, 0x7F80, 0x4000),
}


def _finite(values: np.ndarray, exp_mask: int, top_bit: int) -> np.ndarray:
    """Float bit patterns with any inf/NaN made finite by clearing the exponent's top bit."""
    return np.where((values & exp_mask) == exp_mask, values ^ top_bit, values).astype(values.dtype)


def _sanitize(raw: np.ndarray, name: str) -> np.ndarray:
    """Random bytes (rows, row_bytes) with every float field set to a finite value (random sign, exponent
    and mantissa: zeros and subnormals included)."""
    raw = raw.copy()
    if name in FLOAT_BITS:
        size, exp_mask, top = FLOAT_BITS[name]
        view = raw.view(np.uint32 if size == 4 else np.uint16)
        view[...] = _finite(view, exp_mask, top)
        return raw
    qtype = GGML_TYPES_BY_NAME[name]
    blocks = raw.reshape(-1, qtype.type_size)
    for off in F16_FIELDS[name]:
        field = blocks[:, off:off + 2].copy().view(np.uint16)
        blocks[:, off:off + 2] = _finite(field, 0x7C00, 0x4000).view(np.uint8)
    if name == "IQ1_M":  # the fp16 d is the top nibbles of the 4 uint16 scale words (bytes 48..56)
        words = blocks[:, 48:56].copy().view(np.uint16)
        nibbles = (words >> 12).astype(np.uint16)
        d = nibbles[:, 0] | (nibbles[:, 1] << 4) | (nibbles[:, 2] << 8) | (nibbles[:, 3] << 12)
        d = _finite(d, 0x7C00, 0x4000)
        tops = np.stack([(d >> s) & 0xF for s in (0, 4, 8, 12)], axis=1).astype(np.uint16)
        words = (words & 0x0FFF) | (tops << 12)
        blocks[:, 48:56] = words.view(np.uint8)
    return raw



def _random_rows(name: str, rows: int, blocks_per_row: int, seed: int) -> tuple[np.ndarray, int]:
    qtype = GGML_TYPES_BY_NAME[name]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, blocks_per_row * qtype.type_size), dtype=np.uint8)
    return _sanitize(raw, name), blocks_per_row * qtype.block_size


def _assert_bit_exact(ours: torch.Tensor, ref: np.ndarray) -> None:
    """Same bits everywhere, except that any NaN matches any NaN."""
    theirs = torch.from_numpy(np.ascontiguousarray(ref, dtype=np.float32))
    assert ours.dtype == torch.float32 and ours.shape == theirs.shape
    both_nan = ours.isnan() & theirs.isnan()
    same = (ours.view(torch.int32) == theirs.view(torch.int32)) | both_nan
    if not bool(same.all()):
        i = int((~same).flatten().nonzero()[0])
        raise AssertionError(f"{int((~same).sum())} values differ; first at {i}: "
                             f"{ours.flatten()[i].item()!r} vs {theirs.flatten()[i].item()!r}")


def _check(name: str, raw: np.ndarray, cols: int) -> None:
    qtype = GGML_TYPES_BY_NAME[name]
    ref = gq.dequantize(raw, GGMLQuantizationType(qtype.id))
    data = torch.from_numpy(raw)
    before = data.clone()
    ours = dequantize(data, qtype.id, cols)
    assert torch.equal(data, before), "dequantize modified its input"
    _assert_bit_exact(ours, ref.reshape(raw.shape[0], cols))


@pytest.mark.parametrize("name", sorted(GGML_TYPES_BY_NAME))
def test_bit_exact_against_gguf(name: str) -> None:
    blocks = 64 if GGML_TYPES_BY_NAME[name].block_size == 1 else 6
    raw, cols = _random_rows(name, rows=5, blocks_per_row=blocks, seed=zlib.crc32(name.encode()))
    _check(name, raw, cols)


@settings(max_examples=30, deadline=None)
@given(name=st.sampled_from(["Q4_K", "Q6_K", "IQ2_XS", "IQ1_M", "Q5_1"]), rows=st.integers(1, 3),
       blocks=st.integers(1, 3), seed=st.integers(0, 2**32 - 1))
def test_property_random_blocks(name: str, rows: int, blocks: int, seed: int) -> None:
    raw, cols = _random_rows(name, rows, blocks, seed)
    _check(name, raw, cols)


def test_covers_every_gguf_dequantizer() -> None:
    """Every type the installed gguf package can dequantize is supported here too."""
    gguf_types = {q.value for q in gq._type_traits} | {GGMLQuantizationType.F32.value, GGMLQuantizationType.F16.value}
    assert gguf_types <= set(GGML_TYPES), sorted(GGMLQuantizationType(i).name for i in gguf_types - set(GGML_TYPES))


@pytest.mark.parametrize("type_id", sorted(t.id for t in GGML_TYPES_BY_NAME.values()))
def test_sizes_match_gguf(type_id: int) -> None:
    qtype = ggml_type(type_id)
    gguf_type = GGMLQuantizationType(type_id)
    assert qtype.name == gguf_type.name
    block_size, type_size = GGML_QUANT_SIZES[gguf_type]
    assert (qtype.block_size, qtype.type_size) == (block_size, type_size)
    assert row_bytes(type_id, 3 * block_size) == 3 * type_size


def test_unknown_and_unsupported_types_are_refused_by_name() -> None:
    with pytest.raises(UnsupportedTypeError, match="unknown ggml type 99"):
        ggml_type(99)
    with pytest.raises(ValueError, match=r"ggml type 15 \(Q8_K\)"):
        dequantize(torch.zeros(292, dtype=torch.uint8), 15, 256)
    with pytest.raises(UnsupportedTypeError, match=r"41 \(Q1_0\)"):
        row_bytes(41, 128)


def test_bad_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="Q4_K row of 100 weights"):
        row_bytes(12, 100)
    with pytest.raises(ValueError, match="Q8_0 row of 48 weights"):
        dequantize(torch.zeros(2, 34, dtype=torch.uint8), 8, 48)
    with pytest.raises(ValueError, match="not rows of 34 bytes"):
        dequantize(torch.zeros(2, 35, dtype=torch.uint8), 8, 32)
    with pytest.raises(ValueError, match="not rows of 34 bytes"):
        dequantize(torch.zeros(35, dtype=torch.uint8), 8, 32)
    with pytest.raises(ValueError, match="uint8"):
        dequantize(torch.zeros(2, 34, dtype=torch.int8), 8, 32)


def test_flat_input_dtype_and_no_shared_memory() -> None:
    raw, cols = _random_rows("Q4_K", rows=3, blocks_per_row=2, seed=1)
    rows2d = dequantize(torch.from_numpy(raw), 12, cols)
    flat = dequantize(torch.from_numpy(raw).flatten(), 12, cols)
    assert torch.equal(rows2d, flat)
    assert torch.equal(dequantize(torch.from_numpy(raw), 12, cols, torch.bfloat16), rows2d.to(torch.bfloat16))
    f32 = torch.arange(8, dtype=torch.float32)
    out = dequantize(f32.view(torch.uint8), 0, 4)
    out.zero_()
    assert torch.equal(f32, torch.arange(8, dtype=torch.float32))
    assert dequantize(torch.zeros(0, dtype=torch.uint8), 13, 256).shape == (0, 256)


def test_non_contiguous_rows() -> None:
    raw, cols = _random_rows("IQ3_S", rows=4, blocks_per_row=1, seed=2)
    wide = torch.zeros(4, 2 * raw.shape[1], dtype=torch.uint8)
    wide[:, : raw.shape[1]] = torch.from_numpy(raw)
    assert torch.equal(dequantize(wide[:, : raw.shape[1]], 21, cols), dequantize(torch.from_numpy(raw), 21, cols))


@pytest.mark.parametrize("name", ["IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S"])
def test_codebooks_match_gguf(name: str) -> None:
    cls = getattr(gq, name)
    cls.init_grid()
    ours = getattr(quants_iq, name.lower().replace("_", "") + "_grid")()
    assert torch.equal(ours, torch.from_numpy(cls.grid.reshape(cls.grid_shape)))


def test_ksigns_match_gguf() -> None:
    assert quants_iq.ksigns().tolist() == list(gq.IQ2_XXS.ksigns)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("name", sorted(GGML_TYPES_BY_NAME))
def test_cuda_matches_cpu(name: str) -> None:
    raw, cols = _random_rows(name, rows=3, blocks_per_row=4, seed=3)
    cpu = dequantize(torch.from_numpy(raw), GGML_TYPES_BY_NAME[name].id, cols)
    gpu = dequantize(torch.from_numpy(raw).cuda(), GGML_TYPES_BY_NAME[name].id, cols)
    assert gpu.device.type == "cuda"
    _assert_bit_exact(gpu.cpu(), cpu.numpy())


def _q2_0_scalar(raw: np.ndarray) -> np.ndarray:
    """ggml's dequantize_row_q2_0, one weight at a time: y[j] = d * (((qs[j/4] >> 2*(j%4)) & 3) - 1)."""
    out = []
    for block in raw.reshape(-1, 18):
        d = float(block[:2].view(np.float16)[0])
        out += [d * (((int(block[2 + j // 4]) >> (2 * (j % 4))) & 3) - 1) for j in range(64)]
    return np.array(out, dtype=np.float32)


def test_q2_0_matches_scalar_reference() -> None:
    rng = np.random.default_rng(42)
    raw = rng.integers(0, 256, size=(3, 4 * 18), dtype=np.uint8)
    raw.reshape(-1, 18)[:, :2] = rng.normal(0, 0.1, size=(12, 1)).astype(np.float16).view(np.uint8)
    ours = dequantize(torch.from_numpy(raw), 42, 256)
    _assert_bit_exact(ours, _q2_0_scalar(raw).reshape(3, 256))
    assert ggml_type(42).name == "Q2_0" and row_bytes(42, 128) == 36
