"""The fused Triton kernels equal their reference twins (run on the CPU by Triton's interpreter).

Shapes are tiny because the interpreter executes every program in Python. Tolerances: in float32 each kernel
computes the reference's math with the same roundings and only a different fp32 accumulation order (dot
products of <= 64 terms, softmax sums, GEMV rows), so results agree to a few fp32 ulps of the values' scale;
1e-5 absolute on O(1) values leaves ~50x headroom. bf16 checks here are loose (4 bf16 ulps of the largest value):
Triton's interpreter truncates fp32 -> bf16 casts where the GPU rounds to nearest even, so each rounded
intermediate may be one ulp off the reference's; tools/gpu_check_fused.py checks bf16 on the GPU.

Triton must be importable: a missing Triton is an error here, never a skip.
"""

from __future__ import annotations

import math
import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: run the kernels on the CPU

import pytest
import torch
import triton  # noqa: F401  (fails the module when Triton is missing)

from strata.config import ModelConfig
from strata.kernels import attention, gdn, hyper, sample
from strata.kernels.fused import fused_ops
from strata.model.attention import attend_ref
from strata.model.gdn import GDNParams, gdn_core_ref
from strata.model.hyper import hc_read_ref
from strata.model.ops import Ops, linear_ref
from strata.model.qsa import select_tokens
from strata.runtime.engine import Engine
from strata.runtime.state import GDNState, QSAState
from strata.weights.hf import load_hf
from strata.weights.tensor import DenseTensor
from tests import reference


def config(**overrides) -> ModelConfig:
    return ModelConfig.from_hf_dict(dict(reference.CONFIGS["tiny"], **overrides))


# ------------------------------------------------------------------------------------------------ GDN
@pytest.mark.parametrize("order,gate", [("grouped", "silu"), ("tiled", "sigmoid")])
def test_gdn_step_matches_reference(order, gate):
    cfg = config(output_gate_type=gate)
    g = torch.Generator().manual_seed(1)
    C, nv, dk, dv, K = (cfg.gdn_conv_dim, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                        cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim)
    rnd = lambda *s: torch.randn(*s, generator=g)
    prm = GDNParams(rnd(C, K) * 0.5, -torch.rand(nv, generator=g) * 2, rnd(nv), rnd(dv), order)
    ref = GDNState(rnd(C, K - 1), rnd(nv, dk, dv))
    ours = ref.clone()
    for step in range(3):  # the state written by one step feeds the next
        x, z, b, a = rnd(1, C), rnd(1, nv * dv), rnd(1, nv), rnd(1, nv) * 4
        if step == 2:
            a[0, 0] = 30.0  # softplus past its threshold of 20
        want = gdn_core_ref(x, z, b, a, prm, ref, cfg)
        got = gdn.gdn_step(x, z, b, a, prm, ours, cfg, block_v=8)
        assert torch.allclose(got, want, atol=1e-5, rtol=0)
        assert torch.equal(ours.conv, ref.conv)
        assert torch.allclose(ours.recurrent, ref.recurrent, atol=1e-5, rtol=0)


class _NoLaunch:
    def __getitem__(self, grid):
        raise AssertionError("the one-launch path launched the second kernel")


@pytest.mark.parametrize("order,gate,dtype,K,block_v,heads", [
    ("grouped", "silu", torch.float32, 4, 8, (2, 4)), ("tiled", "sigmoid", torch.float32, 4, 8, (2, 4)),
    ("tiled", "silu", torch.bfloat16, 2, 16, (1, 2)), ("grouped", "sigmoid", torch.float32, 3, 4, (2, 2))])
