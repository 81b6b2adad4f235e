"""Sampling: parameter checks, exact logits adjustments, and the filters checked statistically on known
distributions."""

from __future__ import annotations

import math

import pytest
import torch

from strata.errors import StrataError
from strata.text.sampling import (
    Sampler,
    SamplingParams,
    apply_logit_bias,
    apply_presence_frequency,
    apply_repetition_penalty,
    min_p_filter,
    top_k_filter,
    top_p_filter,
    warp,
)

# probabilities 0.5, 0.3, 0.15, 0.05 (and a 5th token at ~0)
PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])
LOGITS = PROBS.log()


def _draws(params: SamplingParams, logits: torch.Tensor, n: int) -> list[int]:
    s = Sampler(params, logits.shape[-1])
    return [s.next_token(logits) for _ in range(n)]


@pytest.mark.parametrize("kwargs", [
    {"max_tokens": 0}, {"max_tokens": 1.5}, {"max_tokens": True}, {"temperature": -0.1},
    {"temperature": math.nan}, {"top_k": -1}, {"top_p": 0.0}, {"top_p": 1.01}, {"min_p": -0.1}, {"min_p": 1.5},
    {"repetition_penalty": 0.0}, {"presence_penalty": 2.5}, {"frequency_penalty": -3},
    {"logit_bias": {5: 101}}, {"logit_bias": {-1: 1}}, {"logit_bias": [1, 2]}, {"seed": -1}, {"seed": "7"},
    {"stop": ""}, {"stop": ["ok", 3]}, {"greedy": 1},
])
def test_bad_params_are_refused_at_construction(kwargs: dict) -> None:
    with pytest.raises(StrataError):
        SamplingParams(**kwargs)


def test_params_are_normalised() -> None:
    p = SamplingParams(stop="END", logit_bias={"7": 2, 3: -1.5})
    assert p.stop == ("END",) and p.logit_bias == {7: 2.0, 3: -1.5}
    assert SamplingParams(temperature=0).is_greedy and SamplingParams(greedy=True).is_greedy
    with pytest.raises(StrataError, match="outside the vocabulary"):
        Sampler(SamplingParams(logit_bias={10: 1}), 10)


def test_penalties_change_logits_exactly_as_defined() -> None:
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0, 1.0])
    # repetition (CTRL/transformers/vLLM): seen ids = prompt + generated; positive / p, non-positive * p
    seen = torch.tensor([True, True, False, True, False, False])
    assert torch.equal(apply_repetition_penalty(logits, seen, 2.0), torch.tensor([1.0, -2.0, 0.5, 1.5, -2.0, 1.0]))
    # presence/frequency (OpenAI/vLLM): generated counts only
    counts = torch.tensor([0, 1, 0, 3, 0, 0])
    out = apply_presence_frequency(logits, counts, 0.5, 0.25)
    assert torch.allclose(out, torch.tensor([2.0, -1.75, 0.5, 1.75, -2.0, 1.0]))
    assert torch.equal(apply_logit_bias(logits, {4: 10.0, 0: -2.0}), torch.tensor([0.0, -1.0, 0.5, 3.0, 8.0, 1.0]))

    # The Sampler combines them over the prompt and what it generated (bias, repetition, presence/frequency).
    s = Sampler(SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25,
                               logit_bias={5: 1.0}, greedy=True), 6, prompt_ids=[0])
    assert s.next_token(logits) == 3  # nothing generated yet: 3.0 is the top
    # now: 0 seen (prompt), 3 seen + generated once -> 3.0/2 - 0.5 - 0.25 = 0.75; 5: 1.0 + 1.0 = 2.0; 0: 2.0/2 = 1.0
    assert torch.allclose(s.adjust(logits), torch.tensor([1.0, -1.0, 0.5, 0.75, -2.0, 2.0]))
    assert s.next_token(logits) == 5


