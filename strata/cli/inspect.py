"""`strata inspect`: geometry, tensor inventory, parameter counts and the memory a model needs."""

from __future__ import annotations

import argparse
import json

from strata.cli.common import add_model_args


def _gb(n: float) -> str:
    return f"{n / 1e9:.3f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inspect", help="print a model's geometry, tensors, parameter counts and memory",
                       description="Print geometry, tensor inventory by role and storage type, parameter counts "
                                   "(total, active per token) and the memory the model needs.")
    add_model_args(p)
    p.add_argument("--context", type=int, default=4096, help="context length for the state-size estimate")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from strata.runtime.engine import DEFAULT_MODEL, load_weights
    from strata.weights.inventory import inventory, state_bytes

    w = load_weights(args.model or DEFAULT_MODEL)
    cfg = w.cfg
    inv = inventory(w)
    n_gdn = sum(cfg.is_linear(i) for i in range(cfg.num_hidden_layers))
    geometry = {
        "layers": cfg.num_hidden_layers, "gdn_layers": n_gdn, "qsa_layers": cfg.num_hidden_layers - n_gdn,
        "hidden": cfg.hidden_size, "vocab": cfg.vocab_size, "hc_streams": cfg.hc_count,
        "hc_lowrank": cfg.hc_lowrank, "experts": cfg.num_experts, "experts_per_token": cfg.num_experts_per_tok,
        "expert_width": cfg.moe_intermediate_size, "shared_expert_width": cfg.shared_expert_intermediate_size,
        "gdn_heads_k_v": [cfg.linear_num_key_heads, cfg.linear_num_value_heads],
        "qsa_heads_q_kv": [cfg.num_attention_heads, cfg.num_key_value_heads], "head_dim": cfg.head_dim,
        "indexer": {"heads": cfg.indexer_n_heads, "dim": cfg.indexer_head_dim, "budget": cfg.indexer_budget,
                    "compress_ratio": cfg.indexer_compress_ratio},
        "ple_layers": [i for i in cfg.ple_layer_ids], "ple_table_rows": {i + 1: g.rows for i, g in cfg.ple.items()},
    }
    st = state_bytes(cfg, args.context)
    report = {
        "model": str(args.model or DEFAULT_MODEL), "geometry": geometry,
        "params_total": inv.params_total, "params_active_per_token": round(inv.params_active),
        "bytes_total": inv.bytes_total, "bytes_per_token": round(inv.bytes_per_token),
        "state_bytes_at_context": {"context": args.context, "bytes": st},
        "by_role": inv.by_role, "by_storage_type": inv.by_kind,
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"model      {report['model']}")
    for k, v in geometry.items():
        print(f"  {k:<22} {v}")
    print(f"parameters {inv.params_total:,} total, {round(inv.params_active):,} active per token")
    print(f"memory     weights {_gb(inv.bytes_total)}; one token reads {_gb(inv.bytes_per_token)}; "
          f"state at {args.context} tokens {_gb(st)}")
    print(f"\n{'role':<20}{'params':>16}{'bytes':>16}{'bytes/token':>16}")
    for role, r in inv.by_role.items():
        print(f"{role:<20}{int(r['params']):>16,}{int(r['bytes']):>16,}{int(r['bytes_per_token']):>16,}")
    print(f"\n{'storage type':<20}{'tensors':>10}{'params':>16}{'bytes':>16}")
    for kind, r in sorted(inv.by_kind.items()):
        print(f"{kind:<20}{int(r['tensors']):>10}{int(r['params']):>16,}{int(r['bytes']):>16,}")
    return 0
