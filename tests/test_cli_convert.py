"""`strata convert` writes a GGUF that strata loads back to the same logits, and refuses to clobber files."""

from __future__ import annotations

import numpy as np

from strata.cli.main import main


def test_convert_bf16_round_trip(fixtures_dir, tmp_path, capsys):
    out = tmp_path / "tiny-bf16.gguf"
    assert main(["convert", "--model", str(fixtures_dir / "hf"), "--out", str(out), "--outtype", "bf16"]) == 0
    assert main(["convert", "--model", str(fixtures_dir / "hf"), "--out", str(out)]) == 2
    assert "exists" in capsys.readouterr().err
    ids = str(fixtures_dir / "prompt.json")
    assert main(["logits", "--model", str(out), "--ids-file", ids, "--out", str(tmp_path / "g.npy")]) == 0
    assert main(["logits", "--model", str(fixtures_dir / "hf"), "--ids-file", ids,
                 "--out", str(tmp_path / "h.npy")]) == 0
    g, h = np.load(tmp_path / "g.npy"), np.load(tmp_path / "h.npy")
    # Same bf16 weights; only the GDN value-head order (tiled in GGUF) changes float summation order.
    assert np.abs(g - h).max() / np.abs(h).max() < 1e-6
