"""Streaming detokenisation: whole characters only, stop strings found across token boundaries."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from strata.text.detok import StopMatcher, TextStream
from strata.text.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok(fixtures_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(fixtures_dir / "hf")


def _stream(tok: Tokenizer, ids: list[int], stop: tuple[str, ...] = (), skip: bool = False) -> tuple[list[str], TextStream]:
    s = TextStream(tok, stop, skip_special_tokens=skip)
    pieces = []
    for i in ids:
        pieces.append(s.push(i))
        if s.stopped is not None:
            break
    pieces.append(s.finish())
    return pieces, s


@pytest.mark.parametrize("text", ["😀", "a😀b", "你好世界", "🇨🇭 ok", "é€𝄞"])
def test_multibyte_characters_split_across_tokens(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert len(ids) > len(text), "the test wants characters split over several tokens"
    pieces, s = _stream(tok, ids)
    assert "\ufffd" not in "".join(pieces)
    assert "".join(pieces) == s.text == text
    # Nothing is emitted until a character is complete: every piece is whole characters of the text.
    pos = 0
    for p in pieces:
        assert text[pos:pos + len(p)] == p
        pos += len(p)


def test_emoji_bytes_are_held_until_complete(tok: Tokenizer) -> None:
    ids = tok.encode("😀")
    s = TextStream(tok)
    assert [s.push(i) for i in ids] == [""] * (len(ids) - 1) + ["😀"]


def test_incomplete_character_at_the_end_becomes_replacement(tok: Tokenizer) -> None:
    ids = tok.encode("x😀")[:-1]
    pieces, _ = _stream(tok, ids)
    assert "".join(pieces) == "x\ufffd" == tok.decode(ids)


def test_stop_string_split_across_tokens(tok: Tokenizer) -> None:
    text = "value = compute(x)  ### END\nmore text"
    ids = tok.encode(text)
    pieces, s = _stream(tok, ids, stop=("### END",))
    assert not any(b"### END" in tok.token_bytes(i) for i in ids), "the stop string must span several tokens"
    assert "".join(pieces) == s.text == "value = compute(x)  "
    assert s.stopped == "### END"


def test_stop_prefix_is_held_back_then_released(tok: Tokenizer) -> None:
    s = TextStream(tok, stop=("#!stop",))
    out = [s.push(i) for i in tok.encode("a #! b")]
    assert "".join(out) + s.finish() == "a #! b"
    assert s.stopped is None


def test_special_tokens_skipped_or_kept(tok: Tokenizer) -> None:
    ids = tok.encode("hi<|im_start|>there")
    assert "".join(_stream(tok, ids, skip=True)[0]) == "hithere"
    assert "".join(_stream(tok, ids, skip=False)[0]) == "hi<|im_start|>there"


def test_stop_matcher_rules() -> None:
    m = StopMatcher(["abc"])
    assert [m.push(x) for x in ["xa", "b", "d"]] == ["x", "", "abd"]
    m = StopMatcher(["abc"])
    assert [m.push(x) for x in ["xa", "b", "cde"]] == ["x", "", ""] and m.stopped == "abc"
    m = StopMatcher(["lo", "hello"])  # the earliest occurrence wins, whichever stop string it is
    assert m.push("say hello") == "say " and m.stopped == "hello"
    m = StopMatcher(["aab"])
    assert m.push("aaa") == "a" and m.push("b") == "" and m.stopped == "aab"
    m = StopMatcher(["zz"])
    assert m.push("az") == "a" and m.flush() == "z"


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(alphabet="ab\n", max_size=4), max_size=12), st.lists(st.text(alphabet="ab\n", min_size=1,
                                                                                     max_size=3), max_size=3))
def test_stop_matcher_equals_cutting_the_whole_text(pieces: list[str], stops: list[str]) -> None:
    """Generation ends at the first piece after which the text holds a stop string; the text is cut where the
    earliest stop string found at that point begins (a stop that would only complete later never does)."""
    text = ""
    for p in pieces:
        text += p
        if any(s in text for s in stops):
            break
    found = [text.find(s) for s in stops if s in text]
    expected = text[: min(found)] if found else text
    m = StopMatcher(stops)
    out = ""
    for p in pieces:
        out += m.push(p)
        if m.stopped is not None:
            break
    out += m.flush()
    assert out == expected
    assert (m.stopped is not None) == bool(found)


@settings(max_examples=100, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=40))
def test_stream_equals_decode(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    pieces, _ = _stream(tok, ids)
    assert "".join(pieces) == tok.decode(ids)
