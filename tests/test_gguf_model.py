"""GGUF files as models: the fixture files reproduce transformers (f32) and llama.cpp (every quantized file, by
KL), the mapping honours each converter transform, metadata and tensor errors are specific, and loading a
large file reads almost nothing."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
import torch

from strata.weights.gguf import GGUFError, GGUFWarning, ValueType, open_gguf
from strata.weights.gguf_map import config_from_gguf
from strata.weights.gguf_writer import GGUFWriter, copy_gguf
from strata.weights.loader import describe, load_weights
from strata.weights.quant_tensor import QuantTensor
from strata.weights.tensor import WeightError
from tests.test_gguf_util import kl, logits, prompt_ids

A, U32, I32, U64 = ValueType.ARRAY, ValueType.UINT32, ValueType.INT32, ValueType.UINT64


@pytest.fixture(scope="module")
def f32(fixtures_dir):
    return load_weights(fixtures_dir / "tiny-f32.gguf")


@pytest.fixture(scope="module")
def f32_logits(f32, fixtures_dir):
    return logits(f32, prompt_ids(fixtures_dir))


def test_f32_matches_transformers_prefill_and_decode(f32, f32_logits, fixtures_dir):
    ref = np.load(fixtures_dir / "transformers.logits.npy")
    scale = np.abs(ref).max()
    assert np.abs(f32_logits.numpy() - ref).max() <= 1e-4 * scale
    dec = logits(f32, prompt_ids(fixtures_dir), decode=True)
    assert np.abs(dec.numpy() - ref).max() <= 1e-4 * scale


def test_config_from_metadata(f32, fixtures_dir):
    """Every geometry field equals the HF config's (the GGUF was converted from hf/)."""
    from strata.config import ModelConfig

    hf = ModelConfig.from_file(fixtures_dir / "hf")
    cfg = f32.cfg
    for field in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "head_dim", "layer_types", "linear_conv_kernel_dim", "linear_key_head_dim",
                  "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads", "num_experts",
                  "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size", "hc_count",
                  "hc_lowrank", "rms_norm_eps", "gdn_gate_act", "rope_theta", "rotary_dim", "ple_layer_ids",
                  "ple_dim", "ple_conv_kernel_size", "ngram_size", "heads_per_ngram", "indexer_n_heads",
                  "indexer_head_dim", "indexer_budget", "indexer_compress_ratio", "eos_token_id", "pad_token_id",
                  "max_position_embeddings", "tie_word_embeddings"):
        assert getattr(cfg, field) == getattr(hf, field), field
    assert cfg.ple[1] == hf.ple[1]  # primes, offsets, rows, multipliers: from the file, equal to the derived ones
    assert f32.gdn_value_order == "tiled"


def test_value_heads_are_tiled(f32, fixtures_dir):
    """The converter's V-head reorder is what the file holds: read as grouped, the logits are wrong."""
    ref = np.load(fixtures_dir / "transformers.logits.npy")
    ids = prompt_ids(fixtures_dir)
    f32.gdn_value_order = "grouped"
    try:
        wrong = logits(f32, ids).numpy()
    finally:
        f32.gdn_value_order = "tiled"
    assert np.abs(wrong - ref).max() > 100 * np.abs(logits(f32, ids).numpy() - ref).max()


def test_every_fixture_file_kl_table(fixtures_dir, f32_logits, capsys):
    """mean KL(llama.cpp logits || strata logits) <= max(0.3 KL(llama f32 || llama file), 5 KL(transformers ||
    llama f32)) for every quantized fixture file; prints the table."""
    ids = prompt_ids(fixtures_dir)
    hf = np.load(fixtures_dir / "transformers.logits.npy")
    l32 = np.load(fixtures_dir / "tiny-f32.logits.npy")
    floor = 5 * kl(hf, l32)
    rows, bad = [], []
    for path in sorted(fixtures_dir.glob("*.gguf")):
        name = path.name.removesuffix(".gguf")
        w = load_weights(path)
        ours = f32_logits if name == "tiny-f32" else logits(w, ids)
        llama = np.load(fixtures_dir / f"{name}.logits.npy")
        k, kq = kl(llama, ours), kl(l32, llama)
        bound = max(0.3 * kq, floor)
        kinds = sorted({t.kind for t in w.tensors.values()})
        rows.append(f"{name:<14} {k:>12.3e} {kq:>12.3e} {bound:>10.3e} {k / bound:>6.2f}  {','.join(kinds)}")
        if k > bound:
            bad.append(name)
    with capsys.disabled():
        print(f"\n{'file':<14} {'KL(llama||s)':>12} {'KL(f32||q)':>12} {'bound':>10} {'ratio':>6}  types")
        print("\n".join(rows))
    assert len(rows) >= 12 and not bad, bad


