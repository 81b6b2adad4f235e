"""The tokenizer of a model folder: `tokenizer.json` run by the `tokenizers` library, plus what the model files
around it say about special tokens and end-of-sequence ids.

`tokenizer.json` is used exactly as written (normalizer, split regex, byte-level BPE). transformers 5 instead
rebuilds some tokenizer classes from the vocabulary with a class-defined pre-tokenizer (its `Qwen2Tokenizer`
uses the Qwen2 split regex, which lacks the `\\p{M}` combining-mark classes of the Qwen3.5 regex in the file);
the file is what llama.cpp and the model's training used, so it is the one strata follows.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

from strata.errors import StrataError

# Named special-token attributes of a transformers tokenizer, in its order. Chat templates see these by name.
SPECIAL_TOKEN_ATTRIBUTES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                            "mask_token")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map that byte-level BPE vocabularies are written in."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


_UNICODE_TO_BYTE = {c: b for b, c in _bytes_to_unicode().items()}


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object from `path`, {} when the file does not exist; a clear error when it is broken."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise StrataError(f"cannot read {path}: {e}") from None
    except json.JSONDecodeError as e:
        raise StrataError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise StrataError(f"{path} must hold a JSON object")
    return data


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict with `content`."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise StrataError(f"unreadable special token entry in tokenizer_config.json: {value!r}")


def _id_list(value: Any, where: str) -> list[int]:
    """eos_token_id as config files write it: absent, an int, or a list of ints."""
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise StrataError(f"{where}: eos_token_id must be an integer or a list of integers, got {value!r}")
    return list(values)


def _is_byte_level(decoder: Any) -> bool:
    if not isinstance(decoder, dict):
        return False
    if decoder.get("type") == "ByteLevel":
        return True
    return decoder.get("type") == "Sequence" and any(_is_byte_level(d) for d in decoder.get("decoders", []))


class Tokenizer:
    """Text <-> ids for one model folder, with the special tokens and EOS ids the rest of strata needs.

    Build it with `Tokenizer.from_dir(model_path)`. `token_bytes(id)` gives the raw bytes a token stands for,
    which is what streaming needs: byte-level BPE splits multi-byte characters across tokens, so text can only be
    produced once a character's bytes are complete (see strata.text.detok).
    """

    def __init__(self, folder: Path, tokenizer_json: dict[str, Any], tokenizer_config: dict[str, Any],
                 model_config: dict[str, Any], generation_config: dict[str, Any]):
        from tokenizers import Tokenizer as HFTokenizer

        self.folder = folder
        self.config = tokenizer_config
        try:
            self._tok = HFTokenizer.from_str(json.dumps(tokenizer_json))
        except Exception as e:  # noqa: BLE001  (the tokenizers library raises bare Exceptions for bad files)
            raise StrataError(f"{folder / 'tokenizer.json'} is not a usable tokenizer: {e}") from None
        if not _is_byte_level(tokenizer_json.get("decoder")):
            kind = (tokenizer_json.get("decoder") or {}).get("type")
            raise StrataError(f"{folder / 'tokenizer.json'}: decoder {kind!r} is not supported; strata streams "
                              "byte-level BPE tokenizers (decoder type ByteLevel), the qwen4_exp family's kind")
        self._added = dict(self._tok.get_added_tokens_decoder())
        self.special_ids: frozenset[int] = frozenset(i for i, t in self._added.items() if t.special)
        self.special_tokens_map = self._named_special_tokens(tokenizer_config)
        self.eos_ids = self._eos_ids(model_config, generation_config)

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """The tokenizer of a model: `path` is the model folder, or a model file whose folder holds the
        tokenizer files."""
        path = Path(path)
        if not path.exists():
            raise StrataError(f"model path {path} does not exist")
        folder = path if path.is_dir() else path.parent
        tj = folder / "tokenizer.json"
        if not tj.is_file():
            raise StrataError(f"no tokenizer.json in {folder}: text generation needs the model's tokenizer; give the "
                              "folder that holds it (--tokenizer DIR, LLM(tokenizer=...))")
        return cls(folder, _read_json(tj), _read_json(folder / "tokenizer_config.json"),
                   _read_json(folder / "config.json"), _read_json(folder / "generation_config.json"))

    # --- special tokens -----------------------------------------------------------------------------------------

    @staticmethod
    def _named_special_tokens(cfg: dict[str, Any]) -> dict[str, str]:
        """{attribute: token} as transformers' `special_tokens_map` gives it to chat templates: the standard named
        tokens that are set, then any named model-specific ones from a dict-valued `extra_special_tokens`."""
        out: dict[str, str] = {}
        for attr in SPECIAL_TOKEN_ATTRIBUTES:
            text = _token_text(cfg.get(attr))
            if text is not None:
                out[attr] = text
        extra = cfg.get("extra_special_tokens")
        if isinstance(extra, dict):
            for attr, value in extra.items():
                text = _token_text(value)
                if text is not None:
                    out[attr] = text
        return out

    def _eos_ids(self, model_config: dict[str, Any], generation_config: dict[str, Any]) -> tuple[int, ...]:
        """Every id that ends a sequence: config.json's and generation_config.json's `eos_token_id` together
        (instruct checkpoints often list the chat end token only in generation_config.json, base checkpoints only
        in config.json). Only when neither names one does the tokenizer's `eos_token` count."""
        ids = _id_list(model_config.get("eos_token_id"), "config.json")
        ids += _id_list(generation_config.get("eos_token_id"), "generation_config.json")
        if not ids and "eos_token" in self.special_tokens_map:
            found = self._tok.token_to_id(self.special_tokens_map["eos_token"])
            if found is not None:
                ids.append(found)
        return tuple(dict.fromkeys(ids))

    # --- vocabulary ---------------------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer knows, added tokens included (a model's embedding table may be larger)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    @cached_property
    def _byte_table(self) -> list[bytes]:
        """Raw bytes of every id: added tokens are their content as UTF-8, vocabulary tokens map back through
        the byte-level alphabet."""
        vocab = self._tok.get_vocab(with_added_tokens=True)
        table = [b""] * (max(vocab.values(), default=-1) + 1)
        for tok, i in vocab.items():
            if i in self._added:
                table[i] = self._added[i].content.encode("utf-8")
            else:
                table[i] = b"".join(bytes([_UNICODE_TO_BYTE[c]]) if c in _UNICODE_TO_BYTE else c.encode("utf-8")
                                    for c in tok)
        return table

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes `token_id` decodes to (b"" for ids beyond the tokenizer's vocabulary)."""
        table = self._byte_table
        return table[token_id] if 0 <= token_id < len(table) else b""

    # --- text ---------------------------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Ids of `text`. Special-token strings in `text` (e.g. "<|im_end|>") become their ids, as in
        transformers; `add_special_tokens` applies the tokenizer's post-processor (a BOS, for models that use one).
        """
        if not isinstance(text, str):
            raise StrataError(f"text to encode must be a string, got {type(text).__name__}")
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids`; invalid UTF-8 (a character cut off by the end of `ids`) becomes U+FFFD."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)