@pytest.mark.parametrize("early", [True, False])
def test_gdn_step_one_launch_equals_two(monkeypatch, order, gate, dtype, K, block_v, heads, early):
    """The ticketed one-launch step (norm by the last program of each value head, q / k window shift by the
    last program of each key head) gives the two-launch path's bits: output, conv window and state, over
    consecutive tokens (each window shift feeds the next conv); the ticket counters are back at zero. With the
    stored weights and gate inputs loaded early (`EARLY_LOADS`) or by the last program alike."""
    from strata.kernels import gemv

    monkeypatch.setattr(gdn, "EARLY_LOADS", early)

    cfg = config(output_gate_type=gate, linear_conv_kernel_dim=K, linear_num_key_heads=heads[0],
                 linear_num_value_heads=heads[1])
    g = torch.Generator().manual_seed(5)
    C, nv, dk, dv = (cfg.gdn_conv_dim, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                     cfg.linear_value_head_dim)
    rnd = lambda *s: torch.randn(*s, generator=g)
    prm = GDNParams(rnd(C, K) * 0.5, -torch.rand(nv, generator=g) * 2, rnd(nv), rnd(dv), order)
    one = GDNState(rnd(C, K - 1).to(dtype), rnd(nv, dk, dv))
    two = one.clone()
    cnt = gemv.tickets(torch.device("cpu"))
    for _ in range(4):
        x, z, b, a = (t.to(dtype) for t in (rnd(1, C), rnd(1, nv * dv), rnd(1, nv), rnd(1, nv) * 4))
        with monkeypatch.context() as m:
            m.setattr(gdn, "tickets", lambda device: None)
            want = gdn.gdn_step(x, z, b, a, prm, two, cfg, block_v=block_v)
        with monkeypatch.context() as m:
            m.setattr(gdn, "_gdn_out_kernel", _NoLaunch())
            got = gdn.gdn_step(x, z, b, a, prm, one, cfg, block_v=block_v)
        assert torch.equal(got, want)
        assert torch.equal(one.conv, two.conv)
        assert torch.equal(one.recurrent, two.recurrent)
        assert int(cnt.abs().sum()) == 0
    assert torch.equal(one.conv[:, -1], x[0])  # the last token is the window's last tap


