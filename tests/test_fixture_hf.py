"""The fixture HF checkpoint (bf16 weights, float32 compute) and llama.cpp's f32 GGUF of it reproduce
transformers' logits through `strata logits`, in both modes, and `strata inspect` describes them."""

from __future__ import annotations

import json

import numpy as np
import pytest

from strata.cli.main import main


@pytest.mark.parametrize("model", ["hf", "tiny-f32.gguf"])
@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_strata_logits_matches_transformers(fixtures_dir, tmp_path, mode, model):
    out = tmp_path / "logits.npy"
    code = main(["logits", "--model", str(fixtures_dir / model), "--ids-file", str(fixtures_dir / "prompt.json"),
                 "--out", str(out), "--mode", mode])
    assert code == 0
    ours = np.load(out)
    ref = np.load(fixtures_dir / "transformers.logits.npy")
    assert ours.shape == ref.shape == (64, 512) and ours.dtype == np.float32
    assert np.abs(ours - ref).max() / np.abs(ref).max() < 1e-4


def test_inspect(fixtures_dir, capsys):
    assert main(["inspect", "--model", str(fixtures_dir / "hf"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["geometry"]["layers"] == 4 and report["geometry"]["qsa_layers"] == 1
    assert report["params_total"] > report["params_active_per_token"] > 0
    assert set(report["by_role"]) >= {"experts", "gdn", "qsa", "ple-table"}
