"""`strata bench`: decode ms/token and prefill tok/s against the memory-bandwidth floor, on a synthetic model
at the real geometry (default) or on a model file; writes JSON for bench/results/."""

from __future__ import annotations

import argparse
import sys

from strata.cli.common import OOM_HINTS, add_ple_table_arg
from strata.errors import StrataError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="measure decode and prefill speed against the memory-bandwidth floor",
                       description="Decode ms/token (captured CUDA graph) at several context lengths and prefill "
                                   "tok/s, with bytes per token, the floor, the fraction of the floor and a "
                                   "per-stage table. Without --model: a synthetic model at the real "
                                   "Qwen3.8-Flash-Next geometry, random weights in the stated type mix.")
    p.add_argument("--model", metavar="PATH", default=None, help="HF folder or GGUF file (default: synthetic)")
    p.add_argument("--contexts", default="4096,32768,131072",
                   help="comma-separated context lengths for decode (default: 4096,32768,131072); one whose caches "
                        "do not fit the device is skipped and named, the others still measured and written, and "
                        "the command exits with status 2")
    p.add_argument("--tokens", type=int, default=64, help="decode tokens per timed run (default: 64)")
    p.add_argument("--runs", type=int, default=3,
                   help="timed runs per context and of prefill (after an untimed one); the median is reported")
    p.add_argument("--prefill-tokens", type=int, default=512, help="prompt length for prefill (0: skip)")
    p.add_argument("--no-stages", action="store_true", help="skip the per-stage table")
    p.add_argument("--profile", action="store_true",
                   help="also list the kernels one eager decode step and one prefill launch (count, device time, "
                        "largest)")
    p.add_argument("--timeline", action="store_true",
                   help="with --profile: also record every kernel of one graph replay in order (name, start and "
                        "end in microseconds from the replay's start) in the report, and print the critical path "
                        "of a GDN and a QSA layer read off it (per launch: when it ends, its share of the path, "
                        "when it starts)")
    p.add_argument("--commit", default=None,
                   help="commit id to record in the report (default: git rev-parse HEAD; for copies without .git)")
    p.add_argument("--reference-ops", action="store_true", help="use the reference ops, not the Triton kernels")
    p.add_argument("--layers", type=int, default=None,
                   help="synthetic model with fewer layers (for a quick check; the default is the real 48)")
    p.add_argument("--no-pdl", action="store_true",
                   help="launch kernels plainly, without programmatic dependent launch (on by default on "
                        "Hopper and later GPUs, where each kernel starts while the previous one ends)")
    p.add_argument("--one-stream", action="store_true",
                   help="run a layer's independent branches (routed and shared experts) one after the other on "
                        "one CUDA stream instead of side by side")
    p.add_argument("--no-split", action="store_true",
                   help="capture the decode step as one graph, staged whole before it runs, instead of two split "
                        "at the first PLE layer (the host stages that layer's rows while the first runs)")
    p.add_argument("--activations", default="float", choices=["float", "q8"],
                   help="inputs of products with block-quantized weights: float (default) or q8 (rounded to int8 "
                        "runs first: integer dot products; see strata generate --help)")
    add_ple_table_arg(p)
    p.add_argument("--device", default="cuda", help="CUDA device (default: cuda)")
    p.add_argument("--out", default=None, help="write the JSON report here")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from strata.runtime import bench
    from strata.runtime.engine import load_weights
    from strata.runtime.host_memory import place_ple_tables
    from strata.runtime.placement import fast_ops, gpu_layout, place
    from strata.runtime.synthetic import TypeMix, real_config, synthetic_weights

    if not torch.cuda.is_available():
        raise StrataError("strata bench needs a CUDA device")
    try:
        contexts = [int(c) for c in args.contexts.split(",") if c]
    except ValueError:
        raise StrataError(f"--contexts must be comma-separated integers, got {args.contexts!r}") from None
    from strata.kernels import pdl

    dev = torch.device(args.device)
    pdl.set_enabled(not args.no_pdl)
    bw = bench.copy_bandwidth(dev)
    print(f"device copy bandwidth: {bw / 1e12:.2f} TB/s", file=sys.stderr)
    mix = TypeMix()
    if args.model:
        weights = place(load_weights(args.model), dev, torch.bfloat16)
        mix_text = "as stored in " + args.model
    else:
        cfg = real_config() if args.layers is None else real_config(
            num_hidden_layers=args.layers, layer_types=None)
        # as GPU placement stores them for a bfloat16 model
        weights = gpu_layout(synthetic_weights(cfg, mix, dev), inplace=True, dtype=torch.bfloat16)
        mix_text = mix.describe()
    weights, ple_table = place_ple_tables(weights, args.ple_table, dev, progress=sys.stderr.isatty())
    from strata.model.model import Model
    from strata.model.ops import Ops, with_activations

    if args.reference_ops:
        ops = with_activations(Ops(), args.activations)
    else:
        ops = fast_ops(streams=not args.one_stream, activations=args.activations)
    model = Model(weights, torch.bfloat16, dev, ops)
    report = {"commit": args.commit or bench.git_commit(), "gpu": torch.cuda.get_device_name(dev),
              "copy_bandwidth_bytes_per_s": bw, "model": args.model or "synthetic (real geometry)",
              "type_mix": mix_text, "layers": weights.cfg.num_hidden_layers, "ple_table": ple_table,
              "ops": "reference" if args.reference_ops else "triton", "activations": args.activations,
              "pdl": not args.reference_ops and pdl.active(dev),
              "branch_streams": not args.reference_ops and not args.one_stream,
              "split_step": not args.no_split and ple_table not in ("device", "pinned"),
              "memory_gib": {"model": torch.cuda.memory_allocated(dev) / 2**30,
                             "device": torch.cuda.get_device_properties(dev).total_memory / 2**30},
              "decode": []}
    print(f"model: {report['memory_gib']['model']:.1f} GiB of the device's {report['memory_gib']['device']:.1f}; "
          f"PLE table {ple_table}", file=sys.stderr)
    def measure(ctx: int) -> dict:
        torch.cuda.reset_peak_memory_stats(dev)
        r = bench.bench_decode(model, ctx, args.tokens, args.runs, stage_table=not args.no_stages,
                               split=not args.no_split)
        b = bench.token_bytes(weights, ctx)
        r["bytes_per_token"] = b
        r["floor_ms"] = b["total"] / bw * 1e3
        r["fraction_of_floor"] = r["floor_ms"] / r["ms_per_token"]
        r["peak_memory_gib"] = torch.cuda.max_memory_allocated(dev) / 2**30
        mode = f"run ahead; one by one {r['one_by_one']['ms_per_token']:.3f}" if r["run_ahead"] else "one by one"
        print(f"ctx {ctx:>7}: {r['ms_per_token']:.3f} ms/token ({mode}; {r['tok_per_s']:.1f} tok/s), floor "
              f"{r['floor_ms']:.3f} ms, {100 * r['fraction_of_floor']:.1f}% of floor; peak "
              f"{r['peak_memory_gib']:.1f} GiB; replay "
              f"{r['graph_replay_ms']:.3f} ms; host " + ", ".join(
                  f"{k} {v:.3f}" for k, v in r["host_ms_per_token"]["phases"].items()), file=sys.stderr)
        return r

    report["decode"], report["decode_skipped"] = bench.each_context(measure, contexts, dev)
    if args.prefill_tokens:
        torch.cuda.reset_peak_memory_stats(dev)
        report["prefill"] = bench.bench_prefill(model, args.prefill_tokens, runs=args.runs, profile=args.profile)
        report["prefill"]["peak_memory_gib"] = torch.cuda.max_memory_allocated(dev) / 2**30
    if args.profile and report["decode"]:  # after every timing: a process that ran the profiler launches slower
        first = report["decode"][0]
        first.update(bench.profile_decode(model, first["context"], args.tokens, args.runs,
                                          split=not args.no_split, timeline=args.timeline))
    print(bench.format_table(report))
    if args.out:
        bench.write_report(report, args.out)
    if report["decode_skipped"]:
        skipped = ", ".join(str(s["context"]) for s in report["decode_skipped"])
        print(f"strata bench: error: out of device memory at context {skipped} (the others are reported"
              f"{' and written to ' + args.out if args.out else ''})\n  {OOM_HINTS['bench']}", file=sys.stderr)
        return 2
    return 0