class _PoisonedUnits:
    """`torch` for the GDN module, except that int8 `empty` tensors (Q8 units) are filled with -128, which no
    quantized value or scale byte pattern the tests meet holds: a unit byte left unwritten shows."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty(*size, **kw):
        t = torch.empty(*size, **kw)
        return t.fill_(-128) if t.dtype == torch.int8 else t


@pytest.mark.parametrize("dtype,block_v", [(torch.bfloat16, 8), (torch.float32, 32)])
def test_gdn_step_q8_units_are_the_quantized_output(monkeypatch, dtype, block_v):
    """With q8_span the program that normalises a head also writes it as Q8 units: `gemv_q8x.quantize`'s bytes
    of the output, which `quantize` of it then returns without a launch; output and state are the bits of the
    step without units. Without tickets (the two-launch path) or with nv * dv not a multiple of 128 nothing is
    recorded."""
    from strata.kernels import gemv_q8x, gemv_rr

    monkeypatch.setattr(gdn, "torch", _PoisonedUnits())
    cfg = config(linear_num_key_heads=2, linear_num_value_heads=4, linear_value_head_dim=32)
    g = torch.Generator().manual_seed(9)
    C, nv, dk, dv, K = (cfg.gdn_conv_dim, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                        cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim)
    rnd = lambda *s: torch.randn(*s, generator=g)
    prm = GDNParams(rnd(C, K) * 0.5, -torch.rand(nv, generator=g) * 2, rnd(nv), rnd(dv), "grouped")
    plain = GDNState(rnd(C, K - 1).to(dtype), rnd(nv, dk, dv))
    units = plain.clone()
    for _ in range(2):
        x, z, b, a = (t.to(dtype) for t in (rnd(1, C), rnd(1, nv * dv), rnd(1, nv), rnd(1, nv) * 4))
        want = gdn.gdn_step(x, z, b, a, prm, plain, cfg, block_v=block_v)
        got = gdn.gdn_step(x, z, b, a, prm, units, cfg, block_v=block_v, q8_span=8)
        assert torch.equal(got, want) and torch.equal(units.recurrent, plain.recurrent)
        xq = gemv_q8x.quantize(got, "Q8_0_R")
        assert torch.equal(xq, gemv_q8x.quantize(got.clone(), "Q8_0_R"))
        assert gemv_q8x.quantize(got, "Q4_K_R") is xq
    monkeypatch.setattr(gdn, "tickets", lambda device: None)
    out = gdn.gdn_step(x, z, b, a, prm, units, cfg, block_v=block_v, q8_span=8)
    assert gemv_rr.recorded_q8x(out, 8) is None
    monkeypatch.undo()
    cfg = config(linear_num_key_heads=1, linear_num_value_heads=3, linear_value_head_dim=32)
    C, nv = cfg.gdn_conv_dim, cfg.linear_num_value_heads
    prm = GDNParams(rnd(C, K) * 0.5, -torch.rand(nv, generator=g) * 2, rnd(nv), rnd(dv), "grouped")
    state = GDNState(rnd(C, K - 1), rnd(nv, dk, dv))
    out = gdn.gdn_step(rnd(1, C), rnd(1, nv * dv), rnd(1, nv), rnd(1, nv), prm, state, cfg, q8_span=8)
    assert gemv_rr.recorded_q8x(out, 8) is None


# ------------------------------------------------------------------------------------------------ attention
@pytest.mark.parametrize("L,W,split,dtype,tile", [
    (1, 11, None, torch.float32, None), (1, 300, 32, torch.float32, None), (1, 300, 32, torch.float32, 64),
    (3, 70, 64, torch.float32, None), (1, 70, 32, torch.bfloat16, None), (1, 70, 32, torch.bfloat16, 32)])
def test_attend_matches_reference(L, W, split, dtype, tile):
    """One split, and the merge of several: in one pass, or (a merge tile smaller than the splits) in passes
    of a few splits after a first pass for the max."""
    cfg = config()
    g = torch.Generator().manual_seed(2)
    state = QSAState.empty(cfg, dtype, "cpu", 64)
    state.k.normal_(generator=g)
    state.v.normal_(generator=g)
    q = torch.randn(L, cfg.num_attention_heads, cfg.head_dim, generator=g).to(dtype)
    idx = torch.randint(-2, 66, (L, W), generator=g)  # out-of-range rows are clamped, as in the reference
    ok = torch.rand(L, W, generator=g) > 0.3
    ok[:, 0] = True
    got = attention.attend(q, state, idx, ok, cfg, split=split, merge_tile=tile or attention.MERGE_TILE)
    want = attend_ref(q, state, idx, ok, cfg)
    assert got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 4 * 2 ** -8 * float(want.abs().max())
    assert (got.float() - want.float()).abs().max() <= tol


@pytest.mark.parametrize("tile", [None, 128])  # one merge program per head (BD 64), or two of 32 dims
def test_attend_q8_units_are_the_quantized_output(monkeypatch, tile):
    """With q8_span the merge programs also write their dims as Q8 units: `gemv_q8x.quantize`'s bytes of the
    output (every byte: the buffer starts as -128), returned by `quantize` of it without a launch; the output
    is the call's without units. One split (no merge): nothing recorded."""
    from strata.kernels import gemv_q8x, gemv_rr

    monkeypatch.setattr(attention, "torch", _PoisonedUnits())
    cfg = config(head_dim=64, indexer_head_dim=64)
    g = torch.Generator().manual_seed(4)
    state = QSAState.empty(cfg, torch.bfloat16, "cpu", 64)
    state.k.normal_(generator=g)
    state.v.normal_(generator=g)
    qg = torch.randn(1, 4, 128, generator=g).to(torch.bfloat16)
    q, gate = qg[..., :64], qg[..., 64:]
    idx = torch.randint(0, 64, (1, 100), generator=g)
    ok = torch.rand(1, 100, generator=g) > 0.3
    kw = {"split": 32, "merge_tile": tile or attention.MERGE_TILE}
    plain = attention.attend(q, state, idx, ok, cfg, gate, **kw)
    got = attention.attend(q, state, idx, ok, cfg, gate, **kw, q8_span=8)
    assert torch.equal(got, plain)
    xq = gemv_q8x.quantize(got, "Q8_0_R")
    assert xq is gemv_rr.recorded_q8x(got, 8)
    assert torch.equal(xq, gemv_q8x.quantize(got.clone(), "Q8_0_R"))
    single = attention.attend(q, state, idx, ok, cfg, gate, split=128, q8_span=8)
    assert gemv_rr.recorded_q8x(single, 8) is None


@pytest.mark.parametrize("W,split,dtype", [(11, None, torch.float32), (70, 32, torch.float32),
                                           (70, 32, torch.bfloat16)])
