"""What a model holds and what one token reads: tensor inventory by role and storage type, parameter counts
(total and active per token) and bytes per token — the numerator of every decode-speed floor."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from strata.weights.schema import Weights
from strata.weights.tensor import iter_leaves

ROLES = ("embed", "head", "hyper-connections", "gdn", "qsa", "router", "experts", "shared-expert", "ple",
         "ple-table")


def role_of(name: str) -> str:
    """The role of a canonical tensor name."""
    if name == "embed":
        return "embed"
    if name == "head":
        return "head"
    part = name.split(".", 1)[1] if name.startswith("L") else name
    if part.startswith(("hc_", "final")):
        return "hyper-connections"
    if part.startswith("gdn."):
        return "gdn"
    if part.startswith(("attn.", "idx.")):
        return "qsa"
    if part == "moe.router":
        return "router"
    if part.endswith("_exps"):
        return "experts"
    if part.startswith("moe.sh"):
        return "shared-expert"
    if part == "ple.table":
        return "ple-table"
    return "ple"


@dataclass
class Inventory:
    params_total: int
    params_active: float
    bytes_total: int
    bytes_per_token: float
    by_role: dict[str, dict[str, float]]  # role -> {"params", "bytes", "bytes_per_token"}
    by_kind: dict[str, dict[str, float]]  # storage type -> {"tensors", "params", "bytes"}


def inventory(w: Weights) -> Inventory:
    """Count parameters and bytes. A token reads every dense tensor whole, k/E of each expert stack, one row of
    the embedding and ngram_heads rows of each PLE table (the head is read whole)."""
    cfg = w.cfg
    by_role: dict[str, dict[str, float]] = {r: defaultdict(float) for r in ROLES}
    by_kind: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    total_p = total_b = 0
    active_p = active_b = 0.0
    tensors = dict(w.tensors)
    if cfg.tie_word_embeddings:
        tensors.pop("head", None)
    for name, t in tensors.items():
        role = role_of(name)
        if role == "experts":
            frac = cfg.num_experts_per_tok / cfg.num_experts
        elif role == "embed":
            frac = 1 / t.shape[0]
        elif role == "ple-table":
            frac = cfg.ngram_heads / t.shape[0]
        else:
            frac = 1.0
        total_p += t.numel
        total_b += t.nbytes
        active_p += t.numel * frac
        active_b += t.nbytes * frac
        r = by_role[role]
        r["params"] += t.numel
        r["bytes"] += t.nbytes
        r["bytes_per_token"] += t.nbytes * frac
        for leaf in iter_leaves(t):
            k = by_kind[leaf.kind]
            k["tensors"] += 1
            k["params"] += leaf.numel
            k["bytes"] += leaf.nbytes
    if cfg.tie_word_embeddings:  # the shared table is read whole by the head
        active_p += w["embed"].numel
        active_b += w["embed"].nbytes
        by_role["head"]["bytes_per_token"] += w["embed"].nbytes
    return Inventory(total_p, active_p, total_b, active_b,
                     {k: dict(v) for k, v in by_role.items() if v}, {k: dict(v) for k, v in by_kind.items()})


def state_bytes(cfg, context: int, dtype_bytes: int = 2) -> int:
    """Bytes of one sequence's decode state at `context` tokens (GDN states, KV, indexer caches, PLE)."""
    n_gdn = sum(cfg.is_linear(i) for i in range(cfg.num_hidden_layers))
    n_qsa = cfg.num_hidden_layers - n_gdn
    gdn = n_gdn * (cfg.gdn_conv_dim * (cfg.linear_conv_kernel_dim - 1) * dtype_bytes
                   + cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4)
    qsa = 0
    if n_qsa:
        per_tok = 2 * cfg.num_key_value_heads * cfg.head_dim + cfg.indexer_head_dim
        qsa = n_qsa * context * per_tok * dtype_bytes + n_qsa * (context // cfg.indexer_compress_ratio) \
            * cfg.indexer_head_dim * dtype_bytes
    ple = len(cfg.ple_layer_ids) * cfg.hc_dim * cfg.ple_conv_state_len * dtype_bytes
    return gdn + qsa + ple
