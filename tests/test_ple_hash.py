"""The decode step's scalar n-gram hash equals the tensor hash (int64 wrap-around, EOS resets, floor modulo)."""

from __future__ import annotations

import random

import pytest
import torch

from strata.model import ple
from strata.runtime.synthetic import real_config


@pytest.mark.parametrize("n", [2, 3, 4])
def test_scalar_hash_equals_tensor_hash(n: int) -> None:
    # the real multipliers (products overflow int64, as the reference's do); 24 heads at n = 4 need another width
    cfg = real_config(ngram_size=n, **({"ple_embed_dim": 2400} if n == 4 else {}))
    geo = next(iter(cfg.ple.values()))
    eos = cfg.ple_eos
    rng = random.Random(0)
    for _ in range(500):
        hist = [rng.choice([eos, rng.randrange(cfg.vocab_size)]) for _ in range(n)]
        fast = ple.ngram_rows(torch.tensor([hist[-1]]), torch.tensor(hist[:-1]), geo, cfg)
        # the same n-gram as the last of two tokens, which takes the tensor path
        slow = ple.ngram_rows(torch.tensor(hist[-2:]), torch.tensor([eos] + hist[:-2]), geo, cfg)[-1:]
        assert torch.equal(fast, slow), hist
        assert (fast >= 0).all() and (fast < geo.rows).all()


def test_ple_rows_into_equals_ple_rows() -> None:
    """The decode step's one-token staging (`ple_rows_into`, `Model.stage_token`) gathers the rows and advances
    the n-gram context exactly as `ple_rows` does, through EOS resets."""
    from strata.runtime.state import PLEState
    from strata.runtime.synthetic import TypeMix, synthetic_weights

    cfg = real_config(num_hidden_layers=4, vocab_size=512, eos_token_id=3, ngram_vocab_size_base=2_000)
    w = synthetic_weights(cfg, TypeMix(), "cpu")
    layer = next(iter(cfg.ple))
    a, b = PLEState.empty(cfg, torch.float32, "cpu"), PLEState.empty(cfg, torch.float32, "cpu")
    rng = random.Random(1)
    for _ in range(40):
        tok = rng.choice([3, rng.randrange(512)])
        want = ple.ple_rows(torch.tensor([tok]), w, layer, cfg, a)[0]
        out = torch.zeros_like(want)
        ple.ple_rows_into(tok, w, layer, cfg, b, out)
        assert torch.equal(out, want) and torch.equal(a.context, b.context), tok
