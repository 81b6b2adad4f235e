"""The fused MoE decode kernels (routing, combine) equal their references, under Triton's CPU interpreter.

Routing: in fp32 the kernel's softmax differs from torch's only in fp32 rounding (exp, the sum's order), so
probabilities agree to a few ulps and, on random logits whose k-th and (k+1)-th probabilities are far apart
compared to that, the chosen experts and their order are identical. Equal probabilities are taken lowest index
first, checked against a stable sort. bf16 weights may differ by one bf16 ulp (the interpreter truncates the
final cast where the GPU rounds to nearest even).

Triton must be importable: a missing Triton is an error here, never a skip.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: run the kernels on the CPU

import pytest
import torch
import triton  # noqa: F401  (fails the module when Triton is missing)

from strata.kernels import moe
from strata.kernels.fused import fused_ops
from strata.model.moe import moe_combine_ref, route_ref
from strata.model.ops import Ops
from strata.runtime.engine import Engine
from strata.weights.hf import load_hf
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