def test_quant_tensor_rows_experts_and_dense(fixtures_dir, monkeypatch):
    """rows() decodes only the rows asked for; [e] is a view; dense() is the whole tensor."""
    from strata.weights import quants

    w = load_weights(fixtures_dir / "tiny-Q4_K_M.gguf")
    table = w["L1.ple.table"]
    assert isinstance(table, QuantTensor) and table.kind == "Q5_0" and table.shape == (2688, 32)
    full = table.dense()
    decoded_rows = []
    real = quants.dequantize

    def counting(data, *args, **kwargs):
        decoded_rows.append(data.shape[0])
        return real(data, *args, **kwargs)

    monkeypatch.setattr(quants, "dequantize", counting)
    idx = torch.tensor([[5, 2000], [5, 7]])
    assert torch.equal(table.rows(idx), full[idx])
    assert decoded_rows == [3]
    exps = w["L0.moe.gate_exps"]
    assert exps.kind == "Q4_K" and exps.shape == (8, 64, 256)
    e3 = exps[3]
    assert e3.shape == (64, 256) and e3.data.data_ptr() == exps.data[3].data_ptr()
    assert torch.equal(e3.dense(), exps.dense()[3])
    with pytest.raises(WeightError, match="row index out of range"):
        table.rows(torch.tensor([2688]))


def test_describe(fixtures_dir):
    d = describe(load_weights(fixtures_dir / "tiny-Q4_K_M.gguf"))
    assert d["geometry"]["layers"] == 4 and d["geometry"]["gdn_value_order"] == "tiled"
    assert d["storage_types_by_role"]["experts"].keys() >= {"Q4_K"}
    assert d["bytes_total"] > d["bytes_per_token"] > 0
    assert d["by_role"]["ple-table"]["bytes_per_token"] < d["by_role"]["ple-table"]["bytes"] / 100


def test_load_weights_dispatch(fixtures_dir, tmp_path):
    assert load_weights(fixtures_dir / "hf").gdn_value_order == "grouped"
    with pytest.raises(WeightError, match="does not exist"):
        load_weights(tmp_path / "nope.gguf")
    (tmp_path / "x.bin").write_bytes(b"hello")
    with pytest.raises(WeightError, match="neither an HF checkpoint folder nor a GGUF file"):
        load_weights(tmp_path / "x.bin")


# ------------------------------------------------------------------------------------------- errors

def _edited(fixtures_dir, tmp_path, **kw):
    return copy_gguf(open_gguf(fixtures_dir / "tiny-f32.gguf"), tmp_path / "edited.gguf", **kw)[0]


def test_wrong_architecture(fixtures_dir, tmp_path):
    p = _edited(fixtures_dir, tmp_path, metadata={"general.architecture": (ValueType.STRING, "llama")})
    with pytest.raises(GGUFError, match="general.architecture is 'llama'; strata reads only 'qwen4exp'"):
        load_weights(p)


def test_missing_tensor(fixtures_dir, tmp_path):
    p = _edited(fixtures_dir, tmp_path, drop_tensors=["blk.2.ssm_a"])
    with pytest.raises(WeightError, match=r"missing tensor 'blk.2.ssm_a' in .*edited.gguf \(needed for L2.gdn.A, "
                                          r"expected shape \[4\]\)"):
        load_weights(p)


def test_misshaped_tensor(fixtures_dir, tmp_path):
    p = _edited(fixtures_dir, tmp_path, retype={"blk.0.attn_gate.weight": ((128, 256), 0)})
    with pytest.raises(WeightError, match=r"tensor 'blk.0.attn_gate.weight' in .* has shape \[128, 256\], "
                                          r"expected \[256, 256\]"):
        load_weights(p)