def test_filters_keep_exactly_the_defined_sets() -> None:
    def kept(x: torch.Tensor) -> set[int]:
        return set(torch.isfinite(x).nonzero().flatten().tolist())

    assert kept(top_k_filter(LOGITS, 2)) == {0, 1}
    assert kept(top_k_filter(torch.tensor([1.0, 2.0, 2.0, 0.0]), 2)) == {1, 2}
    assert kept(top_k_filter(torch.tensor([1.0, 2.0, 1.0, 0.0]), 2)) == {0, 1, 2}  # ties at the boundary stay
    assert kept(top_p_filter(LOGITS, 0.75)) == {0, 1}
    assert kept(top_p_filter(LOGITS, 0.85)) == {0, 1, 2}
    assert kept(top_p_filter(LOGITS, 0.01)) == {0}
    assert kept(min_p_filter(LOGITS, 0.2)) == {0, 1, 2}  # threshold 0.1
    assert kept(min_p_filter(LOGITS, 0.7)) == {0}


@pytest.mark.parametrize("kwargs,allowed", [
    ({"top_k": 2}, {0, 1}), ({"top_p": 0.75}, {0, 1}), ({"min_p": 0.2}, {0, 1, 2}),
    ({"top_k": 3, "top_p": 0.75}, {0, 1}), ({"top_k": 1}, {0}),
])
def test_sampling_never_leaves_the_allowed_set(kwargs: dict, allowed: set[int]) -> None:
    draws = _draws(SamplingParams(seed=11, **kwargs), LOGITS, 1500)
    assert set(draws) == allowed  # all allowed tokens show up, nothing else does


def _chi_square(draws: list[int], probs: torch.Tensor) -> float:
    n = len(draws)
    counts = torch.bincount(torch.tensor(draws), minlength=probs.numel()).double()
    expected = probs.double() * n
    return float(((counts - expected) ** 2 / expected).sum())


def test_temperature_one_samples_the_softmax() -> None:
    probs = torch.tensor([0.05, 0.1, 0.15, 0.2, 0.5])
    draws = _draws(SamplingParams(seed=3), probs.log() + 7.0, 4000)
    # 4 degrees of freedom: the 99.9% quantile is 18.47
    assert _chi_square(draws, probs) < 18.47


def test_filters_renormalise_over_the_kept_tokens() -> None:
    draws = _draws(SamplingParams(seed=5, top_p=0.75), LOGITS, 3000)
    # kept {0, 1}: renormalised 0.5/0.8 and 0.3/0.8; 1 degree of freedom: the 99.9% quantile is 10.83
    assert _chi_square(draws, torch.tensor([0.625, 0.375])) < 10.83


def test_temperature_changes_entropy_as_expected() -> None:
    def entropy(p: torch.Tensor) -> float:
        p = p[p > 0]
        return float(-(p * p.log()).sum())

    base = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0])
    ent = [entropy(warp(base, SamplingParams(temperature=t)).softmax(-1)) for t in (0.25, 0.5, 1.0, 2.0, 8.0)]
    assert ent == sorted(ent) and ent[-1] < math.log(5)
    assert torch.allclose(warp(base, SamplingParams(temperature=0.5)).softmax(-1), (base / 0.5).softmax(-1))
    # And in the draws: a cold sampler picks the top token far more often than a hot one.
    cold = _draws(SamplingParams(seed=1, temperature=0.3), base, 800)
    hot = _draws(SamplingParams(seed=1, temperature=3.0), base, 800)
    assert cold.count(0) / 800 > 0.9
    assert hot.count(0) / 800 < 0.5
    assert len(set(hot)) == 5


def test_greedy_and_temperature_zero_take_the_argmax() -> None:
    assert set(_draws(SamplingParams(greedy=True, seed=1), LOGITS, 50)) == {0}
    assert set(_draws(SamplingParams(temperature=0.0), LOGITS, 50)) == {0}


def test_same_seed_same_tokens_different_seed_different_tokens() -> None:
    flat = torch.zeros(1000)
    a = _draws(SamplingParams(seed=1234), flat, 40)
    assert a == _draws(SamplingParams(seed=1234), flat, 40)
    assert a != _draws(SamplingParams(seed=1235), flat, 40)
    # No seed: each sampler draws a fresh one.
    assert _draws(SamplingParams(), flat, 40) != _draws(SamplingParams(), flat, 40)
