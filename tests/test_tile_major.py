"""Tile-major weights (`repack.TILE_LAYOUTS`: Q4_K_RT, Q6_K_RT): where the GPU placement makes them, what refuses
to read them row by row, and the model decoding through them as the reference (kernels under Triton's interpreter;
each kernel against its row-major twin: tests/test_kernels_gemv_rr.py, tests/test_kernels_gemv_q8x.py)."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: run the kernels on the CPU

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from strata.errors import StrataError  # noqa: E402
from strata.kernels import gemv_rr  # noqa: E402
from strata.kernels import ops as K_OPS  # noqa: E402
from strata.kernels.fused import fused_ops  # noqa: E402
from strata.runtime import placement  # noqa: E402
from strata.runtime.engine import Engine  # noqa: E402
from strata.runtime.placement import gpu_layout  # noqa: E402
from strata.runtime.synthetic import TypeMix, real_config, synthetic_weights  # noqa: E402
from strata.weights import quants, repack  # noqa: E402
from strata.weights.quant_tensor import QuantTensor  # noqa: E402
from strata.weights.tensor import WeightError, raw_rows  # noqa: E402
from tests import reference  # noqa: E402
from tests.test_kernels_gemv import random_blocks  # noqa: E402


def test_placement_makes_tile_major_gate_up_stacks_and_head() -> None:
    """`word_ordered` stores Q4_K gate/up stacks whose rows are whole tiles and steps as Q4_K_RT and a Q6_K head of
    at least TILE_MAJOR_HEAD_MIN_ROWS rows as Q6_K_RT: the same values (`dense`), bytes kept as whole tiles that
    no row-wise reader takes; other stacks, short heads and rows of one super-block stay row-major."""
    assert placement.TILE_MAJOR_HEAD_MIN_ROWS == 16 * gemv_rr.BIG_LAUNCH_TILES
    rng = np.random.default_rng(5)
    gate = QuantTensor("L0.moe.gate_exps", torch.stack([random_blocks("Q4_K", 8, 512, rng) for _ in range(2)]), 12,
                       (2, 8, 512))
    placed = placement.word_ordered(gate.name, gate)
    assert placed.kind == "Q4_K_RT" and placed.tiled and tuple(placed.data.shape) == (2, 2, 4, 288)
    assert torch.equal(placed.dense(), gate.dense()) and torch.equal(placed[1].dense(), gate[1].dense())
    assert raw_rows(placed) is None and placed.host_rows() is None
    for read in (lambda: placed[0].rows(torch.tensor([1])), lambda: placed[0].stored_rows(torch.tensor([1])),
                 lambda: placed[0].decode_rows(torch.zeros(1, 288, dtype=torch.uint8))):
        with pytest.raises(WeightError, match="L0.moe.gate_exps.*Q4_K_RT.*whole tiles of 4 rows"):
            read()
    with pytest.raises(ValueError, match="whole tiles"):  # a gather of rows decoded as if they were tiles
        quants.dequantize(placed[0].tiled_rows()[:3], repack.Q4_K_RT_ID, 512)
    with pytest.raises(WeightError, match="expected uint8"):  # tile-major bytes given as rows
        QuantTensor("t", placed.tiled_rows(), repack.Q4_K_RT_ID, (2, 8, 512))
    odd = QuantTensor("L0.moe.up_exps", torch.stack([random_blocks("Q4_K", 6, 512, rng)]), 12, (1, 6, 512))
    one = QuantTensor("L0.moe.up_exps", torch.stack([random_blocks("Q4_K", 8, 256, rng)]), 12, (1, 8, 256))
    assert placement.word_ordered(odd.name, odd).kind == "Q4_K_R"  # 6 rows: no whole tiles
    assert placement.word_ordered(one.name, one).kind == "Q4_K_R"  # one super-block: no whole steps
    head = QuantTensor("head", random_blocks("Q6_K", 32, 256, rng), 14, (32, 256))
    assert placement.word_ordered("head", head).kind == "Q6_K_R"
    placement.TILE_MAJOR_HEAD_MIN_ROWS, before = 32, placement.TILE_MAJOR_HEAD_MIN_ROWS
    try:
        tiled = placement.word_ordered("head", head)
    finally:
        placement.TILE_MAJOR_HEAD_MIN_ROWS = before
    assert tiled.kind == "Q6_K_RT" and torch.equal(tiled.dense(), head.dense())


def test_tile_major_in_place_is_tile_major() -> None:
    """`tile_major_` (in place, a run of tiles at a time) equals `tile_major` and undoes itself."""
    rows = torch.randint(0, 256, (3, 32, 576), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    want = repack.tile_major(rows, 4, 288)
    got = rows.clone()
    assert repack.tile_major_(got, 4, 288, chunk_bytes=4 * 576 * 3) is got and torch.equal(got, want)
    assert torch.equal(repack.tile_major_(got, 4, 288, undo=True), rows)
    with pytest.raises(ValueError, match="tiles of 5 rows"):
        repack.tile_major_(got, 5, 288)


def test_model_decodes_with_tile_major_weights_as_the_reference(monkeypatch) -> None:
    """With the routed gate/up stacks and the head placed tile-major (Q4_K_RT, Q6_K_RT: rows of 512 weights, two
    super-blocks a step; the head's threshold lowered to this vocabulary), the kernels decode as the reference:
    prompt rows through the generic GEMV, tokens through the row-register launches of the tiled types."""
    monkeypatch.setattr(placement, "TILE_MAJOR_HEAD_MIN_ROWS", 16)
    cfg = real_config(num_hidden_layers=4, hidden_size=512, vocab_size=256, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=128, linear_num_key_heads=1, linear_num_value_heads=2,
                      linear_key_head_dim=64, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128,
                      shared_expert_intermediate_size=256, hc_lowrank=32, ple_embed_dim=256, heads_per_ngram=2,
                      ngram_vocab_size_base=1000, indexer_budget=16, indexer_head_dim=64, eos_token_id=1)
    w = synthetic_weights(cfg, TypeMix(), "cpu")
    placed = gpu_layout(w)
    assert (placed["L0.moe.gate_exps"].kind, placed["L0.moe.up_exps"].kind, placed["head"].kind) == (
        "Q4_K_RT", "Q4_K_RT", "Q6_K_RT")
    assert placed["L0.moe.down_exps"].kind == "Q5_1_R" and raw_rows(placed["head"]) is None
    with pytest.raises(StrataError, match="tile-major"):
        placed["head"].rows(torch.tensor([3]))
    assert all(not getattr(placed[n], "tiled", False) for n in placed.tensors
               if not n.endswith(("gate_exps", "up_exps", "head")))
    monkeypatch.setattr(K_OPS, "_on_gpu", lambda x: True)
    shape = gemv_rr.launch_shape  # 16x the rows per program: 16x fewer programs for the interpreter to run
    monkeypatch.setattr(gemv_rr, "launch_shape", lambda *a: (lambda s: (16 * s[0], *s[1:]))(shape(*a)))
    kinds = []
    launch = gemv_rr.launch
    monkeypatch.setattr(gemv_rr, "launch", lambda kind, *a, **k: (kinds.append(kind), launch(kind, *a, **k))[1])
    fast = Engine(placed, ops=fused_ops(K_OPS.triton_ops(), force=True))
    ids = torch.randint(2, cfg.vocab_size, (5,), generator=torch.Generator().manual_seed(3)).tolist()
    reference.assert_decodes_match(Engine(w), fast, ids, prompt=2, capacity=8)
    assert {"Q4_K_RT", "Q6_K_RT"} <= set(kinds)
