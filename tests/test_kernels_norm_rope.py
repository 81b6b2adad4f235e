"""The fused RMSNorm + RoPE kernel equals `norm_rope_ref` (run on the CPU by Triton's interpreter).

fp32: the kernel computes the reference's math with the same roundings; only the mean square's summation order
differs, so results agree to 1e-6 relative to the largest value. bf16: the kernel rounds the normalised value
where the reference does, then does the rotation in fp32 of the rounded operands and rounds once per output,
while the reference rounds each product and their sum in bf16; so it matches the reference to 1 bf16 ulp of the
row's largest value (and the single-rounding rotation of the reference's own normalised values but for the rare
normalised value that the mean square's summation order moves across a bf16 rounding boundary).
(The kernel rounds fp32 -> bf16 to nearest even by hand, so the interpreter's truncating cast never enters.)

Triton must be importable: a missing Triton is an error here, never a skip.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: run the kernels on the CPU

import pytest
import torch
import triton  # noqa: F401  (fails the module when Triton is missing)

from strata.config import ModelConfig
from strata.kernels import norm_rope
from strata.kernels.fused import fused_ops
from strata.model.norms import rms_norm
from strata.model.ops import Ops
from strata.model.qsa import apply_rope, norm_rope_ref, rope_tables
from strata.runtime.engine import Engine
from strata.weights.hf import load_hf
from tests import reference


def ulp_bf16(v: torch.Tensor) -> torch.Tensor:
    v = v.float().abs().clamp_min(2.0 ** -126)
    return torch.exp2(torch.floor(torch.log2(v)) - 7)


def inputs(L, heads, d, r, dtype, seed, strided=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(L, heads, 2 * d if strided else d, generator=g)[..., :d].to(dtype)  # a q-like slice
    scale = 1 + 0.2 * torch.randn(d, generator=g)
    ang = torch.rand(L, r, generator=g) * 6
    return x, scale, ang.cos().to(dtype), ang.sin().to(dtype)


# the real geometries' ratios (head d=256 / r=64, indexer d=128 / r=64) at tiny sizes, and odd ones
SHAPES = [(1, 2, 256, 64), (3, 4, 128, 64), (2, 3, 24, 8), (1, 1, 96, 96), (5, 1, 40, 16)]


@pytest.mark.parametrize("L,heads,d,r", SHAPES)
@pytest.mark.parametrize("strided", [False, True])
def test_norm_rope_fp32_matches_reference(L, heads, d, r, strided):
    x, scale, cos, sin = inputs(L, heads, d, r, torch.float32, seed=L * 31 + d, strided=strided)
    want = norm_rope_ref(x, scale, cos, sin, 1e-6)
    got = norm_rope.norm_rope(x, scale, cos, sin, 1e-6)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert (got - want).abs().max() <= 1e-6 * max(1.0, float(want.abs().max()))


@pytest.mark.parametrize("L,heads,d,r", SHAPES)
def test_norm_rope_bf16_matches_reference(L, heads, d, r):
    dt = torch.bfloat16
    for seed in range(3):
        x, scale, cos, sin = inputs(L, heads, d, r, dt, seed=seed * 7 + d, strided=seed == 1)
        want = norm_rope_ref(x, scale, cos, sin, 1e-6)
        got = norm_rope.norm_rope(x, scale, cos, sin, 1e-6)
        assert got.dtype == dt and got.shape == want.shape
        # 1 bf16 ulp of each row's largest value
        err = (got.float() - want.float()).abs()
        assert (err <= ulp_bf16(want.float().abs().amax(-1, keepdim=True))).all()
        # the single-rounding rotation of the reference's normalised values: equal but where the fp32 mean
        # square's summation order moves a normalised value across a bf16 rounding boundary (1 ulp)
        y = rms_norm(x, scale, 1e-6)
        single = apply_rope(y.float(), cos.float(), sin.float()).to(dt)
        assert (got != single).float().mean() < 0.02
        assert ((got[..., r:].float() - y[..., r:].float()).abs() <= ulp_bf16(y[..., r:])).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shapes", [((1, 4, 128), (1, 16, 256)), ((3, 2, 24), (3, 5, 40)), ((2, 1, 96), (2, 3, 96))])
def test_norm_rope_pair_is_two_norm_ropes_in_one_launch(dtype, shapes):
    """A QSA layer's indexer and attention queries (different heads and head dims, the second a strided slice)
    in one launch: the same bits as two `norm_rope` launches, which match the reference (tests above)."""
    (L, h1, d1), (_, h2, d2) = shapes
    r = 8 if min(d1, d2) < 64 else 64
    x1, s1, cos, sin = inputs(L, h1, d1, r, dtype, seed=d1)
    x2, s2, _, _ = inputs(L, h2, d2, r, dtype, seed=d2 + 1, strided=True)
    assert norm_rope.pair_supported([x1, x2], [s1, s2], cos)
    got = norm_rope.norm_ropes([x1, x2], [s1, s2], cos, sin, 1e-6)
    assert [g.shape for g in got] == [x1.shape, x2.shape] and all(g.dtype == dtype for g in got)
    assert got[0].equal(norm_rope.norm_rope(x1, s1, cos, sin, 1e-6))
    assert got[1].equal(norm_rope.norm_rope(x2, s2, cos, sin, 1e-6))
    assert not norm_rope.pair_supported([x1, x2[1:]], [s1, s2], cos)  # token counts differ
    assert not norm_rope.pair_supported([x1, x2.float() if dtype != torch.float32 else x2.half()], [s1, s2], cos)


def test_norm_ropes_entry_dispatch():
    """The fused table runs the pair kernel on forced or CUDA inputs, else the reference's loop over the given
    `norm_rope`; more than two tensors go through that loop too."""
    x1, s1, cos, sin = inputs(2, 2, 24, 8, torch.float32, seed=3)
    x2, s2, _, _ = inputs(2, 3, 40, 8, torch.float32, seed=4)
    want = [norm_rope_ref(x, s, cos, sin, 1e-6) for x, s in ((x1, s1), (x2, s2))]
    plain = fused_ops(Ops()).norm_ropes([x1, x2], [s1, s2], cos, sin, 1e-6, norm_rope_ref)
    assert all(g.equal(w) for g, w in zip(plain, want))
    calls = []
    forced = fused_ops(Ops(), force=True).norm_ropes([x1, x2], [s1, s2], cos, sin, 1e-6,
                                                     lambda *a: calls.append(a) or norm_rope_ref(*a))
    assert not calls and all((g - w).abs().max() <= 1e-6 * 4 for g, w in zip(forced, want))
    three = fused_ops(Ops(), force=True).norm_ropes([x1, x2, x1], [s1, s2, s1], cos, sin, 1e-6,
                                                    lambda *a: calls.append(a) or norm_rope_ref(*a))
    assert len(calls) == 3 and three[2].equal(want[0])


def test_norm_rope_with_model_tables():
    cfg = ModelConfig.from_hf_dict(reference.CONFIGS["tiny"])
    cos, sin = rope_tables(torch.tensor([0, 5, 17]), cfg, torch.float32)
    g = torch.Generator().manual_seed(11)
    x = torch.randn(3, cfg.num_attention_heads, cfg.head_dim, generator=g)
    scale = 1 + 0.1 * torch.randn(cfg.head_dim, generator=g)
    got = norm_rope.norm_rope(x, scale, cos, sin, cfg.rms_norm_eps)
    assert (got - norm_rope_ref(x, scale, cos, sin, cfg.rms_norm_eps)).abs().max() <= 1e-6 * 4


def test_fused_entry_dispatch():
    x, scale, cos, sin = inputs(2, 2, 24, 8, torch.float32, seed=0)
    assert fused_ops(Ops()).norm_rope(x, scale, cos, sin, 1e-6).equal(norm_rope_ref(x, scale, cos, sin, 1e-6))
    forced = fused_ops(Ops(), force=True).norm_rope(x, scale, cos, sin, 1e-6)
    assert (forced - norm_rope_ref(x, scale, cos, sin, 1e-6)).abs().max() <= 1e-6 * 4


@pytest.fixture(scope="module")
def tiny_weights(tmp_path_factory):
    # 4 indexer heads: with 2, exact-zero ReLU scores tie at the k-th block, which torch.topk breaks arbitrarily
    # and the selection kernel by lowest block index
    return load_hf(reference.save(reference.build("tiny", indexer_n_heads=4), tmp_path_factory.mktemp("tiny")))


@pytest.mark.parametrize("pair", [False, True])
def test_norm_rope_only_ops_match_reference(tiny_weights, pair):
    """Only norm_rope (and the query pair's op) replaced: the decode equals the reference path to fp32 summation
    order."""
    ref = Engine(tiny_weights)
    fused = fused_ops(Ops(), force=True)
    swaps = dict(norm_rope=fused.norm_rope, norm_ropes=fused.norm_ropes) if pair else dict(norm_rope=fused.norm_rope)
    fast = Engine(tiny_weights, ops=Ops(**swaps))
    ids = torch.randint(2, ref.cfg.vocab_size, (12,), generator=torch.Generator().manual_seed(5)).tolist()
    reference.assert_decodes_match(ref, fast, ids, prompt=4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_tables_match_reference(dtype):
    """One launch (`rope_at`) gives `Rope.at`'s four tables: the same fp32 angles, cos/sin within one fp32 ulp
    (the interpreter's numpy against torch), each rounded once to the model dtype (so at most one bf16 ulp
    apart where the fp32 values straddle a rounding boundary); positions up to the real context length."""
    from strata.model.qsa import Rope

    cfg = ModelConfig.from_hf_dict(reference.CONFIGS["tiny"])
    pos = torch.tensor([0, 3, 4, 5, 17, 4095, 131071, 262143])
    got, want = norm_rope.rope_at(pos, cfg, dtype), Rope.at(pos, cfg, dtype)
    for name in ("cos", "sin", "block_cos", "block_sin"):
        g, w = getattr(got, name), getattr(want, name)
        assert g.shape == w.shape == (len(pos), cfg.rotary_dim) and g.dtype == dtype, name
        tol = 2 ** -23 if dtype == torch.float32 else ulp_bf16(w)
        assert ((g.float() - w.float()).abs() <= tol).all(), name
    c = cfg.indexer_compress_ratio
    assert c > 1 and torch.equal(got.block_sin, norm_rope.rope_at(pos // c * c, cfg, dtype).sin)
    assert fused_ops(Ops()).rope is not Rope.at and fused_ops(Ops()).rope(pos, cfg, dtype).cos.equal(want.cos)


def test_rope_only_ops_match_reference(tiny_weights):
    """Only the RoPE tables replaced: the decode equals the reference path."""
    ref = Engine(tiny_weights)
    fast = Engine(tiny_weights, ops=Ops(rope=fused_ops(Ops(), force=True).rope))
    ids = torch.randint(2, ref.cfg.vocab_size, (12,), generator=torch.Generator().manual_seed(6)).tolist()
    reference.assert_decodes_match(ref, fast, ids, prompt=4)
