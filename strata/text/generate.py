"""The generation loop: prefill the prompt, then decode one token at a time until EOS, a stop string, the token
budget or the model's context length ends it, yielding text as it becomes final."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from strata.errors import StrataError
from strata.model.model import SequenceState
from strata.runtime.engine import Engine
from strata.runtime.graph import DeviceDraw
from strata.text.detok import TextStream
from strata.text.sampling import Sampler, SamplingParams
from strata.text.tokenizer import Tokenizer


@dataclass
class Timings:
    """Where the time went. Prompt: the prefill of the uncached prompt tokens plus picking the first token. Decode:
    everything after, which runs one forward pass per generated token except the first."""

    prompt_tokens: int = 0
    prompt_seconds: float = 0.0
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    cached_tokens: int = 0

    @property
    def prompt_tokens_per_s(self) -> float | None:
        return self.prompt_tokens / self.prompt_seconds if self.prompt_tokens and self.prompt_seconds > 0 else None

    @property
    def decode_tokens_per_s(self) -> float | None:
        return self.decode_tokens / self.decode_seconds if self.decode_tokens and self.decode_seconds > 0 else None

    def as_dict(self) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt_tokens, "prompt_seconds": self.prompt_seconds,
                "prompt_tokens_per_s": self.prompt_tokens_per_s, "cached_tokens": self.cached_tokens,
                "decode_tokens": self.decode_tokens, "decode_seconds": self.decode_seconds,
                "decode_tokens_per_s": self.decode_tokens_per_s}


def stop_ids(engine: Engine, tokenizer: Tokenizer) -> frozenset[int]:
    """EOS ids from the model config (what the engine read) and from config.json + generation_config.json (what
    the tokenizer read): a checkpoint may name its chat end token in only one of them."""
    return frozenset(engine.cfg.eos_ids) | frozenset(tokenizer.eos_ids)


class Generation:
    """One generation. Iterate it for text pieces; afterwards `token_ids`, `text`, `finish_reason` ("stop": EOS
    or a stop string, "length": max_tokens or the context length) and `timings` hold the result.

    `state`, when given and holding a prefix of `prompt_ids` (e.g. the previous turn of a chat), is continued
    instead of prefilling the whole prompt again; afterwards `state` is the sequence state after the last token
    fed to the model (`state.tokens`). The generated token that ended generation is fed only where the engine
    decodes ahead on the device (`Engine.decode_ahead`: the step that feeds it runs while the host reads it).
    """

    def __init__(self, engine: Engine, tokenizer: Tokenizer, prompt_ids: Sequence[int], params: SamplingParams,
                 state: SequenceState | None = None):
        self.prompt_ids = list(prompt_ids)
        if not self.prompt_ids:
            raise StrataError("empty prompt: at least one token is needed")
        engine.check_ids(self.prompt_ids)
        limit = engine.max_context
        if len(self.prompt_ids) > limit:
            raise StrataError(f"the prompt has {len(self.prompt_ids)} tokens; the model's context is {limit}")
        self.engine = engine
        self.tokenizer = tokenizer
        self.params = params
        self.sampler = Sampler(params, engine.cfg.vocab_size, self.prompt_ids, engine.device)
        self.state = state
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.timings = Timings()
        self._stream = TextStream(tokenizer, params.stop, params.skip_special_tokens)
        self._started = False

    @property
    def text(self) -> str:
        return self._stream.text

    @property
    def seed(self) -> int:
        """The seed the draws used (a fresh one when the params gave none), to reproduce this generation."""
        return self.sampler.seed

    def _start_state(self) -> tuple[SequenceState, list[int]]:
        """The state to continue and the prompt ids it has not seen yet."""
        s = self.state
        if s is not None and len(s.tokens) < len(self.prompt_ids) and s.tokens == self.prompt_ids[:len(s.tokens)]:
            return s, self.prompt_ids[len(s.tokens):]
        return self.engine.new_state(), self.prompt_ids

    def __iter__(self) -> Iterator[str]:
        if self._started:
            raise StrataError("a Generation can be iterated only once")
        self._started = True
        engine, params = self.engine, self.params
        eos = stop_ids(engine, self.tokenizer)
        limit = engine.max_context

        t0 = time.perf_counter()
        state, todo = self._start_state()
        self.state = state
        self.timings.cached_tokens = len(self.prompt_ids) - len(todo)
        self.timings.prompt_tokens = len(todo)
        logits = engine.prefill(todo, state)
        token = self.sampler.next_token(logits)
        t1 = time.perf_counter()
        self.timings.prompt_seconds = t1 - t0

        ahead: Iterator[int] | None = None
        try:
            while True:
                self.token_ids.append(token)
                if token in eos:
                    self.finish_reason, self.stop_reason = "stop", token
                    break
                piece = self._stream.push(token)
                if piece:
                    yield piece
                if self._stream.stopped is not None:
                    self.finish_reason, self.stop_reason = "stop", self._stream.stopped
                    break
                # no position to feed the token (run ahead, the ids end where the state is full)
                if len(self.token_ids) >= params.max_tokens or (ahead is None and state.length >= limit):
                    self.finish_reason = "length"
                    break
                if ahead is None and self.timings.decode_tokens == 0:
                    ahead = self._decode_ahead(token, state)
                nxt = self._decode(token, state) if ahead is None else next(ahead, None)
                if nxt is None:
                    self.finish_reason = "length"
                    break
                token = nxt
                self.timings.decode_tokens += 1
        finally:
            if ahead is not None:
                ahead.close()
        tail = self._stream.finish()
        self.timings.decode_seconds = time.perf_counter() - t1 if self.timings.decode_tokens else 0.0
        if tail:
            yield tail

    def _decode_ahead(self, token: int, state: SequenceState) -> Iterator[int] | None:
        """The ids after `token` chosen on the device, each next step launched before the host reads the current
        id (`Engine.decode_ahead`), where the request needs only the ids; else None (decode one token at a time)."""
        p = self.params
        if not p.logits_free:
            return None
        draw = None if p.is_greedy else DeviceDraw(p.temperature, p.top_k, p.top_p, p.min_p, self.sampler.seed)
        ids = self.engine.decode_ahead(token, state, draw)
        return None if ids is None else self._recorded(ids)

    def _recorded(self, ids: Iterator[int]) -> Iterator[int]:
        """`ids`, each recorded as generated by the sampler (its repetition state) as it is taken."""
        try:
            for nxt in ids:
                self.sampler.record(nxt)
                yield nxt
        finally:
            ids.close()

    def _decode(self, token: int, state: SequenceState) -> int:
        """The next token sampled here from the step's logits (where the ids are not chosen on the device,
        `_decode_ahead`)."""
        return self.sampler.next_token(self.engine.decode(token, state))

    def run(self) -> Generation:
        """Run to the end without streaming; returns self."""
        for _ in self:
            pass
        return self
