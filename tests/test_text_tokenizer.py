"""Tokenizer: tokenizer.json as written, special tokens, EOS ids from both config files, byte table."""

from __future__ import annotations

import json
import shutil
import unicodedata
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from strata.errors import StrataError
from strata.runtime.engine import DEFAULT_MODEL
from strata.text.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok(fixtures_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(fixtures_dir / "hf")


def test_prompt_fixture_encodes_to_its_ids(tok: Tokenizer, fixtures_dir: Path) -> None:
    prompt = json.loads((fixtures_dir / "prompt.json").read_text())
    assert tok.encode(prompt["text"]) == prompt["ids"]
    assert tok.decode(prompt["ids"]) == prompt["text"]


def test_special_tokens_and_eos(tok: Tokenizer) -> None:
    assert tok.special_ids == {508, 509, 510, 511}
    assert tok.special_tokens_map == {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    assert tok.eos_ids == (510,)
    assert tok.vocab_size == 512
    assert tok.token_bytes(510) == b"<|im_end|>"
    assert tok.token_bytes(220) == b" " and tok.token_bytes(198) == b"\n"
    assert tok.token_bytes(10_000) == b""


def test_bundled_model_has_a_tokenizer() -> None:
    tok = Tokenizer.from_dir(DEFAULT_MODEL)
    ids = tok.encode("def fibonacci(n):\n    return n")
    assert tok.decode(ids) == "def fibonacci(n):\n    return n" and len(ids) < 12  # BPE merges, not bytes
    assert tok.token_to_id("<|im_end|>") in tok.eos_ids


def _copy(fixtures_dir: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "m"
    shutil.copytree(fixtures_dir / "hf", folder, ignore=shutil.ignore_patterns("*.safetensors"))
    return folder


def test_eos_ids_join_config_and_generation_config(fixtures_dir: Path, tmp_path: Path) -> None:
    folder = _copy(fixtures_dir, tmp_path)
    gen = json.loads((folder / "generation_config.json").read_text())
    gen["eos_token_id"] = [508, 510]
    (folder / "generation_config.json").write_text(json.dumps(gen))
    assert Tokenizer.from_dir(folder).eos_ids == (510, 508)
    # Neither file names one: the tokenizer's eos_token is the fallback.
    for name in ("config.json", "generation_config.json"):
        data = json.loads((folder / name).read_text())
        del data["eos_token_id"]
        (folder / name).write_text(json.dumps(data))
    assert Tokenizer.from_dir(folder).eos_ids == (510,)


def test_missing_or_broken_files_are_clear_errors(fixtures_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(StrataError, match="does not exist"):
        Tokenizer.from_dir(tmp_path / "nope")
    with pytest.raises(StrataError, match="no tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
    folder = _copy(fixtures_dir, tmp_path)
    (folder / "generation_config.json").write_text("{broken")
    with pytest.raises(StrataError, match="not valid JSON"):
        Tokenizer.from_dir(folder)


def test_matches_transformers_on_text_without_combining_marks(tok: Tokenizer, fixtures_dir: Path) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(fixtures_dir / "hf")
    text = "def f(x):\n    return x  # ok 😀 你好 naïve <|im_start|>user\nhi<|im_end|>\n\n  "
    assert tok.encode(text) == hf.encode(text)
    assert tok.decode(tok.encode(text), skip_special_tokens=True) == hf.decode(hf.encode(text),
                                                                              skip_special_tokens=True)


@settings(max_examples=150, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=60))
def test_encode_decode_round_trip(tok: Tokenizer, text: str) -> None:
    """Decoding the ids gives the text back, NFC-normalised as the tokenizer's normalizer makes it; the byte table
    agrees with the tokenizer's own decoder."""
    ids = tok.encode(text)
    assert tok.decode(ids) == unicodedata.normalize("NFC", text)
    assert b"".join(tok.token_bytes(i) for i in ids).decode("utf-8") == unicodedata.normalize("NFC", text)
