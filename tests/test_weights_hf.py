"""HF checkpoint loading: lazy mapping, and specific errors for every way a checkpoint can be wrong."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from strata.cli.main import main
from strata.weights.hf import load_hf
from strata.weights.tensor import RowConcatTensor, StackedTensor, WeightError
from tests import reference


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return reference.save(reference.build("tiny"), tmp_path_factory.mktemp("ckpt"))


def variant(checkpoint: Path, tmp_path: Path, edit) -> Path:
    """A copy of the checkpoint whose tensors dict is changed by `edit`."""
    out = tmp_path / "variant"
    shutil.copytree(checkpoint, out)
    tensors = load_file(out / "model.safetensors")
    edit(tensors)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


def run_cli(*args: str) -> int:
    return main(list(args))


def test_lazy_layout(checkpoint):
    w = load_hf(checkpoint)
    assert isinstance(w["L0.moe.gate_exps"], StackedTensor)
    table = w["L0.ple.table"]
    assert isinstance(table, RowConcatTensor) and len(table.parts) == 2  # split_ngram_parts=2, kept as parts
    rows = torch.tensor([[0, 4095], [2048, 1]])
    assert torch.equal(table.rows(rows), table.dense()[rows])


def test_sharded_index(checkpoint, tmp_path):
    out = tmp_path / "sharded"
    out.mkdir()
    shutil.copy(checkpoint / "config.json", out)
    tensors = load_file(checkpoint / "model.safetensors")
    names = sorted(tensors)
    half = len(names) // 2
    parts = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    weight_map = {}
    for fname, keys in parts.items():
        save_file({k: tensors[k] for k in keys}, out / fname)
        weight_map |= {k: fname for k in keys}
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    a, b = load_hf(checkpoint), load_hf(out)
    assert a.tensors.keys() == b.tensors.keys()
    assert torch.equal(a["L3.attn.q"].dense(), b["L3.attn.q"].dense())


def test_language_model_prefix_and_ignored_keys(checkpoint, tmp_path):
    def edit(t):
        for k in list(t):
            if k.startswith("model."):
                t["model.language_model." + k[len("model."):]] = t.pop(k)
        t["mtp.layers.0.fc.weight"] = torch.zeros(2, 2)
        t["model.visual.blocks.0.w"] = torch.zeros(2)
    w = load_hf(variant(checkpoint, tmp_path, edit))
    assert "embed" in w.tensors


def test_missing_tensor(checkpoint, tmp_path):
    path = variant(checkpoint, tmp_path, lambda t: t.pop("model.layers.1.linear_attn.in_proj_z.weight"))
    with pytest.raises(WeightError, match=r"missing tensor 'L1.gdn.z'.*expected shape \[64, 64\]"):
        load_hf(path)
    assert run_cli("logits", "--model", str(path), "--ids", "1,2", "--out", str(tmp_path / "x.npy")) == 2


def test_missing_expert(checkpoint, tmp_path):
    path = variant(checkpoint, tmp_path, lambda t: t.pop("model.layers.2.mlp.experts.3.up_proj.weight"))
    with pytest.raises(WeightError, match=r"model.layers.2.mlp.experts.3.up_proj.weight"):
        load_hf(path)


def test_misshaped_tensor_names_both_shapes(checkpoint, tmp_path):
    def edit(t):
        t["model.layers.3.self_attn.o_proj.weight"] = torch.zeros(64, 63)
    with pytest.raises(WeightError, match=r"model.layers.3.self_attn.o_proj.weight.*\[64, 63\].*\[64, 64\]"):
        load_hf(variant(checkpoint, tmp_path, edit))


def test_wrong_hash_constants_refused(checkpoint, tmp_path):
    def edit(t):
        t["model.layers.0.ple.ple_embedding.layer_multipliers"] = torch.tensor([1, 3, 5])
    with pytest.raises(WeightError, match="hash constants"):
        load_hf(variant(checkpoint, tmp_path, edit))


def test_unknown_tensor_reported(checkpoint, tmp_path):
    def edit(t):
        t["model.layers.0.mystery.weight"] = torch.zeros(3)
    with pytest.raises(WeightError, match="mystery"):
        load_hf(variant(checkpoint, tmp_path, edit))


def test_truncated_file(checkpoint, tmp_path):
    out = tmp_path / "trunc"
    shutil.copytree(checkpoint, out)
    f = out / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size - 1000])
    with pytest.raises(WeightError, match="truncated file: tensor"):
        load_hf(out)
    f.write_bytes(b"\x01\x02")
    with pytest.raises(WeightError, match="truncated"):
        load_hf(out)


def test_id_outside_vocabulary_and_bad_ids(checkpoint, tmp_path, capsys):
    out = str(tmp_path / "x.npy")
    assert run_cli("logits", "--model", str(checkpoint), "--ids", "1,2,256", "--out", out) == 2
    assert "token id 256 at position 2 is outside the vocabulary [0, 256)" in capsys.readouterr().err
    assert run_cli("logits", "--model", str(checkpoint), "--ids", "1,x", "--out", out) == 2
    assert run_cli("logits", "--model", str(tmp_path / "nope"), "--ids", "1", "--out", out) == 2


def test_invalid_config_exits_with_field(checkpoint, tmp_path, capsys):
    out = tmp_path / "badcfg"
    shutil.copytree(checkpoint, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["hc_count"] = 1
    (out / "config.json").write_text(json.dumps(cfg))
    assert run_cli("logits", "--model", str(out), "--ids", "1", "--out", str(tmp_path / "x.npy")) == 2
    assert "hc_count: must be > 1" in capsys.readouterr().err
