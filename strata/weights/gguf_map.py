"""llama.cpp's `qwen4exp` GGUF layout mapped onto strata's canonical names, conventions and geometry.

Names: `token_embd`, `output`, `output_hc_*` (the final hyper-connection mixer, which replaces the output norm),
`blk.N.*` per layer and one global `per_layer_token_embd` (the PLE n-gram table, no `blk.` prefix). The table
below is the single source of truth for both directions (reader and writer).

Converter transforms (llama.cpp `conversion/qwen4exp.py` + `qwen.py`) and how each is honoured:
* `1 + w` folded into every Gemma-style norm (`hc_*_norm`, `attn_{q,k}_norm`, `indexer.{q,k}_norm`,
  `ple_norm_*`): that is the canonical form, used as is. `ssm_norm` (the GDN gated norm) is plain w, also
  canonical.
* `ssm_a` = -exp(A_log): canonical `gdn.A`, used as is.
* GDN value heads reordered from grouped (value head j belongs to key head j // (nv/nk)) to tiled order
  (key head j % nk): in the rows of the V part of `attn_qkv`, of `attn_gate`, `ssm_alpha`, `ssm_beta`, in `ssm_a`,
  `ssm_dt`, the V channels of `ssm_conv1d` and the input columns of `ssm_out`. Every one of those is consistent
  with itself, so strata reads them unchanged and sets `Weights.gdn_value_order = "tiled"` (the model then pairs
  value head j with key head j % nk). tests/test_gguf_model.py shows the fixture needs exactly this reading.
* `index_qk_proj` split into `indexer.q_proj` / `indexer.k_proj`: the canonical `idx.q` / `idx.k`.
* Conv weights squeezed to ne = {kernel, channels}: torch shape (channels, kernel), the canonical (C, K).
* `ffn_gate_inp_shexp` ne = {hidden, 1}: torch (1, H), canonical; a 1-D {hidden} (what llama.cpp's loader
  declares) is reshaped. Other 1-D tensors stored 2-D (llama.cpp accepts norms as {n_embd, hc}) are reshaped too.
* The PLE shards concatenated into `per_layer_token_embd` ({d_e, rows}): the canonical `L{i}.ple.table` of the
  one PLE layer. llama.cpp stores one table and one set of hash constants (its loader refuses more than one PLE
  layer), so a file listing several PLE layers is refused.
* The hash constants are metadata (`qwen4exp.ple.{layer_multipliers,head_offsets,head_vocab_sizes}`, UINT64):
  passed to the config as `ple_overrides`, after checking they equal what the config derives (primes from the
  first head size, multipliers from seed 1234 and the vocabulary); a disagreement is an error naming the key.
* `ple.eos_token_id` is the converter's choice (the LAST entry of a list-valued eos_token_id; transformers'
  hash uses the FIRST). The file has no other record of the list, so strata hashes with the id the file gives.
* `compress_ratios`: see `_qsa_ratio` (the all-zero "converter quirk").
* MTP (NextN) blocks past the trunk (`nextn_predict_layers`) are not part of the text model and are skipped.
"""

from __future__ import annotations

import re
import warnings
from typing import Any

import numpy as np
import torch

from strata.config import INDEXED, LINEAR, ConfigError, ModelConfig, PLEGeometry
from strata.weights.gguf import FLOAT_TYPES, KEY_ARCH, GGUFError, GGUFSet, GGUFWarning
from strata.weights.quant_tensor import QuantTensor
from strata.weights.schema import Weights, expected_shapes
from strata.weights.tensor import DenseTensor, StoredTensor

ARCH = "qwen4exp"

