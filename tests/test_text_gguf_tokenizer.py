"""A GGUF file alone is a complete model: the tokenizer rebuilt from its `tokenizer.ggml.*` metadata gives the same
ids as the HF tokenizer.json it was converted from, EOS ids and the chat template come from the file, and
tokenizer models or pre-tokenizers strata does not know are refused by name."""

from __future__ import annotations

import json
import shutil
import unicodedata
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from strata import LLM
from strata.cli.main import main
from strata.errors import StrataError
from strata.text.chat import ChatTemplate
from strata.text.tokenizer import GGUF_PRE_TOKENIZERS, Tokenizer
from strata.weights.gguf import ValueType, open_gguf
from strata.weights.gguf_writer import copy_gguf

S, U32, I32, B, A = ValueType.STRING, ValueType.UINT32, ValueType.INT32, ValueType.BOOL, ValueType.ARRAY
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}{{ eos_token }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def gguf_path(fixtures_dir: Path) -> Path:
    return fixtures_dir / "tiny-f32.gguf"


@pytest.fixture(scope="module")
def gguf_tok(gguf_path: Path) -> Tokenizer:
    return Tokenizer.from_gguf(gguf_path)


@pytest.fixture(scope="module")
def hf_tok(fixtures_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(fixtures_dir / "hf")


@pytest.fixture(scope="module")
def prompt(fixtures_dir: Path) -> dict[str, Any]:
    return json.loads((fixtures_dir / "prompt.json").read_text())


def _variant(gguf_path: Path, out: Path, metadata: dict[str, tuple[Any, ...]] | None = None,
             drop_keys: tuple[str, ...] = (), weights: bool = False) -> Path:
    """A copy of the fixture GGUF with metadata changed; without `weights` it holds the metadata only (all the
    tokenizer needs, and a few KB instead of 19 MB)."""
    gset = open_gguf(gguf_path)
    copy_gguf(gset, out, metadata=metadata, drop_keys=drop_keys,
              drop_tensors=() if weights else list(gset.tensors))
    return out


# --- same tokenizer as tokenizer.json ---------------------------------------------------------------------------

def test_split_regexes_are_the_families_own(fixtures_dir: Path) -> None:
    """qwen35 is the fixture tokenizer.json's split regex; both are what transformers' classes build."""
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX as QWEN2
    from transformers.models.qwen3_5.tokenization_qwen3_5 import PRETOKENIZE_REGEX as QWEN35

    tj = json.loads((fixtures_dir / "hf" / "tokenizer.json").read_text())
    assert GGUF_PRE_TOKENIZERS["qwen35"] == tj["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"]
    assert GGUF_PRE_TOKENIZERS == {"qwen2": QWEN2, "qwen35": QWEN35}


def test_prompt_text_gives_the_prompt_ids(gguf_tok: Tokenizer, hf_tok: Tokenizer, prompt: dict[str, Any]) -> None:
    assert gguf_tok.encode(prompt["text"]) == prompt["ids"] == hf_tok.encode(prompt["text"])
    assert gguf_tok.decode(prompt["ids"]) == prompt["text"]


def test_vocabulary_special_tokens_and_eos_match(gguf_tok: Tokenizer, hf_tok: Tokenizer) -> None:
    assert gguf_tok.gguf is not None and hf_tok.gguf is None
    assert gguf_tok.vocab_size == hf_tok.vocab_size == 512
    assert gguf_tok.special_ids == hf_tok.special_ids == {508, 509, 510, 511}
    assert gguf_tok.special_tokens_map == hf_tok.special_tokens_map == {"eos_token": "<|im_end|>",
                                                                       "pad_token": "<|endoftext|>"}
    assert gguf_tok.eos_ids == hf_tok.eos_ids == (510,)
    for text in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|fim_pad|>", "Ġ", "def"):
        assert gguf_tok.token_to_id(text) == hf_tok.token_to_id(text) is not None
    assert all(gguf_tok.id_to_token(i) == hf_tok.id_to_token(i) for i in range(512))
    assert all(gguf_tok.token_bytes(i) == hf_tok.token_bytes(i) for i in range(512))


_pieces = st.one_of(
    st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=12),  # any unicode
    st.text(alphabet=" \t\n\r\u00a0\u3000", min_size=1, max_size=8),  # whitespace runs
    st.integers(min_value=-10**12, max_value=10**12).map(str),  # digits (split one by one)
    st.sampled_from(["def f(x):\n", "    return x**2  # sq\n", "if a != b: pass", "x = {'k': [1, 2.5]}\n",
                     "it's", "They'LL", "we've", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "\r\n\r\n",
                     "naïve", "e\u0301", "x\u0301y", ".\u0301in", "\u0915\u094d\u0937", "😀👍🏽", "你好，世界",
                     "Ελληνικά", "١٢٣"]),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(_pieces, max_size=8).map("".join))
def test_same_ids_as_tokenizer_json(gguf_tok: Tokenizer, hf_tok: Tokenizer, text: str) -> None:
    ids = gguf_tok.encode(text)
    assert ids == hf_tok.encode(text)
    # The split itself too: on this small vocabulary no merge spans a combining mark, so ids alone cannot tell the
    # qwen35 split from the qwen2 one.
    assert gguf_tok._tok.pre_tokenizer.pre_tokenize_str(text) == hf_tok._tok.pre_tokenizer.pre_tokenize_str(text)
    assert gguf_tok.decode(ids) == unicodedata.normalize("NFC", text)
    assert gguf_tok.decode(ids, skip_special_tokens=True) == hf_tok.decode(ids, skip_special_tokens=True)


# --- what the metadata can say -------------------------------------------------------------------------------------

def test_token_types_user_defined_and_unused(gguf_path: Path, tmp_path: Path) -> None:
    """USER_DEFINED tokens are matched in text but not special; UNUSED ids are unknown, as in the HF tokenizer."""
    md = open_gguf(gguf_path).metadata
    tokens = [*md["tokenizer.ggml.tokens"], "[PAD512]", "<think>"]
    types = [*md["tokenizer.ggml.token_type"], 5, 4]
    types[511] = 4
    tok = Tokenizer.from_gguf(_variant(gguf_path, tmp_path / "t.gguf", {
        "tokenizer.ggml.tokens": (A, tokens, S), "tokenizer.ggml.token_type": (A, types, I32)}))
    assert tok.special_ids == {508, 509, 510}
    ids = tok.encode("a<think>b<|fim_pad|>")
    assert ids[1] == 513 and ids[-1] == 511
    assert tok.decode(ids, skip_special_tokens=True) == "a<think>b<|fim_pad|>"
    assert tok.id_to_token(512) is None and tok.token_bytes(512) == b"" and tok.decode([512]) == ""


def test_bos_eot_and_named_specials(gguf_path: Path, tmp_path: Path) -> None:
    tok = Tokenizer.from_gguf(_variant(gguf_path, tmp_path / "t.gguf", {
        "tokenizer.ggml.bos_token_id": (U32, 508), "tokenizer.ggml.add_bos_token": (B, True),
        "tokenizer.ggml.eot_token_id": (U32, 509)}))
    assert tok.encode("def") == [508, tok.token_to_id("def")]
    assert tok.encode("def", add_special_tokens=False) == [tok.token_to_id("def")]
    assert tok.eos_ids == (510, 509)
    assert tok.special_tokens_map["bos_token"] == "<|endoftext|>"


def test_chat_templates_from_metadata(gguf_path: Path, tmp_path: Path) -> None:
    path = _variant(gguf_path, tmp_path / "t.gguf", {
        "tokenizer.chat_template": (S, TEMPLATE), "tokenizer.chat_template.tool_use": (S, "tools: {{ tools }}"),
        "tokenizer.chat_templates": (A, ["tool_use"], S)})
    tok = Tokenizer.from_gguf(path)
    tpl = ChatTemplate.from_config(tok.config, tok.special_tokens_map, str(path))
    assert tpl is not None and set(tpl.templates) == {"default", "tool_use"}
    msgs = [{"role": "user", "content": "hi"}]
    assert tpl.render(msgs, add_generation_prompt=True) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tpl.render(msgs, tools=[{"name": "f"}]) == "tools: [{'name': 'f'}]"


@pytest.mark.parametrize(("metadata", "drop", "message"), [
    ({"tokenizer.ggml.pre": (S, "llama-bpe")}, (), "tokenizer.ggml.pre = 'llama-bpe' is not supported"),
    ({}, ("tokenizer.ggml.pre",), "tokenizer.ggml.pre = missing is not supported"),
    ({"tokenizer.ggml.model": (S, "llama")}, (), "tokenizer.ggml.model = 'llama' is not supported"),
    ({}, ("tokenizer.ggml.model",), "has no tokenizer"),
    ({}, ("tokenizer.ggml.merges",), "tokenizer.ggml.merges is missing"),
    ({"tokenizer.ggml.eos_token_id": (U32, 512)}, (), "eos_token_id = 512 is not a token id"),
    ({"tokenizer.ggml.add_bos_token": (B, True)}, (), "add_bos_token is set but the file names no bos_token"),
])
def test_what_is_not_supported_is_refused_by_name(gguf_path: Path, tmp_path: Path, metadata: dict[str, Any],
                                                  drop: tuple[str, ...], message: str) -> None:
    with pytest.raises(StrataError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Tokenizer.from_gguf(_variant(gguf_path, tmp_path / "t.gguf", metadata, drop))


def test_from_model_picks_the_source(gguf_path: Path, fixtures_dir: Path, tmp_path: Path) -> None:
    """A GGUF's own metadata first; a GGUF without any falls back to the tokenizer.json beside it."""
    assert Tokenizer.from_model(gguf_path).gguf == gguf_path
    assert Tokenizer.from_model(fixtures_dir / "hf").gguf is None
    bare = _variant(gguf_path, tmp_path / "bare.gguf", drop_keys=("tokenizer.ggml.model",))
    with pytest.raises(StrataError, match="has no tokenizer"):
        Tokenizer.from_model(bare)
    shutil.copy(fixtures_dir / "hf" / "tokenizer.json", tmp_path)
    assert Tokenizer.from_model(bare).folder == tmp_path


# --- the GGUF alone as a model ------------------------------------------------------------------------------------

@pytest.fixture()
def lone_gguf(gguf_path: Path, tmp_path: Path) -> Path:
    """The fixture GGUF alone in a folder (no tokenizer.json or config files beside it)."""
    link = tmp_path / "alone" / "model.gguf"
    link.parent.mkdir()
    link.symlink_to(gguf_path)
    return link


def _generate(capsys: pytest.CaptureFixture, *argv: str) -> dict[str, Any]:
    rc = main(["generate", *argv, "--greedy", "--json"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    return json.loads(out.out)


def test_cli_greedy_from_the_gguf_alone(capsys: pytest.CaptureFixture, fixtures_dir: Path, lone_gguf: Path,
                                        prompt: dict[str, Any]) -> None:
    reference = json.loads((fixtures_dir / "transformers.greedy.json").read_text())
    margins = json.loads((fixtures_dir / "summary.json").read_text())["transformers"]["greedy_top1_top2_margin"]
    n = next((i for i, m in enumerate(margins) if m < 0.005), len(margins))  # steps before the first near-tie
    assert n > 0
    by_ids = _generate(capsys, "--model", str(lone_gguf), "--ids", ",".join(map(str, prompt["ids"])),
                       "--max-tokens", "16")
    assert by_ids["prompt_ids"] == prompt["ids"]
    assert by_ids["generated_ids"][:n] == reference[:n] and len(by_ids["generated_ids"]) == 16
    by_text = _generate(capsys, "--model", str(lone_gguf), prompt["text"], "--max-tokens", "4")
    assert by_text["prompt_ids"] == prompt["ids"]
    assert by_text["generated_ids"] == by_ids["generated_ids"][:4]
    assert by_text["text"] == Tokenizer.from_gguf(lone_gguf).decode(by_text["generated_ids"])


def test_llm_takes_tokenizer_eos_and_template_from_the_gguf(gguf_path: Path, fixtures_dir: Path,
                                                           tmp_path: Path) -> None:
    path = _variant(gguf_path, tmp_path / "m.gguf", {"tokenizer.chat_template": (S, TEMPLATE)}, weights=True)
    (tmp_path / "chat_template.jinja").write_text("a file beside a GGUF is not its template")
    llm = LLM(path)
    assert llm.tokenizer.gguf == path and llm.tokenizer.eos_ids == (510,)
    assert llm.chat_prompt([{"role": "user", "content": "hi"}]) == \
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    # --tokenizer / tokenizer= still overrides: a folder with tokenizer.json (no template there: the fixture has none)
    other = LLM(path, tokenizer=fixtures_dir / "hf")
    assert other.tokenizer.gguf is None and other.tokenizer.folder == fixtures_dir / "hf"
    assert other.chat_template is None


def test_cli_refuses_an_unknown_pre_tokenizer(capsys: pytest.CaptureFixture, gguf_path: Path,
                                              tmp_path: Path) -> None:
    path = _variant(gguf_path, tmp_path / "m.gguf", {"tokenizer.ggml.pre": (S, "qwen99")}, weights=True)
    assert main(["generate", "--model", str(path), "hello"]) == 2
    err = capsys.readouterr().err
    assert "tokenizer.ggml.pre = 'qwen99' is not supported" in err and "Traceback" not in err
    # With a tokenizer given, the same file runs.
    out = _generate(capsys, "--model", str(path), "--tokenizer", str(gguf_path), "hello", "--max-tokens", "1")
    assert out["prompt_ids"] == Tokenizer.from_gguf(gguf_path).encode("hello")
