"""The MoE routing kernel alone, by how it picks the top k (run on the device box).

In the decode step the routing (softmax over 512 router logits, top 10, renormalise) ends ~4 us after the router
GEMV. This lab times the routing launch as 48 launches back to back in a CUDA graph with PDL (each its own bf16
logits), and asks how much of it the top-k is and whether another selection is faster:

* rounds: the engine's kernel (`strata.kernels.moe._route_kernel`: k rounds of argmax in one warp, value and index
  reduced together, ties to the lowest index);
* packed: the same rounds over one int64 key per expert (the probability's bits, then 2**B - 1 - index: larger
  for a larger probability and, among equal ones, a lower index), one value per shuffle;
* bitonic: a bitonic top-2**LOGK network over those keys (`topk_keys`): runs of 2**LOGK sorted with alternating
  directions, then neighbouring runs folded by an elementwise max (a descending and an ascending run give a
  bitonic run holding the pair's largest) and merged, level by level; all the work is independent compare-exchanges
  instead of k dependent reductions;

each with k = 10 and, for the cost without the selection, k = 1, in 1-4 warps. The three give the same ids and
weights (checked). Measured at bfce1eb (bench/results/2026-12-06-h100-route-lab-bfce1eb.json): rounds 3.79 us,
k = 1 1.33, packed 3.52, bitonic in four warps 2.62; in the step the bitonic network moved nothing
(*-step-variants-route-bfce1eb.json), so the engine keeps the rounds.

    python tools/route_lab.py --out route-lab.json
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

from strata.kernels import moe, pdl  # noqa: E402
from strata.kernels.hyper import TL_DTYPES  # noqa: E402
from strata.runtime.bench import git_commit  # noqa: E402

LAYERS, EXPERTS, TOP_K = 48, 512, 10


@triton.jit
def _bit(NDIM: tl.constexpr, b: tl.constexpr):
    """0/1 by bit b of the flat index, shaped to broadcast over a hypercube of NDIM axes (bit b: axis NDIM-1-b)."""
    return tl.reshape(tl.arange(0, 2), [1] * (NDIM - 1 - b) + [2] + [1] * b)


@triton.jit
def _cas(h, NDIM: tl.constexpr, b: tl.constexpr, want_max):
    """Every element against its partner across bit b (a ^ (a ^ b) = b): the larger where want_max, else the
    smaller."""
    other = h ^ tl.xor_sum(h, axis=NDIM - 1 - b, keep_dims=True)
    return tl.where(want_max, tl.maximum(h, other), tl.minimum(h, other))


@triton.jit
def _merge(h, NDIM: tl.constexpr, LOGR: tl.constexpr, desc):
    """Bitonic runs of 2**LOGR (the innermost bits) into sorted runs: descending where desc, else ascending."""
    for i in tl.static_range(LOGR):  # bits LOGR - 1 .. 0
        h = _cas(h, NDIM, LOGR - 1 - i, desc ^ (_bit(NDIM, LOGR - 1 - i) == 1))
    return h


@triton.jit
def topk_keys(keys, LOGN: tl.constexpr, LOGK: tl.constexpr):
    """The 2**LOGK largest of 2**LOGN distinct int64 keys, largest first ([2**LOGK])."""
    if LOGK == 0:
        return tl.max(keys, axis=0, keep_dims=True)
    h = tl.reshape(keys, [2] * LOGN)
    for s in tl.static_range(1, LOGK + 1):  # sorted runs of 2**s, descending where bit s is 0
        if s < LOGN:
            h = _merge(h, LOGN, s, _bit(LOGN, s) == 0)
        else:  # one run: the result
            h = _merge(h, LOGN, s, True)
    for f in tl.static_range(LOGN - LOGK):  # fold f: the hypercube has LOGN - f axes, then one fewer
        h = tl.max(h, axis=LOGN - f - 1 - LOGK)  # bit LOGK: runs 2m (descending) and 2m+1 (ascending)
        if f + 1 < LOGN - LOGK:
            h = _merge(h, LOGN - f - 1, LOGK, _bit(LOGN - f - 1, LOGK) == 0)
        else:
            h = _merge(h, LOGN - f - 1, LOGK, True)
    return tl.reshape(h, [2 ** LOGK])


@triton.jit
def _route_keys_kernel(logits_ptr, idx_ptr, w_ptr, E, K, stride_l, NORM: tl.constexpr, BE: tl.constexpr,
                       BK: tl.constexpr, DT: tl.constexpr, LOGBE: tl.constexpr, LOGBK: tl.constexpr,
                       BITONIC: tl.constexpr, GDC: tl.constexpr = False):
    """The routing over int64 keys: k rounds of a max (packed) or the bitonic network."""
    pdl.enter(GDC)
    row = tl.program_id(0)
    e = tl.arange(0, BE)
    em = e < E
    x = tl.load(logits_ptr + row * stride_l + e, mask=em, other=float("-inf")).to(tl.float32)
    ex = tl.where(em, tl.exp(x - tl.max(x, axis=0)), 0.0)
    p = ex / tl.sum(ex, axis=0)
    key = tl.where(em, (p.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (BE - 1 - e).to(tl.int64), -1)
    slots = tl.arange(0, BK)
    sm = slots < K
    if BITONIC:
        top = topk_keys(key, LOGBE, LOGBK)
    else:
        top = tl.zeros([BK], tl.int64) - 1
        for j in range(K):
            km = tl.max(key, axis=0)
            top = tl.where(slots == j, km, top)
            key = tl.where(key == km, -1, key)
    top_i = (BE - 1) - (top & 0xFFFFFFFF)
    top_w = tl.where(sm, (top >> 32).to(tl.int32).to(tl.float32, bitcast=True), 0.0)
    if NORM:
        top_w = top_w / tl.sum(top_w, axis=0)
    tl.store(idx_ptr + row * K + slots, top_i, mask=sm)
    tl.store(w_ptr + row * K + slots, top_w.to(DT), mask=sm)


def route(logits: torch.Tensor, k: int, how: str, warps: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, weights) of the rows of `logits` (normalised), the top k picked `how`: rounds | packed | bitonic."""
    L, E = logits.shape
    ids = torch.empty(L, k, dtype=torch.int64, device=logits.device)
    w = torch.empty(L, k, dtype=logits.dtype, device=logits.device)
    be, bk = triton.next_power_of_2(E), triton.next_power_of_2(k)
    common = dict(NORM=True, BE=be, BK=bk, DT=TL_DTYPES[logits.dtype], num_warps=warps,
                  **pdl.launch(logits.device, "route"))
    if how == "rounds":
        moe._route_kernel[(L,)](logits, ids, w, E, k, logits.stride(0), **common)
    else:
        _route_keys_kernel[(L,)](logits, ids, w, E, k, logits.stride(0), LOGBE=be.bit_length() - 1,
                                 LOGBK=bk.bit_length() - 1, BITONIC=how == "bitonic", **common)
    return ids, w


