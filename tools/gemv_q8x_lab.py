"""Q8-activation GEMV lab (run on the device box): `gemv_q8x` against the float row-register GEMV at the decode
step's shapes (`tools/gemv_rr_lab.py`'s matrices, shared-expert GLU and routed-expert launches).

Checks first, on the GPU: the quantize kernel's integers and scales equal `act_quant.quantize_q8` of the same x on
the CPU, bit for bit, for both byte orders; every Q8 launch is compared with "the weights decoded in float64 times
round_q8(x)" (`err`: max |y - want| / max |want| for the GLU and expert launches, else per output against
sum |w x|). Then each case is timed over a bank of weight copies (or expert sets) far larger than L2, captured in
a CUDA graph (`tools/gpu_check_gemv.time_graph`): the float GEMV (bf16 x) in its default shape, the Q8 GEMV alone
(x quantized once, outside the timing) in its default shape and the other K splits, the quantize kernel alone, and
quantize + GEMV back to back (what a step would run where no kernel before writes the Q8 x itself).

    python tools/gemv_q8x_lab.py --out lab.json
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
from strata.kernels import gemv_q8x as Q  # noqa: E402
from strata.kernels import gemv_rr  # noqa: E402
from strata.model.act_quant import quantize_q8, round_q8  # noqa: E402
from strata.weights import quants  # noqa: E402
from tools import gemv_rr_lab as RL  # noqa: E402
from tools.gemv_rr_lab import BANK_BYTES, Lab, rr_shapes, word  # noqa: E402

DEVICE = "cuda"


def rand_rows(name: str, n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    return RL.rand_rows(name, n, k, gen)


def check_quantize(gen: torch.Generator) -> list[dict]:
    rows = []
    for kind in ("Q4_K_R", "Q5_1_R"):
        for k in (640, 2560, 6144):
            x = (torch.randn(10, k, generator=gen, device=DEVICE) * 3).to(torch.bfloat16)
            x[0, :32] = 0
            got = Q.unpack(Q.quantize(x, kind).cpu(), kind, k)
            want = quantize_q8(x.cpu())
            rows.append({"check": "quantize", "order": Q.ORDER[kind], "k": k,
                         "equal": all(torch.equal(a, b) for a, b in zip(got, want))})
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def _x(k: int, slots: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(slots, k, generator=gen, device=DEVICE).to(torch.bfloat16)


def matrices(lab: Lab, gen: torch.Generator) -> None:
    for name, n, k in RL.MATRICES:
        kind = name + "_R"
        if kind not in Q.ORDER or n > 100_000:
            continue
        w = rand_rows(name, n, k, gen)
        ref = quants.dequantize(w, G.gemv_type(name).type_id, k).double()
        nbytes = w.numel()
        copies = max(4, min(96, math.ceil(BANK_BYTES / nbytes)))
        br = [word(name, rand_rows(name, n, k, gen), k)[1] for _ in range(copies)]
        wr = word(name, w, k)[1]
        x = _x(k, 1, gen)
        xq = Q.quantize(x, kind)
        xr = round_q8(x.cpu()).double().to(DEVICE)
        out = torch.empty(1, n, device=DEVICE)
        t = G.gemv_type(kind)

        def err(y: torch.Tensor, xd: torch.Tensor) -> float:
            return float(((y.double() - xd @ ref.T).abs() / (xd.abs() @ ref.abs().T)).max())
        shape = f"{n}x{k}"
        lab.case(f"{kind} float", shape, lambda b: G.gemv(x, b, kind, k, out=out), br, nbytes,
                 err(G.gemv(x, wr, kind, k), x.double()))
        n_chunks = k // gemv_rr.CHUNK[kind][0]
        tiles = math.ceil(n / gemv_rr.launch_shape(kind, n_chunks)[0])
        for label, sh in rr_shapes(kind, n_chunks, tiles):
            def fn(b, sh=sh):
                G._launch_rr(t, xq, b, None, out, n, k, 1, 0, 0, 0, None, 0, None, None, sh, q8x=True)
                return out
            lab.case(f"{kind} q8 {label[3:]}", shape, fn, br, nbytes, err(fn(wr), xr))
        lab.case(f"{kind} quantize+q8", shape, lambda b: Q.gemv(Q.quantize(x, kind, out=xq), b, kind, k, out=out),
                 br, nbytes, err(Q.gemv(xq, wr, kind, k), xr))
        lab.case(f"quantize {k}", "1", lambda b: Q.quantize(x, kind, out=xq), br[:8], 0, 0.0)
        del br
        torch.cuda.empty_cache()


def glus(lab: Lab, gen: torch.Generator) -> None:
    for name, n, k in RL.GLUS:
        kind = name + "_R"
        g, u = rand_rows(name, n, k, gen), rand_rows(name, n, k, gen)
        tid = G.gemv_type(name).type_id
        gd, ud = quants.dequantize(g, tid, k).double(), quants.dequantize(u, tid, k).double()
        nbytes = 2 * g.numel()
        copies = max(4, min(96, math.ceil(BANK_BYTES / nbytes)))
        br = [(word(name, rand_rows(name, n, k, gen), k)[1], word(name, rand_rows(name, n, k, gen), k)[1])
              for _ in range(copies)]
        gr, ur = word(name, g, k)[1], word(name, u, k)[1]
        x = _x(k, 1, gen)
        xq = Q.quantize(x, kind)
        out = torch.empty(1, n, device=DEVICE)

        def err(y: torch.Tensor, xd: torch.Tensor) -> float:
            want = torch.nn.functional.silu(xd @ gd.T) * (xd @ ud.T)
            return float((y.double() - want).abs().max() / want.abs().max())
        shape = f"2x{n}x{k}"
        lab.case(f"{kind} glu float", shape, lambda b: G.gemv_glu(x, b[0], b[1], kind, k, out=out), br, nbytes,
                 err(G.gemv_glu(x, gr, ur, kind, k), x.double()))
        lab.case(f"{kind} glu q8", shape, lambda b: Q.gemv_glu(xq, b[0], b[1], kind, k, out=out), br, nbytes,
                 err(Q.gemv_glu(xq, gr, ur, kind, k), round_q8(x.cpu()).double().to(DEVICE)))
        del br
        torch.cuda.empty_cache()


def experts(lab: Lab, gen: torch.Generator) -> None:
    n_exp, slots = 256, 10
    for name, mode, n, k in RL.EXPERTS:
        kind = name + "_R"
        tid = G.gemv_type(name).type_id
        sg = rand_rows(name, n_exp * n, k, gen).view(n_exp, n, -1)
        su = rand_rows(name, n_exp * n, k, gen).view(n_exp, n, -1) if mode == "glu" else None
        nbytes = slots * n * sg.shape[-1] * (2 if mode == "glu" else 1)
        id_sets = [torch.randperm(n_exp, generator=gen, device=DEVICE)[:slots].to(torch.int32) for _ in range(48)]
        sw = torch.softmax(torch.randn(slots, generator=gen, device=DEVICE), 0)
        x = _x(k, 1 if mode == "glu" else slots, gen)
        xq = Q.quantize(x, kind)
        ids0 = id_sets[0]
        stacks = tuple(None if s is None else word(name, s, k)[1] for s in (sg, su))

        def run(ids, q8: bool, fresh: bool = False):
            if q8:
                xa = Q.quantize(x, kind, out=xq) if fresh else xq
                if mode == "glu":
                    return Q.gemv_experts_glu(xa, stacks[0], stacks[1], ids, kind, k)
                return Q.gemv_experts_sum(xa, stacks[0], ids, sw, kind, k)
            if mode == "glu":
                return G.gemv_experts_glu(x, stacks[0], stacks[1], ids, kind, k, out_dtype=torch.float32)
            return G.gemv_experts_sum(x, stacks[0], ids, sw, kind, k, out_dtype=torch.float32)

        ref_f, ref_q = (RL.experts_want(xd, ids0, mode, sg, su, sw, tid, k)
                        for xd in (x.double(), round_q8(x.cpu()).double().to(DEVICE)))

        def err(y: torch.Tensor, ref: torch.Tensor) -> float:
            return float((y.double() - ref).abs().max() / ref.abs().max())
        shape = f"{slots}x{n}x{k}"
        lab.case(f"{kind} experts {mode} float", shape, lambda ids: run(ids, False), id_sets, nbytes,
                 err(run(ids0, False), ref_f))
        lab.case(f"{kind} experts {mode} q8", shape, lambda ids: run(ids, True), id_sets, nbytes,
                 err(run(ids0, True), ref_q))
        lab.case(f"{kind} experts {mode} quantize+q8", shape, lambda ids: run(ids, True, True), id_sets, nbytes,
                 err(run(ids0, True, True), ref_q))
        del sg, su
        torch.cuda.empty_cache()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    checks = check_quantize(gen)
    lab = Lab()
    matrices(lab, gen)
    glus(lab, gen)
    experts(lab, gen)
    print(f"copy bandwidth {lab.bw / 1e12:.2f} TB/s; quantize checks equal: "
          f"{sum(c['equal'] for c in checks)}/{len(checks)}")
    lab.print_table(40)
    if args.out:
        Path(args.out).write_text(json.dumps({"copy_bw": lab.bw, "checks": checks, "rows": lab.rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
