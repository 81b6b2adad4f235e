"""The decode step's scalar n-gram hash equals the tensor hash (int64 wrap-around, EOS resets, floor modulo)."""

from __future__ import annotations

import random

import torch

from strata.model import ple
from strata.runtime.synthetic import real_config


def test_scalar_hash_equals_tensor_hash() -> None:
    cfg = real_config()  # the real multipliers: products overflow int64, as the reference's do
    geo = next(iter(cfg.ple.values()))
    eos, n = cfg.ple_eos, cfg.ngram_size
    rng = random.Random(0)
    for _ in range(500):
        hist = [rng.choice([eos, rng.randrange(cfg.vocab_size)]) for _ in range(n)]
        fast = ple.ngram_rows(torch.tensor([hist[-1]]), torch.tensor(hist[:-1]), geo, cfg)
        # the same n-gram as the last of two tokens, which takes the tensor path
        slow = ple.ngram_rows(torch.tensor(hist[-2:]), torch.tensor([eos] + hist[:-2]), geo, cfg)[-1:]
        assert torch.equal(fast, slow), hist
        assert (fast >= 0).all() and (fast < geo.rows).all()
