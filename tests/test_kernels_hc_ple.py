"""The hyper-connection write and PLE mix kernels equal their reference twins (Triton's interpreter, CPU).

fp32: the kernels round like the references and differ only in fp32 accumulation order, so they agree to
~1e-6 relative. bf16: within 2 bf16 ulps of the row's largest value (the interpreter truncates fp32 -> bf16
casts where the GPU rounds to nearest even, so a rounded intermediate may be one ulp off).

Triton must be importable: a missing Triton is an error here, never a skip.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: run the kernels on the CPU

import pytest
import torch
import triton  # noqa: F401  (fails the module when Triton is missing)

from strata.config import ModelConfig
from strata.kernels import hc_write as hc_write_kernel
from strata.kernels import ple as ple_kernel
from strata.kernels.fused import fused_ops
from strata.model.hyper import hc_write_ref
from strata.model.ops import Ops
from strata.model.ple import ple_mix_ref
from strata.runtime.engine import Engine
from strata.weights.hf import load_hf
from tests import reference


def config(name: str = "tiny", **overrides) -> ModelConfig:
    return ModelConfig.from_hf_dict(dict(reference.CONFIGS[name], **overrides))


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> bool:
    """fp32: 1e-6 of the largest value; bf16: 2 ulps of the largest value of each row."""
    got, want = got.float(), want.float()
    scale = want.abs().amax(-1, keepdim=True).clamp_min(1e-30)
    tol = scale * (1e-6 if dtype == torch.float32 else 2 * 2.0 ** -7)
    return bool(((got - want).abs() <= tol).all())


@pytest.mark.parametrize("L,S,H,dtype", [(1, 2, 64, torch.float32), (3, 4, 48, torch.float32),
                                         (1, 4, 64, torch.bfloat16), (2, 3, 40, torch.bfloat16)])
def test_hc_write_matches_reference(L, S, H, dtype):
    g = torch.Generator().manual_seed(L * 100 + S)
    x = torch.randn(L, S * H, generator=g).to(dtype)
    inject = (2 * torch.rand(L, S, generator=g)).to(dtype)
    y = torch.randn(L, H, generator=g).to(dtype)
    got = hc_write_kernel.hc_write(x, inject, y, block=64)
    want = hc_write_ref(x, inject, y)
    assert got.dtype == dtype and got.shape == want.shape
    if dtype == torch.float32:
        assert torch.equal(got, want)  # same two roundings, no accumulation
    assert close(got, want, dtype)


@pytest.mark.parametrize("name,dtype", [("tiny", torch.float32), ("hc4", torch.float32),
                                        ("tiny", torch.bfloat16), ("hc4", torch.bfloat16)])
def test_ple_mix_matches_reference(name, dtype):
    cfg = config(name)
    S, H, n, Kp = cfg.hc_count, cfg.hidden_size, cfg.ngram_size, cfg.ple_conv_kernel_size
    C = S * H
    g = torch.Generator().manual_seed(7)
    rnd = lambda *s: torch.randn(*s, generator=g)
    nk, nq, nc = 1 + 0.3 * rnd(C), 1 + 0.3 * rnd(C), 1 + 0.3 * rnd(C)
    conv_w = (0.5 * rnd(C, Kp)).to(dtype)
    ref_win = rnd(C, (Kp - 1) * n).to(dtype)
    win = ref_win.clone()
    for step in range(5):  # the window written by one step feeds the next
        x, key, value = rnd(1, C).to(dtype), rnd(1, C).to(dtype), rnd(1, H).to(dtype)
        if step == 3:
            key[0, :H] = 0  # stream 0: a zero key gives s = 0 exactly, so s' = 0
        want = ple_mix_ref(x, key, value, nk, nq, nc, conv_w, ref_win, cfg)
        got = ple_kernel.ple_mix(x, key, value, nk, nq, nc, conv_w, win, cfg, block_c=32)
        assert got.dtype == dtype and got.shape == want.shape
        assert close(got, want, dtype), (step, (got.float() - want.float()).abs().max())
        assert close(win, ref_win, dtype)


def test_fused_entries_dispatch():
    """Off CUDA without `force`: the reference; forced with several tokens: ple_mix falls back."""
    cfg = config()
    ops = fused_ops(Ops())
    assert ops.hc_write is not hc_write_ref and ops.ple_mix is not ple_mix_ref
    g = torch.Generator().manual_seed(3)
    C, H = cfg.hc_dim, cfg.hidden_size
    x, inject = torch.randn(2, C, generator=g), torch.rand(2, cfg.hc_count, generator=g)
    y = torch.randn(2, H, generator=g)
    assert torch.equal(ops.hc_write(x, inject, y), hc_write_ref(x, inject, y))
    forced = fused_ops(Ops(), force=True)
    args = [torch.randn(2, C, generator=g), torch.randn(2, C, generator=g), torch.randn(2, H, generator=g),
            torch.ones(C), torch.ones(C), torch.ones(C), torch.randn(C, cfg.ple_conv_kernel_size, generator=g)]
    w1 = torch.randn(C, cfg.ple_conv_state_len, generator=g)
    w2 = w1.clone()
    assert torch.equal(forced.ple_mix(*args, w1, cfg), ple_mix_ref(*args, w2, cfg))
    assert torch.equal(w1, w2)


@pytest.mark.parametrize("name", ["tiny", "hc4"])
def test_model_decode_matches_reference(name, tmp_path, monkeypatch):
    """Prefill 4 tokens, then decode 4 with every fused op (PLE is active in both configs), through the engine
    and through the fixed-capacity step the GPU captures (run eagerly)."""
    calls = reference.count_calls(monkeypatch, {"hc": (hc_write_kernel, "hc_write"), "ple": (ple_kernel, "ple_mix")})
    weights = load_hf(reference.save(reference.build(name), tmp_path))
    ref = Engine(weights)
    fast = Engine(weights, ops=fused_ops(Ops(), force=True))
    ids = torch.randint(2, ref.cfg.vocab_size, (8,), generator=torch.Generator().manual_seed(5)).tolist()
    reference.assert_decodes_match(ref, fast, ids, prompt=4, capacity=16)
    # the kernels ran on every decode step of every PLE layer, in the engine and in the static step
    assert calls["hc"] > 0 and calls["ple"] == 2 * 4 * len(ref.cfg.ple_layer_ids)


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("wide", [False, True])
def test_ple_gather_kernel_equals_host_gather(n: int, wide: bool) -> None:
    """The device n-gram hash and row gather (`ple_gather`) writes the rows the host path gathers
    (`ngram_rows_one` + `stored_rows_into`), over histories with EOS ids anywhere (they cut the n-grams); with
    the real multipliers (~2^45) and with 64-bit ones (`wide`: products wrap around int64 and hashes go
    negative, so the floor remainder matters)."""
    import dataclasses
    import random

    from strata.model import ple
    from strata.runtime.synthetic import real_config

    cfg = real_config(ngram_size=n, ngram_vocab_size_base=3_000, **({"ple_embed_dim": 2400} if n == 4 else {}))
    geo = next(iter(cfg.ple.values()))
    if wide:
        geo = dataclasses.replace(geo, multipliers=tuple((0x9E3779B97F4A7C15 * (k + 3)) % 2**64 for k in range(n)))
    tables = ple.NgramTables.of(geo, cfg, "cpu")
    table = torch.randint(0, 256, (geo.rows, 18), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
    rng = random.Random(n)
    eos = cfg.ple_eos
    negative = 0
    for _ in range(40):
        hist = [rng.choice([eos, rng.randrange(cfg.vocab_size)]) for _ in range(n)]
        rows = ple.ngram_rows_one(hist[-1], hist[:-1], geo, cfg)
        want = table[rows]
        got = torch.zeros_like(want)
        ple_kernel.ple_gather(torch.tensor(hist), table, tables, got)
        assert torch.equal(got, want), hist
        ref = torch.zeros_like(want)
        ple.ple_gather_ref(torch.tensor(hist), table, tables, ref)
        assert torch.equal(ref, want), hist
        h = ple._i64(hist[-1] * geo.multipliers[0])
        for k in range(1, n):
            h ^= ple._i64((hist[n - 1 - k] if eos not in hist[n - k:n - 1] else eos) * geo.multipliers[k])
            negative += h < 0
    assert (negative > 0) == wide


@pytest.mark.parametrize("name", ["tiny", "hc4"])
def test_step_with_the_gather_kernel_equals_host_staging(name: str, tmp_path) -> None:
    """The decode step gathering its PLE rows with the Triton kernel (under the interpreter) gives the
    host-staged step's logits bit for bit."""
    import dataclasses

    from strata.model.model import Model
    from tests.test_static_step import assert_device_gather_equals_host

    engine = Engine(load_hf(reference.save(reference.build(name), tmp_path)))
    m = engine.model
    model = Model(m.w, m.dtype, m.device, dataclasses.replace(m.ops, ple_gather=ple_kernel.ple_gather))
    assert_device_gather_equals_host(model, engine.cfg)
