"""The hyper-connection write folded into the next read (`strata.kernels.hyper.hc_write_read`) equals
`hc_write_read_ref` (Triton's interpreter, CPU), and the model decodes through it.

Tolerances as in tests/test_kernels_hyper.py (whose shape cases and helpers this reuses): fp32 to 1e-6 of the
largest value, with the written state x' bitwise equal to `hc_write_ref` (same two roundings, no accumulation);
bf16 within 4 ulps of the reference (the interpreter truncates fp32 -> bf16 casts), and also against the
reference's math with truncating casts: x' exactly, the read outputs within `assert_mirrors`.

Triton must be importable: a missing Triton is an error here, never a skip.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: run the kernels on the CPU

import pytest
import torch
import triton  # noqa: F401  (fails the module when Triton is missing)

from strata.kernels import hc_write as hc_write_kernel
from strata.kernels import hyper
from strata.kernels.fused import fused_ops
from strata.model.hyper import hc_write_read_ref, hc_write_ref
from strata.model.ops import Ops, linear_ref
from strata.runtime.engine import Engine
from strata.weights.hf import load_hf
from tests import reference
from tests import test_kernels_hyper as th  # shape cases, inputs, tolerances


@pytest.fixture(autouse=True)
def poisoned(monkeypatch):
    monkeypatch.setattr(hyper, "torch", th.PoisonedTorch())


def write_inputs(S: int, H: int, dtype: torch.dtype, seed: int):
    """The preceding block's injection weights (in (0, 2), as 2 sigma(.)) and output."""
    g = torch.Generator().manual_seed(seed)
    return (2 * torch.rand(1, S, generator=g)).to(dtype), torch.randn(1, H, generator=g).to(dtype)


@pytest.mark.parametrize("S,H,R,dtype,knobs", th.CASES)
def test_hc_write_read_matches_reference(S, H, R, dtype, knobs):
    x, norm, down, up, inject = th.make(S, H, R, dtype, seed=S * 1000 + H + R)
    inj_prev, y = write_inputs(S, H, dtype, seed=S + H)
    for inj in (inject, None):
        x_ref, a_ref, i_ref = hc_write_read_ref(x, inj_prev, y, norm, down, up, inj, S, th.EPS, linear_ref)
        assert torch.equal(x_ref, hc_write_ref(x, inj_prev, y))
        x_new, a, i = hyper.hc_write_read(x, inj_prev, y, norm, down, up, inj, S, th.EPS, **knobs)
        assert x_new.dtype == dtype and x_new.shape == x.shape and not x_new.isnan().any()
        if dtype == torch.float32:
            assert torch.equal(x_new, x_ref)
        else:
            # the write's two roundings as the interpreter does them, then the reference's tolerance
            assert torch.equal(x_new.float(), th.trunc(x.float() + th.trunc(inj_prev.float().T * y.float()).flatten()))
            assert (x_new.float() - x_ref.float()).abs().max() <= 2 * 2 ** -8 * x_ref.float().abs().max()
        th.assert_close(a, a_ref, dtype)
        if inj is None:
            assert i is None
        else:
            th.assert_close(i, i_ref, dtype)
        if dtype == torch.bfloat16:  # the read of the kernel's own x': no rounding step missing
            a_m, i_m = th.truncating_mirror(x_new, norm, down, up, inj, S)
            th.assert_mirrors(a, a_m)
            if inj is not None:
                th.assert_mirrors(i, i_m)


def test_hc_write_read_is_deterministic():
    """Fixed-order reductions, one writer per element of x': two calls agree bit for bit."""
    S, H, R = 4, 48, 20
    x, norm, down, up, inject = th.make(S, H, R, torch.bfloat16, seed=7)
    inj_prev, y = write_inputs(S, H, torch.bfloat16, seed=8)
    knobs = {"block_rows": 8, "block_k": 16, "block_h": 16}  # 3 K chunks per stream, 3 row blocks
    first = hyper.hc_write_read(x, inj_prev, y, norm, down, up, inject, S, th.EPS, **knobs)
    second = hyper.hc_write_read(x, inj_prev, y, norm, down, up, inject, S, th.EPS, **knobs)
    assert all(torch.equal(p, q) for p, q in zip(first, second, strict=True))


def test_fused_entry_dispatch(monkeypatch):
    """Forced with one token: the kernel; with several tokens: the write and the read entries (the write kernel,
    the reference read), equal to the reference composition."""
    calls = []
    S, H, R = 2, 32, 8
    _, norm, down, up, inject = th.make(S, H, R, torch.float32, seed=3)
    ops = fused_ops(Ops(), force=True)
    orig = hyper.hc_write_read
    monkeypatch.setattr(hyper, "hc_write_read", lambda *a, **kw: (calls.append(1), orig(*a, **kw))[1])
    for L in (1, 3):
        g = torch.Generator().manual_seed(L)
        x = torch.randn(L, S * H, generator=g)
        inj_prev, y = torch.rand(L, S, generator=g), torch.randn(L, H, generator=g)
        got = ops.hc_write_read(x, inj_prev, y, norm, down, up, inject, S, th.EPS, linear_ref)
        want = hc_write_read_ref(x, inj_prev, y, norm, down, up, inject, S, th.EPS, linear_ref)
        assert torch.equal(got[0], want[0])
        for p, q in zip(got[1:], want[1:], strict=True):
            th.assert_close(p, q, torch.float32)
        assert len(calls) == 1  # only the one-token call ran the fused kernel


@pytest.mark.parametrize("name", ["tiny", "hc4", "nople"])
def test_model_decode_matches_reference(name, tmp_path, monkeypatch):
    """Prefill 4 tokens, then decode 4 with every fused op, through the engine and the fixed-capacity step the GPU
    captures (run eagerly). Per decode step the fused kernel serves every read that follows a write: both reads
    of every layer, less layer 0's first and those after a PLE mix (which needs the written state), plus the
    final read; the write kernel serves the writes before a PLE mix."""
    calls = reference.count_calls(monkeypatch, {"fused": (hyper, "hc_write_read"),
                                                "write": (hc_write_kernel, "hc_write")})
    weights = load_hf(reference.save(reference.build(name), tmp_path))
    ref = Engine(weights)
    fast = Engine(weights, ops=fused_ops(Ops(), force=True))
    ids = torch.randint(2, ref.cfg.vocab_size, (8,), generator=torch.Generator().manual_seed(5)).tolist()
    reference.assert_decodes_match(ref, fast, ids, prompt=4, capacity=16)
    n = ref.cfg.num_hidden_layers
    split = len([i for i in ref.new_state().ple if i > 0])  # PLE layers (0-based) with a write before the mix
    runs = 2 * 4  # engine and static step, 4 decode steps each
    assert calls["fused"] == runs * (2 * n - split)
    assert calls["write"] >= runs * split  # the decode steps' split writes (prefill's writes come on top)
