"""The first launch of a decode step run ahead (`DecodeStep.ids_ahead`): the step's own inputs advanced on the
device from the id the previous step chose, so the host launches the next step before it reads that id.

One program of one warp: the id copied in, the position incremented, and each PLE layer's n-gram history shifted
by one with the id appended (the twin of `strata.runtime.graph.feed_ref`). Every history value is loaded before
any is stored (one warp issues the load for all its lanes before the store, and a barrier separates them), so the
shift never reads a value it has already overwritten. Where PDL is on, the kernel lets the step's next launches
start at once (their weight loads overlap it; they wait for it to complete before reading its inputs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from strata.kernels import pdl


@triton.jit
def _feed_kernel(ints_ptr, tok_ptr, first, stride, NH: tl.constexpr, N: tl.constexpr, NHP: tl.constexpr,
                 NP: tl.constexpr, GDC: tl.constexpr = False):
    pdl.started(GDC)
    tok = tl.load(tok_ptr)
    pos = tl.load(ints_ptr + 1)
    h = tl.arange(0, NHP)[:, None]
    j = tl.arange(0, NP)[None, :]
    at = first + h * stride + j
    old = tl.load(ints_ptr + at + 1, mask=(h < NH) & (j < N - 1), other=0)
    new = tl.where(j == N - 1, tok, old)
    tl.debug_barrier()
    tl.store(ints_ptr + at, new, mask=(h < NH) & (j < N))
    tl.store(ints_ptr, tok)
    tl.store(ints_ptr + 1, pos + 1)


def feed(ints: torch.Tensor, token: torch.Tensor, starts: tuple[int, ...], n: int) -> None:
    """`feed_ref` in one launch. The histories' starts must be evenly spaced (the step lays them out so)."""
    if ints.dtype != torch.int64 or token.dtype != torch.int64 or not ints.is_contiguous():
        raise ValueError(f"feed: expected contiguous int64 inputs and an int64 id, got {ints.dtype}, {token.dtype}")
    stride = starts[1] - starts[0] if len(starts) > 1 else 0
    if any(b - a != stride for a, b in zip(starts, starts[1:])) or (len(starts) > 1 and stride < n):
        raise ValueError(f"feed: the n-gram histories' starts {starts} are not evenly spaced by at least n={n}")
    nh = len(starts)
    _feed_kernel[(1,)](ints, token, starts[0] if starts else 0, stride, NH=nh, N=max(n, 1),
                       NHP=triton.next_power_of_2(max(nh, 1)), NP=triton.next_power_of_2(max(n, 1)), num_warps=1,
                       GDC=pdl.active(ints.device))
