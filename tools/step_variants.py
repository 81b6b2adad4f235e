"""Decode-step variants, measured in the step itself (run on the device box).

A launch timed alone (the labs) does not show what it costs the step: with PDL and two streams a kernel's own
time overlaps others, and a faster kernel can leave the layer's critical path unchanged (every GEMV ends a fixed
time after its own launch). Here one synthetic model at the real geometry is built once, and the 4K decode step
is captured again for each variant with one knob or op swapped in the same process, so variants are compared back
to back; each row has the replay time and the per-layer critical paths (`bench.layer_paths`). A probe that takes
a launch out of the graph (its outputs frozen from the warm-up) bounds what a faster kernel there could gain.

    python tools/step_variants.py --out variants.json base select:removed select:radix base

With --prefill-tokens N each row also has the prefill tok/s of an N-token prompt (`bench.bench_prefill`) and
how far the prompt's last logits are from the first row's (max |difference| / max |logit|).

Variants (list `base` more than once to see the run-to-run spread; join several with +):
  base                       the step as the engine runs it
  select:removed             the QSA selection's launch left out of the graph (outputs from the warm-up)
  select:radix               the one-program radix select instead of the ranked one
  route:removed              the MoE routing's launch left out of the graph (ids and weights from the warm-up)
  combine:removed            the MoE combine's launch left out of the graph (its output from the warm-up; the
                             side stream still joined): bounds folding the combine into the routed down's tail
  release:after-loop         launches by expert ids let the next kernel in only after their K loop
                             (`gemv_rr.RELEASE["ids"]`)
  gdn:BV[:W]                 the GDN step with BV value columns per program and W warps (default 4) (`gdn.gdn_step`'s
                             block_v, num_warps)
  gdn-early:0|1              the GDN step loads its stored weights before its PDL wait and the gate inputs of
                             its head right after it (1), or as the norm needs them (0) (`gdn.EARLY_LOADS`)
  preload:KIND:N             row-register launches of KIND load N K-loop steps before their PDL wait
                             (`gemv_rr.PRELOAD`; the routed GLU, by unsettled ids, loads them right after it);
                             KIND/S for the launches of S loop steps only (Q8_0_R/6: the out projections);
                             q8:KIND[/S] for launches with Q8 activations (taken before the plain entries there)
  gdn-prefetch:0|1           the GDN step's programs ask L2 for their state slabs before their PDL wait (1) or not
                             (`gdn.PREFETCH_STATE`)
  gemv-type:NAME:R,W,S       the generic GEMV's small one-token launches of type NAME with R rows and W warps per
                             program, K split S (`gemv.GemvType.small`, `small_split`; R = 0: no small shape)
  ids-early:off              the routed down projections read the expert ids after their PDL wait
                             (`ops.SETTLED_IDS`)
  select:ranked:ROWS:CHUNK   the ranked selection with these knobs (`select.select_blocks_ranked`)
  attend:SPLIT:BW            QSA attention with SPLIT keys per program in steps of BW (`attention.attend`)
  hc:I                       the HC read's knobs set to `hyper.hc_read_configs(...)[I]` (but its `finish_in_down`)
  hc-up:BH                   the HC read's up kernel with BH output features per program (default 2 at the real
                             geometry; from 32 a program writes whole Q8 runs in the q8 mode, no tickets)
  release-plain:M            row-register launches without expert ids let the next kernel in after their K loop
                             (0), right after their PDL wait (1) or first (2) (`gemv_rr.RELEASE["plain"]`)
  release-settled:M          the same for launches by settled expert ids (the routed down projections)
  release-rows:N:M           as release-plain:M for launches of N rows only
  late:NAME:0|1              the kernel NAME (a `pdl.LATE_RELEASE` key: qsa_store, gdn_step, route, combine,
                             hc_down, hc_up, quantize) lets the next kernel in after its PDL wait (1) or first (0)
  streams:off                the shared expert on the caller's stream, after the routed experts (no side stream)
  shared:removed             the shared expert's launches left out of the graph (its output from the warm-up; no
                             side stream, so no join before the combine): bounds what a join-free MoE could gain
  argmax:torch               the greedy step ends in torch's argmax (`graph.torch_greedy_token`: a memset and a
                             reduction) instead of one Triton launch (`graph.greedy_token`)
  norm-ropes:split           the QSA layer's two query norm+RoPE ops in two launches (`qsa.norm_ropes_ref` over the
                             single kernel) instead of one (`norm_rope.norm_ropes`)
  activations:q8             products with quantized weights take Q8 activations (`strata generate --activations
                             q8`: `gemv_q8x`; the HC reads, the GDN step, the attention merge and the routed GLU
                             write their outputs' Q8 units, every other GEMV input takes a quantize launch); its
                             prefill logits differ
  q8-units:off               with activations:q8: no producer writes Q8 units (a quantize launch before every Q8
                             GEMV)
  quantize:removed           with activations:q8: the quantize launches left out of the graph (units from the
                             warm-up): bounds what Q8 units written by their producers could gain
  x-widen:0|1|free           the row-register GEMVs widen bf16 x by inline PTX (1) or `.to(tl.float32)` (0)
                             (`gemv_rr.WIDEN_X_ASM`); free: not at all, the bits taken as fp32 (wrong values,
                             timing only: what the widening costs, the bound for x stored as fp32)
  experts-gemm:N             prefill's routed experts as grouped matrix products from N tokens
                             (`ops.GEMM_MIN_TOKENS`; 0: never, the one-slot-per-pass GEMV); with --prefill-tokens
  experts-gemm-shape:BN,W    the grouped expert GEMM with BN weight rows per program over W warps
                             (`experts_gemm.BLOCK_N`, `NUM_WARPS`)
  prefill-chunk:N            the prefill of --prefill-tokens in chunks of N tokens (512: `Engine.prefill`'s)
  row-major:T                T (glu: the routed experts' gate/up stacks; head: the head), which the GPU stores
                             tile-major (Q4_K_RT, Q6_K_RT: `repack.TILE_LAYOUTS`), re-laid row by row in place
                             as their row-major twins (Q4_K_R, Q6_K_R)
  shape:KIND:NCH:LO:HI:BR,SBC,WARPS,SPLIT
                             row-register launches of KIND over NCH chunks with LO <= row tiles < HI in this
                             launch shape (`gemv_rr.launch_shape`)
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from strata.kernels import attention, experts_gemm, gdn, gemv_q8x, gemv_rr, hyper, moe, pdl  # noqa: E402
from strata.kernels import gemv as kernel_gemv  # noqa: E402
from strata.kernels import ops as kernel_ops  # noqa: E402
from strata.model.model import Model  # noqa: E402
from strata.model.ops import branches_ref  # noqa: E402
from strata.model.qsa import norm_ropes_ref  # noqa: E402
from strata.runtime import bench, graph  # noqa: E402
from strata.runtime.placement import fast_ops, gpu_layout  # noqa: E402
from strata.runtime.synthetic import TypeMix, real_config, synthetic_weights  # noqa: E402
from strata.weights import repack  # noqa: E402
from strata.weights.quant_tensor import QuantTensor  # noqa: E402

BASE = {"select_blocks": attention.select_blocks, "select_blocks_ranked": attention.select_blocks_ranked,
        "RANK_SELECT_MAX_BLOCKS": attention.RANK_SELECT_MAX_BLOCKS, "attend": attention.attend,
        "hc_read_defaults": hyper.hc_read_defaults, "launch_shape": gemv_rr.launch_shape,
        "SETTLED_IDS": kernel_ops.SETTLED_IDS, "RELEASE": dict(gemv_rr.RELEASE), "rr_launch": gemv_rr.launch,
        "LATE_RELEASE": dict(pdl.LATE_RELEASE), "WIDEN_X_ASM": gemv_rr.WIDEN_X_ASM,
        "gdn_step": gdn.gdn_step, "GDN_EARLY_LOADS": gdn.EARLY_LOADS, "PRELOAD": dict(gemv_rr.PRELOAD),
        "GDN_PREFETCH_STATE": gdn.PREFETCH_STATE,
        "GEMV_TYPE_NAMES": dict(kernel_gemv.GEMV_TYPE_NAMES), "greedy_token": graph.greedy_token,
        "GEMM_MIN_TOKENS": kernel_ops.GEMM_MIN_TOKENS,
        "GEMM_SHAPE": (experts_gemm.BLOCK_N, experts_gemm.NUM_WARPS), "quantize": gemv_q8x.quantize}


Q8_UNIT_WRITERS = ("hc_read", "hc_write_read", "gdn_core", "attend")  # op entries that write Q8 units in the q8 mode

PREFILL = {"chunk": 512}  # the prefill's chunk size for the variant being measured


def _frozen(fn, nargs: int):
    """`fn` of its first `nargs` arguments run only while not capturing; the captured step reuses the first
    warm-up's outputs (cloned; one entry per argument shapes and values, whatever layer), so the launch is left out
    of the graph and a probe bounds what a faster kernel there could gain. An entry is never replaced: a graph
    captured earlier reads it, and a later warm-up (a step captures several graphs) would free it under that graph
    (the routing's freed ids sent the routed experts' loads out of bounds)."""
    cache = {}

    def frozen(*args, **_):
        args = args[:nargs]
        key = tuple(tuple(a.shape) if isinstance(a, torch.Tensor) else a for a in args)
        if not torch.cuda.is_current_stream_capturing():
            out = fn(*args)
            if key not in cache:
                cache[key] = tuple(o.clone() for o in out) if isinstance(out, tuple) else out.clone()
            return out
        return cache[key]
    return frozen


def _frozen_shared(x, fns):
    """`Ops.branches` of a MoE layer with the shared expert (branch 1) computed only while not capturing: the
    captured step runs the routed branch alone and combines with the first warm-up's shared output (kept, as
    `_frozen` keeps its entries)."""
    if not torch.cuda.is_current_stream_capturing():
        outs = branches_ref(x, fns)
        if tuple(x.shape) not in _frozen_shared.cache:
            _frozen_shared.cache[tuple(x.shape)] = outs[1].clone()
        return outs
    return [fns[0](), _frozen_shared.cache[tuple(x.shape)]]


_frozen_shared.cache = {}


def _shape_override(kind: str, n_chunks: int, lo: int, hi: int, shape: tuple[int, ...]):
    def launch_shape(k: str, nch: int, tiles: int = 1 << 30) -> tuple[int, int, int, int]:
        if k == kind and nch == n_chunks and lo <= tiles < hi:
            return shape
        return BASE["launch_shape"](k, nch, tiles)
    return launch_shape


def _release_for_rows(rows: int, mode: int):
    """`gemv_rr.launch` with `RELEASE["plain"]` = mode for launches of `rows` rows."""
    def launch(kind, x, w, ids, out, n, *a, **kw):
        if n != rows:
            return BASE["rr_launch"](kind, x, w, ids, out, n, *a, **kw)
        before, gemv_rr.RELEASE["plain"] = gemv_rr.RELEASE["plain"], mode
        try:
            return BASE["rr_launch"](kind, x, w, ids, out, n, *a, **kw)
        finally:
            gemv_rr.RELEASE["plain"] = before
    return launch


def _prompt_logits(model: Model, tokens: int, chunk: int) -> torch.Tensor:
    """The last position's logits of a fixed random prompt (float32, on the CPU)."""
    ids = torch.randint(0, model.cfg.vocab_size, (tokens,), generator=torch.Generator().manual_seed(1))
    return bench.prefill_chunks(model, ids, model.new_state(capacity=tokens + 8), chunk).float().cpu()


