"""GPU check of the Triton GEMV kernels (strata.kernels.gemv): correctness at the real shapes, then bandwidth.

For every storage type the kernels cover:
  1. correctness against "dequantize (strata.weights.quants), then x @ W^T in float64", on the GPU:
     `gemv` at K=2560, N=8192 with 1 and 3 tokens; `gemv_experts` with 10 of E experts, the gate/up shape
     (N=640, K=2560, one shared x) and, for 32/64-weight blocks and dense rows, the down shape (N=2560, K=640, one
     x per slot); for the row-register types also one token of bf16 x, widened both ways (`check_bf16_x`); the
     prefill's grouped expert GEMM with fp32 and bf16 x (`check_experts_gemm`).
     Pass: max |y - ref| / sum|w x| <= 1e-5 (fp32 accumulation order only).
  2. bandwidth: each case captured in a CUDA graph as a run of calls over distinct weight copies (or distinct
     expert sets) that together exceed L2 many times over, so every byte comes from HBM; GB/s = weight bytes read
     / time per call (median of replays, CUDA events). Reported also as a fraction of a large device-to-device
     copy's rate ((read + write) bytes / time), the practical ceiling.
A failure in one type is reported and the others continue. Kernels are compiled first in parallel worker
processes (they fill Triton's on-disk cache; the main process then loads them), which keeps the run well under
two minutes.

    python tools/gpu_check_gemv.py --out gemv.json            # all types
    python tools/gpu_check_gemv.py --out gemv.json --types Q4_K,Q8_0 --sweep   # also try other tile sizes
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from strata.kernels import experts_gemm as EG
from strata.kernels import gemv as G
from strata.kernels import gemv_rr as RR
from strata.runtime.bench import copy_bandwidth
from strata.weights import quants

K_MODEL, N_MAT = 2560, 8192  # hidden size; a typical projection height
I_EXPERT, TOP_K, N_EXPERTS = 640, 10, 256  # expert FFN width, experts per token, experts allocated per bank
TOL = 1e-5
L2_BYTES = 50 << 20
BANK_BYTES = 16 * L2_BYTES  # weights touched per graph replay: every call misses L2


def random_rows(name: str, shape: tuple[int, ...], k: int, gen: torch.Generator, device: str = "cuda",
                ) -> torch.Tensor:
    """Random stored rows of `name` on `device` (gen's): (*shape, row_bytes) uint8 with fp16 scales in +-[0.005,
    0.02], or (*shape, k) typed values ~ N(0, 0.02) for dense types."""
    t = G.gemv_type(name)
    if t.dense_dtype is not None:
        return (torch.randn((*shape, k), generator=gen, device=device) * 0.02).to(t.dense_dtype)
    nb = k // t.block_elems
    data = torch.randint(0, 256, (*shape, nb, t.block_bytes), dtype=torch.uint8, device=device, generator=gen)
    for off in t.f16_fields:
        mag = torch.rand((*shape, nb), generator=gen, device=device) * 0.015 + 0.005
        sign = torch.randint(0, 2, (*shape, nb), generator=gen, device=device) * 2 - 1
        data[..., off:off + 2] = (mag * sign).to(torch.float16).view(torch.uint8).reshape(*shape, nb, 2)
    if name == "IQ1_M":  # fp16 d in the top nibbles of the four scale words (bytes 49, 51, 53, 55)
        mag = torch.rand((*shape, nb), generator=gen, device=device) * 0.015 + 0.005
        d = mag.to(torch.float16).view(torch.int16).to(torch.int32) & 0xFFFF
        for j in range(4):
            data[..., 49 + 2 * j] = (data[..., 49 + 2 * j] & 0x0F) | (((d >> (4 * j)) & 0xF) << 4).to(torch.uint8)
    return data.reshape(*shape, nb * t.block_bytes)


def dequant(name: str, rows: torch.Tensor, k: int) -> torch.Tensor:
    """Reference weights (n, k) float64 of stored rows (n, row_bytes)."""
    t = G.gemv_type(name)
    if t.dense_dtype is not None:
        return rows.double()
    if name == "Q2_0":  # not in strata.weights.quants: fp16 d, weight j in bits 2(j%4) of byte j/4, w = d (q - 1)
        b = rows.reshape(-1, 18)
        d = b[:, :2].contiguous().view(torch.float16).float()
        q = (b[:, 2:, None].int() >> torch.tensor([0, 2, 4, 6], device=rows.device)) & 3
        return (d * (q.reshape(-1, 64).float() - 1)).reshape(rows.shape[0], k).double()
    return quants.dequantize(rows, t.type_id, k).double()


def rel_err(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> float:
    """max |y - x w^T| / (|x| |w|^T), float64."""
    xd = x.double()
    return float(((y.double() - xd @ w.T).abs() / (xd.abs() @ w.abs().T)).max())


def has_down_shape(name: str) -> bool:
    return I_EXPERT % G.gemv_type(name).block_elems == 0


def check_bf16_x(name: str, w: torch.Tensor, wd: torch.Tensor, gen: torch.Generator) -> dict:
    """The row-register kernel with bf16 x, its x widened by `.to(tl.float32)` and by inline PTX
    (`gemv_rr.WIDEN_X_ASM`): each against the reference, and "bf16_widen_differing" the count of outputs that
    differ between the two (the widening is exact either way, so it must be 0)."""
    x = torch.randn(1, K_MODEL, generator=gen, device="cuda").to(torch.bfloat16)
    before, ys = RR.WIDEN_X_ASM, []
    try:
        for widen in (False, True):
            RR.WIDEN_X_ASM = widen
            ys.append(G.gemv(x, w, name, K_MODEL))
    finally:
        RR.WIDEN_X_ASM = before
    return {"gemv_t1_bf16": rel_err(ys[0], x.float(), wd), "gemv_t1_bf16_widen": rel_err(ys[1], x.float(), wd),
            "bf16_widen_differing": float((ys[0] != ys[1]).sum())}


def check_experts_gemm(name: str, gen: torch.Generator) -> dict:
    """The prefill's grouped expert GEMM (`experts_gemm.experts_gemm`) at the gate/up shape: 48 tokens x 4 of 16
    experts (tiles of several slots, some experts empty or split over tiles), each slot's product against float64,
    with fp32 x (IEEE fp32 products) and bf16 x (tensor-core bf16 products of the weights rounded to bf16: the
    reference is the float64 product of those rounded weights)."""
    n_exp, n_tok, top = 16, 48, 4
    stack = random_rows(name, (n_exp, I_EXPERT), K_MODEL, gen)
    ids = torch.stack([torch.randperm(n_exp, generator=gen, device="cuda")[:top] for _ in range(n_tok)]).flatten()
    order = ids.argsort(stable=True)
    bm = EG.tile_rows(ids.numel(), n_exp)
    tiles = EG.expert_tiles(ids[order], n_exp, bm)
    errs = {}
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(n_tok, K_MODEL, generator=gen, device="cuda").to(dtype)
        y = EG.experts_gemm(x[order // top].contiguous(), stack, tiles, order, name, K_MODEL, bm)
        err = 0.0
        for e in range(n_exp):
            slots = (ids == e).nonzero().flatten()
            w = dequant(name, stack[e], K_MODEL)
            if dtype != torch.float32:
                w = w.to(dtype).double()
            err = max(err, rel_err(y[slots], x[slots // top].double(), w))
        errs[f"experts_gemm_{str(dtype).split('.')[-1]}"] = err
    return errs


def check_type(name: str, gen: torch.Generator) -> dict:
    """Correctness of every case of one type; returns {case: max relative error}."""
    errs: dict[str, float] = {}
    w = random_rows(name, (N_MAT,), K_MODEL, gen)
    wd = dequant(name, w, K_MODEL)
    for n_tok in (1, 3):
        x = torch.randn(n_tok, K_MODEL, generator=gen, device="cuda")
        errs[f"gemv_t{n_tok}"] = rel_err(G.gemv(x, w, name, K_MODEL), x, wd)
    if name in RR.ROW_REGISTER_TYPES:
        errs.update(check_bf16_x(name, w, wd, gen))
    del wd
    errs.update(check_experts_gemm(name, gen))
    ids = torch.randperm(N_EXPERTS, generator=gen, device="cuda")[:TOP_K].to(torch.int32)
    stack = random_rows(name, (N_EXPERTS, I_EXPERT), K_MODEL, gen)
    x = torch.randn(1, K_MODEL, generator=gen, device="cuda")
    y = G.gemv_experts(x, stack, ids, name, K_MODEL)
    errs["experts_gate"] = max(rel_err(y[s:s + 1], x, dequant(name, stack[e], K_MODEL))
                               for s, e in enumerate(ids.tolist()))
    if has_down_shape(name):
        stack = random_rows(name, (N_EXPERTS, K_MODEL), I_EXPERT, gen)
        x = torch.randn(TOP_K, I_EXPERT, generator=gen, device="cuda")
        y = G.gemv_experts(x, stack, ids, name, I_EXPERT)
        errs["experts_down"] = max(rel_err(y[s:s + 1], x[s:s + 1], dequant(name, stack[e], I_EXPERT))
                                   for s, e in enumerate(ids.tolist()))
    return errs


def time_graph(calls: list[Callable[[], None]], replays: int = 20) -> float:
    """Seconds per call: the calls captured back to back in one CUDA graph, median over replays."""
    for c in calls:  # compile / warm outside the capture
        c()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    g.replay()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / len(calls))
    del g
    return statistics.median(times)


def bench_type(name: str, gen: torch.Generator, tiles: list[tuple[int | None, int | None]]) -> dict:
    """GB/s of each case (T=1 mat, T=8 mat, experts gate/up, experts down) for each (block_n, num_warps)."""
    t = G.gemv_type(name)
    out: dict[str, dict] = {}
    mat_bytes = N_MAT * (K_MODEL // t.block_elems * t.block_bytes)
    copies = max(4, min(64, math.ceil(BANK_BYTES / mat_bytes)))
    bank = random_rows(name, (copies, N_MAT), K_MODEL, gen)
    ys = torch.empty(8, N_MAT, device="cuda")
    for bn, nw in tiles:
        tag = f"bn{bn or t.block_n}_w{nw or t.num_warps}"
        for n_tok in (1, 8):
            x = torch.randn(n_tok, K_MODEL, generator=gen, device="cuda")
            calls = [lambda i=i, x=x, bn=bn, nw=nw: G.gemv(x, bank[i], name, K_MODEL, ys[:x.shape[0]], block_n=bn,
                                                            num_warps=nw)
                     for i in range(copies)]
            s = time_graph(calls)
            out.setdefault(f"mat_t{n_tok}", {})[tag] = {"us": s * 1e6, "GBps": mat_bytes / s / 1e9}
        cases = [("experts_gate", I_EXPERT, K_MODEL, 1)]
        if has_down_shape(name):
            cases.append(("experts_down", K_MODEL, I_EXPERT, TOP_K))
        for case, n, k, x_rows in cases:
            stack = random_rows(name, (N_EXPERTS, n), k, gen)
            call_bytes = TOP_K * n * (k // t.block_elems * t.block_bytes)
            n_sets = max(4, min(64, math.ceil(BANK_BYTES / call_bytes)))
            id_sets = [torch.randperm(N_EXPERTS, generator=gen, device="cuda")[:TOP_K].to(torch.int32)
                       for _ in range(n_sets)]
            x = torch.randn(x_rows, k, generator=gen, device="cuda")
            ye = torch.empty(TOP_K, n, device="cuda")
            calls = [lambda ids=ids, stack=stack, x=x, k=k, ye=ye, bn=bn, nw=nw:
                     G.gemv_experts(x, stack, ids, name, k, ye, block_n=bn, num_warps=nw) for ids in id_sets]
            s = time_graph(calls)
            out.setdefault(case, {})[tag] = {"us": s * 1e6, "GBps": call_bytes / s / 1e9}
            del stack
    return out


def _warm(names: list[str], tiles: list[tuple[int | None, int | None]]) -> None:
    """Compile every kernel variant the run will use (same shapes, so the same specialisations), small banks."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    G.prepare("cuda")
    for name in names:
        try:
            w = random_rows(name, (N_MAT,), K_MODEL, gen)
            for n_tok in (1, 3, 8):
                for bn, nw in tiles if n_tok != 3 else [(None, None)]:
                    G.gemv(torch.randn(n_tok, K_MODEL, device="cuda"), w, name, K_MODEL, block_n=bn, num_warps=nw)
            for n, k, x_rows in [(I_EXPERT, K_MODEL, 1)] + ([(K_MODEL, I_EXPERT, TOP_K)] if has_down_shape(name)
                                                              else []):
                stack = random_rows(name, (N_EXPERTS, n), k, gen)
                ids = torch.arange(TOP_K, dtype=torch.int32, device="cuda")
                for bn, nw in tiles:
                    G.gemv_experts(torch.randn(x_rows, k, device="cuda"), stack, ids, name, k, block_n=bn,
                                   num_warps=nw)
        except Exception as e:  # noqa: BLE001  (the main process meets and reports the same failure)
            print(f"precompile {name}: {type(e).__name__}: {e}", file=sys.stderr)
    torch.cuda.synchronize()


