"""HF -> GGUF conversion: byte-identical to llama.cpp's converter (f32) and llama-quantize (Q8_0) on the fixture,
the same logits as the HF folder, a Q8_0 quantizer equal to ggml's, and an output that appears only complete."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from strata.weights.gguf import GGUFError, GGUFFile, open_gguf
from strata.weights.gguf_writer import (
    GGUFWriter,
    convert_hf_to_gguf,
    quantize_q8_0,
    tensor_type,
    write_gguf,
)
from strata.weights.loader import load_weights
from tests.test_gguf_util import kl, logits, prompt_ids


@pytest.fixture(scope="module")
def converted(fixtures_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("converted")
    return {t: convert_hf_to_gguf(fixtures_dir / "hf", out / f"tiny-{t}.gguf", t) for t in ("f32", "bf16", "q8_0")}


@pytest.fixture(scope="module")
def hf_logits(fixtures_dir):
    return logits(load_weights(fixtures_dir / "hf"), prompt_ids(fixtures_dir))


def test_f32_is_llama_cpp_converter_output(converted, fixtures_dir):
    """Every tensor (names, order, dims, types, bytes) and every metadata key except the model's name equal the
    fixture produced by llama.cpp's convert_hf_to_gguf.py."""
    ours, ref = GGUFFile(converted["f32"]), GGUFFile(fixtures_dir / "tiny-f32.gguf")
    assert list(ours.tensors) == list(ref.tensors)
    for name, info in ref.tensors.items():
        mine = ours.tensors[name]
        assert (mine.dims, mine.type_id) == (info.dims, info.type_id), name
        assert torch.equal(ours.data(mine), ref.data(info)), name
    ref_md = {k: v for k, v in ref.metadata.items() if k not in ("general.name", "general.size_label")}
    our_md = {k: v for k, v in ours.metadata.items() if k != "general.name"}
    assert our_md == ref_md
    assert [ours.value_types[k] for k in our_md] == [ref.value_types[k] for k in ref_md]


def test_q8_0_matches_llama_quantize(converted, fixtures_dir):
    """Byte-identical to llama-quantize's Q8_0 except where the converter and llama-quantize differ: the indexer
    projections (llama-quantize keeps them F32) and ffn_gate_inp_shexp's dims ({H, 1} vs {H}, same bytes)."""
    ours, ref = GGUFFile(converted["q8_0"]), GGUFFile(fixtures_dir / "tiny-Q8_0.gguf")
    assert set(ours.tensors) == set(ref.tensors)
    for name, info in ref.tensors.items():
        mine = ours.tensors[name]
        if "indexer" in name and name.endswith("_proj.weight"):
            assert mine.type_name == "Q8_0" and info.type_name == "F32"
            continue
        assert mine.type_id == info.type_id and mine.shape[-1] == info.shape[-1], name
        assert torch.equal(ours.data(mine), ref.data(info)), name
    assert ours.metadata["general.file_type"] == 7


def test_converted_logits(converted, fixtures_dir, hf_logits):
    ids = prompt_ids(fixtures_dir)
    scale = hf_logits.abs().max()
    f32 = logits(load_weights(converted["f32"]), ids)
    assert (f32 - hf_logits).abs().max() <= 1e-6 * scale
    assert torch.equal(logits(load_weights(converted["bf16"]), ids), f32)  # bf16-exact weights: nothing changes
    q8 = logits(load_weights(converted["q8_0"]), ids)
    assert kl(hf_logits, q8) < 1e-4 and (q8 - hf_logits).abs().max() < 0.05 * scale
    llama_q8 = np.load(fixtures_dir / "tiny-Q8_0.logits.npy")
    assert kl(llama_q8, q8) < 5e-5


