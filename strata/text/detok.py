"""Streaming detokenisation: token ids in, text pieces out, as soon as they are final.

Two things make a piece "not final yet":

* Byte-level BPE splits characters: an emoji's four UTF-8 bytes may come in two or three tokens. Bytes are fed to
  an incremental UTF-8 decoder, which holds an incomplete sequence back until its last byte arrives (and turns
  bytes that can never be valid into U+FFFD, as `Tokenizer.decode` does), so no piece ever ends mid-character.
* Stop strings may be split across tokens ("<|" + "end|>"), or their first characters may arrive long before it is
  known whether the rest follows. Text that could still be the start of a stop string is held back; when a stop
  string completes, everything from its start is dropped and the stream is finished.

Joining every piece gives exactly the text of the generated tokens cut before the first stop string.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence

from strata.text.tokenizer import Tokenizer


class StopMatcher:
    """Finds the first occurrence of any stop string in text that arrives in pieces.

    `push(piece)` returns the text that can be emitted now: text that cannot be part of a stop string. After a
    stop string completes, `stopped` is the string that matched and further pushes return "".
    """

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(s for s in stops if s)
        self.stopped: str | None = None
        self._pending = ""  # received, not yet emitted: a possible stop-string prefix

    def push(self, piece: str) -> str:
        if self.stopped is not None:
            return ""
        text = self._pending + piece
        first = None
        for s in self.stops:
            i = text.find(s)
            if i >= 0 and (first is None or i < first[0]):
                first = (i, s)
        if first is not None:
            self.stopped = first[1]
            self._pending = ""
            return text[:first[0]]
        hold = self._held_suffix(text)
        self._pending = text[len(text) - hold:] if hold else ""
        return text[:len(text) - hold]

    def _held_suffix(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best

    def flush(self) -> str:
        """The held-back text, once no more text will come (it was not a stop string after all)."""
        out, self._pending = self._pending, ""
        return "" if self.stopped is not None else out


class TextStream:
    """Token ids -> final text pieces, with stop strings. One per generated sequence.

    `push(token_id)` returns the new text (possibly ""); check `stopped` after each push. `finish()` returns what
    was held back at the end (an incomplete character becomes U+FFFD). `text` is everything emitted so far.
    """

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = (), skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stops = StopMatcher(stop)
        self.text = ""

    @property
    def stopped(self) -> str | None:
        """The stop string that ended the stream, or None."""
        return self._stops.stopped

    def push(self, token_id: int) -> str:
        if self.skip_special_tokens and token_id in self.tokenizer.special_ids:
            return ""
        out = self._stops.push(self._utf8.decode(self.tokenizer.token_bytes(token_id)))
        self.text += out
        return out

    def finish(self) -> str:
        out = self._stops.push(self._utf8.decode(b"", final=True)) if self._stops.stopped is None else ""
        out += self._stops.flush()
        self.text += out
        return out
