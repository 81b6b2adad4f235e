"""Row-register GEMV lab (run on the device box): `gemv_rr` against the generic kernel at the decode step's shapes.

Each case is checked against "dequantize, then matmul in float64" and timed over a bank of weight copies (or of
expert sets) far larger than L2, captured in a CUDA graph (`tools/gpu_check_gemv.time_graph`). The row-register
launches run in their default `launch_shape` and in the K splits listed, so the placement rules
(`runtime/placement.py`) and the launch shapes can be set from one run:

    python tools/gemv_rr_lab.py --out lab.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from strata.kernels import gemv as G  # noqa: E402
from strata.kernels import gemv_rr, pdl  # noqa: E402
from strata.runtime.bench import copy_bandwidth  # noqa: E402
from strata.weights import quants, repack  # noqa: E402
from tools.gpu_check_gemv import time_graph  # noqa: E402

BANK_BYTES = 800 << 20
SRC = {"Q4_K_R": ("Q4_K", repack.reorder_q4_k), "Q8_0_R": ("Q8_0", repack.reorder_q8_0),
       "Q5_1_R": ("Q5_1", repack.reorder_q5_1), "Q6_K_R": ("Q6_K", repack.reorder_q6_k)}
MATRICES = [("Q8_0", 16432, 2560), ("Q8_0", 2560, 6144), ("Q8_0", 13952, 2560), ("Q4_K", 10240, 2560),
            ("Q6_K", 248320, 2560), ("Q8_0", 248320, 2560)]
"""(ggml type, N, K): the GDN and QSA projection groups, the out projections, a Q4_K matrix, the head."""
GLUS = [("Q8_0", 640, 2560)]
"""(type, I, K): the shared expert's gate/up."""
EXPERTS = [("Q4_K", "glu", 640, 2560), ("Q5_1", "sum", 2560, 640)]
"""(type, kind, N, K) of the routed experts' launches: gate/up GLU, down with the weighted slot sum (10 of 256)."""
SPLITS = (1, 2, 4, 8)
HEAD_SHAPES = {"Q6_K_R": [(16, 2, 4, 1), (32, 2, 8, 1), (64, 2, 16, 1), (16, 1, 2, 1), (32, 1, 4, 1), (64, 1, 8, 1),
                          (16, 2, 2, 1), (32, 2, 4, 1)],
               "Q8_0_R": [(8, 1, 2, 1), (16, 1, 4, 1), (32, 1, 8, 1), (64, 1, 16, 1), (8, 1, 1, 1), (16, 1, 2, 1)]}
"""(rows, chunks per step, warps, split) tried on head-sized matrices: one row per thread at more warps, then 2-4
rows per thread."""
X_DTYPE = [torch.bfloat16]
"""The dtype the GEMV inputs are given in (`--x`): bf16 values either way."""