WEIGHTS: dict = {}  # the synthetic model's weights (main), which the `row-major:` variants re-lay in place
TILE_TARGETS = {"glu": ("gate_exps", "up_exps"), "head": ("head",)}  # name -> tensor name suffixes
ROW_MAJOR: dict[str, QuantTensor] = {}  # tile-major tensors of WEIGHTS re-laid row by row, by name


def _relay(target: str, row_major: bool) -> None:
    """The tile-major tensors of WEIGHTS that `target` names (`TILE_TARGETS`) re-laid row by row in place, each
    replaced by its row-major twin (row_major), or those twins re-laid and replaced back."""
    w = WEIGHTS.get("w")
    for name in [n for n in (w.tensors if w is not None else ()) if n.endswith(TILE_TARGETS[target])]:
        t = w.tensors[name]
        if row_major and isinstance(t, QuantTensor) and t.tiled:
            layout = repack.TILE_LAYOUTS[t.type_id]
            rows = t.tiled_rows()
            repack.tile_major_(rows, layout.tile, layout.step, undo=True)
            ROW_MAJOR[name] = t
            w.tensors[name] = QuantTensor(t.name, rows, layout.base, t.shape)
        elif not row_major and name in ROW_MAJOR:
            tiled = ROW_MAJOR.pop(name)
            layout = repack.TILE_LAYOUTS[tiled.type_id]
            rows = tiled.tiled_rows()
            repack.tile_major_(rows, layout.tile, layout.step)
            w.tensors[name] = tiled