# canonical name (no layer prefix) -> GGUF name
GLOBAL_NAMES = {
    "embed": "token_embd.weight",
    "head": "output.weight",
    "final.norm": "output_hc_norm.weight",
    "final.down": "output_hc_down.weight",
    "final.up": "output_hc_up.weight",
}
PLE_TABLE = "per_layer_token_embd.weight"
# canonical suffix (after "L{i}.") -> GGUF suffix (after "blk.{i}.")
LAYER_NAMES = {
    "gdn.qkv": "attn_qkv.weight", "gdn.z": "attn_gate.weight", "gdn.b": "ssm_beta.weight",
    "gdn.a": "ssm_alpha.weight", "gdn.conv": "ssm_conv1d.weight", "gdn.dt_bias": "ssm_dt.bias", "gdn.A": "ssm_a",
    "gdn.norm": "ssm_norm.weight", "gdn.out": "ssm_out.weight",
    "attn.q": "attn_q.weight", "attn.k": "attn_k.weight", "attn.v": "attn_v.weight", "attn.o": "attn_output.weight",
    "attn.q_bias": "attn_q.bias", "attn.k_bias": "attn_k.bias", "attn.v_bias": "attn_v.bias",
    "attn.o_bias": "attn_output.bias", "attn.q_norm": "attn_q_norm.weight", "attn.k_norm": "attn_k_norm.weight",
    "idx.q": "indexer.q_proj.weight", "idx.k": "indexer.k_proj.weight", "idx.q_norm": "indexer.q_norm.weight",
    "idx.k_norm": "indexer.k_norm.weight",
    "moe.router": "ffn_gate_inp.weight", "moe.gate_exps": "ffn_gate_exps.weight", "moe.up_exps": "ffn_up_exps.weight",
    "moe.down_exps": "ffn_down_exps.weight", "moe.sh_gate": "ffn_gate_shexp.weight",
    "moe.sh_up": "ffn_up_shexp.weight", "moe.sh_down": "ffn_down_shexp.weight",
    "moe.sh_gate_inp": "ffn_gate_inp_shexp.weight",
    "ple.key": "ple_key.weight", "ple.value": "ple_value.weight", "ple.norm_key": "ple_norm_key.weight",
    "ple.norm_query": "ple_norm_query.weight", "ple.norm_conv": "ple_norm_conv.weight",
    "ple.conv": "ple_conv1d.weight",
}
for _which in ("attn", "ffn"):
    for _part in ("norm", "down", "up", "inject"):
        LAYER_NAMES[f"hc_{_which}.{_part}"] = f"hc_{_which}_{_part}.weight"
FUSED_GATE_UP = "ffn_gate_up_exps.weight"  # gate rows then up rows (llama.cpp `create_tensor_gate_up_exps`)

_GLOBAL_TO_CANON = {v: k for k, v in GLOBAL_NAMES.items()}
_LAYER_TO_CANON = {v: k for k, v in LAYER_NAMES.items()}
_BLK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")

# The QSA block size of the released checkpoint (spec: budget 2048, "at most 3 extra tokens" = ratio - 1),
# used only for files whose compress_ratios were zeroed by the converter quirk (see `_qsa_ratio`).
RELEASED_COMPRESS_RATIO = 4


def gguf_name(canonical: str) -> str:
    """The GGUF tensor name of a canonical name."""
    if canonical in GLOBAL_NAMES:
        return GLOBAL_NAMES[canonical]
    layer, _, suffix = canonical.partition(".")
    if suffix == "ple.table":
        return PLE_TABLE
    return f"blk.{layer[1:]}.{LAYER_NAMES[suffix]}"


def _k(key: str) -> str:
    return f"{ARCH}.{key}"


