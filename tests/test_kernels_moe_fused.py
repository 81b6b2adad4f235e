"""The one-launch routed experts (`strata.kernels.moe_fused`) under Triton's interpreter: its partial sums,
added by the combine, give the pair of launches' result (GLU, down with the slot sum) and the model's combine bit
for bit, and the float64 products of the ggml blocks they were made from; what it refuses; and the op tables:
`experts` hands one token's partial sums to the combine, which the reference combine also takes."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from strata.kernels import fused, moe_fused  # noqa: E402
from strata.kernels import gemv as G  # noqa: E402
from strata.kernels import ops as K_OPS  # noqa: E402
from strata.model.moe import PartialSums, moe_combine_ref  # noqa: E402
from strata.model.ops import Ops  # noqa: E402
from strata.weights import repack  # noqa: E402
from tests.test_kernels_gemv_rr import ggml_rows  # noqa: E402

E, H, I, K = 3, 512, 128, 2


@pytest.fixture(autouse=True)
def enabled(monkeypatch) -> None:
    monkeypatch.setattr(moe_fused, "ENABLED", True)


def stacks(seed: int) -> dict:
    """Expert stacks as the GPU stores them (gate/up Q4_K_RT, down Q5_1_R) and their float64 weights."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, kind, rows, k in (("gate", "Q4_K_R", I, H), ("up", "Q4_K_R", I, H), ("down", "Q5_1_R", H, I)):
        data, ref = ggml_rows(kind, E * rows, k, rng)
        data = data.reshape(E, rows, -1)
        if kind == "Q4_K_R":
            data = repack.tile_major(data, 4, 288)
        out[name], out[name + "_f64"] = data.contiguous(), ref.reshape(E, rows, k)
    return out


def inputs(seed: int, dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, H, generator=gen).to(dtype)
    ids = torch.randperm(E, generator=gen)[:K].to(torch.int32)
    sw = torch.softmax(torch.randn(K, generator=gen), 0).to(dtype)
    gate = torch.randn(1, 1, generator=gen).to(dtype)
    shared = (torch.randn(1, H, generator=gen) * 0.1).to(dtype)
    return x, ids, sw, gate, shared


def pair(st: dict, x: torch.Tensor, ids: torch.Tensor, sw: torch.Tensor) -> torch.Tensor:
    h = G.gemv_experts_glu(x, st["gate"], st["up"], ids, "Q4_K_RT", H, out_dtype=x.dtype)
    return G.gemv_experts_sum(h, st["down"], ids, sw, "Q5_1_R", I, out_dtype=x.dtype, ids_settled=True)


def raws(st: dict) -> tuple[tuple[torch.Tensor, str], ...]:
    return (st["gate"], "Q4_K_RT"), (st["up"], "Q4_K_RT"), (st["down"], "Q5_1_R")


@pytest.mark.parametrize("shape", [moe_fused.Shape(1, 128, 4, 1, 32), moe_fused.Shape(2, 256, 4, 2, 64),
                                   moe_fused.Shape(4, 128, 2, 2, 32)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_partial_sums_combine_to_the_pairs_result(shape: moe_fused.Shape, dtype: torch.dtype) -> None:
    st = stacks(11)
    x, ids, sw, gate, shared = inputs(2, dtype)
    assert moe_fused.supported(x, *raws(st), ids, shape)
    parts = moe_fused.experts(x, *raws(st), ids, sw, shape)
    assert parts.parts.shape == (K, I // (32 * shape.nb), H)
    routed = pair(st, x, ids, sw)
    if dtype == torch.bfloat16:  # the fp32 sums' other order is below bf16's rounding here
        assert torch.equal(parts.total(), routed)
    else:
        assert (parts.total() - routed).abs().max() <= 1e-6 * routed.abs().max()
        routed = parts.total()
    got = moe_fused.combine_parts(parts, gate, shared, shape)
    assert torch.equal(got, moe_combine_ref(routed, gate, shared))
    # the float64 products of the ggml blocks, h rounded as the model rounds it
    want = torch.zeros(H, dtype=torch.float64)
    for j, e in enumerate(ids.tolist()):
        g = (st["gate_f64"][e] @ x[0].double()).to(dtype)
        u = (st["up_f64"][e] @ x[0].double()).to(dtype)
        h = (F.silu(g.float()).to(dtype) * u).to(dtype)
        want += float(sw[j]) * (st["down_f64"][e] @ h.double())
    assert (routed[0].double() - want).abs().max() <= 0.02 * want.abs().max()


def test_refuses_what_it_does_not_tile() -> None:
    st = stacks(12)
    x, ids, *_ = inputs(3)
    g, u, d = raws(st)
    assert moe_fused.supported(x, g, u, d, ids)
    assert not moe_fused.supported(torch.cat([x, x]), g, u, d, ids)  # two tokens
    assert not moe_fused.supported(x, (st["gate"], "Q4_K_R"), (st["up"], "Q4_K_R"), d, ids)
    assert not moe_fused.supported(x, g, u, (st["down"], "Q8_0_R"), ids)
    assert not moe_fused.supported(x, g, u, d, ids, moe_fused.Shape(nb=8))  # a chunk wider than a group of four
    assert not moe_fused.supported(x, g, u, d, ids, moe_fused.Shape(rd=384))  # rows per step not dividing H
    moe_fused.ENABLED = False  # (the fixture puts it back)
    assert not moe_fused.supported(x, g, u, d, ids)


def test_op_tables_hand_the_partial_sums_to_the_combine(monkeypatch) -> None:
    """`experts_blocks` returns one token's partial sums (two tokens' result as before); the fused table's combine
    adds them in its kernel, the reference combine by `PartialSums.total`, to the same bits."""
    st = stacks(13)
    x, ids, sw, gate, shared = inputs(4)
    out = K_OPS.experts_blocks(x, ids[None], sw[None], *raws(st))
    assert isinstance(out, PartialSums)
    two = K_OPS.experts_blocks(torch.cat([x, x]), torch.stack([ids, ids]), torch.stack([sw, sw]), *raws(st))
    assert isinstance(two, torch.Tensor) and torch.equal(two[0], two[1])
    one = out.total().float()  # within a bf16 step (the interpreter truncates the slot sum's cast to bf16)
    assert ((two[:1].float() - one).abs() <= one.abs() * 2.0 ** -7).all()
    ref = moe_combine_ref(out, gate, shared)
    assert torch.equal(ref, moe_combine_ref(out.total(), gate, shared))
    forced = fused.fused_ops(Ops(), force=True)
    calls = []
    monkeypatch.setattr(moe_fused, "combine_parts", lambda *a: (calls.append(1), ref)[1])
    assert forced.moe_combine(out, gate, shared) is ref and calls  # the kernel's entry took it
    monkeypatch.undo()
    assert torch.equal(forced.moe_combine(out, gate, shared), ref)
    assert torch.equal(fused.fused_ops(Ops()).moe_combine(out, gate, shared), ref)  # CPU: the reference's entry
