"""Bulk (TMA) copies against register loads at the step's GEMV sizes (run on the device box).

`tools/stream_lab.py` measured what register loads can stream at the routed GLU's size: 18.4 MB in 7.6-7.9 us
(79-82% of the copy bandwidth, H100), against 12.85 us for the tile-major GLU itself: the GEMV's decoding, not
its size, makes the difference, and its programs wait on L1TEX scoreboards at 35% occupancy. A program that
fetches its tiles with bulk copies into shared memory keeps the bytes in flight without holding them in
registers, so its decoding could overlap its loads. This lab asks whether that pays, at the step's sizes (the HC
read's 6.5 MB, the GLU's 18.4, the qkvz group's 44.7), 48 launches back to back in a CUDA graph (each its own
buffer, so L2 is cold), PDL off:

* `stream P/W/U`: the stream lab's register stream (P programs of W warps, U loads in flight per thread);
* `tma P/BM/S`: P programs a SM, each looping over [BM, 256] int32 tiles fetched through a host tensor descriptor,
  S stages in flight (Triton's software pipelining), summed;
* `gemv-regs P/BR/BK/1` / `gemv-tma P/BR/BK/S`: a BF16 GEMV (3584 x 2560, the GLU's bytes) both ways;
* `q8p-regs P/BR/1` / `q8p-tma P/BR/S`: a Q8_0 GEMV with its quants and scales in two planes (tiles a descriptor
  can fetch) both ways, against `strata Q8_0_R`: the step's row-register GEMV at the same shape (random blocks);
  and `q4p-*`: 4-bit weights in planes (nibbles, fp16 scales and mins per 32: 160 bytes per 256 weights against
  Q4_K's 144) at the routed GLU's shape (12800 x 2560) both ways, against the step's Q4_K_R and Q4_K_RT there.

If the descriptor forms of the GEMVs come much closer to the streams than the step's GEMVs do, a type laid out in
planes and fed by bulk copies is worth building; if not, the GEMVs' excess is not their load pattern's.

    python tools/tma_lab.py --out tma-lab.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from strata.kernels import gemv as G  # noqa: E402
from strata.kernels import pdl  # noqa: E402
from strata.runtime.bench import copy_bandwidth, git_commit  # noqa: E402
from tools.gpu_check_gemv import time_graph  # noqa: E402
from tools.stream_lab import SLACK_WORDS, stream  # noqa: E402

LAYERS = 48
SIZES = {"hc 6.5 MB": 320 * 10240 * 2, "glu 18.4 MB": 12800 * 1440, "qkvz 44.7 MB": 16432 * 2720}
COLS = 256  # int32 values per TMA row: 1 KB, the widest box a descriptor allows


@triton.jit
def _read_tma(desc, out, ntiles, BM: tl.constexpr, STAGES: tl.constexpr):
    """out[p] = the sum of program p's [BM, 256] tiles (every num_programs-th), fetched through the descriptor."""
    p = tl.program_id(0)
    acc = tl.zeros([BM, 256], tl.int32)
    for t in tl.range(p, ntiles, tl.num_programs(0), num_stages=STAGES):
        acc += desc.load([t * BM, 0])
    tl.store(out + p, tl.sum(tl.sum(acc, axis=1), axis=0))


@triton.jit
def _gemv_bf16(desc, w, x, y, nblocks, K: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr, TMA: tl.constexpr,
               STAGES: tl.constexpr):
    """Persistent programs over row blocks of BR rows, each block's K loop in BK steps; TMA: tiles through the
    descriptor, else plain loads from w."""
    p = tl.program_id(0)
    for b in range(p, nblocks, tl.num_programs(0)):
        acc = tl.zeros([BR, BK], tl.float32)
        for kk in tl.range(0, K, BK, num_stages=STAGES):
            if TMA:
                wt = desc.load([b * BR, kk])
            else:
                r = b * BR + tl.arange(0, BR)
                wt = tl.load(w + r[:, None] * K + kk + tl.arange(0, BK)[None, :])
            xv = tl.load(x + kk + tl.arange(0, BK))
            acc += wt.to(tl.float32) * xv.to(tl.float32)[None, :]
        tl.store(y + b * BR + tl.arange(0, BR), tl.sum(acc, axis=1))


