"""The fused GEMV kernels of strata.kernels.gemv (output dtype, gate/up GLU), on
the CPU under Triton's interpreter, against float64 references and against the unfused kernels.

Shapes are tiny (10 rows: a partial row tile at 8 rows per program; K of 5-10 blocks). Weights and references come
from tests/test_kernels_gemv.py's helpers. Tolerances, per output:
* fp32 results against float64: RTOL (1e-5) of the sum of |terms| that fed them, as in test_kernels_gemv, with
  the GLU's bound carried through silu (|silu'| < 1.1) and the product.
* bf16/fp16 outputs: bitwise equal to the fp32 result cast once (the kernels round at the store, to nearest even).
* The GLU's rounding emulation: bitwise `F.silu(g.to(dt)) * u.to(dt)` in dt = bf16 from `gemv`'s fp32 g and u,
  except where exp's last bit (numpy's in the interpreter vs torch's) straddles a bf16 rounding boundary (1 ulp,
  expected in ~1e-4 of outputs): at most one output may be 1 bf16 ulp off. Rounding only once (no emulation)
  breaks about a third of them.
Every output is filled with NaN first, so an element the kernel does not write fails the check.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.test_kernels_gemv import _blocks as gb  # the interpreter-mode decoders
from tests.test_kernels_gemv import (
    RTOL,
    G,
    dequant_ref,
    k_for,
    random_blocks,
    zlib_seed,
)

TYPES = ["Q8_0", "Q4_K", "Q5_1", "Q6_K", "BF16", "F32"]
DENSE = {"F32": torch.float32, "BF16": torch.bfloat16}
N = 10  # rows: with block_n=8 (4 of gate + 4 of up for the GLU) the last row tile is partial
EPS32 = torch.finfo(torch.float32).eps


def kk(name: str) -> int:
    return 320 if name in DENSE else k_for(name)


def weights(name: str, rows: int, k: int, rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(stored data, float64 reference weights (rows, k)) for one matrix of a storage type."""
    if name in DENSE:
        w = torch.from_numpy(rng.standard_normal((rows, k), dtype=np.float32)).to(DENSE[name])
        return w, w.double()
    raw = random_blocks(name, rows, k, rng)
    return raw, dequant_ref(name, raw, k)


def stack(name: str, n_exp: int, rows: int, k: int, rng: np.random.Generator):
    """(E, rows, ·) stored expert stack and its E float64 reference matrices."""
    pairs = [weights(name, rows, k, rng) for _ in range(n_exp)]
    return torch.stack([p[0] for p in pairs]), [p[1] for p in pairs]