def test_unknown_tensor(fixtures_dir, tmp_path):
    w = GGUFWriter()
    src = open_gguf(fixtures_dir / "tiny-f32.gguf")
    p = copy_gguf(src, tmp_path / "a.gguf")[0]
    gset = open_gguf(p)
    for k, v in gset.metadata.items():
        w.add(k, gset.value_types[k][0], v, gset.value_types[k][1])
    for name, (part, info) in gset.tensors.items():
        w.add_tensor(name, info.shape, info.type_id, lambda part=part, info=info: [part.data(info).numpy()])
    w.add_tensor("blk.0.mystery.weight", (4, 4), 0, None)
    w.write(tmp_path / "b.gguf")
    with pytest.raises(GGUFError, match=r"1 tensor\(s\) that a qwen4exp text model does not have: "
                                        r"\['blk.0.mystery.weight'\]"):
        load_weights(tmp_path / "b.gguf")


@pytest.mark.parametrize("edit, message", [
    ({"drop_keys": ["qwen4exp.expert_count"]}, r"metadata 'qwen4exp.expert_count' is missing"),
    ({"metadata": {"qwen4exp.embedding_length": (ValueType.STRING, "256")}},
     r"'qwen4exp.embedding_length' must be an integer, got '256'"),
    ({"metadata": {"qwen4exp.ple.layer_multipliers": (A, [4295158889763781, 17440218147737327, 3], U64)}},
     (r"'qwen4exp.ple.layer_multipliers' = \[4295158889763781, 17440218147737327, 3\] but the qwen4_exp config "
      r"derives \[4295158889763781, 17440218147737327, 1270917961434445\]")),
    ({"metadata": {"qwen4exp.ple.head_offsets": (A, [0, 307, 618, 931, 1248, 1579, 1916, 2250], U64)}},
     r"'qwen4exp.ple.head_offsets' = .* but the qwen4_exp config derives"),
    ({"metadata": {"qwen4exp.ple.head_vocab_sizes": (A, [307, 311, 313, 317, 331, 337, 347, 353], U64)}},
     r"'qwen4exp.ple.head_vocab_sizes' = .* but the qwen4_exp config derives"),
    ({"metadata": {"qwen4exp.ple.layers": (A, [0, 1], I32)}}, r"'qwen4exp.ple.layers' lists 2 layers"),
    ({"metadata": {"qwen4exp.ple.layers": (A, [3], I32)}},
     r"PLE is only supported on linear_attention layers"),
    ({"metadata": {"qwen4exp.attention.compress_ratios": (A, [0, 0, 0, -4], I32)}},
     r"'qwen4exp.attention.compress_ratios' gives QSA layers \[3\] the ratios \[-4\]"),
    ({"metadata": {"qwen4exp.attention.recurrent_layers": (A, [True, True], ValueType.BOOL)}},
     r"'qwen4exp.attention.recurrent_layers' has 2 entries, expected 4"),
    ({"metadata": {"tokenizer.ggml.tokens": (A, ["a"] * 500, ValueType.STRING)}},
     r"tokenizer.ggml.tokens lists 500 tokens but token_embd.weight has 512 rows"),
])
def test_metadata_errors(fixtures_dir, tmp_path, edit, message):
    p = _edited(fixtures_dir, tmp_path, **edit)
    with pytest.raises(GGUFError, match=message):
        load_weights(p)


def test_zero_compress_ratios_warn_and_follow_the_reference(fixtures_dir, tmp_path, f32_logits):
    """The converter quirk (all ratios 0): llama.cpp would run dense attention; strata warns and runs the
    reference's sparse QSA with the released checkpoint's ratio (4, which is also the fixture's)."""
    p = _edited(fixtures_dir, tmp_path, metadata={"qwen4exp.attention.compress_ratios": (A, [0, 0, 0, 0], I32)})
    with pytest.warns(GGUFWarning, match=r"compress_ratios is 0 on every QSA layer \(layers \[3\]\).*llama.cpp then "
                                         r"runs dense attention.*compress ratio 4"):
        w = load_weights(p)
    assert w.cfg.indexer_compress_ratio == 4
    assert torch.equal(logits(w, prompt_ids(fixtures_dir)), f32_logits)
    dense = np.load(fixtures_dir / "transformers.dense-qsa.logits.npy")
    assert np.abs(f32_logits.numpy() - dense).max() > 1e-2  # the difference the decision is about