def test_f16_output(fixtures_dir, tmp_path, hf_logits):
    p = convert_hf_to_gguf(fixtures_dir / "hf", tmp_path / "tiny-f16.gguf", "f16")
    g = GGUFFile(p)
    assert g.tensors["blk.0.attn_qkv.weight"].type_name == "F16" and g.tensors["blk.0.ssm_a"].type_name == "F32"
    assert kl(hf_logits, logits(load_weights(p), prompt_ids(fixtures_dir))) < 1e-5


def test_type_rules():
    assert tensor_type("blk.0.hc_attn_norm.weight", (1024,), "Q8_0") == "F32"
    assert tensor_type("blk.0.ffn_gate_inp.weight", (8, 256), "Q8_0") == "F32"
    assert tensor_type("blk.0.ffn_gate_inp_shexp.weight", (1, 256), "BF16") == "F32"
    assert tensor_type("blk.0.ssm_conv1d.weight", (512, 4), "BF16") == "F32"
    assert tensor_type("blk.1.ple_conv1d.weight", (1024, 4), "Q8_0") == "F16"  # rows of 4: no whole Q8_0 block
    assert tensor_type("blk.1.ple_conv1d.weight", (1024, 4), "BF16") == "BF16"
    assert tensor_type("blk.0.attn_qkv.weight", (512, 256), "Q8_0") == "Q8_0"


def test_q8_0_quantizer_matches_ggml():
    """Against gguf.quants.quantize (ggml's reference, bit-exact), on data with zero blocks, exact .5 ties after
    scaling, huge and tiny magnitudes."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=g) * torch.logspace(-6, 3, 64)[:, None]
    x[3] = 0
    x[5, :32] = torch.arange(32) - 15.5
    x[5, 0] = 127.0  # d = 1 exactly: every other value of the block is a .5 tie
    x[7, :32] = torch.tensor([127.0, 63.5, -63.5, 0.5] * 8)
    ref = quantize(x.numpy(), GGMLQuantizationType.Q8_0)
    assert np.array_equal(quantize_q8_0(x).numpy(), ref)


def test_write_is_atomic(fixtures_dir, tmp_path):
    out = tmp_path / "model.gguf"
    out.write_bytes(b"previous content")

    def failing():
        yield torch.zeros(4)
        raise RuntimeError("disk on fire")

    w = GGUFWriter()
    w.add_tensor("a", (4,), 0, lambda: [torch.ones(4)])
    w.add_tensor("b", (8,), 0, failing)
    with pytest.raises(RuntimeError, match="disk on fire"):
        w.write(out)
    assert out.read_bytes() == b"previous content" and not (tmp_path / "model.gguf.tmp").exists()
    w = GGUFWriter()
    w.add_tensor("a", (4,), 0, lambda: [torch.ones(3)])
    with pytest.raises(GGUFError, match="tensor 'a' produced 12 bytes, expected 16"):
        w.write(out)
    assert out.read_bytes() == b"previous content"


def test_writer_refuses_what_qwen4exp_cannot_hold(fixtures_dir, tmp_path):
    from dataclasses import replace

    w = load_weights(fixtures_dir / "hf")
    with pytest.raises(GGUFError, match="unknown output type 'q4_k'"):
        write_gguf(w, tmp_path / "x.gguf", "q4_k")
    w.cfg = replace(w.cfg, output_gate_type="silu")
    with pytest.raises(GGUFError, match="sigmoid GDN output gate"):
        write_gguf(w, tmp_path / "x.gguf", "f32")
    assert not list(tmp_path.iterdir())


def test_round_trip_of_a_gguf(fixtures_dir, tmp_path):
    """Weights read from a GGUF (tiled order, quantized) write back as the same tensors (F32 dequantized)."""
    w = load_weights(fixtures_dir / "tiny-f32.gguf")
    p = write_gguf(w, tmp_path / "again.gguf", "f32")
    src, again = open_gguf(fixtures_dir / "tiny-f32.gguf"), open_gguf(p)
    for name in src.tensors:
        assert torch.equal(src.data(name), again.data(name)), name
