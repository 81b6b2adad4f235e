"""HF checkpoints (config.json + safetensors) mapped onto the canonical weight set.

Both key layouts are accepted (`model.language_model.*` from the VLM checkpoint and `model.*`); `mtp.*` and
`model.visual.*` are ignored. Per-expert tensors become lazy stacks, the PLE table's `shard_{k}` parts stay
parts, and the small vectors whose convention differs from the canonical one (the (1+w) norm weights, A_log)
are converted here, once.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from strata.config import ModelConfig
from strata.weights.safetensors import open_checkpoint
from strata.weights.schema import Weights
from strata.weights.tensor import DenseTensor, RowConcatTensor, StackedTensor, StoredTensor, WeightError

_IGNORED = re.compile(r"^(mtp\.|model\.visual\.|visual\.|model\.mtp\.)")

# HF suffix (after "model.layers.{i}.") -> canonical suffix (after "L{i}.")
_LAYER_MAP = {
    "linear_attn.in_proj_qkv.weight": "gdn.qkv",
    "linear_attn.in_proj_z.weight": "gdn.z",
    "linear_attn.in_proj_b.weight": "gdn.b",
    "linear_attn.in_proj_a.weight": "gdn.a",
    "linear_attn.conv1d.weight": "gdn.conv",
    "linear_attn.dt_bias": "gdn.dt_bias",
    "linear_attn.A_log": "gdn.A",
    "linear_attn.norm.weight": "gdn.norm",
    "linear_attn.out_proj.weight": "gdn.out",
    "self_attn.q_proj.weight": "attn.q",
    "self_attn.k_proj.weight": "attn.k",
    "self_attn.v_proj.weight": "attn.v",
    "self_attn.o_proj.weight": "attn.o",
    "self_attn.q_proj.bias": "attn.q_bias",
    "self_attn.k_proj.bias": "attn.k_bias",
    "self_attn.v_proj.bias": "attn.v_bias",
    "self_attn.o_proj.bias": "attn.o_bias",
    "self_attn.q_norm.weight": "attn.q_norm",
    "self_attn.k_norm.weight": "attn.k_norm",
    "self_attn.indexer.index_qk_proj.weight": "idx.qk",
    "self_attn.indexer.q_layernorm.weight": "idx.q_norm",
    "self_attn.indexer.k_layernorm.weight": "idx.k_norm",
    "mlp.gate.weight": "moe.router",
    "mlp.experts.gate_up_proj": "moe.gate_up_exps",
    "mlp.experts.down_proj": "moe.down_exps",
    "mlp.shared_expert.gate_proj.weight": "moe.sh_gate",
    "mlp.shared_expert.up_proj.weight": "moe.sh_up",
    "mlp.shared_expert.down_proj.weight": "moe.sh_down",
    "mlp.shared_expert_gate.weight": "moe.sh_gate_inp",
    "ple.key_proj.weight": "ple.key",
    "ple.value_proj.weight": "ple.value",
    "ple.norm_key.weight": "ple.norm_key",
    "ple.norm_query.weight": "ple.norm_query",
    "ple.norm_conv.weight": "ple.norm_conv",
    "ple.conv1d.weight": "ple.conv",
    "ple.ple_embedding.ngram_embedding.weight": "ple.table",
}
for _hc_hf, _hc_c in (("attn_hyper_connection", "hc_attn"), ("mlp_hyper_connection", "hc_ffn")):
    _LAYER_MAP |= {f"{_hc_hf}.hc_norm.weight": f"{_hc_c}.norm",
                   f"{_hc_hf}.input_mix_weight_down.weight": f"{_hc_c}.down",
                   f"{_hc_hf}.input_mix_weight_up.weight": f"{_hc_c}.up",
                   f"{_hc_hf}.block_inject_weight.weight": f"{_hc_c}.inject"}
_GLOBAL_MAP = {
    "embed_tokens.weight": "embed",
    "hyper_connection_mixer.hc_norm.weight": "final.norm",
    "hyper_connection_mixer.input_mix_weight_down.weight": "final.down",
    "hyper_connection_mixer.input_mix_weight_up.weight": "final.up",
}
# Norm weights stored zero-centred; the canonical form is the fp32 scale 1 + w.
_OFFSET_NORMS = ("hc_attn.norm", "hc_ffn.norm", "final.norm", "attn.q_norm", "attn.k_norm", "idx.q_norm",
                 "idx.k_norm", "ple.norm_key", "ple.norm_query", "ple.norm_conv")

# Hash constants the reference recomputes at init; when a checkpoint carries them they must agree with ours.
_PLE_BUFFERS = {"ple.ple_embedding.layer_multipliers": "multipliers",
                "ple.ple_embedding.ngram_heads_offsets": "offsets",
                "ple.ple_embedding.ngram_heads_vocab_sizes": "primes"}

_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)$")
_EXPERT_RE = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_SHARD_RE = re.compile(r"^ple\.ple_embedding\.ngram_embedding\.shard_(\d+)\.weight$")


def _small(name: str, t: StoredTensor, fn=None) -> DenseTensor:
    x = t.dense(torch.float32)
    return DenseTensor(name, fn(x) if fn else x.clone())


def load_hf(folder: str | Path, cfg: ModelConfig | None = None) -> Weights:
    """Open an HF checkpoint folder lazily, map it to canonical names and validate it against the geometry."""
    folder = Path(folder)
    cfg = cfg or ModelConfig.from_file(folder)
    raw = open_checkpoint(folder)
    out: dict[str, StoredTensor] = {}
    src: dict[str, str] = {}
    experts: dict[tuple[int, str], dict[int, StoredTensor]] = {}
    shards: dict[int, dict[int, StoredTensor]] = {}
    unknown: list[str] = []
    for key, t in raw.items():
        if _IGNORED.match(key):
            continue
        name = key.removeprefix("model.language_model.").removeprefix("model.")
        if name == "lm_head.weight" or key == "lm_head.weight":
            out["head"], src["head"] = t, key
            continue
        if name in _GLOBAL_MAP:
            c = _GLOBAL_MAP[name]
            out[c], src[c] = t, key
            continue
        m = _LAYER_RE.match(name)
        if not m:
            unknown.append(key)
            continue
        layer, rest = int(m.group(1)), m.group(2)
        if (em := _EXPERT_RE.match(rest)) is not None:
            experts.setdefault((layer, em.group(2)), {})[int(em.group(1))] = t
            continue
        if (sm := _SHARD_RE.match(rest)) is not None:
            shards.setdefault(layer, {})[int(sm.group(1))] = t
            continue
        if rest in _PLE_BUFFERS:
            geo = cfg.ple.get(layer)
            expected = list(getattr(geo, _PLE_BUFFERS[rest])) if geo else None
            found = t.dense(torch.int64).flatten().tolist() if t.kind != "F32" else None
            if expected is None or found != expected:
                raise WeightError(f"tensor {key!r} holds {found} but the config gives {expected}: the checkpoint's "
                                  "n-gram hash constants do not match its config")
            continue
        if rest not in _LAYER_MAP:
            unknown.append(key)
            continue
        c = f"L{layer}.{_LAYER_MAP[rest]}"
        out[c], src[c] = t, key

    # Per-expert tensors -> lazy stacks.
    for (layer, proj), parts in experts.items():
        E = cfg.num_experts
        missing = sorted(set(range(E)) - set(parts))
        if missing:
            raise WeightError(f"missing tensor 'model.layers.{layer}.mlp.experts.{missing[0]}.{proj}.weight' "
                              f"({len(missing)} of {E} experts missing)")
        extra = sorted(set(parts) - set(range(E)))
        if extra:
            raise WeightError(f"tensor 'model.layers.{layer}.mlp.experts.{extra[0]}.{proj}.weight' is beyond "
                              f"num_experts={E}")
        c = f"L{layer}.moe.{proj.removesuffix('_proj')}_exps"
        out[c] = StackedTensor(c, [parts[e] for e in range(E)])
        src[c] = f"model.layers.{layer}.mlp.experts.*.{proj}.weight"
    # Fused runtime layout (E, 2I, H) -> gate / up views.
    for layer in range(cfg.num_hidden_layers):
        fused = out.pop(f"L{layer}.moe.gate_up_exps", None)
        if fused is not None:
            I = cfg.moe_intermediate_size
            if fused.shape != (cfg.num_experts, 2 * I, cfg.hidden_size):
                raise WeightError(f"tensor {src[f'L{layer}.moe.gate_up_exps']!r} has shape {list(fused.shape)}, "
                                  f"expected {[cfg.num_experts, 2 * I, cfg.hidden_size]}")
            d = fused.dense(fused.tensor.dtype) if isinstance(fused, DenseTensor) else fused.dense()
            for part, sl in (("gate", slice(0, I)), ("up", slice(I, 2 * I))):
                c = f"L{layer}.moe.{part}_exps"
                out[c], src[c] = DenseTensor(c, d[:, sl]), src[f"L{layer}.moe.gate_up_exps"]
    # PLE table shards kept as parts.
    for layer, parts in shards.items():
        n = len(parts)
        if sorted(parts) != list(range(n)):
            missing = sorted(set(range(max(parts) + 1)) - set(parts))
            raise WeightError(f"missing tensor 'model.layers.{layer}.ple.ple_embedding.ngram_embedding."
                              f"shard_{missing[0]}.weight' (PLE table shards must be numbered 0..{n - 1})")
        c = f"L{layer}.ple.table"
        out[c] = RowConcatTensor(c, [parts[k] for k in range(n)])
        src[c] = f"model.layers.{layer}.ple.ple_embedding.ngram_embedding.shard_*.weight"

    # Indexer fused projection -> q / k.
    for layer in range(cfg.num_hidden_layers):
        qk = out.pop(f"L{layer}.idx.qk", None)
        if qk is None:
            continue
        hi, di = cfg.indexer_n_heads, cfg.indexer_head_dim
        key = src.pop(f"L{layer}.idx.qk")
        if qk.shape != ((hi + 1) * di, cfg.hidden_size):
            raise WeightError(f"tensor {key!r} has shape {list(qk.shape)}, expected "
                              f"{[(hi + 1) * di, cfg.hidden_size]}")
        full = qk.tensor if isinstance(qk, DenseTensor) else qk.dense()
        out[f"L{layer}.idx.q"] = DenseTensor(key + "[q]", full[: hi * di])
        out[f"L{layer}.idx.k"] = DenseTensor(key + "[k]", full[hi * di:])
        src[f"L{layer}.idx.q"] = src[f"L{layer}.idx.k"] = key

    # Small vectors to the canonical float32 conventions.
    for c in list(out):
        suffix = c.split(".", 1)[1] if c.startswith("L") else c
        t = out[c]
        if suffix in _OFFSET_NORMS:
            out[c] = _small(c, t, lambda x: 1.0 + x)
        elif suffix == "gdn.A":
            out[c] = _small(c, t, lambda x: -torch.exp(x))
        elif suffix in ("gdn.conv", "ple.conv"):
            if len(t.shape) == 3 and t.shape[1] == 1:
                out[c] = _small(c, t, lambda x: x[:, 0, :].contiguous())
        elif suffix in ("gdn.dt_bias", "gdn.norm"):
            out[c] = _small(c, t)

    if cfg.tie_word_embeddings:
        out.pop("head", None)
    w = Weights(cfg, out, gdn_value_order="grouped", source=str(folder), unknown=unknown)
    if unknown:
        raise WeightError(f"{folder}: {len(unknown)} tensor(s) that a qwen4_exp text model does not have: "
                          f"{unknown[:8]}")
    w.check(src)
    return w