def precompile(names: list[str], tiles: list[tuple[int | None, int | None]], jobs: int) -> None:
    """Fill Triton's on-disk kernel cache from `jobs` processes in parallel."""
    if jobs <= 1:
        return
    ctx = mp.get_context("spawn")
    groups = [names[i::jobs] for i in range(jobs)]
    procs = [ctx.Process(target=_warm, args=(g, tiles)) for g in groups if g]
    for p in procs:
        p.start()
    for p in procs:
        p.join()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="JSON results path")
    ap.add_argument("--types", default="", help="comma-separated type names (default: all)")
    ap.add_argument("--sweep", action="store_true", help="also time other rows-per-program / warps settings")
    ap.add_argument("--jobs", type=int, default=min(12, os.cpu_count() or 1), help="parallel compile processes")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    names = [n for n in args.types.split(",") if n] or list(G.GEMV_TYPE_NAMES)
    tiles: list[tuple[int | None, int | None]] = [(None, None)]
    if args.sweep:
        tiles += [(4, 4), (8, 4), (16, 8), (32, 4), (32, 8), (64, 8)]
    t0 = time.time()
    precompile(names, tiles, args.jobs)
    t_compile = time.time() - t0
    G.prepare("cuda")
    gen = torch.Generator(device="cuda").manual_seed(1234)
    copy_bps = copy_bandwidth(torch.device("cuda"))
    result: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                    "triton": __import__("triton").__version__, "copy_GBps": copy_bps / 1e9, "tol": TOL,
                    "precompile_s": t_compile, "types": {}}
    print(f"{result['device']}: device copy {copy_bps / 1e9:.0f} GB/s (read+write); precompile {t_compile:.0f} s")
    hdr = f"{'type':8s} {'ok':3s} {'max err':>8s} | {'mat t1':>13s} {'mat t8':>13s} {'exp gate':>13s} " \
          f"{'exp down':>13s}  GB/s (frac of copy)"
    print(hdr)
    failed = 0
    for name in names:
        rec: dict = {}
        try:
            errs = check_type(name, gen)
            rec["errors"] = errs
            rec["ok"] = all(e <= TOL for e in errs.values())
            rec["bench"] = bench_type(name, gen, tiles)
        except Exception as e:  # noqa: BLE001  (report and go on with the next type)
            rec["ok"] = False
            rec["exception"] = f"{type(e).__name__}: {e}"
            rec["traceback"] = traceback.format_exc()[-3000:]
        failed += not rec["ok"]
        result["types"][name] = rec
        cols = []
        for case in ("mat_t1", "mat_t8", "experts_gate", "experts_down"):
            runs = rec.get("bench", {}).get(case)
            if not runs:
                cols.append(f"{'-':>13s}")
                continue
            best = max(runs.values(), key=lambda r: r["GBps"])
            cols.append(f"{best['GBps']:6.0f} ({best['GBps'] * 1e9 / copy_bps:4.2f})")
        err = max(rec["errors"].values()) if "errors" in rec else float("nan")
        print(f"{name:8s} {'yes' if rec['ok'] else 'NO':3s} {err:8.1e} | {' '.join(cols)}"
              + (f"  {rec['exception']}" if "exception" in rec else ""), flush=True)
        if args.sweep and "bench" in rec:
            for case, runs in rec["bench"].items():
                line = ", ".join(f"{tag} {r['GBps']:.0f}" for tag, r in sorted(runs.items(), key=lambda kv:
                                                                                 -kv[1]["GBps"]))
                print(f"           {case}: {line}")
        torch.cuda.empty_cache()
    result["total_s"] = time.time() - t0
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"{len(names) - failed}/{len(names)} types ok; {result['total_s']:.0f} s; wrote {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
