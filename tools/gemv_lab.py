"""GEMV design experiments on the GPU (run on the device box): which layout/kernel reads quantized rows fastest.

Variants, each checked against "dequantize, then x @ W^T in float64" and timed over a bank of weight copies far
larger than L2 (so every byte comes from HBM), as GB/s of stored bytes and a fraction of the copy bandwidth:

* `skel`     the production skeleton (`strata.kernels.gemv`) on ggml's own layout;
* `skel_g8`  the same skeleton on Q8_0 regrouped by eight blocks ({8 fp16 d}{8 x 32 int8 q}, 272 bytes: the
             same bytes, but the quants 16-byte aligned, so they load as 16-byte vectors instead of bytes);
* `dot`      a tensor-core variant: per 32-weight (sub-)block, tl.dot(q as exact bf16 integers, x (K, 16) bf16)
             accumulated in fp32 and scaled per block afterwards (no per-weight scale multiply, no x reloads
             per row), on Q8_0 (grouped) and on Q4_K (ggml's layout; the mins enter as -dmin*m*sum(x)).

* the suite (`SUITE`, `GLU_SUITE`): per type and shape, the current defaults against the candidates of
  tools/gemv_sass.py (rows/warps, the pre-factored Q8_0 decoder, the GLU kernel without its alignment mark).

    python tools/gemv_lab.py --out lab.json            # the suite, ~1-2 minutes on an H200
    python tools/gemv_lab.py --types Q4_K,Q8_0
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import dataclasses  # noqa: E402

from strata.kernels import gemv as G  # noqa: E402
from strata.kernels import gemv_blocks as gb  # noqa: E402
from strata.runtime.bench import copy_bandwidth  # noqa: E402
from strata.weights import quants  # noqa: E402

BANK_BYTES = 800 << 20


def regroup_q8_0(rows: torch.Tensor, k: int) -> torch.Tensor:
    """(N, K/32*34) ggml Q8_0 rows -> the same bytes as groups of 8 blocks: {8 x fp16 d}{8 x 32 q}."""
    n = rows.shape[0]
    b = rows.reshape(n, k // 256, 8, 34)
    return torch.cat([b[..., :2].reshape(n, k // 256, 16), b[..., 2:].reshape(n, k // 256, 256)], -1).reshape(n, -1)


@triton.jit
def decode_q8_0_g8(rp, tab, BN: tl.constexpr, NB: tl.constexpr):
    """Q8_0 regrouped by 8 blocks: {fp16 d[8]; int8 q[8][32]}. [BN, 8, 32]."""
    b = tl.arange(0, 8)
    i = tl.arange(0, 32)
    d = gb._f16(rp[:, None] + 2 * b[None, :])
    q = gb._u8(rp[:, None, None] + 16 + (b[:, None] * 32 + i[None, :])[None, :, :])
    return gb._i2f(q ^ 0x80, 128.0) * d[:, :, None], b[:, None] * 32 + i[None, :]


Q8_0_G8 = G.GemvType("Q8_0_G8", -1, 32, 34, decode_q8_0_g8, 3, 8, block_n=8)


@triton.jit
def _dot_q8g_kernel(x_ptr, w_ptr, out_ptr, N, K, NG, row_bytes, T, BN: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BN + tl.arange(0, BN)
    rp = w_ptr + tl.minimum(rows, N - 1).to(tl.int64) * row_bytes
    i = tl.arange(0, 32)
    t = tl.arange(0, 16)
    acc = tl.zeros([BN, 16], tl.float32)
    for g in range(NG):
        gp = rp + g * 272
        for b in tl.static_range(8):
            d = gb._f16(gp + 2 * b)
            q = gb._u8(gp[:, None] + 16 + b * 32 + i[None, :])
            qf = gb._i2f(q ^ 0x80, 128.0).to(tl.bfloat16)
            xb = tl.load(x_ptr + t[None, :] * K + (g * 256 + b * 32 + i)[:, None], mask=t[None, :] < T, other=0.0)
            acc += d[:, None] * tl.dot(qf, xb.to(tl.bfloat16))
    tl.store(out_ptr + t[None, :] * N + rows[:, None], acc, mask=(rows[:, None] < N) & (t[None, :] < T))


@triton.jit
def _dot_q4k_kernel(x_ptr, w_ptr, out_ptr, N, K, NSB, row_bytes, T, BN: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BN + tl.arange(0, BN)
    rp = w_ptr + tl.minimum(rows, N - 1).to(tl.int64) * row_bytes
    i = tl.arange(0, 32)
    t = tl.arange(0, 16)
    s8 = tl.arange(0, 8)
    acc = tl.zeros([BN, 16], tl.float32)
    for sb in range(NSB):
        bp = rp + sb * 144
        sc, mn = gb._k4_scale_min(bp + 4, s8[None, :])  # [BN, 1, 8]
        sc = tl.reshape(sc, [BN, 8]) * gb._f16(bp)[:, None]
        mn = tl.reshape(mn, [BN, 8]) * gb._f16(bp + 2)[:, None]
        for c in tl.static_range(4):
            qb = gb._u8(bp[:, None] + 16 + c * 32 + i[None, :])
            for h in tl.static_range(2):
                s = 2 * c + h
                qf = gb._i2f((qb >> (4 * h)) & 15, 0.0).to(tl.bfloat16)
                xo = sb * 256 + c * 64 + h * 32 + i
                xb = tl.load(x_ptr + t[None, :] * K + xo[:, None], mask=t[None, :] < T, other=0.0).to(tl.float32)
                scs = tl.sum(tl.where(s8[None, :] == s, sc, 0.0), axis=1)
                mns = tl.sum(tl.where(s8[None, :] == s, mn, 0.0), axis=1)
                acc += scs[:, None] * tl.dot(qf, xb.to(tl.bfloat16)) - mns[:, None] * tl.sum(xb, axis=0)[None, :]
    tl.store(out_ptr + t[None, :] * N + rows[:, None], acc, mask=(rows[:, None] < N) & (t[None, :] < T))


@triton.jit
def _k4_scale_min_nb(sp, s):
    """_k4_scale_min for [BN, NB] pointers and a [4] tile of sub-block ids: two [BN, NB, 4, 1] fp32 tiles."""
    j = (s & 3)[None, None, :, None]
    low = (s < 4)[None, None, :, None]
    p = sp[:, :, None, None] + j
    b0 = gb._u8(p)
    b4 = gb._u8(p + 4)
    b8 = gb._u8(p + 8)
    sc = tl.where(low, b0 & 63, (b8 & 15) | ((b0 >> 6) << 4))
    mn = tl.where(low, b4 & 63, (b8 >> 4) | ((b4 >> 6) << 4))
    return gb._i2f(sc, 0.0), gb._i2f(mn, 0.0)


@triton.jit
def decode_q4_k_nb(rp, tab, BN: tl.constexpr, NB: tl.constexpr):
    """Q4_K over NB super-blocks per chunk. [BN, NB, 4, 32, 2]."""
    s = tl.arange(0, NB)
    c = tl.arange(0, 4)
    i = tl.arange(0, 32)
    bp = rp[:, None] + s[None, :] * 144
    qb = gb._u8(bp[:, :, None, None] + 16 + (c[:, None] * 32 + i[None, :])[None, None, :, :])
    sl, ml = _k4_scale_min_nb(bp + 4, 2 * c)
    sh, mh = _k4_scale_min_nb(bp + 4, 2 * c + 1)
    d = gb._f16(bp)[:, :, None, None]
    dm = gb._f16(bp + 2)[:, :, None, None]
    base = s[:, None, None] * 256 + c[None, :, None] * 64 + i[None, None, :]
    return (tl.join(gb._i2f(qb & 15, 0.0) * (d * sl) - dm * ml, gb._i2f(qb >> 4, 0.0) * (d * sh) - dm * mh),
            tl.join(base, base + 32))


def dot_gemv(kind: str, x: torch.Tensor, w: torch.Tensor, k: int, out: torch.Tensor, bn: int, nw: int) -> None:
    n = w.shape[0]
    if kind == "Q8_0_G8":
        _dot_q8g_kernel[(triton.cdiv(n, bn),)](x, w, out, n, k, k // 256, w.stride(0), x.shape[0], BN=bn,
                                              num_warps=nw)
    else:
        _dot_q4k_kernel[(triton.cdiv(n, bn),)](x, w, out, n, k, k // 256, w.stride(0), x.shape[0], BN=bn,
                                              num_warps=nw)


def skel_gemv(t: G.GemvType, x, w, k, out, bn, nw, nb: int | None = None) -> None:
    if nb is not None:
        import dataclasses
        nb = min(nb, k // t.block_elems)
        while (k // t.block_elems) % nb:
            nb //= 2
        t = dataclasses.replace(t, max_chunk_blocks=nb)
    G._launch(t, x, w, None, out, w.shape[0], k, 1, x.shape[0], 0, 0, 0, bn, nw)


Q4_K_NB = G.GemvType("Q4_K_NB", -2, 256, 144, decode_q4_k_nb, 5, 1, block_n=8)


def random_rows(name: str, n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    t = G.gemv_type(name)
    nb = k // t.block_elems
    data = torch.randint(0, 256, (n, nb, t.block_bytes), dtype=torch.uint8, device="cuda", generator=gen)
    for off in t.f16_fields:
        mag = torch.rand((n, nb), generator=gen, device="cuda") * 0.015 + 0.005
        data[..., off:off + 2] = mag.to(torch.float16).view(torch.uint8).reshape(n, nb, 2)
    return data.reshape(n, nb * t.block_bytes)


def time_calls(calls, replays: int = 15) -> float:
    for c in calls:
        c()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / 1e3 / len(calls))
    return statistics.median(ts)



def staged(name: str, stages: int) -> G.GemvType:
    """The production type of `name` with a software-pipelined K loop of `stages` stages."""
    return dataclasses.replace(G.gemv_type(name), stages=stages)


# (type, [(N, K)], [(label, GemvType or None for the default, block_n, num_warps)]): the current defaults against
# software-pipelined K loops (Triton's num_stages: later chunks' loads in flight while one is decoded)
SUITE = [
    (name, shapes, [("default", None, None, None), ("st2", staged(name, 2), None, None),
                    ("st3", staged(name, 3), None, None), ("st3 bn2 w4", staged(name, 3), 2, 4)])
    for name, shapes in (("Q8_0", [(10240, 2560), (2560, 6144), (640, 2560)]),
                         ("Q4_K", [(10240, 2560), (640, 2560)]),
                         ("Q5_1", [(2560, 640)]),
                         ("Q6_K", [(10240, 2560)]))
]
EXPERTS = [("Q4_K", 640, 2560, "glu"), ("Q5_1", 2560, 640, "down")]
"""Routed-expert launches at the real shapes (10 of 256 experts): gate/up GLU and the per-slot down projection."""
GLU_SUITE = [("Q4_K", [(1536, 2560)])]
"""GLU (gate/up, I x K each), the default launch."""


def glu_call(t: G.GemvType, x, g, u, k, out) -> None:
    G._launch(t, x, g, None, out, g.shape[0], k, 1, x.shape[0], 0, 0, 0, None, None, up=u)


def _row(name, n, k, label, fn, w0, bank, nbytes, ref_fn, bw):
    try:
        out = fn(w0)
        err = ref_fn(w0, out)
        s = time_calls([lambda ww=ww: fn(ww) for ww in bank])
        return {"type": name, "n": n, "k": k, "variant": label, "us": s * 1e6, "GBps": nbytes / s / 1e9,
                "frac": nbytes / s / bw, "err": err}
    except Exception as e:  # noqa: BLE001
        return {"type": name, "n": n, "k": k, "variant": label, "error": f"{type(e).__name__}: {e}"[:300]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--types", default=None, help="comma-separated subset of the suite's types")
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
            ref = quants.dequantize(w, G.gemv_type(name).type_id, k).double()
            nbytes = w.numel()
            copies = max(4, min(96, math.ceil(BANK_BYTES / nbytes)))
            bank = [random_rows(name, n, k, gen) for _ in range(copies)]
            x = torch.randn(1, k, generator=gen, device="cuda").to(torch.bfloat16)
            xd = x.double()
            out = torch.empty(1, n, device="cuda")

            def ref_fn(w0, o, xd=xd, ref=ref):
                return float(((o.double() - xd @ ref.T).abs() / (xd.abs() @ ref.abs().T)).max())

            for label, t, bn, nw in variants:
                t = t or G.gemv_type(name)

                def fn(ww, t=t, bn=bn, nw=nw, x=x, k=k, out=out):
                    skel_gemv(t, x, ww, k, out, bn, nw)
                    return out
                r = _row(name, n, k, label, fn, w, bank, nbytes, ref_fn, bw)
                rows_out.append(r)
                print(json.dumps(r), file=sys.stderr)
            del bank
            torch.cuda.empty_cache()
    for name, shapes in GLU_SUITE:
        if only and name not in only:
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

            for label in ("glu default",):
                def fn(gu, t=t, x=x, k=k, out=out):
                    glu_call(t, x, gu[0], gu[1], k, out)
                    return out
                r = _row(name, n, k, label, fn, (g, u), bank, nbytes, ref_fn, bw)
                rows_out.append(r)
                print(json.dumps(r), file=sys.stderr)
            del bank
            torch.cuda.empty_cache()
    for name, n, k, kind in EXPERTS:
        if only and name not in only:
            continue
        stack_g = random_rows(name, 256 * n, k, gen).view(256, n, -1)
        stack_u = random_rows(name, 256 * n, k, gen).view(256, n, -1) if kind == "glu" else None
        nbytes = 10 * n * stack_g.shape[-1] * (2 if kind == "glu" else 1)
        id_sets = [torch.randperm(256, generator=gen, device="cuda")[:10].to(torch.int32) for _ in range(48)]
        x = torch.randn(1 if kind == "glu" else 10, k, generator=gen, device="cuda").to(torch.bfloat16)
        for label, stages, bn in (("default", 1, None), ("st2", 2, None), ("st3", 3, None), ("st3 bn4", 3, 4),
                                  ("bn4", 1, 4), ("bn16", 1, 16)):
            t = staged(name, stages)

            def fn(ids, t=t, bn=bn, x=x, k=k, kind=kind):
                if kind == "glu":
                    G._launch(t, x, stack_g, ids, out_e, n, k, 10, 1, stack_g.stride(0), 0, out_e.stride(0), bn,
                              None, up=stack_u, up_slot_stride=stack_u.stride(0))
                else:
                    G._launch(t, x, stack_g, ids, out_e, n, k, 10, 1, stack_g.stride(0), x.stride(0),
                              out_e.stride(0), bn, None)
                return out_e

            out_e = torch.empty(10, n, device="cuda", dtype=torch.bfloat16 if kind == "glu" else torch.float32)
            try:
                s_call = time_calls([lambda ids=ids: fn(ids) for ids in id_sets])
                r = {"type": name, "n": n, "k": k, "variant": f"experts {kind} {label}", "us": s_call * 1e6,
                     "GBps": nbytes / s_call / 1e9, "frac": nbytes / s_call / bw, "err": 0.0}
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
