"""The split-K hyper-connection read kernel (`strata.kernels.hyper.hc_read`) equals `hc_read_ref` (Triton's
interpreter, CPU).

Shapes are tiny and the knobs are chosen per case so that every path runs: several K chunks per stream (the
separate statistics pass) and one chunk per stream, partly masked row blocks, chunks and up tiles, the inject
row block, several W_up column chunks, a stream count that is not a power of two.

Tolerances. fp32: the kernel rounds where the reference rounds and differs only in fp32 accumulation order
(GEMVs of <= S*H = 384 terms, the partial sums over K chunks), so results agree to a few fp32 ulps; 1e-6 of the
largest value leaves >5x headroom over what is observed. bf16 against the reference: 4 bf16 ulps of values up to
2, as in tests/test_kernels_fused.py, because Triton's interpreter truncates fp32 -> bf16 casts where the GPU and
PyTorch round to nearest even, and each of the ~8 rounded intermediates may be one ulp off. That bound alone
would not notice a rounding step missing, so bf16 is also compared with `truncating_mirror`, the reference's
math with truncating casts: there the kernel agrees to within one ulp on at most 1/16 of the outputs (accumulation
order may flip a truncation; a missing rounding of the gated products moves over half of them).
"""

from __future__ import annotations

import math
import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: run the kernels on the CPU

import pytest
import torch
import triton  # noqa: F401  (fails the module when Triton is missing)

from strata.kernels import gemv_q8x, gemv_rr, hyper
from strata.model.hyper import hc_read_ref
from strata.model.ops import linear_ref
from strata.weights.tensor import DenseTensor

EPS = 1e-6