def test_gated_attend_matches_reference(W, split, dtype):
    """QSA's output gate applied at the store (one split, and the merge of several), from a strided gate view
    like the model's [query | gate] rows."""
    cfg = config()
    g = torch.Generator().manual_seed(3)
    state = QSAState.empty(cfg, dtype, "cpu", 64)
    state.k.normal_(generator=g)
    state.v.normal_(generator=g)
    qg = torch.randn(1, cfg.num_attention_heads, 2 * cfg.head_dim, generator=g).to(dtype)
    q, gate = qg[..., :cfg.head_dim], qg[..., cfg.head_dim:]
    idx = torch.randint(0, 64, (1, W), generator=g)
    ok = torch.rand(1, W, generator=g) > 0.3
    ok[:, 0] = True
    got = attention.attend(q, state, idx, ok, cfg, gate, split=split)
    want = attend_ref(q, state, idx, ok, cfg, gate)
    assert torch.allclose(want, attend_ref(q, state, idx, ok, cfg) * torch.sigmoid(gate).reshape(1, -1))
    tol = 1e-5 if dtype == torch.float32 else 4 * 2 ** -8 * float(want.abs().max())
    assert (got.float() - want.float()).abs().max() <= tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qsa_store_matches_reference(dtype):
    """One token's cache writes by one launch, at positions that complete a block and one that does not: every
    cache tensor equals the reference's (fp32 to accumulation order; bf16 to one ulp of the normed rows)."""
    from strata.kernels import qsa_store
    from strata.model.qsa import Rope, qsa_store_ref

    cfg = config()
    g = torch.Generator().manual_seed(8)
    c = cfg.indexer_compress_ratio
    hkv, hd, di = cfg.num_key_value_heads, cfg.head_dim, cfg.indexer_head_dim
    ref = QSAState.empty(cfg, dtype, "cpu", 32)
    for t in (ref.idx_raw, ref.k, ref.v, ref.idx_blocks):
        t.copy_(torch.randn(t.shape, generator=g))
    ours = QSAState(ref.k.clone(), ref.v.clone(), ref.idx_raw.clone(), ref.idx_blocks.clone(), ref.ratio, True)
    inorm, knorm = 1 + 0.2 * torch.randn(di, generator=g), 1 + 0.2 * torch.randn(hd, generator=g)
    for p in (2 * c - 1, 2 * c, 3 * c - 1):  # completes block 1, starts block 2, completes block 2
        pos = torch.tensor([p])
        rope = Rope.at(pos, cfg, dtype)
        ki = torch.randn(1, di, generator=g).to(dtype)
        k = torch.randn(1, hkv * hd, generator=g).to(dtype)
        v = torch.randn(1, hkv * hd, generator=g).to(dtype)
        assert qsa_store.supported(ours, pos, ki, k, v, inorm, knorm)
        qsa_store_ref(ref, pos, ki, k, v, rope, inorm, knorm, cfg, True)
        qsa_store.qsa_store(ours, pos, ki, k, v, rope, inorm, knorm, cfg.rms_norm_eps)
        for name in ("idx_raw", "v"):
            assert torch.equal(getattr(ours, name), getattr(ref, name)), (p, name)
        for name in ("k", "idx_blocks"):
            a, b = getattr(ours, name).float(), getattr(ref, name).float()
            tol = 1e-5 if dtype == torch.float32 else 2 ** -7 * float(b.abs().max())
            assert (a - b).abs().max() <= tol, (p, name, (a - b).abs().max())


