"""GEMVs with Q8 activations (strata.kernels.gemv_q8x, the row-register kernel's XQ loops) on the CPU under Triton's
interpreter.

The quantize kernel must give `act_quant.quantize_q8`'s integers and scales bit for bit (read back through
`gemv_q8x.unpack`, which states the layout); each GEMV must equal "the stored weights decoded in float64 times
round_q8(x)" at the row-register tests' tolerance (RTOL of sum |w x|): plain, K split, GLU of one pair and of the
routed experts, the routed experts' weighted slot sum (ids settled or not: the same bits). Under the interpreter
`dp4a` is its shift-and-multiply twin; the instruction runs on the GPU (tools/gemv_q8x_lab.py checks it there).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.test_kernels_gemv import G, zlib_seed
from tests.test_kernels_gemv_rr import TILED, _tiled, check, ggml_rows, rr_calls, slot_sum_case  # noqa: F401
from strata.kernels import gemv_q8x as Q
from strata.model.act_quant import dequantize_q8, quantize_q8, round_q8

KINDS = [kind for kind in Q.ORDER if kind not in TILED]  # the tile-major types: `test_tile_major_types`


def activations(rows: int, k: int, seed: int) -> torch.Tensor:
    """Random x with an all-zero run, a run of one repeated value and a run with a single nonzero value."""
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed)) * 3
    x[0, :32] = 0
    x[0, 32:64] = -1.25
    x[-1, 64:96] = 0
    x[-1, 70] = 5e-3
    return x


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_gives_the_reference_integers_and_scales(kind: str, dtype: torch.dtype) -> None:
    x = activations(3, 384, zlib_seed(kind)).to(dtype)  # 12 runs: one program, partly masked
    xq = Q.quantize(x, kind)
    assert xq.shape == (3, Q.row_bytes(384)) and xq.dtype == torch.int8
    q, d, s = Q.unpack(xq, kind, 384)
    rq, rd, rs = quantize_q8(x)
    assert torch.equal(q, rq) and torch.equal(d, rd) and torch.equal(s, rs)
    wide = activations(2, 1280, 3)  # 40 runs: three programs
    assert all(torch.equal(a, b) for a, b in zip(Q.unpack(Q.quantize(wide, kind), kind, 1280), quantize_q8(wide)))


def test_reference_rounding() -> None:
    """Each run: q in [-127, 127] with 127 reached by its largest value, |x - d q| <= d / 2 (up to fp32
    rounding), s = d sum(q); all-zero runs give d = s = 0."""
    x = activations(4, 256, 7)
    q, d, s = quantize_q8(x)
    runs = x.reshape(4, -1, 32)
    qr = q.reshape(4, -1, 32).long()
    assert qr.abs().max() <= 127
    nonzero = d > 0
    assert torch.equal(nonzero, runs.abs().amax(-1) > 0)
    assert (qr.abs().amax(-1)[nonzero] == 127).all() and (qr[~nonzero] == 0).all()
    err = (runs.double() - d.double()[..., None] * qr.double()).abs()
    assert (err <= d.double()[..., None] * (0.5 + 1e-5)).all()
    assert torch.equal(s, d * qr.sum(-1).float())
    assert torch.equal(round_q8(x), dequantize_q8(q, d))
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_q8(torch.zeros(1, 48))


def _want(x: torch.Tensor, ref: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    xr = round_q8(x).double()
    return xr @ ref.T, xr.abs() @ ref.abs().T


@pytest.mark.parametrize("kind,k", [("Q4_K_R", 512), ("Q4_K_R", 768), ("Q8_0_R", 512), ("Q8_0_R", 768),
                                    ("Q5_1_R", 640), ("Q5_1_R", 384), ("Q6_K_R", 512), ("Q6_K_R", 768)])
def test_plain(kind: str, k: int, rr_calls) -> None:  # noqa: F811
    rng = np.random.default_rng(zlib_seed(kind) + k)
    w, ref = ggml_rows(kind, 21, k, rng)  # partial row tiles
    x = activations(1, k, k)
    out = torch.full((1, 21), float("nan"))
    y = Q.gemv(Q.quantize(x, kind), w, kind, k, out=out)
    check(y, *_want(x, ref))
    xq = Q.quantize(x.to(torch.bfloat16), kind)  # bf16 x (the model's inputs); a bf16 output is fp32's, rounded once
    check(Q.gemv(xq, w, kind, k), *_want(x.to(torch.bfloat16), ref))
    assert torch.equal(Q.gemv(xq, w, kind, k, out_dtype=torch.bfloat16), Q.gemv(xq, w, kind, k).to(torch.bfloat16))
    assert rr_calls == [kind] * 4


@pytest.mark.parametrize("kind,k", [("Q4_K_R", 2048), ("Q8_0_R", 2048), ("Q5_1_R", 1024), ("Q6_K_R", 2048)])
def test_k_split(kind: str, k: int, rr_calls) -> None:  # noqa: F811
    rng = np.random.default_rng(zlib_seed(kind) + 9)
    (w, ref), (u, uref) = ggml_rows(kind, 6, k, rng), ggml_rows(kind, 6, k, rng)
    x = activations(1, k, 9) * 0.02
    xq = Q.quantize(x, kind)
    for sk in (1, 2, 4):
        out = torch.full((1, 6), float("nan"))
        check(Q.gemv(xq, w, kind, k, out=out, split_k=sk), *_want(x, ref))
        glu = Q.gemv_glu(xq, w, u, kind, k, split_k=sk)
        g, uu = _want(x, ref)[0], _want(x, uref)[0]
        assert (glu.double() - F.silu(g) * uu).abs().max() <= 1e-5 * (F.silu(g) * uu).abs().max()
    assert rr_calls == [kind] * 6
    assert all(int(c.abs().sum()) == 0 for c in G._counters.values())


def test_preloaded_steps_change_no_bit(rr_calls, monkeypatch) -> None:  # noqa: F811
    """The Q8-activation K loop with 1, 2 or all 6 of its steps loaded before the PDL wait (`gemv_rr.PRELOAD`, whose
    "q8:" entries apply to these launches first: two steps for six-step Q8_0_R launches, the out projections, where
    float x takes six): the same sums in the same order."""
    from strata.kernels import gemv_rr

    kind, k = "Q8_0_R", 6 * 256
    assert gemv_rr.preload_steps(kind, 6, q8x=True) == 2 and gemv_rr.preload_steps(kind, 6) == 6
    assert gemv_rr.preload_steps(kind, 5, q8x=True) == gemv_rr.preload_steps(kind, 5) == 1
    w, ref = ggml_rows(kind, 9, k, np.random.default_rng(zlib_seed(kind) + 13))
    xq = Q.quantize(activations(1, k, 13), kind)
    steps, preload_steps = [], gemv_rr.preload_steps
    monkeypatch.setattr(gemv_rr, "preload_steps", lambda *a: steps.append(preload_steps(*a)) or steps[-1])
    outs = [Q.gemv(xq, w, kind, k, split_k=1)]
    for pre in (1, 6):
        monkeypatch.setitem(gemv_rr.PRELOAD, f"q8:{kind}/6", pre)
        outs.append(Q.gemv(xq, w, kind, k, split_k=1))
    assert steps == [2, 1, 6]  # the launches took the preloads asked for
    check(outs[1], *_want(activations(1, k, 13), ref))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    assert rr_calls == [kind] * 3


@pytest.mark.parametrize("kind", list(TILED))
def test_tile_major_types(kind: str, rr_calls, monkeypatch) -> None:  # noqa: F811
    """A tile-major type with Q8 activations gives its row-major twin's bits: plain and the routed experts' GLU."""
    base = TILED[kind]
    monkeypatch.setattr(Q.gemv_rr, "BIG_LAUNCH_TILES", 1)  # Q6_K_R in Q6_K_RT's launch shape
    rng = np.random.default_rng(zlib_seed(kind) + 3)
    k = 512
    w = ggml_rows(base, 32, k, rng)[0]
    gs = torch.stack([ggml_rows(base, 16, k, rng)[0] for _ in range(2)])
    us = torch.stack([ggml_rows(base, 16, k, rng)[0] for _ in range(2)])
    ids = torch.tensor([1, 0, 1], dtype=torch.int32)
    x = activations(1, k, 7) * 0.05
    assert torch.equal(Q.gemv(Q.quantize(x, kind), _tiled(kind, w), kind, k), Q.gemv(Q.quantize(x, base), w, base, k))
    assert torch.equal(Q.gemv_experts_glu(Q.quantize(x, kind), _tiled(kind, gs), _tiled(kind, us), ids, kind, k),
                       Q.gemv_experts_glu(Q.quantize(x, base), gs, us, ids, base, k))
    assert rr_calls == [kind, base, kind, base]


@pytest.mark.parametrize("kind", KINDS)
def test_experts_glu(kind: str, rr_calls) -> None:  # noqa: F811
    """The routed experts' gate/up pairs by expert id, one x for every slot or one per slot."""
    rng = np.random.default_rng(zlib_seed(kind) + 2)
    k = 512
    gate = [ggml_rows(kind, 9, k, rng) for _ in range(3)]
    up = [ggml_rows(kind, 9, k, rng) for _ in range(3)]
    gs, us = torch.stack([g[0] for g in gate]), torch.stack([u[0] for u in up])
    ids = torch.tensor([1, 2, 1], dtype=torch.int32)
    for x in (activations(1, k, 6) * 0.05, activations(3, k, 16) * 0.05):
        outs = torch.full((3, 9), float("nan"))
        Q.gemv_experts_glu(Q.quantize(x, kind), gs, us, ids, kind, k, out=outs)
        for s, e in enumerate(ids.tolist()):
            xs = x[s if x.shape[0] > 1 else 0][None]
            (g, gb), (u, ub) = _want(xs, gate[e][1]), _want(xs, up[e][1])
            check(outs[s], (F.silu(g) * u)[0], (1.1 * gb * (u.abs() + ub) + F.silu(g).abs() * ub)[0])
    assert rr_calls == [kind] * 2