def rand_rows(name: str, n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    t = G.gemv_type(name)
    nb = k // t.block_elems
    data = torch.randint(0, 256, (n, nb, t.block_bytes), dtype=torch.uint8, device="cuda", generator=gen)
    for off in t.f16_fields:
        mag = torch.rand((n, nb), generator=gen, device="cuda") * 0.015 + 0.005
        data[..., off:off + 2] = mag.to(torch.float16).view(torch.uint8).reshape(n, nb, 2)
    return data.reshape(n, -1)


def word(name: str, rows: torch.Tensor, k: int) -> tuple[str, torch.Tensor]:
    kind = name + "_R"
    return kind, SRC[kind][1](rows, k).contiguous()


class Lab:
    def __init__(self) -> None:
        self.rows: list[dict] = []
        self.bw = copy_bandwidth(torch.device("cuda"))

    def case(self, label: str, shape: str, fn, bank: list, nbytes: int, err: float) -> None:
        try:
            s = time_graph([lambda b=b: fn(b) for b in bank])
            r = {"case": label, "shape": shape, "us": s * 1e6, "frac": nbytes / s / self.bw, "err": err}
        except Exception as e:  # noqa: BLE001
            r = {"case": label, "shape": shape, "error": f"{type(e).__name__}: {e}"[:300]}
        self.rows.append(r)
        print(json.dumps(r), file=sys.stderr, flush=True)

    def print_table(self, width: int = 34) -> None:
        print(f"{'case':<{width}}{'shape':>16}{'us':>9}{'frac':>7}{'err':>10}")
        for r in self.rows:
            if "error" in r:
                print(f"{r['case']:<{width}}{r['shape']:>16}  ERROR {r['error'][:70]}")
            else:
                print(f"{r['case']:<{width}}{r['shape']:>16}{r['us']:>9.1f}{r['frac']:>7.2f}{r['err']:>10.1e}")


def rr_shapes(kind: str, n_chunks: int, tiles: int) -> list[tuple[str, tuple | None]]:
    base = gemv_rr.launch_shape(kind, n_chunks, tiles)
    out = [(f"rr default split{base[3]}", None)]
    for sp in SPLITS + (5,):
        if sp != base[3] and n_chunks % (sp * base[1]) == 0:
            out.append((f"rr split{sp}", (*base[:3], sp)))
    if base[1] == 2:  # one super-block per step: other splits divide the chunks
        for sp in (1, 2, 5):
            if n_chunks % sp == 0:
                out.append((f"rr sbc1 split{sp}", (2 * base[0], 1, base[2], sp)))
    return out


def matrices(lab: Lab, gen: torch.Generator, types: set[str] | None) -> None:
    for name, n, k in MATRICES:
        if types and name not in types:
            continue
        w = rand_rows(name, n, k, gen)
        ref = quants.dequantize(w, G.gemv_type(name).type_id, k).double()
        nbytes = w.numel()
        copies = max(4, min(96, math.ceil(BANK_BYTES / nbytes)))
        bank = [rand_rows(name, n, k, gen) for _ in range(copies)]
        x = torch.randn(1, k, generator=gen, device="cuda").to(torch.bfloat16).to(X_DTYPE[0])
        out = torch.empty(1, n, device="cuda")

        def err(y: torch.Tensor) -> float:
            return float(((y.double() - x.double() @ ref.T).abs() / (x.double().abs() @ ref.abs().T)).max())
        lab.case(f"{name} generic", f"{n}x{k}", lambda b: G.gemv(x, b, name, k, out=out), bank, nbytes,
                 err(G.gemv(x, w, name, k)))
        if name == "Q8_0":
            b8 = [repack.regroup_q8_0(b, k) for b in bank]
            lab.case("Q8_0_R8 generic", f"{n}x{k}", lambda b: G.gemv(x, b, "Q8_0_R8", k, out=out), b8, nbytes,
                     err(G.gemv(x, repack.regroup_q8_0(w, k), "Q8_0_R8", k)))
            del b8
        if name == "Q6_K":
            bp = [repack.pad_q6_k(b, k) for b in bank]
            lab.case("Q6_K_P generic", f"{n}x{k}", lambda b: G.gemv(x, b, "Q6_K_P", k, out=out), bp, nbytes,
                     err(G.gemv(x, repack.pad_q6_k(w, k), "Q6_K_P", k)))
            del bp
        kind, wr = word(name, w, k)
        br = [word(name, b, k)[1] for b in bank]
        n_chunks = k // gemv_rr.CHUNK[kind][0]
        t = G.gemv_type(kind)
        tiles = math.ceil(n / gemv_rr.launch_shape(kind, n_chunks)[0])
        for label, shape in rr_shapes(kind, n_chunks, tiles):
            def fn(b, shape=shape):
                G._launch_rr(t, x, b, None, out, n, k, 1, 0, 0, 0, None, 0, None, None, shape)
                return out
            lab.case(f"{kind} {label}", f"{n}x{k}", fn, br, nbytes, err(fn(wr)))
        if kind in HEAD_SHAPES and n >= 100_000:  # bandwidth-bound: bigger programs, rows per thread
            for shape in HEAD_SHAPES[kind]:
                def fn(b, shape=shape):
                    gemv_rr.launch(kind, x, b, None, out, n, k, 1, 0, 0, 0, None, 0, shape, G._split_sum, out, out,
                                   None, pdl.launch(x.device))
                    return out
                lab.case(f"{kind} rr {shape}", f"{n}x{k}", fn, br, nbytes, err(fn(wr)))
        with pdl.enabled(False):  # back-to-back launches of one kernel: PDL's early programs hold SM slots
            lab.case(f"{name} generic no-pdl", f"{n}x{k}", lambda b: G.gemv(x, b, name, k, out=out),
                     [b for b in bank], nbytes, err(G.gemv(x, w, name, k)))
            lab.case(f"{kind} rr default no-pdl", f"{n}x{k}", lambda b: G.gemv(x, b, kind, k, out=out), br,
                     nbytes, err(G.gemv(x, wr, kind, k)))
        del bank, br
        torch.cuda.empty_cache()


def glus(lab: Lab, gen: torch.Generator, types: set[str] | None) -> None:
    for name, n, k in GLUS:
        if types and name not in types:
            continue
        g, u = rand_rows(name, n, k, gen), rand_rows(name, n, k, gen)
        tid = G.gemv_type(name).type_id
        gd, ud = quants.dequantize(g, tid, k).double(), quants.dequantize(u, tid, k).double()
        nbytes = 2 * g.numel()
        copies = max(4, min(96, math.ceil(BANK_BYTES / nbytes)))
        bank = [(rand_rows(name, n, k, gen), rand_rows(name, n, k, gen)) for _ in range(copies)]
        x = torch.randn(1, k, generator=gen, device="cuda").to(torch.bfloat16).to(X_DTYPE[0])
        out = torch.empty(1, n, device="cuda")
        want = torch.nn.functional.silu(x.double() @ gd.T) * (x.double() @ ud.T)

        def err(y: torch.Tensor) -> float:
            return float((y.double() - want).abs().max() / want.abs().max())
        lab.case(f"{name} glu generic", f"2x{n}x{k}", lambda b: G.gemv_glu(x, b[0], b[1], name, k, out=out), bank,
                 nbytes, err(G.gemv_glu(x, g, u, name, k)))
        kind = name + "_R"
        br = [(word(name, a, k)[1], word(name, b, k)[1]) for a, b in bank]
        gr, ur = word(name, g, k)[1], word(name, u, k)[1]
        t = G.gemv_type(kind)
        n_chunks = k // gemv_rr.CHUNK[kind][0]
        tiles = math.ceil(n / (gemv_rr.launch_shape(kind, n_chunks)[0] // 2))
        for label, shape in rr_shapes(kind, n_chunks, tiles):
            def fn(b, shape=shape):
                G._launch_rr(t, x, b[0], None, out, n, k, 1, 0, 0, 0, b[1], 0, None, None, shape)
                return out
            lab.case(f"{kind} glu {label}", f"2x{n}x{k}", fn, br, nbytes, err(fn((gr, ur))))
        del bank, br
        torch.cuda.empty_cache()


def experts_want(xd: torch.Tensor, ids: torch.Tensor, mode: str, sg: torch.Tensor, su: torch.Tensor | None,
                 sw: torch.Tensor, tid: int, k: int) -> torch.Tensor:
    """float64 result of an expert launch ("glu": each slot's silu(G x) * U x; "sum": the weighted sum of the
    slots' G x[slot]) from the stored stacks."""
    rows = []
    for s, e in enumerate(ids.tolist()):
        xs = xd[0 if mode == "glu" else s]
        g = xs @ quants.dequantize(sg[e], tid, k).double().T
        if mode == "glu":
            rows.append(torch.nn.functional.silu(g) * (xs @ quants.dequantize(su[e], tid, k).double().T))
        else:
            rows.append(float(sw[s]) * g)
    return torch.stack(rows) if mode == "glu" else sum(rows)[None]


def experts(lab: Lab, gen: torch.Generator, types: set[str] | None) -> None:
    n_exp, slots = 256, 10
    for name, mode, n, k in EXPERTS:
        if types and name not in types:
            continue
        tid = G.gemv_type(name).type_id
        sg = rand_rows(name, n_exp * n, k, gen).view(n_exp, n, -1)
        su = rand_rows(name, n_exp * n, k, gen).view(n_exp, n, -1) if mode == "glu" else None
        nbytes = slots * n * sg.shape[-1] * (2 if mode == "glu" else 1)
        id_sets = [torch.randperm(n_exp, generator=gen, device="cuda")[:slots].to(torch.int32) for _ in range(48)]
        sw = torch.softmax(torch.randn(slots, generator=gen, device="cuda"), 0)
        x = torch.randn(1 if mode == "glu" else slots, k, generator=gen, device="cuda")
        x = x.to(torch.bfloat16).to(X_DTYPE[0])
        ids0 = id_sets[0]
        ref = experts_want(x.double(), ids0, mode, sg, su, sw, tid, k)

        def run(stacks, kind, ids):
            if mode == "glu":
                return G.gemv_experts_glu(x, stacks[0], stacks[1], ids, kind, k, out_dtype=torch.float32)
            return G.gemv_experts_sum(x, stacks[0], ids, sw, kind, k, out_dtype=torch.float32)

        def err(y: torch.Tensor) -> float:
            return float((y.double() - ref).abs().max() / ref.abs().max())
        for kind, stacks in ((name, (sg, su)), (name + "_R", tuple(None if s is None else word(name, s, k)[1]
                                                                  for s in (sg, su)))):
            lab.case(f"{kind} experts {mode}", f"{slots}x{n}x{k}", lambda ids, st=stacks, kd=kind: run(st, kd, ids),
                     id_sets, nbytes, err(run(stacks, kind, ids0)))
            if mode == "glu" and kind.endswith("_R"):
                for sk in (5,):
                    def run_split(ids, st=stacks, kd=kind, sk=sk):
                        return G.gemv_experts_glu(x, st[0], st[1], ids, kd, k, out_dtype=torch.float32, split_k=sk)
                    lab.case(f"{kind} experts glu split{sk}", f"{slots}x{n}x{k}", run_split, id_sets, nbytes,
                             err(run_split(ids0)))
            with pdl.enabled(False):
                lab.case(f"{kind} experts {mode} no-pdl", f"{slots}x{n}x{k}",
                         lambda ids, st=stacks, kd=kind: run(st, kd, ids), id_sets, nbytes, err(run(stacks, kind, ids0)))
        del sg, su
        torch.cuda.empty_cache()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--types", nargs="*", default=None, help="only the cases of these ggml types (e.g. Q6_K)")
    ap.add_argument("--x", choices=("bf16", "fp32"), default="bf16",
                    help="the inputs' dtype (the same bf16 values): fp32 spares the kernels their conversion")
    args = ap.parse_args()
    X_DTYPE[0] = torch.float32 if args.x == "fp32" else torch.bfloat16
    types = set(args.types) if args.types else None
    gen = torch.Generator(device="cuda").manual_seed(0)
    lab = Lab()
    matrices(lab, gen, types)
    glus(lab, gen, types)
    experts(lab, gen, types)
    print(f"copy bandwidth {lab.bw / 1e12:.2f} TB/s")
    lab.print_table()
    if args.out:
        Path(args.out).write_text(json.dumps({"copy_bw": lab.bw, "x": args.x, "rows": lab.rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