CASES = [("rounds", TOP_K, 1), ("rounds", 1, 1), ("rounds", TOP_K, 2), ("packed", TOP_K, 1), ("packed", 1, 1),
         ("packed", TOP_K, 4), ("bitonic", TOP_K, 1), ("bitonic", TOP_K, 2), ("bitonic", TOP_K, 4)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="write the report as JSON")
    ap.add_argument("--commit", help="commit id for the report (default: git rev-parse HEAD)")
    args = ap.parse_args()
    from tools.gpu_check_gemv import time_graph

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    logits = [(torch.randn(1, EXPERTS, device=dev, generator=g) * 3).to(torch.bfloat16) for _ in range(LAYERS)]
    want = route(logits[0], TOP_K, "rounds")
    same = {how: all(torch.equal(a, b) for a, b in zip(want, route(logits[0], TOP_K, how)))
            for how in ("packed", "bitonic")}
    rows = []
    for how, k, warps in CASES + CASES[:1]:  # the first case again: the spread
        us = time_graph([lambda x=x: route(x, k, how, warps) for x in logits]) * 1e6
        rows.append({"topk": how, "k": k, "warps": warps, "us_per_launch": round(us, 3)})
        print(f"{how:8s} k={k:2d} warps={warps}  {us:6.3f} us per launch")
    report = {"commit": args.commit or git_commit(), "gpu": torch.cuda.get_device_name(dev), "experts": EXPERTS,
              "launches": LAYERS, "same_ids_and_weights_as_rounds": same, "rows": rows}
    print("same ids and weights as the rounds:", same)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