class _Meta:
    """Typed access to the metadata, every failure a GGUFError naming the key."""

    def __init__(self, gset: GGUFSet):
        self.md = gset.metadata
        self.where = gset.describe()

    def fail(self, key: str, problem: str) -> GGUFError:
        return GGUFError(f"{self.where}: metadata {key!r} {problem}")

    def has(self, key: str) -> bool:
        return key in self.md

    def int(self, key: str, default: int | None = None, positive: bool = True) -> int:
        if key not in self.md:
            if default is None:
                raise self.fail(key, "is missing (required for a qwen4exp model)")
            return default
        v = self.md[key]
        if isinstance(v, list) and v and all(x == v[0] for x in v):  # a per-layer array with one value
            v = v[0]
        if not isinstance(v, int) or isinstance(v, bool):
            raise self.fail(key, f"must be an integer, got {_brief(v)}")
        if positive and v <= 0:
            raise self.fail(key, f"must be positive, got {v}")
        return v

    def float(self, key: str, default: float | None = None) -> float:
        if key not in self.md:
            if default is None:
                raise self.fail(key, "is missing (required for a qwen4exp model)")
            return default
        v = self.md[key]
        if not isinstance(v, int | float) or isinstance(v, bool) or not np.isfinite(v):
            raise self.fail(key, f"must be a finite number, got {_brief(v)}")
        # float32 in the file: take the shortest decimal that rounds to it (1e-06, not 9.99999997e-07)
        return float(str(np.float32(v)))

    def int_list(self, key: str, length: int | None = None) -> list[int]:
        if key not in self.md:
            raise self.fail(key, "is missing (required for a qwen4exp model)")
        v = self.md[key]
        if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
            raise self.fail(key, f"must be an array of integers, got {_brief(v)}")
        if length is not None and len(v) != length:
            raise self.fail(key, f"has {len(v)} entries, expected {length}")
        return list(v)

    def bool_list(self, key: str, length: int) -> list[bool]:
        v = self.md[key]
        if not isinstance(v, list) or not all(isinstance(x, bool | int) for x in v):
            raise self.fail(key, f"must be an array of booleans, got {_brief(v)}")
        if len(v) != length:
            raise self.fail(key, f"has {len(v)} entries, expected {length} (block_count)")
        return [bool(x) for x in v]


