"""The fused MoE decode kernels (routing, combine) equal their references, under Triton's CPU interpreter.

Routing: in fp32 the kernel's softmax differs from torch's only in fp32 rounding (exp, the sum's order), so
probabilities agree to a few ulps and, on random logits whose k-th and (k+1)-th probabilities are far apart
compared to that, the chosen experts and their order are identical. Equal probabilities are taken lowest index
first, checked against a stable sort. bf16 weights may differ by one bf16 ulp (the interpreter truncates the
final cast where the GPU rounds to nearest even).

Router (the router GEMV and the routing in one launch): compared with the composition it replaces on the GPU,
the GEMV `linears` (logits rounded to x's dtype at the store) then `route`. The kernel reads the same stored
weights and accumulates in fp32, in another order: with fp32 x the logits, hence the routing weights and the gate
logit, agree to a few fp32 ulps (1e-6 relative); with bf16 x both round the logits to bf16, where a few-ulp fp32
difference crosses a rounding boundary with probability ~2^-14 per logit, which the seeded draws here do not
do, so everything is equal bit for bit (the routing is `route`'s own code). The ids are equal in every case:
the draws' top-k gaps are far above those ulps, and exact ties (duplicated rows, zero input) break alike.

Triton must be importable: a missing Triton is an error here, never a skip.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: run the kernels on the CPU

import pytest
import torch
import triton  # noqa: F401  (fails the module when Triton is missing)

from strata.kernels import gemv, moe
from strata.kernels import ops as K_OPS
from strata.kernels.fused import fused_ops
from strata.model.moe import moe_combine_ref, moe_layer, route_ref, router_ref
from strata.model.ops import Ops, linear_ref, linears_ref
from strata.runtime import placement
from strata.runtime.engine import Engine
from strata.weights.hf import load_hf
from strata.weights.quant_tensor import QuantTensor
from strata.weights.tensor import DenseTensor
from tests import reference


# ------------------------------------------------------------------------------------------------ routing
@pytest.mark.parametrize("L,E,k", [(1, 512, 10), (3, 100, 7), (8, 1024, 16), (2, 4, 2), (1, 5, 1), (1, 6, 6)])
@pytest.mark.parametrize("norm", [True, False])
def test_route_matches_reference(L, E, k, norm):
    g = torch.Generator().manual_seed(E * 31 + k)
    logits = torch.randn(L, E, generator=g) * 3
    want_i, want_w = route_ref(logits, k, norm)
    got_i, got_w = moe.route(logits, k, norm)
    assert got_i.dtype == torch.int64 and got_w.dtype == torch.float32
    assert got_i.shape == got_w.shape == (L, k)
    assert torch.equal(got_i, want_i)
    assert torch.allclose(got_w, want_w, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("norm", [True, False])
def test_route_bf16_and_strided_rows(norm):
    g = torch.Generator().manual_seed(7)
    wide = (torch.randn(4, 700, generator=g) * 2).to(torch.bfloat16)
    logits = wide[:, :512]  # row stride 700
    # bf16 logits tie often: compare the sets via the stable order and the weights loosely
    got_i, got_w = moe.route(logits, 10, norm)
    probs = torch.softmax(logits.float(), -1)
    want_i = torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :10]
    assert torch.equal(got_i, want_i)
    _, want_w = route_ref(logits, 10, norm)
    assert got_w.dtype == torch.bfloat16
    assert torch.allclose(got_w.float(), want_w.float(), atol=0, rtol=2 ** -7)


def test_route_ties_take_the_lowest_index():
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0, 2.0, -1.0, 1.0, 2.0],
                           [1.0] * 8,
                           [-50.0, 0.0, -60.0, -200.0, -150.0, -65.0, -300.0, -90.0]])  # three underflow to 0
    for k in (1, 3, 5, 8):
        got_i, got_w = moe.route(logits, k, True)
        probs = torch.softmax(logits, -1)
        want = torch.sort(probs, dim=-1, descending=True, stable=True)
        assert torch.equal(got_i, want.indices[:, :k])
        top = want.values[:, :k]
        assert torch.allclose(got_w, top / top.sum(-1, keepdim=True), atol=1e-6, rtol=1e-5)


# ------------------------------------------------------------------------------------------------ router
def _router_weights(E: int, H: int, dtype: torch.dtype, fused: bool, g: torch.Generator,
                    gate_rows: int = 1) -> tuple[DenseTensor, DenseTensor]:
    """Router (E, H) and shared-expert gate (gate_rows, H) weights, stored back to back as `place` leaves them
    (`fused`) or as two tensors."""
    r = DenseTensor("router", (torch.randn(E, H, generator=g) * 0.3).to(dtype))
    gi = DenseTensor("sh_gate_inp", (torch.randn(gate_rows, H, generator=g) * 0.3).to(dtype))
    if fused:
        r, gi = placement.fuse_rows([r, gi])
        assert K_OPS.adjacent_span([r.tensor, gi.tensor]) is not None
    return r, gi


def _gpu_composition(monkeypatch, a, r, gi, k, norm):
    """What the GPU computes without the fused router: the GEMV `linears`, then the `route` kernel."""
    monkeypatch.setattr(K_OPS, "_on_gpu", lambda x: True)  # run the CUDA entries under the interpreter
    return router_ref(a, r, gi, k, norm, K_OPS.linears_triton, K_OPS.linear_triton, moe.route)


def _assert_router_equal(got, want, xdtype) -> None:
    (gi, gw, gg), (wi, ww, wg) = got, want
    assert gi.dtype == torch.int64 and gw.dtype == gg.dtype == xdtype
    assert gi.shape == wi.shape and gw.shape == ww.shape and gg.shape == wg.shape
    assert torch.equal(gi, wi)
    if xdtype == torch.float32:  # fp32 logits summed in another order: a few ulps
        assert torch.allclose(gw, ww, rtol=1e-6, atol=1e-7)
        assert torch.allclose(gg, wg, rtol=1e-6, atol=1e-6 * wg.abs().max().item())
    else:  # logits rounded to x's dtype by both: the same bits
        assert torch.equal(gw, ww) and torch.equal(gg, wg)


def _tickets_clear() -> bool:
    return not gemv.tickets(torch.device("cpu")).any()


@pytest.mark.parametrize("E,H,k,L,wdtype,xdtype,norm,fused", [
    (64, 96, 8, 1, torch.float32, torch.bfloat16, True, True),  # the real model's case: F32 rows, bf16 x
    (64, 96, 4, 1, torch.float32, torch.float32, False, True),
    (40, 256, 6, 1, torch.bfloat16, torch.bfloat16, False, False),  # two tensors: two row pointers
    (40, 256, 5, 1, torch.bfloat16, torch.float32, True, True),
    (64, 96, 8, 3, torch.float32, torch.bfloat16, True, False),  # a short verify batch
    (40, 100, 4, 2, torch.float32, torch.float32, True, True),  # H not a multiple of the chunk: masked loads
])
def test_router_matches_the_two_launch_composition(monkeypatch, E, H, k, L, wdtype, xdtype, norm, fused):
    g = torch.Generator().manual_seed(E * 7 + H + k + L)
    r, gi = _router_weights(E, H, wdtype, fused, g)
    a = torch.randn(L, H, generator=g).to(xdtype)
    got = moe.router(a, r, gi, k, norm)
    assert _tickets_clear()  # every counter is back at 0: a graph replay starts from the same state
    _assert_router_equal(got, _gpu_composition(monkeypatch, a, r, gi, k, norm), xdtype)
    assert all(torch.equal(x, y) for x, y in zip(moe.router(a, r, gi, k, norm), got, strict=True))  # again
    if wdtype == xdtype == torch.float32:  # and the plain PyTorch reference (same math, fp32 throughout)
        _assert_router_equal(got, router_ref(a, r, gi, k, norm, linears_ref, linear_ref, route_ref), xdtype)


@pytest.mark.parametrize("kw", [dict(block_rows=1, split_k=1), dict(block_rows=4, split_k=3, block_k=16),
                                dict(block_rows=8, split_k=2, block_k=32, num_warps=2)])
def test_router_knobs(monkeypatch, kw):
    """Other launch shapes (one split, several chunks per split, more rows per tile, a gate of 3 rows) give
    the same routing."""
    g = torch.Generator().manual_seed(5)
    r, gi = _router_weights(48, 128, torch.float32, True, g, gate_rows=3)
    for xdtype in (torch.bfloat16, torch.float32):
        a = torch.randn(2, 128, generator=g).to(xdtype)
        got = moe.router(a, r, gi, 6, True, **kw)
        assert _tickets_clear()
        _assert_router_equal(got, _gpu_composition(monkeypatch, a, r, gi, 6, True), xdtype)


@pytest.mark.parametrize("xdtype", [torch.float32, torch.bfloat16])
def test_router_ties_take_the_lowest_index(xdtype):
    """Equal logits (rows stored several times give the same sums; a zero input makes every logit 0) are taken
    lowest expert index first, as `route` takes them."""
    g = torch.Generator().manual_seed(9)
    w = torch.randn(40, 64, generator=g) * 0.1
    w[2] = torch.randn(64, generator=g).abs() * 0.5
    w[[7, 19, 33]] = w[2].clone()  # four equal winners
    w[4] = torch.randn(64, generator=g).abs() * 0.3
    w[[11, 25]] = w[4].clone()  # three equal runners-up
    r, gi = DenseTensor("router", w), DenseTensor("gate", torch.randn(1, 64, generator=g))
    a = torch.randn(1, 64, generator=g).abs().to(xdtype)
    top_i, top_w, _ = moe.router(a, r, gi, 8, True)
    assert top_i[0, :7].tolist() == [2, 7, 19, 33, 4, 11, 25]
    assert (top_w[0, :4] == top_w[0, 0]).all() and (top_w[0, 4:7] == top_w[0, 4]).all()
    logits = (a.float() @ w.T).to(xdtype).float()
    want = torch.sort(torch.softmax(logits, -1), dim=-1, descending=True, stable=True)
    assert torch.equal(top_i, want.indices[:, :8])
    zero_i, zero_w, zero_g = moe.router(torch.zeros(1, 64, dtype=xdtype), r, gi, 5, False)
    assert zero_i.tolist() == [[0, 1, 2, 3, 4]] and torch.equal(zero_w, torch.full((1, 5), 1 / 40).to(xdtype))
    assert not zero_g.any() and _tickets_clear()


def test_router_entry_dispatch(monkeypatch):
    """The fused entry runs the kernel where it applies; elsewhere (no force on the CPU, quantized weights,
    more tokens than MAX_L, more experts than MAX_E) the composition it replaces (`base.router` over the table's
    own `linears` and `route`), bit for bit."""
    calls = reference.count_calls(monkeypatch, {"router": (moe, "router")})
    g = torch.Generator().manual_seed(12)
    r, gi = _router_weights(16, 64, torch.float32, True, g)
    plain, forced, ref = fused_ops(Ops()), fused_ops(Ops(), force=True), Ops()

    def call(ops, a, rw, gw, k=3, fn=None):
        return (fn or ops.router)(a, rw, gw, k, True, ops.linears, ops.linear, ops.route)

    a = torch.randn(1, 64, generator=g)
    _assert_router_equal(call(forced, a, r, gi), call(ref, a, r, gi), torch.float32)
    assert calls["router"] == 1
    assert all(torch.equal(x, y) for x, y in zip(call(plain, a, r, gi), call(ref, a, r, gi), strict=True))
    q = QuantTensor("router_q8", torch.randint(0, 255, (16, 68), dtype=torch.uint8, generator=g), 8, (16, 64))
    q.data[:, [1, 35]] = 0x2C  # the blocks' fp16 scales ~0.06
    big_e = DenseTensor("router_big", torch.randn(moe.MAX_E + 1, 64, generator=g))
    for args in ((torch.randn(moe.MAX_L + 1, 64, generator=g), r, gi), (a, q, gi), (a, big_e, gi)):
        got, want = call(forced, *args), call(forced, *args, fn=router_ref)
        assert all(torch.equal(x, y) for x, y in zip(got, want, strict=True))
    assert calls["router"] == 1


def test_moe_layer_with_the_router_kernel_matches_reference(tiny_weights, monkeypatch):
    """`moe_layer` through `fused_ops(force=True)` runs the router kernel (over the router and gate stored
    apart and back to back) and gives the reference path's output."""
    calls = reference.count_calls(monkeypatch, {"router": (moe, "router")})
    fused_w = placement.fuse_groups(tiny_weights)
    cfg = tiny_weights.cfg
    g = torch.Generator().manual_seed(21)
    for weights in (tiny_weights, fused_w):
        for L in (1, 3):
            a = torch.randn(L, cfg.hidden_size, generator=g)
            want = moe_layer(a, tiny_weights, 0, cfg, Ops())
            got = moe_layer(a, weights, 0, cfg, fused_ops(Ops(), force=True))
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    assert calls["router"] == 4


