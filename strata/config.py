"""Typed, validated geometry of a qwen4_exp text model.

`ModelConfig` is built once, at the edge, from an HF `config.json` (either the `qwen4_exp` layout with a
`text_config` or a bare `qwen4_exp_text`) or from GGUF metadata. It applies every validation rule of the
reference config (spec 1.3) and precomputes the derived quantities (layer kinds, PLE primes/offsets/hash
multipliers, selection width) so nothing downstream re-derives them.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from strata.errors import StrataError

LINEAR = "linear_attention"
INDEXED = "indexed_attention"

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


class ConfigError(StrataError, ValueError):
    """An invalid or unsupported model configuration; the message names the field and the rule."""


def splitmix64(value: int) -> int:
    """One splitmix64 step, every operation mod 2**64 (spec 7.3)."""
    z = (value + _GOLDEN) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & _MASK64


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    return all(n % d for d in range(3, math.isqrt(n) + 1, 2))


def _primes_from(base: int, count: int) -> list[int]:
    """The `count` smallest primes >= base (the reference searches from base-1 upward)."""
    out: list[int] = []
    p = base - 1
    while len(out) < count:
        p += 1
        while not _is_prime(p):
            p += 1
        out.append(p)
    return out


@dataclass(frozen=True)
class PLEGeometry:
    """Derived hashing geometry of one PLE layer."""

    layer: int  # 0-based decoder layer index
    ple_index: int  # rank in the sorted ple_layer_ids
    primes: tuple[int, ...]
    offsets: tuple[int, ...]
    rows: int  # padded table rows
    multipliers: tuple[int, ...]


@dataclass(frozen=True)
class ModelConfig:
    """The geometry of a qwen4_exp text model. Field names follow the HF config."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    linear_conv_kernel_dim: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    hc_count: int
    hc_lowrank: int
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    output_gate_type: str | None = None
    norm_topk_prob: bool = True
    attention_bias: bool = False
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 1.0
    rope_type: str = "default"
    ple_layer_ids: tuple[int, ...] = ()
    ple_embed_dim: int | None = None
    ple_conv_kernel_size: int = 4
    ngram_size: int = 3
    heads_per_ngram: int = 8
    ngram_vocab_size_base: int = 20_000_000
    make_ngram_vocab_size_divisible_by: int = 128
    seed: int = 1234
    split_ngram_parts: int = 512
    indexer_n_heads: int | None = None
    indexer_kv_heads: int | None = None
    indexer_head_dim: int | None = None
    indexer_budget: int | None = None
    indexer_compress_ratio: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768
    torch_dtype: str = "bfloat16"
    # PLE tables and hash constants may be given explicitly (GGUF stores them); else derived.
    ple_overrides: dict[int, PLEGeometry] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        self.validate()

    # ------------------------------------------------------------------ validation (spec 1.3)
    def validate(self) -> None:
        def fail(fieldname: str, rule: str) -> None:
            raise ConfigError(f"invalid config: {fieldname}: {rule}")

        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "linear_conv_kernel_dim", "linear_key_head_dim",
                     "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads", "hc_lowrank"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                fail(name, f"must be a positive integer, got {v!r}")
        if len(self.layer_types) != self.num_hidden_layers:
            fail("layer_types", f"has {len(self.layer_types)} entries but num_hidden_layers is "
                                f"{self.num_hidden_layers}")
        bad = sorted(set(self.layer_types) - {LINEAR, INDEXED})
        if bad:
            fail("layer_types", f"unsupported layer types {bad}; allowed: {LINEAR!r}, {INDEXED!r} "
                                f"(and {', '.join(map(repr, _INDEXED_ALIASES))}, read as indexed)")
        if self.gdn_gate_act not in ("sigmoid", "silu"):
            fail("output_gate_type", f"(or hidden_act) must be 'sigmoid' or 'silu', got {self.gdn_gate_act!r}")
        if self.hidden_act not in ("silu", "sigmoid"):
            fail("hidden_act", f"must be 'silu' or 'sigmoid', got {self.hidden_act!r}")
        if self.hc_count <= 1:
            fail("hc_count", f"must be > 1, got {self.hc_count}")
        if self.num_experts <= 0:
            fail("num_experts", f"must be > 0, got {self.num_experts}")
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            fail("num_experts_per_tok", f"must be in [1, num_experts={self.num_experts}], "
                                        f"got {self.num_experts_per_tok}")
        if self.moe_intermediate_size <= 0:
            fail("moe_intermediate_size", f"must be > 0, got {self.moe_intermediate_size}")
        if self.shared_expert_intermediate_size <= 0:
            fail("shared_expert_intermediate_size", f"must be > 0, got {self.shared_expert_intermediate_size}")
        if self.num_attention_heads % self.num_key_value_heads:
            fail("num_attention_heads", f"({self.num_attention_heads}) must be a multiple of "
                                        f"num_key_value_heads ({self.num_key_value_heads})")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            fail("linear_num_value_heads", f"({self.linear_num_value_heads}) must be a multiple of "
                                           f"linear_num_key_heads ({self.linear_num_key_heads})")
        if self.rope_type != "default":
            fail("rope_parameters.rope_type", f"only 'default' is supported, got {self.rope_type!r}")
        if not 0 < self.partial_rotary_factor <= 1:
            fail("rope_parameters.partial_rotary_factor", f"must be in (0, 1], got {self.partial_rotary_factor}")
        if self.rotary_dim % 2:
            fail("rope_parameters.partial_rotary_factor", f"gives an odd rotary dim {self.rotary_dim}")
        qsa = {n: getattr(self, n) for n in ("indexer_n_heads", "indexer_kv_heads", "indexer_head_dim",
                                              "indexer_budget", "indexer_compress_ratio")}
        if any(v is not None for v in qsa.values()):
            missing = [n for n, v in qsa.items() if v is None]
            if missing:
                fail(missing[0], f"QSA config is missing required fields {missing}")
            for n, v in qsa.items():
                if v <= 0:
                    fail(n, f"QSA values must be positive, got {v}")
            if self.indexer_kv_heads != 1:
                fail("indexer_kv_heads", f"must be 1, got {self.indexer_kv_heads}")
            if self.indexer_budget % self.indexer_compress_ratio:
                fail("indexer_budget", f"({self.indexer_budget}) must be divisible by indexer_compress_ratio "
                                       f"({self.indexer_compress_ratio})")
            if self.rotary_dim > self.indexer_head_dim:
                fail("indexer_head_dim", f"rotary dim {self.rotary_dim} (head_dim x partial_rotary_factor) "
                                         f"must be <= indexer_head_dim {self.indexer_head_dim}")
        elif INDEXED in self.layer_types:
            fail("indexer_n_heads", "indexed attention layers need the five indexer_* fields")
        if self.ple_layer_ids:
            if self.ngram_heads <= 0:
                fail("heads_per_ngram", f"gives {self.ngram_heads} n-gram heads; must be positive")
            if self.ple_dim <= 0 or self.ple_dim % self.ngram_heads:
                fail("ple_embed_dim", f"({self.ple_dim}) must be positive and divisible by the number of n-gram "
                                      f"heads ({self.ngram_heads})")
            bad_ids = [i for i in self.ple_layer_ids if i < 1 or i > self.num_hidden_layers]
            if bad_ids:
                fail("ple_layer_ids", f"must be 1-indexed ids in [1, {self.num_hidden_layers}], got {bad_ids}")
            bad_kind = [i for i in self.ple_layer_ids if self.layer_types[i - 1] != LINEAR]
            if bad_kind:
                fail("ple_layer_ids", f"PLE is only supported on linear_attention layers, got layers {bad_kind}")
            if self.ple_eos is None:
                fail("eos_token_id", "must be set when PLE layers are enabled")
            if self.ngram_size < 2:
                fail("ngram_size", f"must be >= 2, got {self.ngram_size}")
        for name in ("eos_token_id",):
            for t in self.eos_ids:
                if not 0 <= t < self.vocab_size:
                    fail(name, f"id {t} is outside the vocabulary [0, {self.vocab_size})")

    # ------------------------------------------------------------------ derived quantities
    @property
    def gdn_gate_act(self) -> str:
        return self.output_gate_type or self.hidden_act

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def eos_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int):
            return (self.eos_token_id,)
        return tuple(self.eos_token_id)

    @property
    def ple_eos(self) -> int | None:
        """The EOS id used by the n-gram hash: the first one when a list is given."""
        ids = self.eos_ids
        return ids[0] if ids else None

    @property
    def ple_dim(self) -> int:
        return self.hidden_size if self.ple_embed_dim is None else self.ple_embed_dim

    @property
    def ngram_heads(self) -> int:
        return (self.ngram_size - 1) * self.heads_per_ngram

    @property
    def ple_head_dim(self) -> int:
        return self.ple_dim // self.ngram_heads

    @property
    def hc_dim(self) -> int:
        return self.hc_count * self.hidden_size

    @property
    def gdn_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def gdn_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def gdn_conv_dim(self) -> int:
        return 2 * self.gdn_key_dim + self.gdn_value_dim

    @property
    def block_topk(self) -> int:
        return self.indexer_budget // self.indexer_compress_ratio

    @property
    def selection_width(self) -> int:
        """Most tokens one query can attend to on a QSA layer."""
        return self.indexer_budget + self.indexer_compress_ratio - 1

    @property
    def ple_conv_state_len(self) -> int:
        return (self.ple_conv_kernel_size - 1) * self.ngram_size

    def is_linear(self, layer: int) -> bool:
        return self.layer_types[layer] == LINEAR

    def has_ple(self, layer: int) -> bool:
        return (layer + 1) in self.ple_layer_ids

    @cached_property
    def ple(self) -> dict[int, PLEGeometry]:
        """PLE hashing geometry per 0-based decoder layer."""
        out: dict[int, PLEGeometry] = {}
        for rank, layer_id in enumerate(self.ple_layer_ids):
            layer = layer_id - 1
            if layer in self.ple_overrides:
                out[layer] = self.ple_overrides[layer]
                continue
            all_primes = _primes_from(self.ngram_vocab_size_base, (rank + 1) * self.ngram_heads)
            primes = tuple(all_primes[rank * self.ngram_heads:])
            offsets = tuple(sum(primes[:j]) for j in range(len(primes)))
            div = self.make_ngram_vocab_size_divisible_by
            rows = math.ceil(sum(primes) / div) * div
            out[layer] = PLEGeometry(layer, rank, primes, offsets, rows,
                                     tuple(ple_multipliers(self.vocab_size, self.ngram_size, rank, self.seed)))
        return out

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Build from a parsed HF config.json (qwen4_exp with text_config, or qwen4_exp_text)."""
        if not isinstance(raw, dict):
            raise ConfigError("invalid config: config.json must hold a JSON object")
        model_type = raw.get("model_type")
        if model_type == "qwen4_exp" or "text_config" in raw:
            text = raw.get("text_config")
            if not isinstance(text, dict):
                raise ConfigError("invalid config: text_config: a qwen4_exp config needs a text_config object")
            merged = dict(text)
            for key in ("eos_token_id", "pad_token_id", "bos_token_id", "tie_word_embeddings"):
                if key not in merged and key in raw:
                    merged[key] = raw[key]
            raw = merged
            model_type = raw.get("model_type", "qwen4_exp_text")
        if model_type not in (None, "qwen4_exp_text"):
            raise ConfigError(f"invalid config: model_type: expected 'qwen4_exp' or 'qwen4_exp_text', "
                              f"got {model_type!r}")
        d = _HF_DEFAULTS | {k: v for k, v in raw.items() if v is not None or k in _NULLABLE}
        n_layers = d["num_hidden_layers"]
        layer_types = d.get("layer_types")
        if layer_types is None:
            interval = d.get("full_attention_interval", 4)
            if not isinstance(interval, int) or interval <= 0:
                raise ConfigError(f"invalid config: full_attention_interval: must be a positive integer, "
                                  f"got {interval!r}")
            layer_types = [LINEAR if (i + 1) % interval else INDEXED for i in range(n_layers)]
        if not isinstance(layer_types, list | tuple):
            raise ConfigError(f"invalid config: layer_types: must be a list, got {type(layer_types).__name__}")
        layer_types = tuple(INDEXED if t in _INDEXED_ALIASES else t for t in layer_types)
        rope = d.get("rope_parameters") or {}
        if not isinstance(rope, dict):
            raise ConfigError("invalid config: rope_parameters: must be an object")
        rope_theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
        prf = rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
        eos = d.get("eos_token_id")
        if isinstance(eos, list):
            if not eos:
                eos = None
            else:
                eos = tuple(eos)
        ple_ids = d.get("ple_layer_ids") or []
        if not isinstance(ple_ids, list | tuple) or not all(isinstance(i, int) for i in ple_ids):
            raise ConfigError(f"invalid config: ple_layer_ids: must be a list of integers, got {ple_ids!r}")
        kwargs: dict[str, Any] = {}
        for name in _INT_FIELDS:
            v = d.get(name)
            if v is None and name in _OPTIONAL_INT:
                kwargs[name] = None
                continue
            if not isinstance(v, int) or isinstance(v, bool):
                raise ConfigError(f"invalid config: {name}: must be an integer, got {v!r}")
            kwargs[name] = v
        try:
            return cls(
                **kwargs,
                layer_types=layer_types,
                rms_norm_eps=float(d["rms_norm_eps"]),
                hidden_act=str(d["hidden_act"]),
                output_gate_type=d.get("output_gate_type"),
                norm_topk_prob=bool(d["norm_topk_prob"]),
                attention_bias=bool(d["attention_bias"]),
                rope_theta=float(rope_theta),
                partial_rotary_factor=float(prf),
                rope_type=str(rope.get("rope_type", rope.get("type", "default"))),
                ple_layer_ids=tuple(sorted(set(ple_ids))),
                eos_token_id=eos,
                tie_word_embeddings=bool(d["tie_word_embeddings"]),
                torch_dtype=str(d.get("dtype") or d.get("torch_dtype") or "bfloat16"),
            )
        except (TypeError, ValueError) as e:
            if isinstance(e, ConfigError):
                raise
            raise ConfigError(f"invalid config: {e}") from e

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ConfigError(f"no config.json at {path}")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"invalid config: {path} is not valid JSON ({e})") from e
        return cls.from_hf_dict(raw)

    def to_hf_dict(self) -> dict[str, Any]:
        """The `qwen4_exp_text` config.json this geometry corresponds to."""
        d: dict[str, Any] = {"model_type": "qwen4_exp_text", "architectures": ["Qwen4ExpForCausalLM"]}
        for name in _INT_FIELDS:
            d[name] = getattr(self, name)
        d.update(
            layer_types=["full_attention" if t == INDEXED else t for t in self.layer_types],
            rms_norm_eps=self.rms_norm_eps, hidden_act=self.hidden_act, output_gate_type=self.output_gate_type,
            norm_topk_prob=self.norm_topk_prob, attention_bias=self.attention_bias,
            rope_parameters={"rope_type": self.rope_type, "rope_theta": self.rope_theta,
                             "partial_rotary_factor": self.partial_rotary_factor},
            ple_layer_ids=list(self.ple_layer_ids),
            eos_token_id=list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id,
            tie_word_embeddings=self.tie_word_embeddings, dtype=self.torch_dtype,
        )
        return d


def ple_multipliers(vocab_size: int, ngram_size: int, ple_index: int, seed: int) -> list[int]:
    """Hash multipliers M_0..M_{n-1} of one PLE layer (spec 7.3)."""
    half = max(1, ((1 << 63) - 1) // max(vocab_size, 1) // 2)
    base = seed + 10007 * ple_index
    return [2 * (splitmix64((base + _GOLDEN * (i + 1)) & _MASK64) % half) + 1 for i in range(ngram_size)]


# Spellings of the QSA layer type in released checkpoints ("full_attention") and in earlier versions of the
# reference (same math, other names: spec 1.3).
_INDEXED_ALIASES = ("full_attention", "qwen_sparse_attention", "deepseek_sparse_attention")

_HF_DEFAULTS: dict[str, Any] = dict(
    vocab_size=248320, hidden_size=2048, num_hidden_layers=40, num_attention_heads=16, num_key_value_heads=2,
    head_dim=256, hidden_act="silu", rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False,
    linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
    linear_num_value_heads=32, moe_intermediate_size=512, shared_expert_intermediate_size=512,
    num_experts_per_tok=10, num_experts=512, hc_count=4, hc_lowrank=320, ple_conv_kernel_size=4, ngram_size=3,
    heads_per_ngram=8, ngram_vocab_size_base=20_000_000, make_ngram_vocab_size_divisible_by=128, seed=1234,
    split_ngram_parts=512, norm_topk_prob=True, max_position_embeddings=32768,
)
_NULLABLE = {"output_gate_type", "eos_token_id", "pad_token_id", "bos_token_id", "ple_embed_dim",
             "indexer_n_heads", "indexer_kv_heads", "indexer_head_dim", "indexer_budget", "indexer_compress_ratio"}
_OPTIONAL_INT = {"ple_embed_dim", "indexer_n_heads", "indexer_kv_heads", "indexer_head_dim", "indexer_budget",
                 "indexer_compress_ratio", "pad_token_id", "bos_token_id"}
_INT_FIELDS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
    "linear_num_value_heads", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
    "shared_expert_intermediate_size", "hc_count", "hc_lowrank", "ple_embed_dim", "ple_conv_kernel_size",
    "ngram_size", "heads_per_ngram", "ngram_vocab_size_base", "make_ngram_vocab_size_divisible_by", "seed",
    "split_ngram_parts", "indexer_n_heads", "indexer_kv_heads", "indexer_head_dim", "indexer_budget",
    "indexer_compress_ratio", "pad_token_id", "bos_token_id", "max_position_embeddings",
)