def _variant_model(w, dev: torch.device, variant: str) -> Model:
    """The bf16 model on `w` with `variant`'s patches applied and its op swaps in the fast op table."""
    return Model(w, torch.bfloat16, dev, dataclasses.replace(fast_ops(streams=True), **apply(variant)))


def apply(variant: str) -> dict:
    """Reset every patch, then apply those of `variant`'s parts (see the module docstring); the op table
    entries they swap."""
    attention.select_blocks = BASE["select_blocks"]
    attention.select_blocks_ranked = BASE["select_blocks_ranked"]
    attention.RANK_SELECT_MAX_BLOCKS = BASE["RANK_SELECT_MAX_BLOCKS"]
    attention.attend = BASE["attend"]
    hyper.hc_read_defaults = BASE["hc_read_defaults"]
    gemv_rr.launch_shape = BASE["launch_shape"]
    kernel_ops.SETTLED_IDS = BASE["SETTLED_IDS"]
    kernel_ops.Q8_UNITS_FROM_GLU = True
    gemv_rr.RELEASE.update(BASE["RELEASE"])
    gemv_rr.launch = BASE["rr_launch"]
    pdl.LATE_RELEASE.update(BASE["LATE_RELEASE"])
    gdn.gdn_step = BASE["gdn_step"]
    gdn.EARLY_LOADS = BASE["GDN_EARLY_LOADS"]
    gemv_q8x.quantize = BASE["quantize"]
    gemv_rr.WIDEN_X_ASM = BASE["WIDEN_X_ASM"]
    graph.greedy_token = BASE["greedy_token"]
    kernel_ops.GEMM_MIN_TOKENS = BASE["GEMM_MIN_TOKENS"]
    PREFILL["chunk"] = 512
    experts_gemm.BLOCK_N, experts_gemm.NUM_WARPS = BASE["GEMM_SHAPE"]
    gemv_rr.PRELOAD.clear()
    gemv_rr.PRELOAD.update(BASE["PRELOAD"])
    gdn.PREFETCH_STATE = BASE["GDN_PREFETCH_STATE"]
    for target in TILE_TARGETS:
        _relay(target, f"row-major:{target}" in variant.split("+"))
    for t in BASE["GEMV_TYPE_NAMES"].values():
        kernel_gemv.GEMV_TYPE_NAMES[t.name] = kernel_gemv.GEMV_TYPES[t.type_id] = t
    swaps = {}
    for part in variant.split("+"):
        swaps.update(_apply_one(part))
    return swaps