def test_mtp_block_and_fused_gate_up(fixtures_dir, tmp_path, f32_logits):
    """A trailing NextN/MTP block is skipped; a fused ffn_gate_up_exps (gate rows first) reads as gate / up."""
    src = open_gguf(fixtures_dir / "tiny-f32.gguf")
    w = GGUFWriter()
    md = dict(src.metadata)
    md["qwen4exp.block_count"] = 5
    md["qwen4exp.attention.recurrent_layers"] = md["qwen4exp.attention.recurrent_layers"] + [False]
    md["qwen4exp.attention.compress_ratios"] = md["qwen4exp.attention.compress_ratios"] + [0]
    for k, v in md.items():
        w.add(k, src.value_types[k][0], v, src.value_types[k][1])
    w.add("qwen4exp.nextn_predict_layers", U32, 1)
    for name, (part, info) in src.tensors.items():
        data = (lambda part=part, info=info: [part.data(info).numpy()])
        if "ffn_up_exps" in name:
            continue
        if "ffn_gate_exps" in name:
            up_part, up = src.tensors[name.replace("gate", "up")]
            E, I, H = info.shape
            fused = lambda p=part, i=info, q=up_part, u=up, E=E, I=I, H=H: [torch.cat(
                [p.data(i).view(torch.float32).view(E, I, H), q.data(u).view(torch.float32).view(E, I, H)], 1)]
            w.add_tensor(name.replace("gate_exps", "gate_up_exps"), (E, 2 * I, H), 0, fused)
            continue
        w.add_tensor(name, info.shape, info.type_id, data)
        if name.startswith("blk.3."):
            w.add_tensor(name.replace("blk.3.", "blk.4."), info.shape, info.type_id, data)
    w.write(tmp_path / "mtp.gguf")
    weights = load_weights(tmp_path / "mtp.gguf")
    assert weights.cfg.num_hidden_layers == 4
    assert torch.equal(logits(weights, prompt_ids(fixtures_dir)), f32_logits)


def test_tied_embeddings_and_eos_pair(fixtures_dir, tmp_path):
    p = _edited(fixtures_dir, tmp_path, drop_tensors=["output.weight"],
                metadata={"tokenizer.ggml.eos_token_id": (U32, 508)})
    cfg = config_from_gguf(open_gguf(p))
    assert cfg.tie_word_embeddings and cfg.eos_token_id == (510, 508) and cfg.ple_eos == 510
    w = load_weights(p)
    assert "head" not in w.tensors and w.head is w["embed"]


def test_load_reads_almost_nothing_of_a_large_file(fixtures_dir, tmp_path):
    """A 1.1 GB sparse GGUF (the PLE table as 32M Q8_0 rows of zeros, the rest the tiny model): loading it and
    running three tokens keeps the process's RSS growth far below the file size."""
    rows = 32_000_000
    p = copy_gguf(open_gguf(fixtures_dir / "tiny-f32.gguf"), tmp_path / "big.gguf",
                  retype={"per_layer_token_embd.weight": ((rows, 32), 8)})[0]
    assert p.stat().st_size > 1_000_000_000 and p.stat().st_blocks * 512 < 100_000_000  # sparse
    code = textwrap.dedent(f"""
        import torch
        torch.set_num_threads(1)
        def rss():
            for line in open("/proc/self/status"):
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        from strata.model.model import Model
        from strata.weights.loader import load_weights
        import strata.weights.gguf_map, strata.weights.quants
        before = rss()
        w = load_weights({str(p)!r})
        loaded = rss()
        t = w["L1.ple.table"]
        assert t.shape == ({rows}, 32) and t.kind == "Q8_0"
        assert float(t.rows(torch.tensor([0, 12_345_678, {rows} - 1])).abs().sum()) == 0.0
        m = Model(w)
        m.forward(torch.tensor([1, 2, 3]), m.new_state())
        ran = rss()
        print(before, loaded, ran)
    """)
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    before, loaded, ran = map(int, out.stdout.split()[-3:])
    print(f"RSS growth: load {(loaded - before) / 2**20:.1f} MiB, load + 3 tokens {(ran - before) / 2**20:.1f} MiB "
          f"for a {p.stat().st_size / 2**30:.2f} GiB file")
    assert loaded - before < 20 << 20, (before, loaded)
    assert ran - before < 100 << 20, (before, ran)


def test_clean_files_load_without_warnings(fixtures_dir):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_weights(fixtures_dir / "tiny-Q8_0.gguf")
