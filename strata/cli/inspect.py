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
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from strata.runtime.engine import DEFAULT_MODEL, load_weights
    from strata.runtime.host_memory import plan
    from strata.weights.inventory import state_bytes
    from strata.weights.loader import describe

    w = load_weights(args.model or DEFAULT_MODEL)
    report = describe(w)
    context = args.context or 4096  # the state-size estimate's context (--context, else 4096)
    st = state_bytes(w.cfg, context)
    report["state_bytes_at_context"] = {"context": context, "bytes": st}
    decided, table_bytes, avail = plan(w, args.ple_table)
    report["ple_table"] = {"mode": args.ple_table, "would_be": decided, "host_bytes": table_bytes,
                           "available_bytes": avail}
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"model      {report['source']}")
    for k, v in report["geometry"].items():
        print(f"  {k:<22} {v}")
    print(f"parameters {report['params_total']:,} total, {report['params_active_per_token']:,} active per token")
    print(f"memory     weights {_gb(report['bytes_total'])}; one token reads {_gb(report['bytes_per_token'])}; "
          f"state at {context} tokens {_gb(st)}")
    if decided == "device":
        print(f"ple table  {_gb(table_bytes)}; --ple-table device: copied into the GPU's memory at load (it must fit "
              "beside the model)")
    elif decided == "pinned":
        have = f"{_gb(avail)} available" if avail is not None else "available memory unknown"
        print(f"ple table  {_gb(table_bytes)}; --ple-table pinned: copied into page-locked host memory the GPU reads "
              f"({have})")
    elif decided != "none":
        have = f"{_gb(avail)} available" if avail is not None else "available memory unknown"
        print(f"ple table  {_gb(table_bytes)} in host memory; --ple-table {args.ple_table}: {decided} ({have})")
    print(f"\n{'role':<20}{'params':>16}{'bytes':>16}{'bytes/token':>16}  storage types")
    for role, r in report["by_role"].items():
        kinds = ", ".join(sorted(report["storage_types_by_role"].get(role, {})))
        print(f"{role:<20}{int(r['params']):>16,}{int(r['bytes']):>16,}{int(r['bytes_per_token']):>16,}  {kinds}")
    print(f"\n{'storage type':<20}{'tensors':>10}{'params':>16}{'bytes':>16}")
    for kind, r in sorted(report["by_storage_type"].items()):
        print(f"{kind:<20}{int(r['tensors']):>10}{int(r['params']):>16,}{int(r['bytes']):>16,}")
    return 0