def _apply_one(variant: str) -> dict:
    name, *args = variant.split(":")
    if name == "base":
        return {}
    if name == "route" and args == ["removed"]:
        return {"route": _frozen(moe.route, 3)}
    if name == "combine" and args == ["removed"]:
        return {"moe_combine": _frozen(moe.moe_combine, 3)}
    if name == "gemv-type" and len(args) == 2:
        rows, warps, split = (int(v) for v in args[1].split(","))
        t = dataclasses.replace(kernel_gemv.GEMV_TYPE_NAMES[args[0]], small=(rows, warps) if rows else None,
                                small_split=(split, 1))
        kernel_gemv.GEMV_TYPE_NAMES[t.name] = kernel_gemv.GEMV_TYPES[t.type_id] = t
    elif name == "preload" and len(args) in (2, 3):  # preload:KIND:N or preload:q8:KIND:N
        gemv_rr.PRELOAD[":".join(args[:-1])] = int(args[-1])
    elif name == "gdn-prefetch" and args in (["0"], ["1"]):
        gdn.PREFETCH_STATE = args[0] == "1"
    elif name == "gdn-early" and args in (["0"], ["1"]):
        gdn.EARLY_LOADS = args[0] == "1"
    elif name == "gdn" and len(args) in (1, 2):
        gdn.gdn_step = functools.partial(BASE["gdn_step"], block_v=int(args[0]),
                                         num_warps=int(args[1]) if len(args) == 2 else 4)
    elif name == "release" and args == ["after-loop"]:
        gemv_rr.RELEASE["ids"] = gemv_rr.AFTER_LOOP
    elif name == "release-plain" and len(args) == 1:
        gemv_rr.RELEASE["plain"] = int(args[0])
    elif name == "release-settled" and len(args) == 1:
        gemv_rr.RELEASE["settled-ids"] = int(args[0])
    elif name == "release-rows" and len(args) == 2:
        gemv_rr.launch = _release_for_rows(int(args[0]), int(args[1]))
    elif name == "late" and len(args) == 2 and args[0] in pdl.LATE_RELEASE:
        pdl.LATE_RELEASE[args[0]] = bool(int(args[1]))
    elif name == "argmax" and args == ["torch"]:
        graph.greedy_token = graph.torch_greedy_token
    elif name == "norm-ropes" and args == ["split"]:
        return {"norm_ropes": norm_ropes_ref}
    elif name == "experts-gemm" and len(args) == 1:
        kernel_ops.GEMM_MIN_TOKENS = int(args[0]) or 1 << 30
    elif name == "prefill-chunk" and len(args) == 1:
        PREFILL["chunk"] = int(args[0])
    elif name == "experts-gemm-shape" and len(args) == 1:
        experts_gemm.BLOCK_N, experts_gemm.NUM_WARPS = (int(v) for v in args[0].split(","))
    elif name == "activations" and args == ["q8"]:
        q8 = fast_ops(streams=True, activations="q8")
        return {n: getattr(q8, n) for n in ("linear", "linears", "mlp", "experts", *Q8_UNIT_WRITERS)}
    elif name == "q8-units" and args == ["off"]:
        kernel_ops.Q8_UNITS_FROM_GLU = False
        plain = fast_ops(streams=True)
        return {n: getattr(plain, n) for n in Q8_UNIT_WRITERS}
    elif name == "quantize" and args == ["removed"]:
        gemv_q8x.quantize = _frozen(BASE["quantize"], 3)
    elif name == "x-widen" and args in (["0"], ["1"], ["free"]):
        gemv_rr.WIDEN_X_ASM = "free" if args[0] == "free" else args[0] == "1"
    elif name == "shared" and args == ["removed"]:
        return {"branches": _frozen_shared}
    elif name == "streams" and args == ["off"]:
        return {"branches": branches_ref}
    elif name == "ids-early" and args == ["off"]:
        kernel_ops.SETTLED_IDS = False
    elif name == "select" and args == ["removed"]:
        attention.select_blocks_ranked = _frozen(BASE["select_blocks_ranked"], 4)
    elif name == "select" and args == ["radix"]:
        attention.RANK_SELECT_MAX_BLOCKS = 0
    elif name == "select" and args[:1] == ["ranked"] and len(args) == 3:
        attention.select_blocks_ranked = functools.partial(BASE["select_blocks_ranked"], rows=int(args[1]),
                                                           chunk=int(args[2]))
    elif name == "attend" and len(args) == 2:
        attention.attend = functools.partial(BASE["attend"], split=int(args[0]), block_w=int(args[1]))
    elif name == "hc" and len(args) == 1:
        cfg = real_config()
        configs = hyper.hc_read_configs(cfg.hc_count, cfg.hidden_size, cfg.hc_lowrank,
                                        torch.cuda.get_device_properties(0).multi_processor_count)
        if not 0 <= int(args[0]) < len(configs):
            raise SystemExit(f"variant {variant!r}: the HC read has {len(configs)} knob settings, 0 to "
                             f"{len(configs) - 1} (`hyper.hc_read_configs`)")
        knobs = dict(configs[int(args[0])])
        knobs.pop("finish_in_down", None)
        hyper.hc_read_defaults = lambda *a: dict(knobs)
    elif name == "row-major" and len(args) == 1 and args[0] in TILE_TARGETS:
        pass  # re-laid by `apply`
    elif name == "hc-up" and len(args) == 1:
        hyper.hc_read_defaults = functools.partial(BASE["hc_read_defaults"], block_h=int(args[0]))
    elif name == "shape" and len(args) == 5:
        shape = tuple(int(v) for v in args[4].split(","))
        gemv_rr.launch_shape = _shape_override(args[0], int(args[1]), int(args[2]), int(args[3]), shape)
    else:
        raise SystemExit(f"unknown variant {variant!r} (see --help)")
    return {}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("variants", nargs="+")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--out", default=None)
    ap.add_argument("--commit", default=None, help="commit id to record (default: git rev-parse HEAD)")
    ap.add_argument("--prefill-tokens", type=int, default=0, help="also time a prefill of N tokens per variant")
    args = ap.parse_args()
    dev = torch.device("cuda")
    pdl.set_enabled(True)
    bw = bench.copy_bandwidth(dev)
    w = gpu_layout(synthetic_weights(real_config(), TypeMix(), dev), inplace=True, dtype=torch.bfloat16)
    WEIGHTS["w"] = w
    floor_ms = bench.token_bytes(w, args.context)["total"] / bw * 1e3
    report = {"commit": args.commit or bench.git_commit(), "gpu": torch.cuda.get_device_name(dev),
              "context": args.context, "floor_ms": floor_ms, "rows": []}
    # every variant timed first, then the critical paths profiled: a process that has run the profiler launches
    # more slowly (tools/launch_lab.py), which would add to the later rows' ms/token and prefill
    print(f"{'variant':<34}{'replay ms':>10}{'ms/token':>10}"
          + (f"{'prefill t/s':>12}{'logits diff':>12}" if args.prefill_tokens else ""), flush=True)
    first_logits = None
    for variant in args.variants:
        model = _variant_model(w, dev, variant)
        t0 = time.perf_counter()
        r = bench.bench_decode(model, args.context, args.tokens, 3, stage_table=False)
        row = {"variant": variant, "replay_ms": r["graph_replay_ms"], "ms_per_token": r["ms_per_token"],
               "ms_per_token_runs": r["ms_per_token_runs"], "seconds": time.perf_counter() - t0}
        if args.prefill_tokens:
            row["prefill"] = bench.bench_prefill(model, args.prefill_tokens, runs=2, chunk=PREFILL["chunk"])
            logits = _prompt_logits(model, args.prefill_tokens, PREFILL["chunk"])
            first_logits = logits if first_logits is None else first_logits
            row["prefill"]["logits_diff"] = float((logits - first_logits).abs().max() / first_logits.abs().max())
        report["rows"].append(row)
        pre = (f"{row['prefill']['tok_per_s']:>12.1f}{row['prefill']['logits_diff']:>12.2e}"
               if args.prefill_tokens else "")
        print(f"{variant:<34}{row['replay_ms']:>10.3f}{row['ms_per_token']:>10.3f}{pre}", flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"{'variant':<34}{'GDN us':>8}{'QSA us':>8}  (critical paths, profiled)", flush=True)
    for row in report["rows"]:
        model = _variant_model(w, dev, row["variant"])
        paths = bench.profile_decode(model, args.context, args.tokens, 3, timeline=True)["replay_kernels"]["layers"]
        row["layer_paths"] = paths
        span = {k: paths.get(k, {}).get("span_us", float("nan")) for k in ("gdn", "qsa")}
        print(f"{row['variant']:<34}{span['gdn']:>8.1f}{span['qsa']:>8.1f}", flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=1))
    apply("base")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
