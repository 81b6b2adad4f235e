"""One entry point for every model format: `load_weights(path)` opens an HF checkpoint folder, a `.gguf` file
or any part of a GGUF split set, lazily, and returns the validated canonical `Weights` (config inside).
`describe(weights)` is the data `strata inspect` prints."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from strata.weights.inventory import inventory, role_of
from strata.weights.schema import Weights
from strata.weights.tensor import WeightError, iter_leaves


def is_gguf(path: Path) -> bool:
    """A GGUF file, by name or by magic."""
    if path.suffix.lower() == ".gguf":
        return True
    try:
        with open(path, "rb") as fh:
            return fh.read(4) == b"GGUF"
    except OSError:
        return False


def load_weights(path: str | Path) -> Weights:
    """HF folder (config.json + safetensors) -> `load_hf`; a GGUF file or split part -> the GGUF loader."""
    path = Path(path)
    if path.is_dir():
        from strata.weights.hf import load_hf

        return load_hf(path)
    if not path.exists():
        raise WeightError(f"model path {path} does not exist")
    if path.is_file() and is_gguf(path):
        from strata.weights.gguf import open_gguf
        from strata.weights.gguf_map import weights_from_gguf

        return weights_from_gguf(open_gguf(path))
    if path.name == "config.json":
        from strata.weights.hf import load_hf

        return load_hf(path.parent)
    raise WeightError(f"{path} is neither an HF checkpoint folder nor a GGUF file")


def describe(w: Weights) -> dict[str, Any]:
    """Geometry, storage types and bytes by role, and the bytes one decoded token reads (every dense tensor,
    k/E of each expert stack, one embedding row, ngram_heads rows of each PLE table, the whole head)."""
    cfg = w.cfg
    inv = inventory(w)
    n_gdn = sum(cfg.is_linear(i) for i in range(cfg.num_hidden_layers))
    types_by_role: dict[str, dict[str, int]] = {}
    for name, t in w.tensors.items():
        role = types_by_role.setdefault(role_of(name), {})
        for leaf in iter_leaves(t):
            role[leaf.kind] = role.get(leaf.kind, 0) + leaf.nbytes
    return {
        "source": w.source,
        "geometry": {
            "layers": cfg.num_hidden_layers, "gdn_layers": n_gdn, "qsa_layers": cfg.num_hidden_layers - n_gdn,
            "hidden": cfg.hidden_size, "vocab": cfg.vocab_size, "hc_streams": cfg.hc_count,
            "hc_lowrank": cfg.hc_lowrank, "experts": cfg.num_experts, "experts_per_token": cfg.num_experts_per_tok,
            "expert_width": cfg.moe_intermediate_size, "shared_expert_width": cfg.shared_expert_intermediate_size,
            "gdn_heads_k_v": [cfg.linear_num_key_heads, cfg.linear_num_value_heads],
            "gdn_value_order": w.gdn_value_order,
            "qsa_heads_q_kv": [cfg.num_attention_heads, cfg.num_key_value_heads], "head_dim": cfg.head_dim,
            "rotary_dim": cfg.rotary_dim,
            "indexer": {"heads": cfg.indexer_n_heads, "dim": cfg.indexer_head_dim, "budget": cfg.indexer_budget,
                        "compress_ratio": cfg.indexer_compress_ratio},
            "ple_layers": list(cfg.ple_layer_ids), "ple_table_rows": {i + 1: g.rows for i, g in cfg.ple.items()},
            "tied_embeddings": cfg.tie_word_embeddings,
        },
        "params_total": inv.params_total,
        "params_active_per_token": round(inv.params_active),
        "bytes_total": inv.bytes_total,
        "bytes_per_token": round(inv.bytes_per_token),
        "by_role": inv.by_role,
        "by_storage_type": inv.by_kind,
        "storage_types_by_role": types_by_role,
    }