class PoisonedTorch:
    """`torch` for the kernel module, except that `empty` returns NaN-filled floating tensors: every output and
    scratch element the kernels leave unwritten (or read before writing) shows up as NaN."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty(*size, **kw):
        t = torch.empty(*size, **kw)
        if t.dtype == torch.int8:  # Q8 units: -128 is no quantized value, and as scale bytes no scale
            return t.fill_(-128)
        return t.fill_(math.nan) if t.is_floating_point() else t


@pytest.fixture(autouse=True)
def poisoned(monkeypatch):
    monkeypatch.setattr(hyper, "torch", PoisonedTorch())


def make(S: int, H: int, R: int, dtype: torch.dtype, seed: int):
    """State and weights with pre-activations of order one (SiLU and sigmoid away from linear), streams of
    different scales (so a wrong stream's statistics show) and non-trivial norm scales."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g)
    x = (rnd(S, H) * torch.arange(1, S + 1)[:, None]).reshape(1, S * H).to(dtype)
    norm = 1 + 0.2 * rnd(S * H)
    down = DenseTensor("down", (rnd(R, S * H) / math.sqrt(S * H) * 4).to(dtype))
    up = DenseTensor("up", (rnd(S * H, R) / math.sqrt(R) * 2).to(dtype))
    inject = DenseTensor("inject", (rnd(S, S * H) / math.sqrt(S * H) * 4).to(dtype))
    return x, norm, down, up, inject


def trunc(t: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16 -> fp32 by truncation, as the interpreter casts."""
    return (t.float().contiguous().view(torch.int32) & -65536).view(torch.float32)


def truncating_mirror(x, norm, down, up, inject, S):
    """`hc_read_ref` for bf16 with every rounding a truncation: normalised state, GEMV outputs, / S, SiLU,
    sigmoid, gated products, mean, 2 sigma."""
    xf = x.float().reshape(S, -1)
    xn = trunc((xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).flatten() * norm)
    m = trunc(trunc(down.tensor.float() @ xn) / S)
    m = trunc(m * torch.sigmoid(m))
    gate = trunc(torch.sigmoid(trunc(up.tensor.float() @ m)))
    a = trunc(trunc(gate * xn).reshape(S, -1).sum(0) / S)
    if inject is None:
        return a, None
    return a, trunc(2 * trunc(torch.sigmoid(trunc(trunc(inject.tensor.float() @ xn) / S))))


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == dtype and got.shape == want.shape and not got.isnan().any()
    err = (got.float() - want.float()).abs().max()
    if dtype == torch.float32:
        assert err <= 1e-6 * want.abs().max()
    else:
        assert want.abs().max() <= 2 and err <= 4 * 2 ** -8 * 2


def assert_mirrors(got: torch.Tensor, want: torch.Tensor) -> None:
    """Within one bf16 ulp of the truncating mirror everywhere, and equal on all but 1/16 of the values."""
    got, want = got.float().flatten(), want.flatten()
    ulp = torch.ldexp(torch.ones_like(want), torch.frexp(want).exponent - 8)
    diff = (got - want).abs()
    assert (diff <= ulp).all()
    assert int((diff > 0).sum()) <= want.numel() // 16


# S, H, R, dtype, knobs: the paths each case adds are noted
CASES = [
    (2, 48, 16, torch.float32, {"block_rows": 4, "block_k": 16, "block_h": 16, "block_r": 16}),  # 3 chunks per stream
    (4, 64, 20, torch.float32, {"block_rows": 8, "block_k": 64, "block_h": 16}),  # one chunk per stream, partial rows
    (3, 40, 12, torch.float32, {}),  # defaults; S not a power of two; H not a multiple of 16
    (4, 96, 20, torch.bfloat16, {"block_rows": 8, "block_k": 32, "block_h": 32, "block_r": 8}),  # 3 W_up column chunks
    (2, 48, 20, torch.bfloat16, {"block_rows": 16, "block_k": 64, "block_h": 32, "warps_down": 8}),  # partial up tile
    (3, 96, 16, torch.bfloat16, {}),  # defaults; padded stream row in the up tile
]


@pytest.mark.parametrize("S,H,R,dtype,knobs", CASES)
def test_hc_read_matches_reference(S, H, R, dtype, knobs):
    x, norm, down, up, inject = make(S, H, R, dtype, seed=S * 1000 + H + R)
    for inj in (inject, None):
        a_ref, i_ref = hc_read_ref(x, norm, down, up, inj, S, EPS, linear_ref)
        a, i = hyper.hc_read(x, norm, down, up, inj, S, EPS, **knobs)
        assert_close(a, a_ref, dtype)
        if inj is None:
            assert i is None
        else:
            assert_close(i, i_ref, dtype)
        if dtype == torch.bfloat16:
            a_m, i_m = truncating_mirror(x, norm, down, up, inj, S)
            assert_mirrors(a, a_m)
            if inj is not None:
                assert_mirrors(i, i_m)


def test_hc_read_is_deterministic():
    """Fixed-order reductions: two calls agree bit for bit (the property a CUDA-graph replay relies on)."""
    S, H, R = 4, 48, 20
    x, norm, down, up, inject = make(S, H, R, torch.bfloat16, seed=7)
    knobs = {"block_rows": 8, "block_k": 16, "block_h": 16}  # 3 K chunks per stream: 12 partial rows to reduce
    first = hyper.hc_read(x, norm, down, up, inject, S, EPS, **knobs)
    second = hyper.hc_read(x, norm, down, up, inject, S, EPS, **knobs)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])


@pytest.mark.parametrize("S,H,R,dtype,knobs", CASES[:4])
def test_finishing_in_the_down_kernel_changes_no_bit(S, H, R, dtype, knobs):
    """The down kernel's last program per row block finishing m and iota (tickets) gives the bits of every up
    program summing the partials itself: the same sums in the same order, the same roundings; twice in a row,
    so the tickets were put back."""
    x, norm, down, up, inject = make(S, H, R, dtype, seed=S * 100 + H + R)
    base = hyper.hc_read(x, norm, down, up, inject, S, EPS, finish_in_down=False, **knobs)
    for _ in range(2):
        got = hyper.hc_read(x, norm, down, up, inject, S, EPS, **knobs)
        assert torch.equal(got[0], base[0]) and torch.equal(got[1], base[1])


def test_sweep_configs_are_valid_and_correct():
    """Every setting `hc_read_configs` offers for the benchmark sweep runs and matches the reference (on a tiny
    shape, where the settings derived for 132 SMs are clamped to the shape)."""
    S, H, R = 2, 64, 16
    x, norm, down, up, inject = make(S, H, R, torch.float32, seed=11)
    a_ref, i_ref = hc_read_ref(x, norm, down, up, inject, S, EPS, linear_ref)
    configs = hyper.hc_read_configs(S, H, R, sms=132)
    assert configs[0] == hyper.hc_read_defaults(S, H, R, sms=132) and len(configs) > 1
    for knobs in configs:
        a, i = hyper.hc_read(x, norm, down, up, inject, S, EPS, **knobs)
        assert_close(a, a_ref, torch.float32)
        assert_close(i, i_ref, torch.float32)


def test_defaults_at_the_real_geometry():
    """S=4, H=2560, R=320 on 132 SMs: powers of two, and both launches give every SM several programs."""
    S, H, R, sms = 4, 2560, 320, 132
    d = hyper.hc_read_defaults(S, H, R, sms)
    for k in ("block_rows", "block_k", "block_h", "block_r"):
        assert d[k] & (d[k] - 1) == 0
    down_programs = (-(-R // d["block_rows"]) + -(-S // d["block_rows"])) * S * -(-H // d["block_k"])
    assert down_programs >= 2 * sms and -(-H // d["block_h"]) >= 2 * sms
    for bh in (8, 32):  # a fixed up-program width: the column tile shrinks so the tile stays <= 16K elements
        f = hyper.hc_read_defaults(S, H, R, sms, block_h=bh)
        assert f["block_h"] == bh and 4 * bh * f["block_r"] <= 16384 < 4 * bh * 2 * f["block_r"]
        assert {k: v for k, v in f.items() if k not in ("block_h", "block_r")} == \
            {k: v for k, v in d.items() if k not in ("block_h", "block_r")}


@pytest.mark.parametrize("block_h", [4, 32, 64])  # 8 programs per run (tickets), one, two runs per program
@pytest.mark.parametrize("write", [False, True])
def test_q8_units_are_the_quantized_output(block_h, write):
    """With q8_span the up kernel also writes a as Q8 units: the bytes `gemv_q8x.quantize` makes of a, every one
    written (the int8 scratch is poisoned), a itself unchanged; `quantize` of a, or of a view of all of it,
    returns them without a launch, twice in a row (the tickets were put back). A consumer of another span, or a
    changed in place, gets a fresh quantization."""
    S, H, R = 4, 256, 24
    x, norm, down, up, inject = make(S, H, R, torch.bfloat16, seed=block_h + write)
    args = (norm, down, up, inject, S, EPS)
    knobs = {"block_rows": 8, "block_k": 64, "block_h": block_h}
    wr = (inject.tensor[:, 0].reshape(1, S).float().sigmoid().to(torch.bfloat16), x[:, :H].flip(-1)) if write else ()
    call = hyper.hc_write_read if write else hyper.hc_read
    plain = call(x, *wr, *args, **knobs)
    for _ in range(2):
        got = call(x, *wr, *args, **knobs, q8_span=gemv_q8x.UNITS_SPAN)
        assert all(torch.equal(g, p) for g, p in zip(got, plain, strict=True))
        a = got[-2]
        units = gemv_q8x.quantize(a, "Q8_0_R")
        assert torch.equal(units, gemv_q8x.quantize(a.clone(), "Q8_0_R"))
        assert gemv_q8x.quantize(a.reshape(1, H), "Q4_K_R") is units
        assert gemv_q8x.quantize(a, "Q5_1_R") is not units
        a.mul_(1)
        assert gemv_q8x.quantize(a, "Q8_0_R") is not units


def test_q8_units_need_a_hidden_size_of_whole_units():
    """H not a multiple of 128 (a unit): no units are written or recorded, `quantize` launches."""
    S, H, R = 2, 96, 16
    x, norm, down, up, inject = make(S, H, R, torch.float32, seed=3)
    a, _ = hyper.hc_read(x, norm, down, up, inject, S, EPS, q8_span=gemv_q8x.UNITS_SPAN)
    assert gemv_rr.recorded_q8x(a, gemv_q8x.UNITS_SPAN) is None