@pytest.mark.parametrize("kind", KINDS)
def test_slot_sum(kind: str, rr_calls) -> None:  # noqa: F811
    """The routed experts' down projections and their weighted sum in one launch; ids settled or not, the same
    bits; every ticket put back."""
    k = 512
    mats, st, ids, sw = slot_sum_case(kind, k)
    x = activations(4, k, 8)
    xq = Q.quantize(x, kind)
    out = torch.full((1, 11), float("nan"))
    Q.gemv_experts_sum(xq, st, ids, sw, kind, k, out=out)
    parts = [_want(x[s][None], mats[e][1]) for s, e in enumerate(ids.tolist())]
    check(out[0], sum(float(sw[s]) * p[0][0] for s, p in enumerate(parts)),
          sum(float(sw[s]) * p[1][0] for s, p in enumerate(parts)))
    settled = torch.full((1, 11), float("nan"))
    Q.gemv_experts_sum(xq, st, ids, sw, kind, k, out=settled, ids_settled=True)
    assert torch.equal(settled, out)
    assert rr_calls == [kind] * 2
    assert all(int(c.abs().sum()) == 0 for c in G._counters.values())


def test_bad_input_names_what_is_wrong() -> None:
    rng = np.random.default_rng(1)
    w, _ = ggml_rows("Q4_K_R", 4, 256, rng)
    x = torch.randn(1, 256)
    with pytest.raises(ValueError, match="Q4_0: no GEMV with Q8 activations"):
        Q.quantize(x, "Q4_0")
    with pytest.raises(ValueError, match="not a multiple of 128"):
        Q.quantize(torch.randn(1, 96), "Q4_K_R")
    with pytest.raises(ValueError, match=r"expected int8 \(1, 320\)"):
        Q.gemv(Q.quantize(torch.randn(1, 512), "Q4_K_R"), w, "Q4_K_R", 256)
    with pytest.raises(ValueError, match="contiguous rows"):
        Q.quantize(torch.randn(256, 2)[:, 0][None], "Q4_K_R")
    with pytest.raises(ValueError, match="Q8 activations"):
        from strata.kernels import gemv_rr
        gemv_rr.launch("Q4_0", x, w, None, x, 4, 256, 1, 0, 0, 0, None, 0, (8, 1, 1, 1), None, x, x, None, {},
                       q8x=True)


