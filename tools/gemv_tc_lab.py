"""Tensor-core GEMV (`strata.kernels.gemv_tc`) against the CUDA-core one, on the GPU (run on the device box).

Times the Q4_K matrix 10240 x 2560 and the routed experts' gate/up GLU (10 of 256 experts of 640 x 2560) over
banks of weights far larger than L2, checks each against "dequantize, then matmul" in float64, and prints each
launch's registers and spills.

    python tools/gemv_tc_lab.py --out tc.json
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
from strata.kernels import gemv_tc as TC  # noqa: E402
from strata.runtime.bench import copy_bandwidth  # noqa: E402
from strata.weights import quants  # noqa: E402
from tools.gemv_lab import BANK_BYTES, _row, expert_err, random_rows  # noqa: E402
from tools.gpu_check_gemv import time_graph  # noqa: E402

PLAIN = [(10240, 2560)]
PLAIN_VARIANTS = [(32, 4, 0, 1, 0), (32, 4, 1, 1, 0), (64, 8, 0, 1, 0), (32, 4, 0, 1, 1), (32, 4, 0, 3, 1),
                  (64, 8, 0, 3, 1), (128, 8, 0, 3, 1)]
GLU_VARIANTS = [(16, 4, 0, 1, 0, 1), (32, 4, 0, 1, 0, 1), (32, 4, 1, 1, 0, 1), (32, 4, 0, 3, 0, 1),
                (64, 8, 0, 1, 0, 1), (32, 4, 0, 1, 1, 1), (32, 4, 0, 3, 1, 1), (64, 8, 0, 3, 1, 1),
                (32, 4, 0, 1, 0, 5), (32, 4, 0, 1, 1, 5), (16, 4, 0, 1, 1, 5), (64, 8, 0, 1, 1, 5)]
"""(block_n, num_warps, pipe, num_stages, x prebuilt, split_k)"""


def _kernel_info(fn) -> dict:
    """Registers and spills of the most recently compiled variant of a Triton kernel."""
    try:
        cache = fn.device_caches[torch.cuda.current_device()][0]
        k = list(cache.values())[-1]
        return {"regs": k.n_regs, "spills": k.n_spills}
    except Exception as e:  # noqa: BLE001
        return {"info_error": str(e)[:100]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    bw = copy_bandwidth(torch.device("cuda"))
    rows_out = []
    name = "Q4_K"
    for n, k in PLAIN:
        w = random_rows(name, n, k, gen)
        ref = quants.dequantize(w, 12, k).double()
        nbytes = w.numel()
        bank = [random_rows(name, n, k, gen) for _ in range(max(4, min(96, math.ceil(BANK_BYTES / nbytes))))]
        x = torch.randn(1, k, generator=gen, device="cuda").to(torch.bfloat16)
        xd = x.double()
        out = torch.empty(1, n, device="cuda")

        def ref_fn(w0, o, xd=xd, ref=ref):
            return float(((o.double() - xd @ ref.T).abs() / (xd.abs() @ ref.abs().T)).max())

        def prod(ww, x=x, k=k, out=out):
            G.gemv(x, ww, name, k, out=out)
            return out
        rows_out.append(_row(name, n, k, "cuda-core default", prod, w, bank, nbytes, ref_fn, bw))
        for bn, nw, pipe, st, xg in PLAIN_VARIANTS:
            def tc(ww, x=x, k=k, out=out, bn=bn, nw=nw, pipe=pipe, st=st, xg=xg):
                TC.gemv_tc(x, ww, name, k, out=out, block_n=bn, num_warps=nw, pipe=bool(pipe), num_stages=st,
                           x_prebuilt=bool(xg))
                return out
            r = _row(name, n, k, f"tc bn{bn} w{nw} p{pipe} s{st} xg{xg}", tc, w, bank, nbytes, ref_fn, bw)
            r.update(_kernel_info(TC._tc_gemv_kernel))
            rows_out.append(r)
            print(json.dumps(r), file=sys.stderr)
        del bank
        torch.cuda.empty_cache()

    n, k = 640, 2560
    sg = random_rows(name, 256 * n, k, gen).view(256, n, -1)
    su = random_rows(name, 256 * n, k, gen).view(256, n, -1)
    nbytes = 10 * n * sg.shape[-1] * 2
    id_sets = [torch.randperm(256, generator=gen, device="cuda")[:10].to(torch.int32) for _ in range(48)]
    x = torch.randn(1, k, generator=gen, device="cuda").to(torch.bfloat16)
    out_e = torch.empty(10, n, device="cuda", dtype=torch.bfloat16)
    variants = [("cuda-core default", lambda ids: G.gemv_experts_glu(x, sg, su, ids, name, k, out=out_e), None)]
    for bn, nw, pipe, st, xg, sk in GLU_VARIANTS:
        variants.append((f"tc bn{bn} w{nw} p{pipe} s{st} xg{xg} sk{sk}",
                         lambda ids, bn=bn, nw=nw, pipe=pipe, st=st, xg=xg, sk=sk:
                         TC.gemv_tc_experts_glu(x, sg, su, ids, name, k, out=out_e, block_n=bn, num_warps=nw,
                                                pipe=bool(pipe), num_stages=st, x_prebuilt=bool(xg), split_k=sk),
                         TC._tc_glu_kernel))
    for label, fn, kern in variants:
        try:
            fn(id_sets[0])
            err = expert_err(out_e.float(), x, sg, su, id_sets[0], 12, k)
            s_call = time_graph([lambda ids=ids: fn(ids) for ids in id_sets])
            r = {"type": name, "n": n, "k": k, "variant": f"experts glu {label}", "us": s_call * 1e6,
                 "GBps": nbytes / s_call / 1e9, "frac": nbytes / s_call / bw, "err": err}
            if kern is not None:
                r.update(_kernel_info(kern))
        except Exception as e:  # noqa: BLE001
            r = {"type": name, "n": n, "k": k, "variant": f"experts glu {label}",
                 "error": f"{type(e).__name__}: {e}"[:300]}
        rows_out.append(r)
        print(json.dumps(r), file=sys.stderr)
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    print(f"{'type':<6}{'shape':>12} {'variant':<38}{'us':>8}{'GB/s':>8}{'frac':>6}{'err':>9}{'regs':>6}{'spill':>6}")
    for r in rows_out:
        if "error" in r:
            print(f"{r['type']:<6}{r['n']:>6}x{r['k']:<5} {r['variant']:<38} ERROR {r['error'][:80]}")
        else:
            print(f"{r['type']:<6}{r['n']:>6}x{r['k']:<5} {r['variant']:<38}{r['us']:>8.1f}{r['GBps']:>8.0f}"
                  f"{r['frac']:>6.2f}{r['err']:>9.1e}{r.get('regs', ''):>6}{r.get('spills', ''):>6}")
    if args.out:
        Path(args.out).write_text(json.dumps({"copy_bw": bw, "gpu": torch.cuda.get_device_name(),
                                              "rows": rows_out}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
