"""The row-register GEMV (strata.kernels.gemv_rr) and its layouts, Q4_K_R, Q5_1_R, Q8_0_R and Q6_K_R, on the CPU under
Triton's interpreter, against "dequantize the ggml blocks, then x @ W^T in float64".

The layouts are checked against the ggml types they are made from (`repack.reorder_*`: the same weights), the
kernel against the reference at the tolerance of tests/test_kernels_gemv.py (RTOL of sum |w x| per output): plain,
by expert id (one x for every slot, or one per slot), gate/up GLU of one matrix pair and of the routed experts,
fp32 and bf16 outputs (bf16: the fp32 result rounded once), partial row tiles and both chunk steps of Q4_K_R (an
even and an odd super-block count), the routed experts' weighted slot sum and K split over programs. Each launch is
checked to have gone through `gemv_rr` (the launcher sends one token of these types there), and every output starts
as NaN so an unwritten one fails. Under the interpreter the byte permute is the shift-and-mask twin; the PRMT form
runs on the GPU (tools/gpu_check_gemv.py, tools/gemv_rr_lab.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.test_kernels_gemv import RTOL, G, _rr, random_blocks, zlib_seed
from strata.errors import StrataError
from strata.weights import quants, repack

KINDS = {"Q4_K_R": ("Q4_K", repack.reorder_q4_k), "Q8_0_R": ("Q8_0", repack.reorder_q8_0),
         "Q5_1_R": ("Q5_1", repack.reorder_q5_1), "Q6_K_R": ("Q6_K", repack.reorder_q6_k)}


def ggml_rows(kind: str, rows: int, k: int, rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows stored in `kind`, their float64 weights decoded from the ggml rows they were made from)."""
    src, reorder = KINDS[kind]
    raw = random_blocks(src, rows, k, rng)
    return reorder(raw, k).contiguous(), quants.dequantize(raw, G.gemv_type(src).type_id, k).double()


@pytest.fixture
def rr_calls(monkeypatch) -> list[str]:
    """The kinds of every launch that went through the row-register kernel."""
    calls: list[str] = []
    real = _rr.launch

    def spy(kind, *a, **kw):
        calls.append(kind)
        return real(kind, *a, **kw)
    monkeypatch.setattr(_rr, "launch", spy)
    return calls


def check(y: torch.Tensor, want: torch.Tensor, bound: torch.Tensor) -> None:
    assert not torch.isnan(y).any(), "an output was not written"
    err = ((y.double() - want).abs() / bound).max().item()
    assert err <= RTOL, f"max relative error {err:.3e} > {RTOL}"


@pytest.mark.parametrize("kind", list(KINDS))
def test_layouts_hold_the_ggml_weights(kind: str) -> None:
    rng = np.random.default_rng(zlib_seed(kind))
    stored, ref = ggml_rows(kind, 5, 768, rng)
    assert stored.shape == (5, 768 // G.gemv_type(kind).block_elems * G.gemv_type(kind).block_bytes)
    assert torch.equal(quants.dequantize(stored, G.gemv_type(kind).type_id, 768).double(), ref)


@pytest.mark.parametrize("kind,k", [("Q4_K_R", 512), ("Q4_K_R", 768), ("Q8_0_R", 512), ("Q8_0_R", 768),
                                    ("Q5_1_R", 640), ("Q5_1_R", 384), ("Q6_K_R", 512), ("Q6_K_R", 768)])
def test_plain(kind: str, k: int, rr_calls) -> None:
    rng = np.random.default_rng(zlib_seed(kind) + k)
    w, ref = ggml_rows(kind, 21, k, rng)  # partial row tiles at 4, 8 and 16 rows per program
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(k))
    out = torch.full((1, 21), float("nan"))
    y = G.gemv(x, w, kind, k, out=out)
    check(y, x.double() @ ref.T, x.double().abs() @ ref.abs().T)
    yb = G.gemv(x, w, kind, k, out_dtype=torch.bfloat16)
    assert torch.equal(yb, y.to(torch.bfloat16))
    xb = x.to(torch.bfloat16)  # bf16 x (the model's inputs), widened to fp32 in the kernel: exact
    check(G.gemv(xb, w, kind, k), xb.double() @ ref.T, xb.double().abs() @ ref.abs().T)
    assert rr_calls == [kind, kind, kind]