# ------------------------------------------------------------------------------------------------ combine
@pytest.mark.parametrize("L,H,dtype,bh", [(1, 64, torch.float32, 1024), (3, 2560, torch.float32, 1024),
                                          (2, 100, torch.bfloat16, 32)])
def test_moe_combine_matches_reference(L, H, dtype, bh):
    g = torch.Generator().manual_seed(H)
    routed, shared = (torch.randn(L, H, generator=g).to(dtype) for _ in range(2))
    gate = (torch.randn(L, 1, generator=g) * 3).to(dtype)
    got = moe.moe_combine(routed, gate, shared, bh=bh)
    want = moe_combine_ref(routed, gate, shared)
    assert got.dtype == dtype
    if dtype == torch.float32:
        assert torch.allclose(got, want, atol=1e-6, rtol=0)
    else:  # each of the three rounded intermediates may be one bf16 ulp off (interpreter truncation)
        assert torch.allclose(got.float(), want.float(), atol=4 * 2 ** -8 * want.float().abs().max().item(), rtol=0)


# ------------------------------------------------------------------------------------------------ op table
def test_fused_entries_dispatch():
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(2, 16, generator=g)
    plain, forced = fused_ops(Ops()), fused_ops(Ops(), force=True)
    for ops in (plain, forced):
        i, w = ops.route(logits, 3, True)
        want_i, want_w = route_ref(logits, 3, True)
        assert torch.equal(i, want_i) and torch.allclose(w, want_w, atol=1e-6, rtol=0)
    # too many tokens or experts for the kernel: the reference, bit for bit
    for big in (torch.randn(9, 16, generator=g), torch.randn(1, 2048, generator=g)):
        assert all(torch.equal(a, b) for a, b in zip(forced.route(big, 3, False), route_ref(big, 3, False)))
    r, s, gt = torch.randn(9, 8, generator=g), torch.randn(9, 8, generator=g), torch.randn(9, 1, generator=g)
    assert torch.equal(forced.moe_combine(r, gt, s), moe_combine_ref(r, gt, s))
    assert torch.equal(plain.moe_combine(r[:1], gt[:1], s[:1]), moe_combine_ref(r[:1], gt[:1], s[:1]))