@triton.jit
def _q8_part(qd, sd, qp, sp, x, b, ks, K: tl.constexpr, BR: tl.constexpr, TMA: tl.constexpr):
    """One item of Q8_0 in planes (int8 quants [N, K], fp16 scales [N, K / 32]): BR rows' dot products over 256
    weights."""
    if TMA:
        q = qd.load([b * BR, ks * 256])
        d = sd.load([b * BR, ks * 8])
    else:
        r = b * BR + tl.arange(0, BR)
        q = tl.load(qp + r[:, None] * K + ks * 256 + tl.arange(0, 256)[None, :])
        d = tl.load(sp + r[:, None] * (K // 32) + ks * 8 + tl.arange(0, 8)[None, :])
    xv = tl.load(x + ks * 256 + tl.arange(0, 256)).to(tl.float32)
    dots = tl.sum(tl.reshape(q.to(tl.float32) * xv[None, :], [BR, 8, 32]), axis=2)
    return tl.sum(dots * d.to(tl.float32), axis=1)


@triton.jit
def _q4_part(qd, sd, md, qp, sp, mp, x, b, ks, K: tl.constexpr, BR: tl.constexpr, TMA: tl.constexpr):
    """One item of 4-bit weights in three planes (byte j of a 256-weight step: weight j in its low nibble, weight
    128 + j in its high; per 32 weights an fp16 scale and min: w = q * s - m; 160 bytes per 256 weights, Q4_K's 144
    with its 6-bit sub-block scales unpacked)."""
    if TMA:
        q = qd.load([b * BR, ks * 128])
        sc = sd.load([b * BR, ks * 8])
        mn = md.load([b * BR, ks * 8])
    else:
        r = b * BR + tl.arange(0, BR)
        q = tl.load(qp + r[:, None] * (K // 2) + ks * 128 + tl.arange(0, 128)[None, :])
        sc = tl.load(sp + r[:, None] * (K // 32) + ks * 8 + tl.arange(0, 8)[None, :])
        mn = tl.load(mp + r[:, None] * (K // 32) + ks * 8 + tl.arange(0, 8)[None, :])
    w = tl.reshape(tl.permute(tl.join(q & 15, q >> 4), (0, 2, 1)), [BR, 256]).to(tl.float32)
    xv = tl.reshape(tl.load(x + ks * 256 + tl.arange(0, 256)).to(tl.float32), [8, 32])
    dots = tl.sum(tl.reshape(w, [BR, 8, 32]) * xv[None, :, :], axis=2)
    return tl.sum(dots * sc.to(tl.float32) - mn.to(tl.float32) * tl.sum(xv, axis=1)[None, :], axis=1)


@triton.jit
def _gemv_planes(qd, sd, md, qp, sp, mp, x, y, nblocks, per, K: tl.constexpr, BR: tl.constexpr, BITS: tl.constexpr,
                 TMA: tl.constexpr, STAGES: tl.constexpr):
    """A GEMV over weights in planes (BITS 8: `_q8_part`, md / mp unused; 4: `_q4_part`): persistent programs,
    each over `per` row blocks of BR rows, the (row block, K step) items in one pipelined loop; TMA: tiles through
    the descriptors qd / sd / md, else plain loads from qp / sp / mp."""
    KS: tl.constexpr = K // 256
    first = tl.program_id(0) * per * KS
    last = tl.minimum(first + per * KS, nblocks * KS)
    acc = tl.zeros([BR], tl.float32)
    for i in tl.range(first, last, num_stages=STAGES):
        b = i // KS
        ks = i % KS
        if BITS == 8:
            part = _q8_part(qd, sd, qp, sp, x, b, ks, K, BR, TMA)
        else:
            part = _q4_part(qd, sd, md, qp, sp, mp, x, b, ks, K, BR, TMA)
        acc = acc * (ks != 0).to(tl.float32) + part
        if ks == KS - 1:
            tl.store(y + b * BR + tl.arange(0, BR), acc)


def q4p_dense(q: torch.Tensor, sc: torch.Tensor, mn: torch.Tensor) -> torch.Tensor:
    """The float weights of `_q4_part`'s planes: q (N, K / 2) uint8, sc and mn (N, K / 32)."""
    n = q.shape[0]
    steps = q.view(n, -1, 128).to(torch.int32)
    w = torch.cat([steps & 15, steps >> 4], dim=2).reshape(n, -1, 32).float()
    return (w * sc.float()[:, :, None] - mn.float()[:, :, None]).reshape(n, -1)


def main() -> int:
    from triton.tools.tensor_descriptor import TensorDescriptor

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--commit", default=None)
    args = ap.parse_args()
    pdl.set_enabled(False)
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    bw = copy_bandwidth(dev)
    rows: list[dict] = []

    def case(size: str, what: str, calls: list, nbytes: int, y: torch.Tensor | None = None,
             ref: torch.Tensor | None = None) -> None:
        """Time `calls`; with y and ref, also the first call's relative error (y its output, ref in float)."""
        try:
            s = time_graph(calls)
        except Exception as e:  # a variant Triton cannot compile here is a row, not the end of the lab
            print(f"{size:<14}{what:<24} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
            rows.append({"size": size, "launch": what, "error": f"{type(e).__name__}: {str(e)[:400]}"})
            return
        rows.append({"size": size, "launch": what, "us": s * 1e6, "bytes": nbytes, "fraction_of_copy": nbytes / s / bw})
        print(f"{size:<14}{what:<24}{s * 1e6:>9.2f} us{nbytes / s / bw:>8.2f} of copy", flush=True)
        if ref is not None:
            calls[0]()
            rows[-1]["max_rel_err"] = float((y - ref).abs().max() / ref.abs().max())

    for size, nbytes in SIZES.items():
        n = nbytes // 4
        nrows = -(-n // COLS)
        bufs = [torch.randint(-2**31, 2**31 - 1, (nrows * COLS + SLACK_WORDS,), dtype=torch.int32, device=dev)
                for _ in range(LAYERS)]
        out = torch.empty(sms * 64 + 4096, dtype=torch.int32, device=dev)
        for programs, warps, unroll in ((800, 8, 1), (1600, 4, 1), (528, 8, 4)):
            case(size, f"stream {programs}/{warps}/{unroll}",
                 [lambda b=b, p=programs, w=warps, u=unroll: stream(b[:n + SLACK_WORDS], out, p, w, u) for b in bufs],
                 nbytes)
        for per_sm, bm, stages in ((1, 16, 4), (1, 32, 4), (2, 16, 3), (2, 16, 4), (1, 64, 3), (4, 8, 4)):
            descs = [TensorDescriptor.from_tensor(b[:nrows * COLS].view(nrows, COLS), [bm, COLS]) for b in bufs]
            ntiles = -(-nrows // bm)
            grid = (sms * per_sm,)
            case(size, f"tma {per_sm}/{bm}/{stages}",
                 [lambda d=d, g=grid, nt=ntiles, m=bm, s=stages: _read_tma[g](d, out, nt, BM=m, STAGES=s, num_warps=4)
                  for d in descs], nbytes)
        del bufs
    # A BF16 GEMV of the routed GLU's bytes: 3584 x 2560 (18.4 MB).
    k_dim, n_rows = 2560, 3584
    ws = [torch.randn(n_rows, k_dim, device=dev).to(torch.bfloat16) for _ in range(LAYERS)]
    x = torch.randn(k_dim, device=dev).to(torch.bfloat16)
    y = torch.empty(n_rows, device=dev)
    nbytes = n_rows * k_dim * 2
    ref = ws[0].float() @ x.float()
    for per_sm, br, bk, stages, tma in ((4, 2, 512, 1, False), (8, 1, 512, 1, False), (1, 8, 256, 4, True),
                                        (2, 8, 256, 3, True), (1, 16, 256, 4, True), (2, 4, 256, 4, True),
                                        (4, 4, 128, 4, True)):
        descs = [TensorDescriptor.from_tensor(w, [br, bk]) for w in ws] if tma else ws
        grid = (sms * per_sm,)
        call = [lambda i=i, g=grid, b=br, kb=bk, s=stages, t=tma: _gemv_bf16[g](
            descs[i], ws[i], x, y, n_rows // b, K=k_dim, BR=b, BK=kb, TMA=t, STAGES=s, num_warps=4)
            for i in range(LAYERS)]
        case("gemv 18.4 MB", f"gemv-{'tma' if tma else 'regs'} {per_sm}/{br}/{bk}/{stages}", call, nbytes, y, ref)
    del ws
    # Q8_0 in planes against the step's Q8_0_R (below), at the qkvz group's shape and at about the GLU's bytes.
    for n_q in (16480, 7200):
        qs = [torch.randint(-127, 127, (n_q, k_dim), dtype=torch.int8, device=dev) for _ in range(LAYERS)]
        ds = [(torch.rand(n_q, k_dim // 32, device=dev) * 0.01).to(torch.float16) for _ in range(LAYERS)]
        yq = torch.empty(n_q, device=dev)
        ref = (qs[0].float().view(n_q, -1, 32) * ds[0].float()[:, :, None]).view(n_q, k_dim) @ x.float()
        q_bytes = n_q * k_dim * 34 // 32
        for per_sm, br, stages, tma in ((2, 16, 1, False), (4, 16, 1, False), (1, 16, 4, True), (2, 16, 4, True),
                                        (1, 32, 4, True), (2, 32, 3, True), (4, 16, 3, True)):
            nb = n_q // br
            grid = sms * per_sm
            per = -(-nb // grid)
            qds = [TensorDescriptor.from_tensor(q, [br, 256]) for q in qs] if tma else qs
            dds = [TensorDescriptor.from_tensor(d, [br, 8]) for d in ds] if tma else ds
            call = [lambda i=i, b=br, pr=per, g=grid, t=tma, st=stages: _gemv_planes[(g,)](
                qds[i], dds[i], dds[i], qs[i], ds[i], ds[i], x, yq, nb, pr, K=k_dim, BR=b, BITS=8, TMA=t, STAGES=st,
                num_warps=4) for i in range(LAYERS)]
            case(f"q8 {n_q}x{k_dim}", f"q8p-{'tma' if tma else 'regs'} {per_sm}/{br}/{stages}", call, q_bytes, yq,
                 ref)
        del qs, ds
    # 4-bit planes (160 bytes per 256 weights) at the routed GLU's shape, against the step's Q4_K_R(T) below.
    n_q = 12800
    qs = [torch.randint(0, 256, (n_q, k_dim // 2), dtype=torch.uint8, device=dev) for _ in range(LAYERS)]
    scs = [(torch.rand(n_q, k_dim // 32, device=dev) * 0.01).to(torch.float16) for _ in range(LAYERS)]
    mns = [(torch.rand(n_q, k_dim // 32, device=dev) * 0.01).to(torch.float16) for _ in range(LAYERS)]
    yq = torch.empty(n_q, device=dev)
    ref = q4p_dense(qs[0], scs[0], mns[0]) @ x.float()
    q_bytes = n_q * k_dim * 160 // 256
    for per_sm, br, stages, tma in ((2, 16, 1, False), (4, 8, 1, False), (1, 16, 4, True), (2, 16, 4, True),
                                    (1, 32, 4, True), (2, 8, 4, True)):
        nb = n_q // br
        grid = sms * per_sm
        per = -(-nb // grid)
        descs = [tuple(TensorDescriptor.from_tensor(t, box) for t, box in
                       ((qs[i], [br, 128]), (scs[i], [br, 8]), (mns[i], [br, 8]))) if tma else (qs[i], scs[i], mns[i])
                 for i in range(LAYERS)]
        call = [lambda i=i, b=br, pr=per, g=grid, t=tma, st=stages: _gemv_planes[(g,)](
            *descs[i], qs[i], scs[i], mns[i], x, yq, nb, pr, K=k_dim, BR=b, BITS=4, TMA=t, STAGES=st, num_warps=4)
            for i in range(LAYERS)]
        case(f"q4 {n_q}x{k_dim}", f"q4p-{'tma' if tma else 'regs'} {per_sm}/{br}/{stages}", call, q_bytes, yq, ref)
    del qs, scs, mns
    # The step's own kernels at the same bytes.
    xq = torch.randn(1, k_dim, device=dev).to(torch.bfloat16)
    flat = [torch.randint(0, 256, (12800, k_dim // 256 * 144), dtype=torch.uint8, device=dev) for _ in range(LAYERS)]
    for kind in ("Q4_K_R", "Q4_K_RT"):
        case(f"q4 12800x{k_dim}", f"strata {kind}",
             [lambda w=w, t=kind: G.gemv(xq, w, t, k_dim, out_dtype=torch.bfloat16) for w in flat], flat[0].numel())
    del flat
    for n_q in (16480, 7200):
        q8r = [torch.randint(0, 256, (n_q, k_dim // 256 * 272), dtype=torch.uint8, device=dev)
               for _ in range(LAYERS)]
        case(f"q8 {n_q}x{k_dim}", "strata Q8_0_R",
             [lambda w=w: G.gemv(xq, w, "Q8_0_R", k_dim, out_dtype=torch.bfloat16) for w in q8r], q8r[0].numel())
        del q8r
    result = {"commit": args.commit or git_commit(), "gpu": torch.cuda.get_device_name(dev),
              "triton": triton.__version__, "copy_bandwidth_Bps": bw, "layers": LAYERS, "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