@pytest.mark.parametrize("kind", list(KINDS))
def test_experts(kind: str, rr_calls) -> None:
    rng = np.random.default_rng(zlib_seed(kind) + 1)
    k = 512
    mats = [ggml_rows(kind, 10, k, rng) for _ in range(3)]
    st = torch.stack([m[0] for m in mats])
    gen = torch.Generator().manual_seed(5)
    ids = torch.tensor([2, 0, 2], dtype=torch.int32)
    for x in (torch.randn(1, k, generator=gen), torch.randn(3, k, generator=gen)):
        out = torch.full((3, 10), float("nan"))
        G.gemv_experts(x, st, ids, kind, k, out=out)
        for s, e in enumerate(ids.tolist()):
            xs = x[s if x.shape[0] > 1 else 0].double()
            check(out[s], xs @ mats[e][1].T, xs.abs() @ mats[e][1].abs().T)
    assert rr_calls == [kind, kind]


@pytest.mark.parametrize("kind", list(KINDS))
def test_glu(kind: str, rr_calls) -> None:
    """One pair (`gemv_glu`) and the routed experts' pairs (`gemv_experts_glu`); fp32 outputs against float64
    (silu' < 1.1 carries the bound), bf16 outputs against the fp32 ones rounded as the model rounds."""
    rng = np.random.default_rng(zlib_seed(kind) + 2)
    k = 768
    gate = [ggml_rows(kind, 9, k, rng) for _ in range(3)]
    up = [ggml_rows(kind, 9, k, rng) for _ in range(3)]
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(6)) * 0.05

    def want(e: int) -> tuple[torch.Tensor, torch.Tensor]:
        g, u = x.double() @ gate[e][1].T, x.double() @ up[e][1].T
        gb, ub = x.double().abs() @ gate[e][1].abs().T, x.double().abs() @ up[e][1].abs().T
        return (F.silu(g) * u)[0], (1.1 * gb * (u.abs() + ub) + F.silu(g).abs() * ub)[0]

    out = torch.full((1, 9), float("nan"))
    G.gemv_glu(x, gate[0][0], up[0][0], kind, k, out=out)
    check(out[0], *want(0))
    ids = torch.tensor([1, 2, 1])
    gs, us = torch.stack([g[0] for g in gate]), torch.stack([u[0] for u in up])
    outs = torch.full((3, 9), float("nan"))
    G.gemv_experts_glu(x, gs, us, ids, kind, k, out=outs)
    for s, e in enumerate(ids.tolist()):
        check(outs[s], *want(e))
    ob = G.gemv_experts_glu(x, gs, us, ids, kind, k, out_dtype=torch.bfloat16)
    # bf16: the same products rounded (g, silu(g), u and the product each to bf16: a few bf16 ulps at most)
    assert ((ob.float() - outs).abs() <= 2.0 ** -6 * outs.abs() + 1e-6 * outs.abs().max()).all()
    assert rr_calls == [kind] * 3


def test_other_launches_take_the_generic_kernel(rr_calls) -> None:
    """Several tokens and explicit launch shapes of these types go to the generic skeleton (its decoders are
    tested in tests/test_kernels_gemv.py); so does a row start that is not 16-byte aligned."""
    rng = np.random.default_rng(3)
    k = 512
    w, ref = ggml_rows("Q4_K_R", 8, k, rng)
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(3))
    check(G.gemv(x, w, "Q4_K_R", k), x.double() @ ref.T, x.double().abs() @ ref.abs().T)
    check(G.gemv(x[:1], w, "Q4_K_R", k, block_n=4), x[:1].double() @ ref.T, x[:1].double().abs() @ ref.abs().T)
    buf = torch.empty(w.numel() + 1, dtype=torch.uint8)
    shifted = buf[1:].view(w.shape)
    shifted.copy_(w)
    check(G.gemv(x[:1], shifted, "Q4_K_R", k), x[:1].double() @ ref.T, x[:1].double().abs() @ ref.abs().T)
    assert rr_calls == []