# ------------------------------------------------------------------------------------------------ whole model
@pytest.fixture(scope="module")
def tiny_weights(tmp_path_factory):
    return load_hf(reference.save(reference.build("tiny"), tmp_path_factory.mktemp("tiny")))


def test_tiny_model_decode_with_moe_kernels_matches_reference(tiny_weights):
    """Prefill 5 tokens and decode 8 with every fused entry (routing and combine included) forced on, through
    the engine and through the fixed-capacity step the GPU captures (run eagerly)."""
    ref = Engine(tiny_weights)
    fast = Engine(tiny_weights, ops=fused_ops(Ops(), force=True))
    ids = torch.randint(2, ref.cfg.vocab_size, (13,), generator=torch.Generator().manual_seed(4)).tolist()
    reference.assert_decodes_match(ref, fast, ids, prompt=5, capacity=32)


@pytest.mark.parametrize("T,k,N", [(1, 10, 2560), (3, 2, 100), (2, 1, 7)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_slot_sum_is_the_weighted_sum_in_slot_order(T, k, N, dtype):
    g = torch.Generator().manual_seed(T * 100 + k)
    y = torch.randn(T * k, N, generator=g)
    w = torch.softmax(torch.randn(T, k, generator=g), -1).to(dtype)
    got = moe.slot_sum(y, w, dtype)
    acc = torch.zeros(T, N)
    for j in range(k):  # the kernel's order: slot 0 first
        acc += y.view(T, k, N)[:, j] * w[:, j, None].float()
    want = acc.to(dtype)
    if dtype == torch.float32:
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-6)
    else:  # the interpreter truncates fp32 -> bf16 where torch rounds: one bf16 ulp
        assert ((got.float() - want.float()).abs() <= want.float().abs() * 2 ** -7 + 1e-30).all()
    w2 = w.clone()
    w2[0, 0] += 0.5
    assert not torch.equal(moe.slot_sum(y, w2, dtype), got)
