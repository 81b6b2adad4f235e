"""Conversation reuse: sequence states saved after requests, found again by token prefix.

A chat client sends the whole conversation every turn. The state after the previous turn already holds every
token up to the end of the previous reply, so the next turn only needs the tokens after it: the closing tag of
the reply and the new user message. Two states are saved per chat request: the one where the conversation before
the generation prompt ends (a prefix of the next turn even when the reply's text re-encodes to other tokens than
the model generated, or the template re-renders the reply without its thinking) and the one at the end of
generation (the longer match when it does re-encode the same).

States are keyed by their exact token list and found by the longest key that is a strict prefix of the new
prompt (strict: the model must see at least one new token to produce the logits of the next one). `lookup`
hands out a clone, so a saved state is never shared between sequences; `put` takes ownership of the state it is
given. Least recently used states are dropped to stay under a byte bound.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from strata.model.model import SequenceState


def state_bytes(state: SequenceState) -> int:
    """Bytes held by a state's tensors (on whatever device they live)."""
    total = 0
    for part in [*state.layers, *state.ple.values()]:
        for value in vars(part).values():
            if isinstance(value, torch.Tensor):
                total += value.numel() * value.element_size()
    return total + 8 * len(state.tokens)


@dataclass
class _Entry:
    state: SequenceState
    nbytes: int


@dataclass(frozen=True)
class CacheStats:
    entries: int
    bytes: int
    max_bytes: int
    hits: int
    misses: int
    reused_tokens: int

    def as_dict(self) -> dict[str, int]:
        return {"entries": self.entries, "bytes": self.bytes, "max_bytes": self.max_bytes, "hits": self.hits,
                "misses": self.misses, "reused_tokens": self.reused_tokens}


class PrefixCache:
    """Saved sequence states keyed by token prefix, least recently used dropped first. Thread-safe: worker
    threads look up and save concurrently. max_bytes 0 disables saving."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max(0, int(max_bytes))
        self._entries: OrderedDict[tuple[int, ...], _Entry] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._hits = self._misses = self._reused = 0

    def lookup(self, ids: Sequence[int]) -> SequenceState | None:
        """A private copy of the saved state with the longest token list that is a strict prefix of `ids`."""
        ids = list(ids)
        with self._lock:
            best: tuple[int, ...] | None = None
            for key in self._entries:
                if len(key) < len(ids) and (best is None or len(key) > len(best)) and \
                        tuple(ids[:len(key)]) == key:
                    best = key
            if best is None:
                self._misses += 1
                return None
            self._entries.move_to_end(best)
            entry = self._entries[best]
            self._hits += 1
            self._reused += len(best)
        with torch.inference_mode():
            return entry.state.clone()

    def put(self, state: SequenceState) -> None:
        """Save `state` (now owned by the cache) under its tokens; evict old states to respect the bound."""
        if self.max_bytes == 0 or not state.tokens:
            return
        key = tuple(state.tokens)
        nbytes = state_bytes(state)
        if nbytes > self.max_bytes:
            return
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old.nbytes
            self._entries[key] = _Entry(state, nbytes)
            self._bytes += nbytes
            while self._bytes > self.max_bytes and self._entries:
                _, dropped = self._entries.popitem(last=False)
                self._bytes -= dropped.nbytes

    def put_copy(self, state: SequenceState) -> None:
        """Save a copy of `state` (which its owner goes on using); no copy is made when it could not be kept."""
        if self.max_bytes == 0 or not state.tokens or state_bytes(state) > self.max_bytes:
            return
        with torch.inference_mode():
            self.put(state.clone())

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    def keys(self) -> list[tuple[int, ...]]:
        """Saved token lists, least recently used first (for tests and the monitor)."""
        with self._lock:
            return list(self._entries)

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(len(self._entries), self._bytes, self.max_bytes, self._hits, self._misses,
                              self._reused)