def slot_sum_case(kind: str, k: int) -> tuple[list, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Three random expert matrices of 11 rows (stored, float64), their stack, the ids of 4 slots and their
    weights."""
    rng = np.random.default_rng(zlib_seed(kind) + 7)
    mats = [ggml_rows(kind, 11, k, rng) for _ in range(3)]
    return mats, torch.stack([m[0] for m in mats]), torch.tensor([2, 0, 2, 1]), torch.tensor([0.4, 0.3, 0.2, 0.1])


@pytest.mark.parametrize("kind", list(KINDS))
def test_slot_sum(kind: str, rr_calls) -> None:
    """`gemv_experts_sum`: the routed experts' down projections and their weighted sum in one launch (the slots'
    products added in slot order by the last program of each row tile); the ticket counters end at 0. With the
    ids settled (read before the PDL wait on a GPU) the kernel computes the same bits."""
    k = 512
    mats, st, ids, sw = slot_sum_case(kind, k)
    x = torch.randn(4, k, generator=torch.Generator().manual_seed(8))
    out = torch.full((1, 11), float("nan"))
    G.gemv_experts_sum(x, st, ids, sw, kind, k, out=out)
    want = sum(float(sw[s]) * (x[s].double() @ mats[e][1].T) for s, e in enumerate(ids.tolist()))
    bound = sum(float(sw[s]) * (x[s].double().abs() @ mats[e][1].abs().T) for s, e in enumerate(ids.tolist()))
    check(out[0], want, bound)
    settled = torch.full((1, 11), float("nan"))
    G.gemv_experts_sum(x, st, ids, sw, kind, k, out=settled, ids_settled=True)
    assert torch.equal(settled, out)
    assert rr_calls == [kind] * 2
    assert all(int(c.abs().sum()) == 0 for c in G._counters.values())


@pytest.mark.parametrize("kind,k", [("Q4_K_R", 2048), ("Q8_0_R", 2048), ("Q5_1_R", 1024)])
def test_k_split(kind: str, k: int, rr_calls) -> None:
    """Few row tiles over long rows split K (`launch_shape`, and `split_k` given); plain and GLU launches agree
    with the reference and put every ticket back."""
    rng = np.random.default_rng(zlib_seed(kind) + 9)
    n_chunks = k // _rr.CHUNK[kind][0]
    assert _rr.launch_shape(kind, n_chunks, 4)[3] > 1
    (w, ref), (u, uref) = ggml_rows(kind, 6, k, rng), ggml_rows(kind, 6, k, rng)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(9)) * 0.05
    for sk in (None, 2):
        out = torch.full((1, 6), float("nan"))
        check(G.gemv(x, w, kind, k, out=out, split_k=sk), x.double() @ ref.T, x.double().abs() @ ref.abs().T)
        glu = G.gemv_glu(x, w, u, kind, k, split_k=sk)
        g, uu = x.double() @ ref.T, x.double() @ uref.T
        assert (glu.double() - F.silu(g) * uu).abs().max() <= 1e-5 * (F.silu(g) * uu).abs().max()
    assert rr_calls == [kind] * 4
    assert all(int(c.abs().sum()) == 0 for c in G._counters.values())


def test_launch_shapes_keep_one_row_per_thread() -> None:
    """Rows per program = rows a warp's threads cover per chunk step x warps (Q4_K_R, Q6_K_R: 4 per step of 2
    super-blocks, 8 per step of 1; Q8_0_R: 4; Q5_1_R: 8), so x is never loaded twice by one thread; a K split
    divides the chunks into runs of whole steps."""
    for n_chunks in (1, 2, 3, 5, 10, 24, 64):
        for tiles in (1, 100, 10_000):
            for kind in ("Q4_K_R", "Q6_K_R"):
                br, sbc, warps, split = _rr.launch_shape(kind, n_chunks, tiles)
                assert br == (4 if sbc == 2 else 8) * warps and n_chunks % (sbc * split) == 0
            br, sbc, warps, split = _rr.launch_shape("Q8_0_R", n_chunks, tiles)
            assert sbc == 1 and br == 4 * warps and n_chunks % split == 0
            br, sbc, warps, split = _rr.launch_shape("Q5_1_R", n_chunks, tiles)
            assert sbc == 1 and br == 8 * warps and n_chunks % split == 0
            assert tiles < _rr.SPLIT_MIN_PROGRAMS or split == 1


def test_gpu_layout_word_orders_expert_stacks_and_q8_0_matrices() -> None:
    """`placement.word_ordered` stores Q4_K and Q5_1 expert stacks as Q4_K_R / Q5_1_R and 2-D Q8_0 matrices as
    Q8_0_R (the same weights); 2-D Q4_K matrices, Q8_0 rows of a length that is no multiple of 256 and other
    tensors stay as they were."""
    from strata.runtime import placement
    from strata.weights.quant_tensor import QuantTensor

    rng = np.random.default_rng(4)
    raw = torch.stack([random_blocks("Q4_K", 3, 512, rng) for _ in range(2)])
    q51 = torch.stack([random_blocks("Q5_1", 3, 640, rng) for _ in range(2)])
    cases = [(QuantTensor("L0.moe.gate_exps", raw, 12, (2, 3, 512)), "Q4_K_R"),
             (QuantTensor("L0.moe.down_exps", q51, 7, (2, 3, 640)), "Q5_1_R"),
             (QuantTensor("L0.gdn.out", random_blocks("Q8_0", 3, 512, rng), 8, (3, 512)), "Q8_0_R")]
    for t, kind in cases:
        placed = placement.word_ordered(t.name, t)
        assert placed.kind == kind and torch.equal(placed.dense(), t.dense())
    same = [QuantTensor("L0.moe.up_exps", raw[0], 12, (3, 512)),
            QuantTensor("L0.moe.sh_down", random_blocks("Q8_0", 3, 640, rng), 8, (3, 640)),
            QuantTensor("L0.attn.o", random_blocks("Q5_1", 3, 640, rng), 7, (3, 640))]
    assert all(placement.word_ordered(t.name, t) is t for t in same)


@pytest.mark.parametrize("kind,k", [("Q5_1_R", 512)])
def test_preloaded_steps_change_no_bit(kind: str, k: int, rr_calls, monkeypatch) -> None:
    """Loading the first 2 or all 4 of a launch's K-loop steps before the PDL wait (`PRELOAD`) only moves loads:
    the same sums in the same order, plain and as the routed experts' slot sum."""
    rng = np.random.default_rng(zlib_seed(kind) + 11)
    w, ref = ggml_rows(kind, 9, k, rng)
    st = torch.stack([w, ggml_rows(kind, 9, k, rng)[0]])
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(11))
    ids, sw = torch.tensor([1, 0, 1]), torch.tensor([0.5, 0.3, 0.2])
    assert _rr.launch_shape(kind, k // _rr.CHUNK[kind][0], 3)[3] == 1  # four loop steps, no K split
    outs = []
    for pre in (1, 2, 4):
        monkeypatch.setitem(_rr.PRELOAD, kind, pre)
        assert _rr.preload_steps(kind, 4) == pre
        outs.append((G.gemv(x[:1], w, kind, k), G.gemv_experts_sum(x, st, ids, sw, kind, k, ids_settled=True)))
    check(outs[0][0][0], x[0].double() @ ref.T, x[0].double().abs() @ ref.abs().T)
    for plain, summed in outs[1:]:
        assert torch.equal(plain, outs[0][0]) and torch.equal(summed, outs[0][1])
    assert rr_calls == [kind] * 6


@pytest.mark.parametrize("kind", ["Q4_K_R", "Q6_K_R", "Q8_0_R"])
def test_preloaded_k_loop_steps_change_no_bit(kind: str, rr_calls, monkeypatch) -> None:
    """The K loop (`_k_loop`) with 2 or all 5 of its steps loaded before the PDL wait: the same sums in the same
    order as one step ahead, plain and as a GLU by expert ids (the routed experts' gate/up)."""
    rng = np.random.default_rng(zlib_seed(kind) + 12)
    k = 5 * 256  # an odd count: one super-block (group of 8 blocks) per step, five steps, no K split
    w, ref = ggml_rows(kind, 9, k, rng)
    gs = torch.stack([w, ggml_rows(kind, 9, k, rng)[0]])
    us = torch.stack([ggml_rows(kind, 9, k, rng)[0], ggml_rows(kind, 9, k, rng)[0]])
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(12))
    ids = torch.tensor([1, 0, 1])
    assert _rr.launch_shape(kind, 5, 3)[1::2] == (1, 1)  # one super-block per step, no K split
    outs = []
    for pre in (1, 2, 5):
        monkeypatch.setitem(_rr.PRELOAD, kind, pre)
        assert _rr.preload_steps(kind, 5) == pre
        outs.append((G.gemv(x, w, kind, k), G.gemv_experts_glu(x, gs, us, ids, kind, k)))
    check(outs[0][0][0], x[0].double() @ ref.T, x[0].double().abs() @ ref.abs().T)
    for plain, glu in outs[1:]:
        assert torch.equal(plain, outs[0][0]) and torch.equal(glu, outs[0][1])
    assert rr_calls == [kind] * 6
    monkeypatch.setitem(_rr.PRELOAD, kind, 8)
    assert _rr.preload_steps(kind, 5) == 5 and _rr.preload_steps(kind, 8) == _rr.MAX_PRELOAD == 6
    monkeypatch.setitem(_rr.PRELOAD, f"{kind}/5", 2)  # launches of five loop steps only
    assert _rr.preload_steps(kind, 5) == 2 and _rr.preload_steps(kind, 8) == 6
    monkeypatch.setitem(_rr.PRELOAD, f"q8:{kind}", 3)  # launches with Q8 activations: their entries first
    assert _rr.preload_steps(kind, 5, q8x=True) == 3 and _rr.preload_steps(kind, 5) == 2


