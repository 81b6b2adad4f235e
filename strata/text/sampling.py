"""Sampling parameters and the logits -> next token step.

Definitions (the conventions of transformers and vLLM, which agree on these):

* `logit_bias` {id: b}: `logit[id] += b` (OpenAI's logit_bias; b in [-100, 100]).
* `repetition_penalty` p (CTRL, as transformers' RepetitionPenaltyLogitsProcessor and vLLM): for every distinct id
  in the prompt or the generated tokens, `logit = logit / p` if `logit > 0` else `logit * p`. 1.0 = off.
* `presence_penalty` a and `frequency_penalty` f (OpenAI, as vLLM): for an id generated c > 0 times so far (prompt
  tokens do not count), `logit -= a + f * c`. 0.0 = off. Both in [-2, 2].
* then greedy (argmax) when `greedy` or `temperature == 0`; otherwise, in transformers' warper order,
  `logit /= temperature`, top-k (keep logits >= the k-th largest; ties kept; 0 = off), top-p (transformers' rule:
  sort ascending, drop tokens whose cumulative probability is <= 1 - top_p; the most likely token always stays;
  1.0 = off), min-p (drop tokens whose probability is below min_p times the largest probability; 0.0 = off),
  softmax, and one draw from the result with the request's own `torch.Generator`, so a seed fixes the tokens.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from strata.errors import StrataError


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop. Checked when built, so a bad request fails before the model runs.

    max_tokens: most tokens to generate (>= 1). stop: strings that end generation; the text stops before them.
    seed: fixes the random draws (None: a fresh random seed per request). greedy: always the most likely token
    (also what temperature 0 means). skip_special_tokens: leave special tokens (e.g. <|im_start|>) out of the text.
    See the module docstring for the exact definition of every logits adjustment.
    """

    max_tokens: int = 64
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    seed: int | None = None
    stop: Sequence[str] = ()
    greedy: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        def bad(name: str, rule: str) -> StrataError:
            return StrataError(f"{name} {rule}, got {getattr(self, name)!r}")

        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise bad("max_tokens", "must be an integer >= 1")
        if not _is_real(self.temperature) or self.temperature < 0:
            raise bad("temperature", "must be a finite number >= 0")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise bad("top_k", "must be an integer >= 0 (0 disables it)")
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1]")
        if not _is_real(self.min_p) or not 0 <= self.min_p <= 1:
            raise bad("min_p", "must be in [0, 1]")
        if not _is_real(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "must be a finite number > 0 (1 disables it)")
        for name in ("presence_penalty", "frequency_penalty"):
            if not _is_real(getattr(self, name)) or not -2 <= getattr(self, name) <= 2:
                raise bad(name, "must be in [-2, 2]")
        if not isinstance(self.logit_bias, Mapping):
            raise bad("logit_bias", "must map token ids to numbers")
        bias: dict[int, float] = {}
        for k, v in self.logit_bias.items():
            key = int(k) if isinstance(k, str) and k.strip().lstrip("-").isdigit() else k  # JSON object keys
            if not _is_int(key) or key < 0:
                raise StrataError(f"logit_bias keys must be token ids >= 0, got {k!r}")
            if not _is_real(v) or not -100 <= v <= 100:
                raise StrataError(f"logit_bias values must be in [-100, 100], got {v!r} for id {key}")
            bias[key] = float(v)
        object.__setattr__(self, "logit_bias", bias)
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**63):
            raise bad("seed", "must be an integer in [0, 2**63) or None")
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, Iterable) or not all(isinstance(s, str) for s in stop):
            raise bad("stop", "must be a string or a list of strings")
        stop = tuple(dict.fromkeys(stop))
        if any(s == "" for s in stop):
            raise StrataError("stop strings must not be empty")
        object.__setattr__(self, "stop", stop)
        for name in ("greedy", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "must be true or false")

    @property
    def is_greedy(self) -> bool:
        return self.greedy or self.temperature == 0

    @property
    def logits_free(self) -> bool:
        """Whether the choice needs nothing but the model's logits (no bias, no penalties), so it can be made on
        the device inside the captured decode step."""
        return (not self.logit_bias and self.repetition_penalty == 1.0 and self.presence_penalty == 0.0
                and self.frequency_penalty == 0.0)


# --- logits adjustments, each a pure function so tests can check the definitions ---------------------------------