def _brief(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 60 else s[:57] + "..."


def _qsa_ratio(m: _Meta, layer_types: list[str], n_all: int) -> int | None:
    """The one QSA block size of the model from `compress_ratios` (entries of linear layers are ignored).

    The converter quirk (MANIFEST "Converter quirk"): converting under transformers >= 5 writes 0 for every layer,
    and llama.cpp then runs dense attention on the QSA layers. strata follows the reference model instead:
    QSA layers are sparse-attention layers whatever the file says, so a file whose ratios are all zero runs with
    the released checkpoint's ratio (`RELEASED_COMPRESS_RATIO`), with a GGUFWarning saying so (strata's
    output then differs from llama.cpp's on the same file once a sequence is longer than the indexer budget).
    """
    qsa = [i for i, t in enumerate(layer_types) if t == INDEXED]
    if not qsa:
        return None
    key = _k("attention.compress_ratios")
    if not m.has(key):
        raise m.fail(key, "is missing (required when the model has QSA layers)")
    v = m.md[key]
    ratios = [v] * n_all if isinstance(v, int) and not isinstance(v, bool) else m.int_list(key)
    if len(ratios) < len(layer_types):
        raise m.fail(key, f"has {len(ratios)} entries, expected {len(layer_types)}")
    used = sorted({ratios[i] for i in qsa})
    if used == [0]:
        warnings.warn(f"{m.where}: {key} is 0 on every QSA layer (layers {qsa}): this file was converted under "
                      "transformers >= 5, which loses the QSA block size (llama.cpp then runs dense attention on "
                      f"it). strata runs the reference sparse attention with compress ratio "
                      f"{RELEASED_COMPRESS_RATIO} (the released checkpoint's); set {key} to the model's ratio to "
                      "silence this", GGUFWarning, stacklevel=3)
        return RELEASED_COMPRESS_RATIO
    if len(used) != 1 or used[0] <= 0:
        raise m.fail(key, f"gives QSA layers {qsa} the ratios {[ratios[i] for i in qsa]}; strata needs one "
                          "positive ratio for all of them")
    return used[0]


def config_from_gguf(gset: GGUFSet) -> ModelConfig:
    """The ModelConfig described by a qwen4exp GGUF's metadata (and the shapes of two tensors)."""
    m = _Meta(gset)
    arch = gset.metadata.get(KEY_ARCH)
    if arch != ARCH:
        raise GGUFError(f"{m.where}: {KEY_ARCH} is {arch!r}; strata reads only {ARCH!r} models "
                        "(Qwen3.8-Flash-Next)")
    n_all = m.int(_k("block_count"))
    nextn = m.int(_k("nextn_predict_layers"), 0, positive=False)
    if nextn >= n_all:
        raise m.fail(_k("nextn_predict_layers"), f"= {nextn} leaves no trunk layers of block_count {n_all}")
    n_layers = n_all - nextn
    hidden = m.int(_k("embedding_length"))
    head_dim = m.int(_k("attention.key_length"))
    if m.int(_k("attention.value_length"), head_dim) != head_dim:
        raise m.fail(_k("attention.value_length"), f"must equal attention.key_length ({head_dim})")
    rot = m.int(_k("rope.dimension_count"), head_dim)
    prf = rot / head_dim
    if int(head_dim * prf) != rot:
        raise m.fail(_k("rope.dimension_count"), f"= {rot} is not a representable fraction of head dim {head_dim}")

    if m.has(_k("attention.recurrent_layers")):
        recurrent = m.bool_list(_k("attention.recurrent_layers"), n_all)
    else:
        interval = m.int(_k("full_attention_interval"), 4)
        recurrent = [(i + 1) % interval != 0 for i in range(n_all)]
    layer_types = [LINEAR if recurrent[i] else INDEXED for i in range(n_layers)]

    nv = m.int(_k("ssm.time_step_rank"))
    inner = m.int(_k("ssm.inner_size"))
    if inner % nv:
        raise m.fail(_k("ssm.inner_size"), f"= {inner} is not a multiple of ssm.time_step_rank ({nv})")

    kw: dict[str, Any] = {
        "hidden_size": hidden, "num_hidden_layers": n_layers,
        "num_attention_heads": m.int(_k("attention.head_count")),
        "num_key_value_heads": m.int(_k("attention.head_count_kv")), "head_dim": head_dim,
        "layer_types": tuple(layer_types), "linear_conv_kernel_dim": m.int(_k("ssm.conv_kernel")),
        "linear_key_head_dim": m.int(_k("ssm.state_size")), "linear_value_head_dim": inner // nv,
        "linear_num_key_heads": m.int(_k("ssm.group_count")), "linear_num_value_heads": nv,
        "num_experts": m.int(_k("expert_count")), "num_experts_per_tok": m.int(_k("expert_used_count")),
        "moe_intermediate_size": m.int(_k("expert_feed_forward_length")),
        "shared_expert_intermediate_size": m.int(_k("expert_shared_feed_forward_length")),
        "hc_count": m.int(_k("hyper_connection.count")), "hc_lowrank": m.int(_k("hyper_connection.low_rank")),
        "rms_norm_eps": m.float(_k("attention.layer_norm_rms_epsilon")),
        "hidden_act": "silu", "output_gate_type": "sigmoid",  # qwen4exp.cpp: SiLU experts, sigmoid GDN output gate
        "rope_theta": m.float(_k("rope.freq_base"), 10000.0), "partial_rotary_factor": prf,
        "max_position_embeddings": m.int(_k("context_length"), 32768),
        "tie_word_embeddings": "output.weight" not in gset.tensors,
        "torch_dtype": "float32",
    }
    if INDEXED in layer_types:
        kw.update(indexer_n_heads=m.int(_k("attention.indexer.head_count")), indexer_kv_heads=1,
                  indexer_head_dim=m.int(_k("attention.indexer.key_length")),
                  indexer_budget=m.int(_k("attention.indexer.top_k")),
                  indexer_compress_ratio=_qsa_ratio(m, layer_types, n_all))

    # vocabulary: the token list, checked against the embedding's rows
    emb = gset.tensors.get("token_embd.weight")
    emb_rows = emb[1].dims[1] if emb is not None and len(emb[1].dims) == 2 else None
    tokens = gset.metadata.get("tokenizer.ggml.tokens")
    if isinstance(tokens, list) and tokens:
        vocab = len(tokens)
        if emb_rows is not None and emb_rows != vocab:
            raise GGUFError(f"{m.where}: tokenizer.ggml.tokens lists {vocab} tokens but token_embd.weight has "
                            f"{emb_rows} rows")
    elif emb_rows is not None:
        vocab = emb_rows
    else:
        raise GGUFError(f"{m.where}: no tokenizer.ggml.tokens and no 2-D token_embd.weight: the vocabulary size "
                        "is unknown")
    kw["vocab_size"] = vocab

    eos_tok = gset.metadata.get("tokenizer.ggml.eos_token_id")
    for name, key in (("pad_token_id", "tokenizer.ggml.padding_token_id"),
                      ("bos_token_id", "tokenizer.ggml.bos_token_id")):
        if m.has(key):
            kw[name] = m.int(key, positive=False)

    overrides: dict[int, PLEGeometry] = {}
    ple_key = _k("ple.layers")
    if m.has(ple_key) and m.md[ple_key] != []:
        ple_layers = m.int_list(ple_key)
        if len(ple_layers) != 1:
            raise m.fail(ple_key, f"lists {len(ple_layers)} layers {ple_layers}; a GGUF holds one PLE table and one "
                                  "set of hash constants (llama.cpp supports one PLE layer), so strata reads one")
        layer = ple_layers[0]
        if not 0 <= layer < n_layers:
            raise m.fail(ple_key, f"names layer {layer}, outside the {n_layers} trunk layers")
        n, hpn = m.int(_k("ple.ngram_size")), m.int(_k("ple.heads_per_ngram"))
        if n < 2:
            raise m.fail(_k("ple.ngram_size"), f"must be >= 2, got {n}")
        heads = (n - 1) * hpn
        d_e = m.int(_k("embedding_length_per_layer_input"))
        eos = m.int(_k("ple.eos_token_id"), positive=False)
        kw.update(ple_layer_ids=(layer + 1,), ple_embed_dim=d_e * heads, ngram_size=n, heads_per_ngram=hpn,
                  ple_conv_kernel_size=m.int(_k("ple.conv_kernel")))
        kw["eos_token_id"] = eos if eos_tok in (None, eos) or not isinstance(eos_tok, int) else (eos, eos_tok)
        mult = m.int_list(_k("ple.layer_multipliers"), n)
        offsets = m.int_list(_k("ple.head_offsets"), heads)
        sizes = m.int_list(_k("ple.head_vocab_sizes"), heads)
        if any(s <= 1 for s in sizes):
            raise m.fail(_k("ple.head_vocab_sizes"), f"must hold primes > 1, got {_brief(sizes)}")
        kw["ngram_vocab_size_base"] = sizes[0]
        table = gset.tensors.get(PLE_TABLE)
        need_rows = max(o + s for o, s in zip(offsets, sizes, strict=True))
        rows = table[1].dims[1] if table is not None and len(table[1].dims) == 2 else need_rows
        if rows < need_rows:
            raise GGUFError(f"{m.where}: tensor {PLE_TABLE!r} has {rows} rows, too few for the PLE head ranges of "
                            f"{_k('ple.head_offsets')} / {_k('ple.head_vocab_sizes')} ({need_rows})")
        overrides[layer] = PLEGeometry(layer, 0, tuple(sizes), tuple(offsets), rows, tuple(mult))
    elif isinstance(eos_tok, int) and not isinstance(eos_tok, bool):
        kw["eos_token_id"] = eos_tok

    try:
        cfg = ModelConfig(**kw, ple_overrides=overrides)
    except ConfigError as e:
        raise GGUFError(f"{m.where}: the metadata describes an invalid model: {e}") from None
    if overrides:
        _check_hash_constants(m, cfg, next(iter(overrides.values())))
    return cfg


def _check_hash_constants(m: _Meta, cfg: ModelConfig, given: PLEGeometry) -> None:
    """The file's PLE constants must be the ones the reference derives (consecutive primes from the first head
    size, offsets = running sums, multipliers = splitmix64 of seed 1234 for this vocabulary)."""
    derived = ModelConfig(**{f: getattr(cfg, f) for f in cfg.__dataclass_fields__ if f != "ple_overrides"})
    geo = derived.ple[given.layer]
    for key, want, got in (("ple.head_vocab_sizes", geo.primes, given.primes),
                           ("ple.head_offsets", geo.offsets, given.offsets),
                           ("ple.layer_multipliers", geo.multipliers, given.multipliers)):
        if tuple(want) != tuple(got):
            raise m.fail(_k(key), f"= {_brief(list(got))} but the qwen4_exp config derives {_brief(list(want))} "
                                  f"(vocabulary {cfg.vocab_size}, seed {derived.seed}): the file's n-gram hash "
                                  "constants do not match its geometry")


def _stored(gset: GGUFSet, name: str) -> StoredTensor:
    """A GGUF tensor as a StoredTensor (torch-order shape): float types as typed views, the rest QuantTensor."""
    part, info = gset.tensors[name]
    raw = part.data(info)
    shape = info.shape if info.dims else (1,)
    if info.type_id in FLOAT_TYPES:
        t = raw.view(FLOAT_TYPES[info.type_id]) if raw.numel() else torch.empty(0, dtype=FLOAT_TYPES[info.type_id])
        return DenseTensor(name, t.view(shape))
    return QuantTensor.from_bytes(name, raw, info.type_id, shape, info.row_bytes)


def _reshaped(t: StoredTensor, shape: tuple[int, ...]) -> StoredTensor:
    """A float tensor stored with a different but equivalent shape ({H} vs {H, 1}, {n_embd, hc} vs {hc_dim})."""
    if tuple(t.shape) == shape or not isinstance(t, DenseTensor) or t.numel != int(np.prod(shape)):
        return t
    return DenseTensor(t.name, t.tensor.reshape(shape))


def weights_from_gguf(gset: GGUFSet) -> Weights:
    """Map a qwen4exp GGUF (file or split set) onto the canonical weight set and validate it."""
    cfg = config_from_gguf(gset)
    expected = expected_shapes(cfg)
    ple_layer = cfg.ple_layer_ids[0] - 1 if cfg.ple_layer_ids else None
    out: dict[str, StoredTensor] = {}
    src: dict[str, str] = {c: gguf_name(c) for c in expected}
    unknown: list[str] = []
    for name in gset.tensors:
        if name in _GLOBAL_TO_CANON:
            canon = _GLOBAL_TO_CANON[name]
        elif name == PLE_TABLE and ple_layer is not None:
            canon = f"L{ple_layer}.ple.table"
        elif (mb := _BLK_RE.match(name)) is not None:
            layer, suffix = int(mb.group(1)), mb.group(2)
            if layer >= cfg.num_hidden_layers and layer < cfg.num_hidden_layers + _nextn(gset):
                continue  # an MTP draft block: not part of the text model
            if suffix == FUSED_GATE_UP:
                _split_gate_up(gset, name, layer, cfg, out, src)
                continue
            if suffix not in _LAYER_TO_CANON:
                unknown.append(name)
                continue
            canon = f"L{layer}.{_LAYER_TO_CANON[suffix]}"
        else:
            unknown.append(name)
            continue
        t = _stored(gset, name)
        if canon in expected:
            t = _reshaped(t, expected[canon])
        out[canon] = t
    if unknown:
        raise GGUFError(f"{gset.describe()}: {len(unknown)} tensor(s) that a qwen4exp text model does not have: "
                        f"{unknown[:8]}")
    if cfg.tie_word_embeddings:
        out.pop("head", None)
    w = Weights(cfg, out, gdn_value_order="tiled", source=gset.describe())
    w.check(src)
    return w


def _nextn(gset: GGUFSet) -> int:
    v = gset.metadata.get(_k("nextn_predict_layers"), 0)
    return v if isinstance(v, int) else 0


def _split_gate_up(gset: GGUFSet, name: str, layer: int, cfg: ModelConfig, out: dict[str, StoredTensor],
                   src: dict[str, str]) -> None:
    """A fused `ffn_gate_up_exps` ({H, 2I, E}: gate rows first) as the canonical gate / up stacks (views)."""
    t = _stored(gset, name)
    E, I2 = (t.shape[0], t.shape[1]) if len(t.shape) == 3 else (0, 0)
    if len(t.shape) != 3 or I2 % 2:
        raise GGUFError(f"{gset.describe()}: tensor {name!r} has shape {list(t.shape)}, expected "
                        f"[{cfg.num_experts}, {2 * cfg.moe_intermediate_size}, {cfg.hidden_size}]")
    half = I2 // 2
    for part, sl in (("gate", slice(0, half)), ("up", slice(half, I2))):
        c = f"L{layer}.moe.{part}_exps"
        if isinstance(t, QuantTensor):
            out[c] = QuantTensor(f"{name}[{part}]", t.data[:, sl], t.type_id, (E, half, t.shape[2]))
        else:
            assert isinstance(t, DenseTensor)
            out[c] = DenseTensor(f"{name}[{part}]", t.tensor[:, sl])
        src[c] = name