def x_for(w64: torch.Tensor, n_tok: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(n_tok, K) random x scaled so that x W^T is O(1) (random blocks' weights range over 1e-2..1e2): the GLU
    then works where silu bends, not where it is 0 or the identity."""
    k = w64.shape[-1]
    scale = 1.5 / (w64.pow(2).mean().sqrt().item() * k ** 0.5)
    return (torch.randn(n_tok, k, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def poisoned(shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype)


def assert_close(y: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor, tol: float = RTOL) -> None:
    """|y - ref| <= tol * bound elementwise (every y finite: NaN means an element was never written)."""
    assert y.shape == ref.shape and torch.isfinite(y).all()
    err = ((y.double() - ref).abs() / bound).max().item()
    assert err <= tol, f"max relative error {err:.3e} > {tol}"


def check_glu(z: torch.Tensor, x: torch.Tensor, g64: torch.Tensor, u64: torch.Tensor) -> None:
    """z (T, I) fp32 against silu(x G^T) * (x U^T) in float64; each product's error, RTOL of its |terms| sum,
    carried through silu and the multiplication."""
    xd = x.double()
    g, u = xd @ g64.T, xd @ u64.T
    bg, bu = xd.abs() @ g64.abs().T, xd.abs() @ u64.abs().T
    sg = F.silu(g)
    bound = 1.1 * bg * u.abs() + sg.abs() * bu + (sg * u).abs() * (4 * EPS32 / RTOL)
    assert_close(z, sg * u, bound)


def ulp_bf16(v: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 values at |v| (v bf16)."""
    a = v.float().abs().clamp_min(torch.finfo(torch.bfloat16).tiny)
    return torch.exp2(torch.floor(torch.log2(a)) - 7)


# ---------------------------------------------------------------------------------------------------------------
# output dtype


@pytest.mark.parametrize("name", TYPES)
def test_out_dtype_is_fp32_cast_once(name: str) -> None:
    """bf16/fp16 outputs, given (`out=`) or made (`out_dtype=`), equal the fp32 result cast: one rounding."""
    rng = np.random.default_rng(zlib_seed(name) + 10)
    k = kk(name)
    w, w64 = weights(name, N, k, rng)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(10))
    y32 = G.gemv(x, w, name, k, poisoned((3, N)), block_n=8)
    assert_close(y32, x.double() @ w64.T, x.double().abs() @ w64.abs().T)
    for dt in (torch.bfloat16, torch.float16):
        out = poisoned((3, N), dt)
        assert G.gemv(x, w, name, k, out, block_n=8) is out
        assert torch.equal(out, y32.to(dt)), dt
        assert torch.equal(G.gemv(x, w, name, k, out_dtype=dt, block_n=8), y32.to(dt))


def test_out_dtype_experts_and_rounding_ties() -> None:
    """gemv_experts with a bf16 output; and dense rows picked so fp32 results sit exactly on bf16 rounding ties
    and just past them (round to nearest even, not truncation, not half-up)."""
    rng = np.random.default_rng(11)
    st, _ = stack("Q8_0", 3, N, 320, rng)
    x = torch.randn(2, 320, generator=torch.Generator().manual_seed(11))
    ids = torch.tensor([2, 0])
    y32 = G.gemv_experts(x, st, ids, "Q8_0", 320, block_n=8)
    out = poisoned((2, N), torch.bfloat16)
    assert G.gemv_experts(x, st, ids, "Q8_0", 320, out, block_n=8) is out
    assert torch.equal(out, y32.to(torch.bfloat16))
    # one nonzero weight per row, x = 1: y = that weight exactly; bf16 has 8 significant bits
    vals = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-8 + 2**-20, -(1 + 3 * 2**-8), 1 - 2**-9 - 2**-10,
                         2**-130 * (1 + 2**-8), 3.0e38 * 1.1])
    w = torch.zeros(len(vals), 32)
    w[:, 0] = vals
    assert torch.equal(G.gemv(torch.ones(1, 32), w, "F32", 32)[0], vals)
    y = G.gemv(torch.ones(1, 32), w, "F32", 32, out_dtype=torch.bfloat16)
    assert torch.equal(y[0].view(torch.int16), vals.to(torch.bfloat16).view(torch.int16))


# ---------------------------------------------------------------------------------------------------------------
# GLU


@pytest.mark.parametrize("name", TYPES)
def test_gemv_glu(name: str) -> None:
    """Two separate tensors, then two views with a shared row stride of one (I, 2 row_bytes) buffer; 3 tokens."""
    rng = np.random.default_rng(zlib_seed(name) + 20)
    k = kk(name)
    g, g64 = weights(name, N, k, rng)
    u, u64 = weights(name, N, k, rng)
    x = x_for(g64, 3, 20)
    z = G.gemv_glu(x, g, u, name, k, poisoned((3, N)), block_n=8)
    check_glu(z, x, g64, u64)
    buf = torch.cat([u, g], dim=1)  # each row: up's bytes, then gate's
    width = g.shape[1]
    z2 = G.gemv_glu(x, buf[:, width:], buf[:, :width], G.gemv_type(name).type_id, k, poisoned((3, N)))
    check_glu(z2, x, g64, u64)
    # the fp32 result is silu(g) * u from the unfused kernel's g and u (up to exp's last bit)
    ref = F.silu(G.gemv(x, g, name, k, block_n=8)) * G.gemv(x, u, name, k, block_n=8)
    assert torch.allclose(z, ref, rtol=1e-6, atol=0)


def test_gemv_glu_more_tokens_than_one_launch() -> None:
    rng = np.random.default_rng(21)
    g, g64 = weights("Q8_0", N, 320, rng)
    u, u64 = weights("Q8_0", N, 320, rng)
    x = x_for(g64, G.MAX_TOKENS + 1, 21)
    check_glu(G.gemv_glu(x, g, u, "Q8_0", 320, poisoned((G.MAX_TOKENS + 1, N))), x, g64, u64)