def apply_logit_bias(logits: torch.Tensor, bias: Mapping[int, float]) -> torch.Tensor:
    """logits[id] += bias[id]."""
    if not bias:
        return logits
    ids = torch.tensor(list(bias.keys()), dtype=torch.long, device=logits.device)
    vals = torch.tensor(list(bias.values()), dtype=logits.dtype, device=logits.device)
    return logits.index_add(-1, ids, vals)


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """For ids where `seen` (bool, V) holds: divide positive logits by `penalty`, multiply the others by it."""
    if penalty == 1.0:
        return logits
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalised, logits)


def apply_presence_frequency(logits: torch.Tensor, counts: torch.Tensor, presence: float,
                             frequency: float) -> torch.Tensor:
    """logits -= presence * (count > 0) + frequency * count, with `counts` (V,) of the generated tokens."""
    if presence == 0 and frequency == 0:
        return logits
    c = counts.to(logits.dtype)
    return logits - presence * (c > 0).to(logits.dtype) - frequency * c


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the logits >= the k-th largest (ties at the boundary stay, as in transformers); others -> -inf."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, -math.inf)


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus filter, transformers' rule: drop tokens whose ascending cumulative probability is <= 1 - p, always
    keeping the most likely one."""
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, descending=False, dim=-1)
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove_sorted = cum <= (1 - p)
    remove_sorted[..., -1:] = False
    remove = remove_sorted.scatter(-1, order, remove_sorted)
    return logits.masked_fill(remove, -math.inf)


def min_p_filter(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Drop tokens whose probability is below min_p * (largest probability)."""
    if min_p <= 0:
        return logits
    probs = logits.softmax(dim=-1)
    threshold = min_p * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < threshold, -math.inf)


def warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p (transformers' order) on already biased/penalised logits."""
    x = logits / params.temperature if params.temperature != 1.0 else logits
    x = top_k_filter(x, params.top_k)
    x = top_p_filter(x, params.top_p)
    return min_p_filter(x, params.min_p)


class Sampler:
    """The per-request token picker: owns the random generator and the token counts the penalties need.

    `next_token(logits)` adjusts the logits, picks a token, and records it as generated.
    """

    def __init__(self, params: SamplingParams, vocab_size: int, prompt_ids: Sequence[int] = (),
                 device: torch.device | str = "cpu"):
        self.params = params
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        too_big = [i for i in params.logit_bias if i >= vocab_size]
        if too_big:
            raise StrataError(f"logit_bias id {too_big[0]} is outside the vocabulary [0, {vocab_size})")
        self.seed = params.seed if params.seed is not None else secrets.randbits(63)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(self.seed)
        self.counts = torch.zeros(vocab_size, dtype=torch.int32, device=self.device)
        self.seen = torch.zeros(vocab_size, dtype=torch.bool, device=self.device)
        if len(prompt_ids):
            self.seen[torch.as_tensor(list(prompt_ids), dtype=torch.long, device=self.device)] = True

    def adjust(self, logits: torch.Tensor) -> torch.Tensor:
        """Logit bias, repetition penalty, presence/frequency penalties (float32)."""
        p = self.params
        x = logits.to(self.device, torch.float32)
        x = apply_logit_bias(x, p.logit_bias)
        x = apply_repetition_penalty(x, self.seen, p.repetition_penalty)
        return apply_presence_frequency(x, self.counts, p.presence_penalty, p.frequency_penalty)

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        """The distribution the next token is drawn from (one-hot at the argmax when greedy)."""
        x = self.adjust(logits)
        if self.params.is_greedy:
            return torch.nn.functional.one_hot(x.argmax(), x.shape[-1]).float()
        return warp(x, self.params).softmax(dim=-1)

    def next_token(self, logits: torch.Tensor) -> int:
        """Pick the next token from raw model logits (V,) and count it as generated."""
        if logits.shape[-1] != self.vocab_size:
            raise StrataError(f"logits have {logits.shape[-1]} entries, the sampler expects {self.vocab_size}")
        x = self.adjust(logits)
        if self.params.is_greedy:
            token = int(x.argmax())
        else:
            probs = warp(x, self.params).softmax(dim=-1)
            if not bool(torch.isfinite(probs).all()):
                raise StrataError("the model produced non-finite logits; cannot sample")
            token = int(torch.multinomial(probs, 1, generator=self.generator))
        self.record(token)
        return token

    def record(self, token: int) -> None:
        """Count `token` as generated (for the penalties), when it was chosen elsewhere (on the device)."""
        self.counts[token] += 1
        self.seen[token] = True
