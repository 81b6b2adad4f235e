"""The tokenizer of a model: `tokenizer.json` run by the `tokenizers` library, plus what the model files around it
say about special tokens and end-of-sequence ids; or, for a GGUF file, the same tokenizer rebuilt from its
`tokenizer.ggml.*` metadata, so that a GGUF file alone is a complete model.

`tokenizer.json` is used exactly as written (normalizer, split regex, byte-level BPE). transformers 5 instead
rebuilds some tokenizer classes from the vocabulary with a class-defined pre-tokenizer (its `Qwen2Tokenizer`
uses the Qwen2 split regex, which lacks the `\\p{M}` combining-mark classes of the Qwen3.5 regex in the file);
the file is what llama.cpp and the model's training used, so it is the one strata follows.

A GGUF file carries the vocabulary (`tokenizer.ggml.tokens`), the token types, the BPE merges and the name of the
pre-tokenizer (`tokenizer.ggml.pre`), but not the pipeline around them. `Tokenizer.from_gguf` writes the
tokenizer.json that the Hugging Face tokenizer of that family has (byte-level BPE, NFC normalizer, the family's
split regex, ByteLevel decoder) and runs it like any other, so both sources give the same ids. Only the
tokenizer models and pre-tokenizers whose pipeline is known exactly are accepted (`GGUF_PRE_TOKENIZERS`); any other
is refused by name rather than approximated, because a near miss tokenizes most text right and some text wrong.
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


# --- GGUF metadata -> tokenizer.json -------------------------------------------------------------------------------

# The pre-tokenizer split regex of each supported `tokenizer.ggml.pre`, as the family's tokenizer.json writes it
# (transformers' Qwen2Tokenizer / Qwen3_5Tokenizer build the same; llama.cpp's llama-vocab.cpp keeps these as the
# "original regex from tokenizer.json" of LLAMA_VOCAB_PRE_TYPE_QWEN2 / _QWEN35, spelling the case-insensitive
# contractions out for its own regex engine). qwen35 differs from qwen2 only in the `\p{M}` classes: combining
# marks stay with their letters and out of punctuation runs.
GGUF_PRE_TOKENIZERS: dict[str, str] = {
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
             r"\s+(?!\S)|\s+",
    "qwen35": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|"
              r"\s*[\r\n]+|\s+(?!\S)|\s+",
}
# `tokenizer.ggml.model` values strata can run: "gpt2" is llama.cpp's name for byte-level BPE.
GGUF_TOKENIZER_MODELS = ("gpt2",)

# llama.cpp's token types (`llama_token_type`, the values of tokenizer.ggml.token_type).
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6
_TOKEN_TYPE_NAMES = {0: "UNDEFINED", 1: "NORMAL", 2: "UNKNOWN", 3: "CONTROL", 4: "USER_DEFINED", 5: "UNUSED",
                     6: "BYTE"}

# Named special tokens -> the GGUF key holding the id (llama.cpp's spelling, "seperator" included).
_GGUF_SPECIAL_KEYS = {
    "bos_token": "tokenizer.ggml.bos_token_id", "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id", "sep_token": "tokenizer.ggml.seperator_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id", "cls_token": "tokenizer.ggml.cls_token_id",
    "mask_token": "tokenizer.ggml.mask_token_id",
}
# The keys naming ids that end generation: end of sequence, of turn, of message (llama.cpp reads the same; it also
# guesses more end tokens from their text, e.g. "<|endoftext|>", which strata does not: only what the file states).
_GGUF_EOS_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")


def _gguf_list(md: dict[str, Any], key: str, kind: type, where: str) -> list[Any]:
    """A required array of `kind` from GGUF metadata, or a StrataError naming the key."""
    value = md.get(key)
    if value is None:
        raise StrataError(f"{where}: {key} is missing; a byte-level BPE tokenizer needs it")
    if not isinstance(value, list) or not all(isinstance(v, kind) and not isinstance(v, bool) for v in value):
        raise StrataError(f"{where}: {key} must be an array of {kind.__name__}")
    return value


def _gguf_flag(md: dict[str, Any], key: str, where: str) -> bool:
    value = md.get(key, False)
    if not isinstance(value, bool):
        raise StrataError(f"{where}: {key} must be a boolean, got {value!r}")
    return value


def _gguf_id(md: dict[str, Any], key: str, n_tokens: int, where: str) -> int | None:
    """A token id from GGUF metadata (None when absent); an id outside the vocabulary is an error, not skipped,
    since a wrong end-of-sequence id would silently change where generation stops."""
    value = md.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < n_tokens:
        raise StrataError(f"{where}: {key} = {value!r} is not a token id of its {n_tokens}-token vocabulary")
    return value


def gguf_tokenizer_files(md: dict[str, Any], where: str) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(tokenizer.json, tokenizer_config.json, config.json) contents equivalent to a GGUF's `tokenizer.ggml.*`
    metadata, for `Tokenizer` to run.

    How the GGUF was made (llama.cpp's converter, `get_vocab_base`): every id below the vocabulary size is listed;
    ids the HF tokenizer lacked are `[PAD<i>]` UNUSED entries, added tokens marked special are CONTROL, other added
    tokens USER_DEFINED, the rest NORMAL. The inverse: NORMAL, CONTROL and USER_DEFINED tokens form the BPE
    vocabulary at their GGUF ids; CONTROL and USER_DEFINED are also added tokens (matched in text before the BPE,
    special or not); UNUSED ids stay unknown, as they are in the HF tokenizer. Added tokens are listed in the
    vocabulary too because the `tokenizers` library numbers added tokens that are not in it by their order,
    ignoring the ids written beside them.
    """
    model = md.get("tokenizer.ggml.model")
    if model is None:
        raise StrataError(f"{where} has no tokenizer (no tokenizer.ggml.model); give the folder with the model's "
                          "tokenizer.json (--tokenizer DIR, LLM(tokenizer=...))")
    if model not in GGUF_TOKENIZER_MODELS:
        raise StrataError(f"{where}: tokenizer.ggml.model = {model!r} is not supported; strata runs byte-level BPE "
                          f"tokenizers ({', '.join(repr(m) for m in GGUF_TOKENIZER_MODELS)}); give the model's "
                          "tokenizer.json folder with --tokenizer DIR instead")
    pre = md.get("tokenizer.ggml.pre")
    if pre not in GGUF_PRE_TOKENIZERS:
        shown = "missing" if pre is None else f"{pre!r}"
        raise StrataError(f"{where}: pre-tokenizer tokenizer.ggml.pre = {shown} is not supported (strata knows "
                          f"{', '.join(repr(p) for p in GGUF_PRE_TOKENIZERS)}); give the model's tokenizer.json "
                          "folder with --tokenizer DIR instead")
    tokens = _gguf_list(md, "tokenizer.ggml.tokens", str, where)
    types = _gguf_list(md, "tokenizer.ggml.token_type", int, where)
    merges_raw = _gguf_list(md, "tokenizer.ggml.merges", str, where)
    if len(types) != len(tokens):
        raise StrataError(f"{where}: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")

    vocab: dict[str, int] = {}
    added: list[dict[str, Any]] = []
    for i, (text, kind) in enumerate(zip(tokens, types)):
        if kind == TOKEN_UNUSED:
            continue
        if kind not in (TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED):
            raise StrataError(f"{where}: token {i} ({text!r}) has type {kind} "
                              f"({_TOKEN_TYPE_NAMES.get(kind, 'unknown')}), which a byte-level BPE vocabulary does "
                              "not have")
        if text in vocab:
            raise StrataError(f"{where}: token {text!r} appears twice (ids {vocab[text]} and {i}); its id would be "
                              "ambiguous")
        vocab[text] = i
        if kind != TOKEN_NORMAL:
            added.append({"id": i, "content": text, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": kind == TOKEN_CONTROL})
    merges = []
    for m in merges_raw:
        cut = m.find(" ", 1)  # as llama.cpp splits them: the first space after the first character
        if cut < 0:
            raise StrataError(f"{where}: BPE merge {m!r} is not two tokens separated by a space")
        merges.append([m[:cut], m[cut + 1:]])

    n = len(tokens)
    specials = {attr: _gguf_id(md, key, n, where) for attr, key in _GGUF_SPECIAL_KEYS.items()}
    eos = [i for i in (_gguf_id(md, key, n, where) for key in _GGUF_EOS_KEYS) if i is not None]
    # Absent means no: llama.cpp's default for these BPE vocabularies, and Qwen's HF tokenizers add no BOS.
    add_bos = _gguf_flag(md, "tokenizer.ggml.add_bos_token", where)
    add_eos = _gguf_flag(md, "tokenizer.ggml.add_eos_token", where)
    post_processor = None
    if add_bos or add_eos:
        # llama.cpp puts the BOS before and the EOS after the text; as transformers' template for such tokenizers.
        used = [attr for flag, attr in ((add_bos, "bos_token"), (add_eos, "eos_token")) if flag]
        for attr in used:
            if specials[attr] is None:
                raise StrataError(f"{where}: tokenizer.ggml.add_{attr} is set but the file names no {attr} id")

        def piece(seq: str, type_id: int) -> list[dict[str, Any]]:
            out: list[dict[str, Any]] = [{"Sequence": {"id": seq, "type_id": type_id}}]
            if add_bos:
                out.insert(0, {"SpecialToken": {"id": tokens[specials["bos_token"]], "type_id": type_id}})
            if add_eos:
                out.append({"SpecialToken": {"id": tokens[specials["eos_token"]], "type_id": type_id}})
            return out

        post_processor = {
            "type": "TemplateProcessing", "single": piece("A", 0), "pair": piece("A", 0) + piece("B", 1),
            "special_tokens": {tokens[specials[a]]: {"id": tokens[specials[a]], "ids": [specials[a]],
                                                     "tokens": [tokens[specials[a]]]} for a in used},
        }

    tokenizer_json = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": GGUF_PRE_TOKENIZERS[pre]}, "behavior": "Isolated",
             "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]},
        "post_processor": post_processor,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": merges},
    }
    from strata.text.chat import templates_from_gguf

    tokenizer_config: dict[str, Any] = {attr: tokens[i] for attr, i in specials.items() if i is not None}
    tokenizer_config.update(add_bos_token=add_bos, add_eos_token=add_eos)
    templates = templates_from_gguf(md, where)
    if templates:
        tokenizer_config["chat_template"] = templates
    return tokenizer_json, tokenizer_config, {"eos_token_id": list(dict.fromkeys(eos))}


class Tokenizer:
    """Text <-> ids for one model, with the special tokens and EOS ids the rest of strata needs.

    Build it with `Tokenizer.from_model(path)` (a model folder or a GGUF file), or `from_dir` / `from_gguf` to pick
    the source. `token_bytes(id)` gives the raw bytes a token stands for, which is what streaming needs: byte-level
    BPE splits multi-byte characters across tokens, so text can only be produced once a character's bytes are
    complete (see strata.text.detok). `gguf` is the GGUF file the tokenizer was read from (None for tokenizer.json);
    `config` holds what tokenizer_config.json would (named special tokens, `chat_template`) for either source.
    """

    def __init__(self, folder: Path, tokenizer_json: dict[str, Any], tokenizer_config: dict[str, Any],
                 model_config: dict[str, Any], generation_config: dict[str, Any], *, gguf: Path | None = None):
        from tokenizers import Tokenizer as HFTokenizer

        self.folder = folder
        self.gguf = gguf
        self.config = tokenizer_config
        origin = gguf if gguf is not None else folder / "tokenizer.json"
        try:
            self._tok = HFTokenizer.from_str(json.dumps(tokenizer_json))
        except Exception as e:  # noqa: BLE001  (the tokenizers library raises bare Exceptions for bad files)
            raise StrataError(f"{origin} is not a usable tokenizer: {e}") from None
        if not _is_byte_level(tokenizer_json.get("decoder")):
            kind = (tokenizer_json.get("decoder") or {}).get("type")
            raise StrataError(f"{origin}: decoder {kind!r} is not supported; strata streams "
                              "byte-level BPE tokenizers (decoder type ByteLevel), the qwen4_exp family's kind")
        self._added = dict(self._tok.get_added_tokens_decoder())
        self.special_ids: frozenset[int] = frozenset(i for i, t in self._added.items() if t.special)
        self.special_tokens_map = self._named_special_tokens(tokenizer_config)
        self.eos_ids = self._eos_ids(model_config, generation_config)

    @classmethod
    def from_model(cls, path: str | Path) -> Tokenizer:
        """The tokenizer of whatever `path` names: a folder (or a file inside one) -> its tokenizer.json; a GGUF
        file or any part of a split set -> its own `tokenizer.ggml.*` metadata, or, for a GGUF without them, the
        tokenizer.json beside it."""
        from strata.weights.loader import is_gguf

        path = Path(path)
        if not path.exists():
            raise StrataError(f"model path {path} does not exist")
        if path.is_file() and is_gguf(path):
            from strata.weights.gguf import open_gguf

            gset = open_gguf(path)
            if "tokenizer.ggml.model" in gset.metadata or not (path.parent / "tokenizer.json").is_file():
                return cls._from_gguf_metadata(gset.metadata, gset.path)
        return cls.from_dir(path)

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        """The tokenizer a GGUF file (or any part of a split set) describes in its `tokenizer.ggml.*` metadata;
        see `gguf_tokenizer_files` for what is supported."""
        from strata.weights.gguf import open_gguf

        path = Path(path)
        if not path.exists():
            raise StrataError(f"model path {path} does not exist")
        gset = open_gguf(path)
        return cls._from_gguf_metadata(gset.metadata, gset.path)

    @classmethod
    def _from_gguf_metadata(cls, metadata: dict[str, Any], path: Path) -> Tokenizer:
        """Built like a folder's tokenizer, from the equivalent files; the folder is the GGUF's, but nothing in it
        is read (the file is the whole model)."""
        tokenizer_json, tokenizer_config, model_config = gguf_tokenizer_files(metadata, str(path))
        return cls(path.parent, tokenizer_json, tokenizer_config, model_config, {}, gguf=path)

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