@pytest.mark.parametrize("name", ["Q4_K", "BF16"])
def test_gemv_glu_rounding_emulates_model_dtype(name: str) -> None:
    """bf16 output from bf16 x: `F.silu(g.to(bf16)) * u.to(bf16)` computed in bf16, g and u gemv's fp32 results."""
    rng = np.random.default_rng(zlib_seed(name) + 22)
    k, rows, dt = kk(name), 32, torch.bfloat16
    g, g64 = weights(name, rows, k, rng)
    u, _ = weights(name, rows, k, rng)
    x = x_for(g64, 3, 22, dt)
    z = G.gemv_glu(x, g, u, name, k, poisoned((3, rows), dt), block_n=8)
    g32, u32 = G.gemv(x, g, name, k, block_n=8), G.gemv(x, u, name, k, block_n=8)
    ref = F.silu(g32.to(dt)) * u32.to(dt)
    assert ref.dtype == dt and torch.isfinite(z).all()
    off = (z.float() - ref.float()).abs()
    assert (off <= ulp_bf16(ref)).all() and (off > 0).sum() <= 1, f"{(off > 0).sum()} outputs differ"
    # the emulation matters: rounding once, at the end, gives other values
    once = (F.silu(g32) * u32).to(dt)
    assert (once != ref).sum() >= 5


def test_gemv_glu_fp16_output() -> None:
    rng = np.random.default_rng(23)
    g, g64 = weights("Q6_K", N, 512, rng)
    u, _ = weights("Q6_K", N, 512, rng)
    x = x_for(g64, 2, 23, torch.float16)
    z = G.gemv_glu(x, g, u, "Q6_K", 512, out_dtype=torch.float16)
    ref = F.silu(G.gemv(x, g, "Q6_K", 512).half()) * G.gemv(x, u, "Q6_K", 512).half()
    off = (z.float() - ref.float()).abs()
    assert z.dtype == torch.float16 and (off > 0).sum() <= 1 and (off <= ref.float().abs() * 2**-10).all()


@pytest.mark.parametrize("name", TYPES)
def test_gemv_experts_glu(name: str) -> None:
    """A repeated expert id; x of k rows (per slot) and of one row (shared); int32 and int64 ids."""
    rng = np.random.default_rng(zlib_seed(name) + 30)
    k = kk(name)
    gs, g64 = stack(name, 3, N, k, rng)
    us, u64 = stack(name, 3, N, k, rng)
    x = x_for(g64[0], 3, 30)
    ids = [2, 0, 2]
    z = G.gemv_experts_glu(x, gs, us, torch.tensor(ids, dtype=torch.int32), name, k, poisoned((3, N)), block_n=8)
    for s, e in enumerate(ids):
        check_glu(z[s:s + 1], x[s:s + 1], g64[e], u64[e])
        # each slot is exactly the single-matrix kernel on its expert (same tile, same order)
        assert torch.equal(z[s:s + 1], G.gemv_glu(x[s:s + 1], gs[e], us[e], name, k, block_n=8))
    x1 = x_for(g64[0], 1, 31)
    out = poisoned((3, N), torch.bfloat16)
    z1 = G.gemv_experts_glu(x1, gs, us, torch.tensor(ids), name, k, out)
    assert z1 is out
    for s, e in enumerate(ids):
        assert torch.equal(z1[s:s + 1], G.gemv_glu(x1, gs[e], us[e], name, k, out_dtype=torch.bfloat16))
    assert torch.equal(z1[0], z1[2])  # the repeated expert on the shared x


