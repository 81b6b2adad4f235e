"""The bundled default model: a small qwen4_exp trained by tools/train_small.py (every feature active).

Its logits from strata match transformers on held-out text, its perplexity there is reproduced by
`strata perplexity` and is far below the text's unigram perplexity, and it writes text of its corpus's kind.
"""

from __future__ import annotations

import json
import math
from collections import Counter

import pytest
import torch
from tokenizers import Tokenizer

from strata.cli.main import main
from strata.runtime.engine import DEFAULT_MODEL, Engine

SLICE_TOKENS = 384  # > 3x the QSA selection width (64 + 4 - 1), so sparse selection is active


@pytest.fixture(scope="module")
def heldout_ids() -> list[int]:
    text = (DEFAULT_MODEL / "heldout.txt").read_text()
    return Tokenizer.from_file(str(DEFAULT_MODEL / "tokenizer.json")).encode(text).ids


def test_every_architectural_feature_is_active():
    cfg = Engine.load().cfg
    assert sum(not cfg.is_linear(i) for i in range(cfg.num_hidden_layers)) >= 2
    assert cfg.indexer_budget < SLICE_TOKENS and cfg.hc_count == 4 and cfg.ple_layer_ids
    assert cfg.shared_expert_intermediate_size > 0 and cfg.num_experts > cfg.num_experts_per_tok


def test_logits_match_transformers_on_heldout(heldout_ids):
    from transformers import Qwen4ExpForCausalLM

    ids = heldout_ids[:SLICE_TOKENS]
    hf = Qwen4ExpForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32, attn_implementation="eager",
                                             experts_implementation="eager").eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    ours = Engine.load().prefill(ids, Engine.load().new_state(), all_logits=True)
    assert float((ours - ref).abs().max() / ref.abs().max()) < 1e-4


def test_perplexity_is_reproduced_and_beats_unigram(heldout_ids, tmp_path, capsys):
    """`strata perplexity` on a slice equals exp(mean NLL) of strata's own logits, and the recorded full-text
    figure (docs/quality.md, quality.json) is well below the unigram perplexity of the same text."""
    recorded = json.loads((DEFAULT_MODEL / "quality.json").read_text())
    n = 1024
    text = tmp_path / "slice.txt"
    tok = Tokenizer.from_file(str(DEFAULT_MODEL / "tokenizer.json"))
    text.write_text(tok.decode(heldout_ids[:n]))
    assert main(["perplexity", "--text-file", str(text), "--ctx", "512", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["ppl"] == pytest.approx(recorded["slice_1024_ctx512_perplexity_float32"], rel=1e-4)
    counts = Counter(heldout_ids)
    unigram = math.exp(-sum(c * math.log(c / len(heldout_ids)) for c in counts.values()) / len(heldout_ids))
    assert recorded["heldout_perplexity_float32"] < unigram / 5
    assert recorded["unigram_perplexity"] == pytest.approx(unigram, rel=1e-6)


def test_writes_python(capsys):
    assert main(["generate", "import os", "--greedy", "--max-tokens", "24"]) == 0
    out = capsys.readouterr().out
    assert "import" in out or "def " in out