def test_block_scores_and_selection_match_reference():
    cfg = config()
    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, cfg.indexer_n_heads, cfg.indexer_head_dim, generator=g)
    blocks = torch.randn(16, cfg.indexer_head_dim, generator=g)
    positions = torch.tensor([30, 63])  # 7 and 16 visible blocks (the second sees all)
    want = torch.relu(torch.einsum("lhd,md->lhm", q, blocks)).sum(1) / math.sqrt(cfg.indexer_head_dim)
    visible = torch.arange(16)[None, :] < ((positions + 1) // cfg.indexer_compress_ratio)[:, None]
    got = attention.block_scores(q, blocks, positions, cfg, block_m=8)
    assert torch.equal(torch.isinf(got), ~visible)
    assert torch.allclose(got[visible], want[visible], atol=1e-5, rtol=0)
    # the k-th and (k+1)-th visible scores are well apart, so both pick the same blocks
    top = want.masked_fill(~visible, -math.inf).sort(-1, descending=True).values
    assert (top[:, cfg.block_topk - 1] - top[:, cfg.block_topk] > 1e-3).all()
    (idx, ok), (ridx, rok) = attention.select_tokens(q, blocks, positions, cfg), select_tokens(q, blocks, positions,
                                                                                             cfg)
    # the same blocks (the kernel lists them in block order, torch.topk by score), then the same tail
    n = cfg.block_topk * cfg.indexer_compress_ratio
    assert torch.equal(idx[:, :n].sort(-1).values, ridx[:, :n].sort(-1).values)
    assert torch.equal(idx[:, n:], ridx[:, n:]) and torch.equal(ok, rok)


def test_selection_beyond_the_kernel_limit(monkeypatch):
    """Past SELECT_KERNEL_MAX_BLOCKS (and RANK_SELECT_MAX_BLOCKS) candidates: the many-program selection
    (`select_blocks_wide`) chooses the reference's visible blocks (listed in block order) with the same validity and
    tail, also for a query that sees fewer complete blocks than k (its invalid picks are the lowest-indexed hidden
    blocks, torch.topk's its own: `attend` masks both); past what that serves, torch.topk and `expand_blocks` equal
    the reference."""
    cfg = config()
    g = torch.Generator().manual_seed(6)
    q = torch.randn(3, cfg.indexer_n_heads, cfg.indexer_head_dim, generator=g)
    blocks = torch.randn(16, cfg.indexer_head_dim, generator=g)
    positions = torch.tensor([5, 30, 63])
    monkeypatch.setattr(attention, "SELECT_KERNEL_MAX_BLOCKS", 8)
    monkeypatch.setattr(attention, "RANK_SELECT_MAX_BLOCKS", 8)
    c, n = cfg.indexer_compress_ratio, cfg.block_topk * cfg.indexer_compress_ratio
    (idx, ok), (ridx, rok) = attention.select_tokens(q, blocks, positions, cfg), select_tokens(q, blocks, positions,
                                                                                               cfg)
    for row in range(3):
        assert idx[row, :n][ok[row, :n]].sort().values.tolist() == ridx[row, :n][rok[row, :n]].sort().values.tolist()
        assert int(ok[row, :n].sum()) == int(rok[row, :n].sum())
    assert (idx[:, :n:c].diff(dim=1) > 0).all()  # block order
    assert torch.equal(idx[:, n:], ridx[:, n:]) and torch.equal(ok[:, n:], rok[:, n:])
    from strata.kernels import select
    monkeypatch.setattr(select, "tickets", lambda device: None)  # a stream without a ticket region: torch.topk
    for a, b in zip(attention.select_tokens(q, blocks, positions, cfg), select_tokens(q, blocks, positions, cfg),
                    strict=True):
        assert torch.equal(a, b)
    monkeypatch.undo()
    monkeypatch.setattr(attention, "SELECT_KERNEL_MAX_BLOCKS", 8)
    monkeypatch.setattr(attention, "RANK_SELECT_MAX_BLOCKS", 8)
    monkeypatch.setattr(attention, "wide_supported", lambda scores: False)
    for a, b in zip(attention.select_tokens(q, blocks, positions, cfg), select_tokens(q, blocks, positions, cfg),
                    strict=True):
        assert torch.equal(a, b)


# ------------------------------------------------------------------------------------------------ hyper-connections
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hc_read_matches_reference(dtype):
    g = torch.Generator().manual_seed(5)
    S, H, R = 3, 40, 12  # odd sizes: every tile is partly masked
    x = torch.randn(1, S * H, generator=g).to(dtype)
    norm = 1 + 0.2 * torch.randn(S * H, generator=g)
    down = DenseTensor("down", (0.2 * torch.randn(R, S * H, generator=g)).to(dtype))
    up = DenseTensor("up", torch.randn(S * H, R, generator=g).to(dtype))
    inject = DenseTensor("inject", (0.1 * torch.randn(S, S * H, generator=g)).to(dtype))
    tol = 1e-5 if dtype == torch.float32 else 4 * 2 ** -8 * 2  # 4 bf16 ulps of values up to ~2
    for inj in (inject, None):
        a_ref, i_ref = hc_read_ref(x, norm, down, up, inj, S, 1e-6, linear_ref)
        a, i = hyper.hc_read(x, norm, down, up, inj, S, 1e-6, block_rows=4, block_h=16)
        assert a.dtype == dtype and a.shape == a_ref.shape
        assert (a.float() - a_ref.float()).abs().max() <= tol
        if inj is None:
            assert i is None
        else:
            assert (i.float() - i_ref.float()).abs().max() <= tol


# ------------------------------------------------------------------------------------------------ sampling
def filter_ref(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """transformers' warpers, written out: the logits that survive (others -inf)."""
    x = logits / temperature
    if 0 < top_k < x.shape[-1]:
        x = x.masked_fill(x < x.topk(top_k).values[-1], -math.inf)
    if top_p < 1:
        s, order = x.sort()
        remove = s.softmax(-1).cumsum(-1) <= 1 - top_p
        remove[-1] = False
        x = x.masked_fill(remove.scatter(0, order, remove), -math.inf)
    if min_p > 0:
        p = x.softmax(-1)
        x = x.masked_fill(p < min_p * p.max(), -math.inf)
    return x


def full(n: int, v: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.full((n,), v, dtype=dtype)


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", [
    (1.0, 0, 1.0, 0.0), (0.7, 5, 1.0, 0.0), (1.3, 0, 0.8, 0.0), (1.0, 0, 1.0, 0.1), (0.5, 20, 0.9, 0.05)])
def test_sampling_thresholds_match_reference_filters(temperature, top_k, top_p, min_p):
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(4, 50, generator=g) * 3
    x = logits / temperature
    thr = sample.thresholds(x, full(4, top_k, torch.int64), full(4, top_p), full(4, min_p))
    for row in range(4):
        kept = torch.isfinite(filter_ref(logits[row], temperature, top_k, top_p, min_p))
        assert torch.equal(x[row] >= thr[row], kept)


def test_sampling_draws_from_the_filtered_distribution():
    g = torch.Generator().manual_seed(7)
    V, N = 8, 400
    logits = torch.randn(V, generator=g) * 2
    want = filter_ref(logits, 0.8, 6, 0.95, 0.02).softmax(-1)
    args = (full(N, 0.8), full(N, 6, torch.int64), full(N, 0.95), full(N, 0.02), full(N, 11, torch.int64))
    tokens = sample.sample(logits.expand(N, V), *args, torch.arange(N))
    assert want[tokens].gt(0).all()  # never a filtered token
    freq = torch.bincount(tokens, minlength=V).float() / N
    assert (freq - want).abs().max() < 4 * math.sqrt(0.25 / N)  # 4 sigma at the worst case p = 1/2
    n = 40
    again = sample.sample(logits.expand(n, V), *(t[:n] for t in args), torch.arange(n))
    assert torch.equal(tokens[:n], again)  # a function of (seed, offset)


def test_greedy_and_device_sampler():
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(30, generator=g)
    assert int(sample.greedy(logits)) == int(logits.argmax())
    s = sample.DeviceSampler("cpu")
    s.configure(0.0)
    assert int(s(logits)) == int(logits.argmax())
    s.configure(1.0, top_k=3, seed=5)
    first = [int(s(logits)) for _ in range(4)]
    assert int(s.offset) == 4 and set(first) <= set(logits.topk(3).indices.tolist())
    s.configure(1.0, top_k=3, seed=5)
    assert [int(s(logits)) for _ in range(4)] == first


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("V,block", [(1000, 128), (4097, 4096), (5, 4), (248320, 4096)])
def test_argmax_kernel_is_torchs_argmax(V, block, dtype):
    """The decode step's greedy choice (`sample.argmax`, per-block keys and a ticket) is torch's index: random
    values, a tie across blocks (the first), -0.0 against a later +0.0 (equal: the first), every NaN above +inf
    whatever its sign (the first NaN), all -inf (index 0); the ticket counter is back at 0 after each call."""
    from strata.kernels.gemv import tickets

    x = torch.randn(V, generator=torch.Generator().manual_seed(V)).to(dtype)
    ties = torch.zeros(V, dtype=dtype)
    ties[V // 2] = ties[V - 1] = 3
    zeros = torch.full((V,), -1.0, dtype=dtype)
    zeros[V // 3] = -0.0
    zeros[V // 3 + 1:] = 0.0
    nan = x.clone()
    nan[1], nan[V - 2], nan[V - 1] = float("inf"), -float("nan"), float("nan")  # the first NaN with its sign set
    for t in (x, ties, zeros, nan, torch.full((V,), float("-inf"), dtype=dtype), x.reshape(1, V)):
        got = sample.argmax(t, block)
        assert got.shape == () and got.dtype == torch.int64 and int(got) == int(t.argmax())
        assert int(tickets(t.device)[0]) == 0
    with pytest.raises(ValueError, match="contiguous float"):
        sample.argmax(torch.zeros(4, 2)[:, 0])


# ------------------------------------------------------------------------------------------------ op table
def test_fused_ops_dispatch_to_the_reference_off_cuda():
    base = Ops()
    ops = fused_ops(base)
    cfg = config()
    g = torch.Generator().manual_seed(9)
    C, nv, dv = cfg.gdn_conv_dim, cfg.linear_num_value_heads, cfg.linear_value_head_dim
    prm = GDNParams(torch.randn(C, 4, generator=g), -torch.rand(nv, generator=g), torch.randn(nv, generator=g),
                    torch.randn(dv, generator=g), "grouped")
    x, z, b, a = (torch.randn(2, n, generator=g) for n in (C, nv * dv, nv, nv))
    s1 = GDNState.empty(cfg, torch.float32, "cpu")
    s2 = s1.clone()
    # CPU tensors without `force`: bit-identical to the reference (it *is* the reference)
    assert torch.equal(ops.gdn_core(x[:1], z[:1], b[:1], a[:1], prm, s1, cfg),
                       gdn_core_ref(x[:1], z[:1], b[:1], a[:1], prm, s2, cfg))
    # forced, but two tokens: the reference (chunked) path
    forced = fused_ops(base, force=True)
    assert torch.equal(forced.gdn_core(x, z, b, a, prm, s1, cfg), gdn_core_ref(x, z, b, a, prm, s2, cfg))
    assert ops.linear is base.linear and ops.experts is base.experts


@pytest.fixture(scope="module")
def tiny_weights(tmp_path_factory):
    # 4 indexer heads: with 2, exact-zero ReLU scores tie at the k-th block, which torch.topk breaks arbitrarily
    # and the selection kernel by lowest block index
    return load_hf(reference.save(reference.build("tiny", indexer_n_heads=4), tmp_path_factory.mktemp("tiny")))


def test_tiny_model_decode_matches_reference(tiny_weights):
    """Prefill 5 tokens, then decode past the dense range (selection width 11), so every fused op runs,
    including attention over a sparse selection; through the engine's decode and through the fixed-capacity
    step that the GPU captures as a graph (run eagerly here)."""
    ref = Engine(tiny_weights)
    fast = Engine(tiny_weights, ops=fused_ops(Ops(), force=True))
    cfg = ref.cfg
    ids = torch.randint(2, cfg.vocab_size, (3 + cfg.selection_width + 6,),
                        generator=torch.Generator().manual_seed(3)).tolist()
    reference.assert_decodes_match(ref, fast, ids, prompt=5, capacity=32)


def test_decode_step_draws_on_the_device(tiny_weights):
    """The step's "sampled" ending (run eagerly here, under the interpreter): a seed fixes the draws, different
    seeds give different ones, and temperature 0 gives the greedy ending's tokens (the argmax of the logits)."""
    from strata.runtime.graph import DecodeStep

    model = Engine(tiny_weights).model
    prompt = torch.arange(2, 8)

    def run(temperature: float | None, seed: int = 0) -> list[int]:
        step = DecodeStep(model, capacity=24, capture=False)
        step.prefill(prompt)
        if temperature is not None:
            step.sampler.configure(temperature, top_k=20, seed=seed)
        tok, out = 9, []
        for _ in range(6):
            tok = int(step.next_token(tok, sampled=temperature is not None))
            out.append(tok)
        return out

    drawn = run(0.9, seed=1)
    assert run(0.9, seed=1) == drawn
    assert drawn != run(0.9, seed=2) or drawn != run(0.9, seed=3)
    assert all(0 <= t < model.cfg.vocab_size for t in drawn)
    assert run(0.0, seed=1) == run(None)
