"""The Q8-activation mode (`--activations q8`) through the whole model: the reference rounds every product with a
block-quantized weight by `linear_q8_ref`, and the Triton entries (`triton_ops(q8=True)`, run under the interpreter
on the CPU) compute the same thing, with the `gemv_q8x` kernels where the types have them (the bench's type mix:
Q4_K experts with Q5_1 down projections, Q8_0 attention and GDN, BF16 hyper-connections, a Q6_K head, which
takes x rounded and the float GEMV)."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: run the kernels on the CPU

import pytest  # noqa: E402
import torch  # noqa: E402

from strata.kernels import gemv_q8x, gemv_rr  # noqa: E402
from strata.kernels import ops as K_OPS  # noqa: E402
from strata.kernels.fused import fused_ops  # noqa: E402
from strata.model.ops import Ops, linear_q8_ref, linear_ref, with_activations  # noqa: E402
from strata.runtime.engine import Engine  # noqa: E402
from strata.runtime.placement import gpu_layout  # noqa: E402
from strata.runtime.synthetic import TypeMix, real_config, synthetic_weights  # noqa: E402
from strata.errors import StrataError  # noqa: E402
from strata.weights.tensor import DenseTensor  # noqa: E402
from tests import reference  # noqa: E402


def _weights():
    """The bench's type mix at a geometry small enough for the interpreter (every row-register GEMV kind, K a
    multiple of 128 everywhere, experts 4 of which 2 are selected)."""
    cfg = real_config(num_hidden_layers=4, hidden_size=256, vocab_size=256, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=128, linear_num_key_heads=1, linear_num_value_heads=2,
                      linear_key_head_dim=64, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128,
                      shared_expert_intermediate_size=256, hc_lowrank=32, ple_embed_dim=256, heads_per_ngram=2,
                      ngram_vocab_size_base=1000, indexer_budget=16, indexer_head_dim=64, eos_token_id=1)
    return synthetic_weights(cfg, TypeMix(), "cpu")


def test_model_decodes_with_q8_activations_as_the_reference(monkeypatch) -> None:
    w = _weights()
    placed = gpu_layout(w)
    assert {placed[n].kind for n in ("L0.gdn.qkv", "L0.gdn.out", "L3.attn.o", "L0.moe.sh_down")} == {"Q8_0_R"}
    assert (placed["L0.moe.gate_exps"].kind, placed["L0.moe.down_exps"].kind) == ("Q4_K_R", "Q5_1_R")
    monkeypatch.setattr(K_OPS, "_on_gpu", lambda x: True)  # run the CUDA entries under the interpreter
    shape = gemv_rr.launch_shape  # 16x the rows per program: 16x fewer programs for the interpreter to run
    monkeypatch.setattr(gemv_rr, "launch_shape", lambda *a: (lambda s: (16 * s[0], *s[1:]))(shape(*a)))
    calls = reference.count_calls(monkeypatch, {n: (gemv_q8x, n) for n in (
        "quantize", "gemv", "gemv_glu", "gemv_experts_glu", "gemv_experts_sum", "round_rows")})
    hits = []  # quantize calls served by the units an HC read wrote (`fused_ops(q8=True)`)
    lookup = gemv_rr.recorded_q8x
    monkeypatch.setattr(gemv_rr, "recorded_q8x", lambda *a: (lambda u: hits.append(u is not None) or u)(lookup(*a)))
    ref = Engine(w, activations="q8")
    fast = Engine(placed, ops=fused_ops(K_OPS.triton_ops(with_activations(Ops(), "q8"), q8=True), force=True,
                                        q8=True))
    ids = torch.randint(2, w.cfg.vocab_size, (5,), generator=torch.Generator().manual_seed(3)).tolist()
    reference.assert_decodes_match(ref, fast, ids, prompt=2, capacity=8)
    assert all(calls.values()), calls  # the projections, the shared and the routed experts all took the kernels
    assert any(hits) and not all(hits), hits  # the HC reads' outputs took no quantize launch; the rest did
    # the mode changes the model's output: float activations give other logits
    plain = reference.decode_logits(Engine(w), ids, 2)
    rounded = reference.decode_logits(ref, ids, 2)
    assert (plain - rounded).abs().max() > 1e-4 * rounded.abs().max()


def test_rounding_applies_to_quantized_weights_only() -> None:
    dense = DenseTensor("w", torch.randn(8, 64))
    x = torch.randn(2, 64)
    assert torch.equal(linear_q8_ref(x, dense), linear_ref(x, dense))
    assert with_activations(Ops(), "float") == Ops()
    with pytest.raises(ValueError, match="activations must be one of float, q8"):
        with_activations(Ops(), "int4")
    with pytest.raises(StrataError, match="activations must be one of"):
        Engine(_weights(), activations="fp8")


def test_capturable_expert_twin_rounds_as_the_mode() -> None:
    """The captured step's reference experts (`experts_gather`, the capturable twin of `experts_ref`) round their
    inputs in the q8 mode as `linear_q8_ref` does."""
    from strata.model.experts import experts_gather, experts_ref
    from strata.runtime.graph import capturable

    w = _weights()
    gate, up, down = (w[f"L0.moe.{n}_exps"] for n in ("gate", "up", "down"))
    a = torch.randn(3, w.cfg.hidden_size, generator=torch.Generator().manual_seed(4))
    top_i = torch.tensor([[0, 2], [3, 1], [2, 3]])
    top_w = torch.softmax(torch.randn(3, 2, generator=torch.Generator().manual_seed(5)), -1)
    ops = capturable(with_activations(Ops(), "q8"))
    got = ops.experts(a, top_i, top_w, gate, up, down, ops.linear)
    want = experts_ref(a, top_i, top_w, gate, up, down, linear_q8_ref)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6 * want.abs().max().item())
    plain = experts_gather(a, top_i, top_w, gate, up, down, linear_ref)
    assert (plain - want).abs().max() > 1e-4 * want.abs().max()
    assert capturable(Ops()).experts is experts_gather


def test_entries_take_q8_kernels_where_they_apply(monkeypatch) -> None:
    """`linear_blocks` in the q8 mode: one aligned row of a row-register type through `gemv_q8x`; rows that do not
    start 16-byte aligned, and several rows, through x rounded and the float GEMV: the same products either way."""
    import numpy as np

    from strata.model.act_quant import round_q8
    from tests.test_kernels_gemv_rr import ggml_rows

    w, ref = ggml_rows("Q4_K_R", 8, 512, np.random.default_rng(12))
    shifted = torch.empty(w.numel() + 1, dtype=torch.uint8)[1:].view(w.shape)
    shifted.copy_(w)
    calls = reference.count_calls(monkeypatch, {"q8": (gemv_q8x, "gemv"), "float": (K_OPS, "gemv")})
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(12))
    for data, rows, path in ((w, 1, "q8"), (shifted, 1, "float"), (w, 3, "float")):
        before = dict(calls)
        y = K_OPS.linear_blocks(x[:rows], data, "Q4_K_R", q8=True)
        want = round_q8(x[:rows]).double() @ ref.T
        assert (y.double() - want).abs().max() <= 1e-5 * want.abs().max()
        assert calls[path] == before[path] + 1


def test_jittered_linear_moves_each_row_by_at_most_rel_of_its_largest_value() -> None:
    from strata.model.ops import jittered_linear

    w = _weights()["L0.gdn.out"]
    x = torch.randn(3, w.shape[1], generator=torch.Generator().manual_seed(6))
    y = linear_ref(x, w)
    assert torch.equal(jittered_linear(linear_ref, 0.0, 1)(x, w), y)
    moved = jittered_linear(linear_ref, 1e-3, 1)(x, w) - y
    assert 0 < moved.abs().max() <= 1e-3 * y.abs().amax() * (1 + 1e-6)
    assert torch.equal(jittered_linear(linear_ref, 1e-3, 1)(x, w), jittered_linear(linear_ref, 1e-3, 1)(x, w))


def test_q8_mode_is_discontinuous_at_rounding_boundaries(fixtures_dir) -> None:
    """Why the GPU check of the mode allows more than the float check (tools/gpu_check_model.py): jittering the
    reference's products by ~1e-6 of their rows' largest values (the size of fp32 accumulation-order differences)
    moves float-activation logits by about that much, but Q8-activation logits by orders of magnitude more, since
    inputs at a rounding boundary land on the other integer."""
    import dataclasses
    import json

    from strata.model.ops import jittered_linear
    from strata.runtime.engine import load_weights

    ids = json.loads((fixtures_dir / "prompt.json").read_text())["ids"]
    w = load_weights(fixtures_dir / "tiny-IQ4_XS.gguf")
    moved = {}
    for mode in ("float", "q8"):
        base = with_activations(Ops(), mode)
        ref, jit = Engine(w, ops=base), Engine(w, ops=dataclasses.replace(
            base, linear=jittered_linear(base.linear, 2.0**-20, 0)))
        want = ref.prefill(ids, ref.new_state(), all_logits=True)
        got = jit.prefill(ids, jit.new_state(), all_logits=True)
        moved[mode] = float((got - want).abs().max() / want.abs().max())
    assert moved["float"] < 1e-5 and moved["q8"] > 1e-4, moved
