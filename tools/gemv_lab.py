"""GEMV design experiments on the GPU (run on the device box): launch shapes per type and shape.

Each variant is checked against "dequantize, then x @ W^T in float64" and timed over a bank of weight copies far
larger than L2 (so every byte comes from HBM), as GB/s of stored bytes and a fraction of the copy bandwidth:

* `SUITE`: per type and shape, the production defaults (`strata.kernels.gemv`) against other rows/warps per
  program and K splits;
* `EXPERTS`: the routed-expert launches at the real shapes (10 of 256 experts per call): gate/up GLU, down
  (timed only: their outputs are not checked here; tests/test_kernels_gemv_fused.py checks both Q4_K forms);
* `GLU_SUITE`: the gate/up GLU of one matrix pair.

The suites hold what the last experiment compared; earlier variants (a tensor-core dot per block, a factored
Q8_0 decoder, pipelined K loops, Q8_0_R8 with one scale per int32 word, Q4_K with only its nibbles as words, x
loaded in the weight tile's layout, Q6_K read as uint16: 524 against 402 us at the head's shape) and their
timings are in bench/results/2026-12-02-h200-gemv-lab*.json.

    python tools/gemv_lab.py --out lab.json            # under a minute on an H200
    python tools/gemv_lab.py --types Q4_K,Q8_0 --no-experts --no-glu
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from strata.kernels import gemv as G  # noqa: E402
from strata.kernels import gemv_blocks as gb  # noqa: E402
from strata.runtime.bench import copy_bandwidth  # noqa: E402
from strata.weights import quants  # noqa: E402
from tools.gpu_check_gemv import time_graph  # noqa: E402

BANK_BYTES = 800 << 20


def skel_gemv(t: G.GemvType, x, w, k, out, bn, nw, sk=None) -> None:
    """One launch of the production kernel for type description t (block_n / num_warps / split_k overrides or
    None)."""
    G._launch(t, x, w, None, out, w.shape[0], k, 1, x.shape[0], 0, 0, 0, bn, nw, split_k=sk)


LAB_TYPES = {"Q4_K_BYTES": G._Q4_K_BYTES,
             "Q4_K_NOPIPE": dataclasses.replace(G.gemv_type("Q4_K"), load=None, unpack=None),
             "Q5_1_PIPE": dataclasses.replace(G.gemv_type("Q5_1"), load=gb.load_q5_1, unpack=gb.unpack_q5_1),
             "Q8_0_R8_PIPE": dataclasses.replace(G.gemv_type("Q8_0_R8"), load=gb.load_q8_0_r8,
                                                 unpack=gb.unpack_q8_0_r8),
             "Q6_K_P_NOPIPE": dataclasses.replace(G.gemv_type("Q6_K_P"), load=None, unpack=None)}
"""Decoders not in the production table, by name: Q4_K_BYTES is Q4_K's byte-wise form, which production keeps
for small one-token launches only; Q4_K_NOPIPE is Q4_K's decoder called whole (no software-pipelined K loop),
NAME_PIPE NAME's decoder pipelined (H200, 8d02f4e: Q4_K routed GLU 21.9 -> 19.6 us pipelined; Q5_1 expert down
10.3 -> 10.2; Q8_0_R8 16432 x 2560 18.3 -> 19.1, so production pipelines Q4_K only).
(Rejected candidates and their timings: bench/results/*gemv-lab*.json.)"""


def lab_type(name: str) -> G.GemvType:
    return LAB_TYPES.get(name) or G.gemv_type(name)


def random_rows(name: str, n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    t = lab_type(name)
    if t.dense_dtype is not None:
        return torch.randn(n, k, generator=gen, device="cuda").to(t.dense_dtype)
    nb = k // t.block_elems
    data = torch.randint(0, 256, (n, nb, t.block_bytes), dtype=torch.uint8, device="cuda", generator=gen)
    for off in t.f16_fields:
        mag = torch.rand((n, nb), generator=gen, device="cuda") * 0.015 + 0.005
        data[..., off:off + 2] = mag.to(torch.float16).view(torch.uint8).reshape(n, nb, 2)
    return data.reshape(n, nb * t.block_bytes)


# (type, [(N, K)], [(label, block_n, num_warps)]): the production defaults against other launch shapes. Software-
# pipelined K loops (Triton num_stages 2-3) were tried and moved no shape by more than ~10%:
# bench/results/2026-12-02-h200-gemv-lab-stages.json.
_D = ("default", None, None, None)
_SPLITS = [_D, ("sk2", None, None, 2), ("sk4", None, None, 4), ("sk5", None, None, 5)]
SUITE = [
    ("Q8_0_R8", [(16432, 2560)], [_D, ("sk2", None, None, 2)]),
    ("Q8_0_R8_PIPE", [(16432, 2560)], [_D]),
    ("Q8_0", [(2560, 6144)], [_D]),
    ("Q6_K", [(248320, 2560)], [_D]),
    ("Q6_K_P", [(248320, 2560)], [_D, ("bn4", 4, None, None), ("bn16", 16, None, None), ("w8", None, 8, None),
                                  ("bn16 w8", 16, 8, None), ("bn4 w2", 4, 2, None)]),
    ("Q6_K_P_NOPIPE", [(248320, 2560)], [_D, ("bn16", 16, None, None)]),
]
"""(type, [(N, K)], [(label, block_n, num_warps, split_k)]): the production defaults against other launch shapes
at the decode step's shapes (GDN projections, out projection, head); NAME_PIPE / NAME_NOPIPE: the K loop with /
without the software pipelining."""
EXPERTS = [("Q4_K", 640, 2560, "glu", [("default", None, None), ("bn8", 8, None), ("bn32", 32, None),
                                        ("sk2", None, 2)]),
           ("Q4_K_NOPIPE", 640, 2560, "glu", [("default", None, None), ("bn8", 8, None)]),
           ("Q5_1", 2560, 640, "down", [("default", None, None), ("bn8", 8, None), ("sk5", None, 5)]),
           ("Q5_1_PIPE", 2560, 640, "down", [("default", None, None)])]
"""Routed-expert launches at the real shapes (10 of 256 experts): gate/up GLU and the per-slot down projection,
(label, block_n, split_k) variants."""
GLU_SUITE = [("Q8_0", [(640, 2560)])]
"""GLU (gate/up, I x K each): the shared expert's."""
_GLU_VARIANTS = [_D, ("sk2", None, None, 2), ("sk5", None, None, 5), ("bn2 w4 sk5", 2, 4, 5)]


def expert_err(out: torch.Tensor, x: torch.Tensor, sg: torch.Tensor, su: torch.Tensor | None, ids: torch.Tensor,
               type_id: int, k: int) -> float:
    """Largest error of one expert launch's slots against "dequantize, then matmul" in float64, relative to the
    largest reference value (the GLU's output is bf16, so its error is bf16 rounding, ~4e-3)."""
    errs, refs = [], []
    for s, e in enumerate(ids.tolist()):
        xs = (x[0] if x.shape[0] == 1 else x[s]).double()
        g = xs @ quants.dequantize(sg[e], type_id, k).double().T
        ref = g if su is None else torch.nn.functional.silu(g) * (xs @ quants.dequantize(su[e], type_id, k).double().T)
        errs.append((out[s].double() - ref).abs().max())
        refs.append(ref.abs().max())
    return float(max(errs) / max(refs))


def _row(name, n, k, label, fn, w0, bank, nbytes, ref_fn, bw):
    try:
        out = fn(w0)
        err = ref_fn(w0, out)
        s = time_graph([lambda ww=ww: fn(ww) for ww in bank])
        return {"type": name, "n": n, "k": k, "variant": label, "us": s * 1e6, "GBps": nbytes / s / 1e9,
                "frac": nbytes / s / bw, "err": err}
    except Exception as e:  # noqa: BLE001
        return {"type": name, "n": n, "k": k, "variant": label, "error": f"{type(e).__name__}: {e}"[:300]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--types", default=None, help="comma-separated subset of the suite's types")
    ap.add_argument("--no-experts", action="store_true")
    ap.add_argument("--no-glu", action="store_true")
    args = ap.parse_args()
    only = set(args.types.split(",")) if args.types else None
    gen = torch.Generator(device="cuda").manual_seed(0)
    bw = copy_bandwidth(torch.device("cuda"))
    rows_out = []
    for name, shapes, variants in SUITE:
        if only and name not in only:
            continue
        for n, k in shapes:
            w = random_rows(name, n, k, gen)
            ref = w.double() if w.is_floating_point() else quants.dequantize(w, lab_type(name).type_id, k).double()
            nbytes = w.numel() * w.element_size()
            copies = max(4, min(96, math.ceil(BANK_BYTES / nbytes)))
            bank = [random_rows(name, n, k, gen) for _ in range(copies)]
            x = torch.randn(1, k, generator=gen, device="cuda").to(torch.bfloat16)
            xd = x.double()
            out = torch.empty(1, n, device="cuda")

            def ref_fn(w0, o, xd=xd, ref=ref):
                return float(((o.double() - xd @ ref.T).abs() / (xd.abs() @ ref.abs().T)).max())

            t = lab_type(name)
            for label, bn, nw, sk in variants:

                def fn(ww, t=t, bn=bn, nw=nw, sk=sk, x=x, k=k, out=out):
                    skel_gemv(t, x, ww, k, out, bn, nw, sk)
                    return out
                r = _row(name, n, k, label, fn, w, bank, nbytes, ref_fn, bw)
                rows_out.append(r)
                print(json.dumps(r), file=sys.stderr)
            del bank
            torch.cuda.empty_cache()
    for name, shapes in GLU_SUITE:
        if (only and name not in only) or args.no_glu:
            continue
        t = G.gemv_type(name)
        for n, k in shapes:
            g, u = random_rows(name, n, k, gen), random_rows(name, n, k, gen)
            gd = quants.dequantize(g, t.type_id, k).double()
            ud = quants.dequantize(u, t.type_id, k).double()
            nbytes = 2 * g.numel()
            copies = max(4, min(96, math.ceil(BANK_BYTES / nbytes)))
            bank = [(random_rows(name, n, k, gen), random_rows(name, n, k, gen)) for _ in range(copies)]
            x = torch.randn(1, k, generator=gen, device="cuda").to(torch.bfloat16)
            xd = x.double()
            out = torch.empty(1, n, device="cuda")
            refv = torch.nn.functional.silu(xd @ gd.T) * (xd @ ud.T)

            def ref_fn(w0, o, refv=refv):
                return float((o.double() - refv).abs().max() / refv.abs().max())

            for label, bn, nw, sk in _GLU_VARIANTS:
                def fn(gu, t=t, x=x, k=k, out=out, bn=bn, nw=nw, sk=sk):
                    G._launch(t, x, gu[0], None, out, gu[0].shape[0], k, 1, x.shape[0], 0, 0, 0, bn, nw, up=gu[1],
                              split_k=sk)
                    return out
                r = _row(name, n, k, "glu " + label, fn, (g, u), bank, nbytes, ref_fn, bw)
                rows_out.append(r)
                print(json.dumps(r), file=sys.stderr)
            del bank
            torch.cuda.empty_cache()
    for name, n, k, kind, ex_variants in EXPERTS:
        if (only and name not in only) or args.no_experts:
            continue
        stack_g = random_rows(name, 256 * n, k, gen).view(256, n, -1)
        stack_u = random_rows(name, 256 * n, k, gen).view(256, n, -1) if kind == "glu" else None
        nbytes = 10 * n * stack_g.shape[-1] * (2 if kind == "glu" else 1)
        id_sets = [torch.randperm(256, generator=gen, device="cuda")[:10].to(torch.int32) for _ in range(48)]
        x = torch.randn(1 if kind == "glu" else 10, k, generator=gen, device="cuda").to(torch.bfloat16)
        t = lab_type(name)
        for label, bn, sk in ex_variants:

            def fn(ids, t=t, bn=bn, sk=sk, x=x, k=k, kind=kind, sg=stack_g, su=stack_u):
                if kind == "glu":
                    G._launch(t, x, sg, ids, out_e, n, k, 10, 1, sg.stride(0), 0, out_e.stride(0), bn,
                              None, up=su, up_slot_stride=su.stride(0), split_k=sk)
                else:
                    G._launch(t, x, sg, ids, out_e, n, k, 10, 1, sg.stride(0), x.stride(0), out_e.stride(0), bn,
                              None, split_k=sk)
                return out_e

            out_e = torch.empty(10, n, device="cuda", dtype=torch.bfloat16 if kind == "glu" else torch.float32)
            try:
                err = expert_err(fn(id_sets[0]).float(), x, stack_g, stack_u, id_sets[0], t.type_id, k)
                s_call = time_graph([lambda ids=ids: fn(ids) for ids in id_sets])
                r = {"type": name, "n": n, "k": k, "variant": f"experts {kind} {label}", "us": s_call * 1e6,
                     "GBps": nbytes / s_call / 1e9, "frac": nbytes / s_call / bw, "err": err}
            except Exception as e:  # noqa: BLE001
                r = {"type": name, "n": n, "k": k, "variant": f"experts {kind} {label}",
                     "error": f"{type(e).__name__}: {e}"[:300]}
            rows_out.append(r)
            print(json.dumps(r), file=sys.stderr)
        del stack_g, stack_u
        torch.cuda.empty_cache()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    print(f"{'type':<6}{'shape':>12} {'variant':<24}{'us':>8}{'GB/s':>8}{'frac':>6}{'err':>9}")
    for r in rows_out:
        if "error" in r:
            print(f"{r['type']:<6}{r['n']:>6}x{r['k']:<5} {r['variant']:<24} ERROR {r['error'][:60]}")
        else:
            print(f"{r['type']:<6}{r['n']:>6}x{r['k']:<5} {r['variant']:<24}{r['us']:>8.1f}{r['GBps']:>8.0f}"
                  f"{r['frac']:>6.2f}{r['err']:>9.1e}")
    if args.out:
        Path(args.out).write_text(json.dumps({"copy_bw": bw, "rows": rows_out}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