def test_q4_k_both_forms_one_token(monkeypatch) -> None:
    """Q4_K has two decoders of the same bytes: byte-wise for small one-token launches, int32 words (with the GLU
    told its rows are 16-byte aligned) for the rest, as the real geometry's routed experts run. Both, for the
    plain, expert and expert-GLU launches of one token, against the reference."""
    rng = np.random.default_rng(32)
    k = kk("Q4_K")
    gs, g64 = stack("Q4_K", 3, N, k, rng)
    us, u64 = stack("Q4_K", 3, N, k, rng)
    x1 = x_for(g64[0], 1, 32)
    ids = torch.tensor([2, 0, 1])
    decoders = []
    real = G._decode_args
    monkeypatch.setattr(G, "_decode_args", lambda t, kk_: (decoders.append(t.decode), real(t, kk_))[1])
    for small_rows in (G.SMALL_LAUNCH_ROWS, 0):  # 0: no launch counts as small, the word-wise form runs
        monkeypatch.setattr(G, "SMALL_LAUNCH_ROWS", small_rows)
        z = G.gemv_experts_glu(x1, gs, us, ids, "Q4_K", k, poisoned((3, N)))
        y = G.gemv_experts(x1, gs, ids, "Q4_K", k, poisoned((3, N)))
        for s, e in enumerate(ids.tolist()):
            check_glu(z[s:s + 1], x1, g64[e], u64[e])
            assert_close(y[s:s + 1], x1.double() @ g64[e].T, x1.double().abs() @ g64[e].abs().T)
    assert decoders == [gb.decode_q4_k] * 2 + [gb.decode_q4_k_hw] * 2


# ---------------------------------------------------------------------------------------------------------------
# weighted sum over expert slots


@pytest.mark.parametrize("name", ["Q5_1", "Q4_K", "Q8_0", "BF16"])
def test_gemv_experts_sum(name: str) -> None:
    """One token's down projections and their weighted sum in one launch: exactly `slot_sum` of `gemv_experts`'
    rows (the interpreter does not fuse multiply-adds), close to float64, the same bits on a second call (the
    tickets were put back), a repeated expert, x of one row per slot and of one row for all, bf16 out."""
    from strata.kernels.moe import slot_sum

    rng = np.random.default_rng(zlib_seed(name) + 40)
    k = kk(name)
    ws, w64 = stack(name, 4, N, k, rng)
    ids = torch.tensor([3, 0, 3, 1, 2])
    sw = torch.tensor([0.4, 0.1, 0.25, 0.15, 0.1], dtype=torch.bfloat16)
    for rows in (5, 1):
        x = x_for(w64[0], rows, 41 + rows)
        got = G.gemv_experts_sum(x, ws, ids, sw, name, k, poisoned((1, N)), block_n=8)
        want = slot_sum(G.gemv_experts(x, ws, ids, name, k, block_n=8), sw[None], torch.float32)
        assert torch.equal(got, want)
        assert torch.equal(G.gemv_experts_sum(x, ws, ids, sw, name, k, block_n=8), got)
        xs = x.double() if rows == 5 else x.double().expand(5, -1)
        ref = sum(sw[s].double() * (xs[s] @ w64[e].T) for s, e in enumerate(ids.tolist()))
        bound = sum(sw[s].double() * (xs[s].abs() @ w64[e].abs().T) for s, e in enumerate(ids.tolist()))
        assert_close(got, ref[None], bound[None])
        b16 = G.gemv_experts_sum(x, ws, ids, sw, name, k, out_dtype=torch.bfloat16, block_n=8)
        assert torch.equal(b16, got.to(torch.bfloat16))
    with pytest.raises(ValueError, match="slot_weights"):
        G.gemv_experts_sum(x, ws, ids, sw[:4], name, k)


def test_fused_reject_bad_input() -> None:
    rng = np.random.default_rng(42)
    g = random_blocks("Q8_0", 4, 64, rng)
    st = torch.stack([g, g])
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="out_dtype"):
        G.gemv(x, g, "Q8_0", 64, out_dtype=torch.float64)
    with pytest.raises(ValueError, match="out:"):
        G.gemv(x, g, "Q8_0", 64, torch.zeros(2, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="act"):
        G.gemv_glu(x, g, g, "Q8_0", 64, act="gelu")
    with pytest.raises(ValueError, match="same shape"):
        G.gemv_glu(x, g, g[:3], "Q8_0", 64)
    with pytest.raises(ValueError, match="expert_ids"):
        G.gemv_experts_glu(x, st, st, torch.tensor([[0, 1]]), "Q8_0", 64)
    with pytest.raises(ValueError, match="x: 2 rows for 3"):
        G.gemv_experts_glu(x, st, st, torch.tensor([0, 1, 1]), "Q8_0", 64)