@pytest.mark.parametrize("kind,units_for", [("Q4_K_R", "Q5_1_R"), ("Q8_0_R", "Q8_0_R"), ("Q5_1_R", "Q4_K_R")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_experts_glu_writes_the_next_products_units(kind: str, units_for: str, dtype: torch.dtype,
                                                    monkeypatch) -> None:
    """units_for: the routed GLU also writes its output as Q8 units for the down projections (the last of each
    run's programs, by tickets): `quantize`'s bytes of the output (every byte: the buffer starts as -128),
    returned by `quantize` of it without a launch; the output itself unchanged and every ticket put back. Rows
    that do not fill whole units: no units."""
    empty = torch.empty
    monkeypatch.setattr(Q.torch, "empty", lambda *a, **kw: (lambda t: t.fill_(-128) if t.dtype == torch.int8
                                                            else t)(empty(*a, **kw)))
    rng = np.random.default_rng(zlib_seed(kind) + 5)
    k, n = 256, 128
    gs = torch.stack([ggml_rows(kind, n, k, rng)[0] for _ in range(3)])
    us = torch.stack([ggml_rows(kind, n, k, rng)[0] for _ in range(3)])
    ids = torch.tensor([2, 0, 2], dtype=torch.int32)
    xq = Q.quantize(activations(1, k, 4) * 0.05, kind)
    plain = Q.gemv_experts_glu(xq, gs, us, ids, kind, k, out_dtype=dtype)
    for _ in range(2):
        out = Q.gemv_experts_glu(xq, gs, us, ids, kind, k, out_dtype=dtype, units_for=units_for)
        assert torch.equal(out, plain)
        units = Q.quantize(out, units_for)
        assert units is Q.gemv_rr.recorded_q8x(out, Q.ORDER[units_for])
        assert torch.equal(units, Q.quantize(out.clone(), units_for))
        assert all(int(c.abs().sum()) == 0 for c in G._counters.values())
    short = Q.gemv_experts_glu(xq, gs[:, :96], us[:, :96], ids, kind, k, out_dtype=dtype, units_for=units_for)
    assert Q.gemv_rr.recorded_q8x(short, Q.ORDER[units_for]) is None


def test_round_rows_is_the_reference_rounding() -> None:
    """One launch gives `round_q8(x)` cast to x's dtype: bit for bit in fp32; in bf16 within one bf16 ulp (the
    interpreter truncates fp32 -> bf16 casts where the GPU rounds to nearest). Several rows, partly masked
    programs, all-zero runs; a K that is not a multiple of 32 is refused."""
    x = activations(3, 1280, 11)  # 40 runs: three programs per row
    assert torch.equal(Q.round_rows(x), round_q8(x))
    xb = x.to(torch.bfloat16).reshape(3, 2, 640)
    got, want = Q.round_rows(xb).float(), round_q8(xb).float()
    ulp = torch.ldexp(torch.ones_like(want), torch.frexp(want).exponent - 8)
    assert got.shape == xb.shape and ((got - want).abs() <= ulp).all()
    with pytest.raises(ValueError, match="multiple of 32"):
        Q.round_rows(torch.zeros(2, 48))
