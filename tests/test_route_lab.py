"""tools/route_lab.py's kernels under Triton's interpreter (the timing runs on the device box): the bitonic top-k
network returns the largest keys in order, and the routing over int64 keys, by rounds or by the network, picks
the engine's experts with its weights, ties to the lowest index included."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from tests.tool_module import load_tool  # noqa: E402

lab = load_tool("route_lab")


@triton.jit
def _topk_kernel(x_ptr, o_ptr, LOGN: tl.constexpr, LOGK: tl.constexpr):
    tl.store(o_ptr + tl.arange(0, 2 ** LOGK), lab.topk_keys(tl.load(x_ptr + tl.arange(0, 2 ** LOGN)), LOGN, LOGK))


@pytest.mark.parametrize("logn,logk", [(9, 4), (10, 4), (3, 1), (4, 4), (5, 0), (6, 3), (1, 1)])
def test_topk_keys_is_the_sorted_top(logn: int, logk: int) -> None:
    g = torch.Generator().manual_seed(logn * 16 + logk)
    for _ in range(3):
        x = torch.randint(-(1 << 40), 1 << 40, (1 << logn,), generator=g)  # negative keys too
        assert x.unique().numel() == x.numel()
        out = torch.empty(1 << logk, dtype=torch.int64)
        _topk_kernel[(1,)](x, out, LOGN=logn, LOGK=logk)
        assert torch.equal(out, torch.sort(x, descending=True).values[: 1 << logk])


@pytest.mark.parametrize("how", ["packed", "bitonic"])
@pytest.mark.parametrize("E,k", [(512, 10), (100, 7), (8, 3), (6, 6)])
def test_key_routing_picks_the_engines_experts(how: str, E: int, k: int) -> None:
    g = torch.Generator().manual_seed(E + k)
    logits = (torch.randn(3, E, generator=g) * 3).to(torch.bfloat16)
    logits[1, : E // 2] = 1.0  # ties: the lowest index first
    logits[2] = -300.0  # all but one underflow to probability 0
    logits[2, E // 3] = 0.0
    want = lab.route(logits, k, "rounds")
    got = lab.route(logits, k, how)
    assert torch.equal(got[0], want[0])
    assert torch.equal(got[1], want[1])