TILED = {"Q4_K_RT": "Q4_K_R", "Q6_K_RT": "Q6_K_R"}


def _tiled(kind: str, rows: torch.Tensor) -> torch.Tensor:
    """Row-major rows of `kind`'s base type re-laid as `kind` (a new tensor)."""
    layout = repack.TILE_LAYOUTS[G.gemv_type(kind).type_id]
    return repack.tile_major(rows, layout.tile, layout.step)


@pytest.mark.parametrize("kind", list(TILED))
@pytest.mark.parametrize("pre", [1, 2])
def test_tile_major_types_read_as_their_base(kind: str, pre: int, rr_calls, monkeypatch) -> None:
    """A tile-major type (`repack.TILE_LAYOUTS`) gives its row-major twin's bits in every kernel that reads it: the
    row-register launches (plain, K split, the routed experts' GLU by id; one or two steps loaded before the wait),
    the generic GEMV for several tokens, the device dequantization and the grouped expert GEMM; matrices that are
    not whole tiles are refused, naming the type."""
    from strata.kernels import experts_gemm as EG

    base = TILED[kind]
    tid = G.gemv_type(kind).type_id
    monkeypatch.setitem(_rr.PRELOAD, kind, pre)
    monkeypatch.setitem(_rr.PRELOAD, base, pre)
    monkeypatch.setattr(_rr, "BIG_LAUNCH_TILES", 1)  # Q6_K_R in the shape Q6_K_RT's launches take (the same sums)
    rng = np.random.default_rng(zlib_seed(kind) + 13)
    k, n = 1024, 32
    w, ref = ggml_rows(base, n, k, rng)
    wt = _tiled(kind, w)
    assert not torch.equal(wt, w)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(13))
    plain = G.gemv(x, w, base, k)
    check(plain[0], x[0].double() @ ref.T, x[0].double().abs() @ ref.abs().T)
    assert torch.equal(G.gemv(x, wt, kind, k), plain)
    assert torch.equal(G.gemv(x, wt, kind, k, split_k=2), G.gemv(x, w, base, k, split_k=2))
    gs = torch.stack([ggml_rows(base, 16, k, rng)[0] for _ in range(2)])
    us = torch.stack([ggml_rows(base, 16, k, rng)[0] for _ in range(2)])
    ids = torch.tensor([1, 0, 1])
    glu = G.gemv_experts_glu(x, gs, us, ids, base, k)
    assert not torch.isnan(glu).any()
    assert torch.equal(G.gemv_experts_glu(x, _tiled(kind, gs), _tiled(kind, us), ids, kind, k), glu)
    assert rr_calls == [base, kind, kind, base, base, kind]
    x3 = torch.randn(3, k, generator=torch.Generator().manual_seed(14))  # several tokens: the generic kernel
    assert torch.equal(G.gemv(x3, wt, kind, k), G.gemv(x3, w, base, k))
    assert torch.equal(G.gemv_experts_glu(x3, _tiled(kind, gs), _tiled(kind, us), ids, kind, k),
                       G.gemv_experts_glu(x3, gs, us, ids, base, k))
    assert torch.equal(G.dequantize_rows(wt, kind, k), G.dequantize_rows(w, base, k))
    assert torch.equal(quants.dequantize(wt, tid, k), quants.dequantize(w, G.gemv_type(base).type_id, k))
    xs = torch.randn(20, k, generator=torch.Generator().manual_seed(15))
    e_ids = torch.tensor([0, 1] * 10)
    order = e_ids.argsort(stable=True)
    tiles = EG.expert_tiles(e_ids[order], 2, 16)
    want = EG.experts_gemm_glu(xs, gs, us, tiles, order, base, k, 16, torch.float32)
    assert torch.equal(EG.experts_gemm_glu(xs, _tiled(kind, gs), _tiled(kind, us), tiles, order, kind, k, 16,
                                           torch.float32), want)
    with pytest.raises(ValueError, match=kind):
        G.gemv(x3, wt[:-1], kind, k)  # not whole tiles
    with pytest.raises(ValueError, match="whole tiles"):
        quants.dequantize(wt.reshape(-1), tid, k)
    layout = repack.TILE_LAYOUTS[tid]
    assert torch.equal(repack.tile_major(wt, layout.tile, layout.step, undo=True), w)
