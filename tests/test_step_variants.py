"""tools/step_variants.py's variant parsing (the timing itself runs on the device box): each documented form sets
the knob it names, and `apply("base")` puts every knob back, so the rows of one run do not leak into each other."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # as the kernel tests: no kernel runs here, but Triton may be imported first

import pytest  # noqa: E402
import torch  # noqa: E402

from strata.kernels import attention, experts_gemm, gdn, gemv_q8x, gemv_rr, hyper, pdl  # noqa: E402
from strata.kernels import gemv as kernel_gemv  # noqa: E402
from strata.kernels import ops as kernel_ops  # noqa: E402
from strata.model.moe import moe_combine_ref  # noqa: E402
from strata.runtime import graph  # noqa: E402

from tests.tool_module import load_tool  # noqa: E402

sv = load_tool("step_variants")

# every form of the module's docstring that needs no CUDA device to parse (hc:I reads the SM count)
VARIANTS = ["base", "select:removed", "select:radix", "route:removed", "combine:removed", "release:after-loop",
            "gdn:16", "gdn:16:1", "gdn-prefetch:0",
            "preload:Q4_K_R:3", "preload:Q8_0_R/6:2", "preload:q8:Q8_0_R/6:3", "preload:q8:Q4_K_R:5",
            "gemv-type:Q8_0:4,2,1", "ids-early:off", "select:ranked:8:1024", "attend:64:32", "hc-up:8",
            "row-major:glu", "row-major:glu+row-major:head",
            "release-plain:0", "release-settled:1", "release-rows:2560:1", "late:hc_up:1", "streams:off",
            "shared:removed", "argmax:torch", "norm-ropes:split", "activations:q8", "q8-units:off",
            "quantize:removed", "x-widen:0", "experts-gemm:0", "experts-gemm-shape:32,8", "prefill-chunk:1024",
            "shape:Q4_K_R:10:0:1000000:4,2,1,1", "activations:q8+preload:q8:Q4_K_R:5+shape:Q4_K_R:10:0:1000000:4,2,1,1"]


def _knobs() -> tuple:
    return (dict(gemv_rr.PRELOAD), gdn.PREFETCH_STATE, dict(gemv_rr.RELEASE), dict(pdl.LATE_RELEASE),
            gemv_rr.WIDEN_X_ASM,
            gemv_rr.launch_shape, gemv_rr.launch, hyper.hc_read_defaults, dict(sv.PREFILL), gdn.gdn_step,
            attention.select_blocks_ranked, attention.RANK_SELECT_MAX_BLOCKS, attention.attend, gemv_q8x.quantize,
            kernel_ops.SETTLED_IDS, kernel_ops.GEMM_MIN_TOKENS, kernel_ops.Q8_UNITS_FROM_GLU, graph.greedy_token,
            (experts_gemm.BLOCK_N, experts_gemm.NUM_WARPS), kernel_gemv._launch_rr)


@pytest.mark.parametrize("variant", VARIANTS)
def test_variant_parses_and_base_restores_every_knob(variant: str) -> None:
    before = _knobs()
    swaps = sv.apply(variant)
    assert isinstance(swaps, dict)
    sv.apply("base")
    assert _knobs() == before


def test_preload_variants_set_the_entry_they_name() -> None:
    try:
        sv.apply("preload:q8:Q8_0_R/6:3+preload:Q5_1_R:1")
        assert gemv_rr.PRELOAD["q8:Q8_0_R/6"] == 3 and gemv_rr.PRELOAD["Q5_1_R"] == 1
        assert gemv_rr.preload_steps("Q8_0_R", 6, q8x=True) == 3
        assert gemv_rr.preload_steps("Q8_0_R", 6) == sv.BASE["PRELOAD"]["Q8_0_R/6"]
        sv.apply("shape:Q4_K_R:10:0:1000000:4,2,1,1")
        assert gemv_rr.launch_shape("Q4_K_R", 10, 80) == (4, 2, 1, 1)
        assert gemv_rr.launch_shape("Q4_K_R", 5, 80) == sv.BASE["launch_shape"]("Q4_K_R", 5, 80)
    finally:
        sv.apply("base")


@pytest.mark.parametrize("variant", ["nonsense", "preload:Q4_K_R", "gdn", "late:no_such_kernel:1"])
def test_unknown_variant_is_refused(variant: str) -> None:
    with pytest.raises(SystemExit, match="unknown variant"):
        sv.apply(variant)
    sv.apply("base")


def test_hc_variant_sets_the_knob_setting_it_names_and_refuses_one_past_the_list(monkeypatch) -> None:
    """`hc:I` takes setting I of `hyper.hc_read_configs` (for this card's SM count); an index past the list is
    refused by name with the range, not an IndexError in the middle of a device run."""
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *_: type("P", (), {"multi_processor_count": 132}))
    cfg = sv.real_config()
    configs = hyper.hc_read_configs(cfg.hc_count, cfg.hidden_size, cfg.hc_lowrank, 132)
    try:
        sv.apply(f"hc:{len(configs) - 1}")
        expected = {k: v for k, v in configs[-1].items() if k != "finish_in_down"}
        assert hyper.hc_read_defaults(cfg.hc_count, cfg.hidden_size, cfg.hc_lowrank, 132) == expected
    finally:
        sv.apply("base")
    with pytest.raises(SystemExit, match=f"has {len(configs)} knob settings, 0 to {len(configs) - 1}"):
        sv.apply(f"hc:{len(configs)}")
    sv.apply("base")


def test_row_major_variant_relays_the_tiled_tensors_and_back(monkeypatch) -> None:
    """`row-major:glu` re-lays the tile-major gate/up stacks (Q4_K_RT) in place as their row-major twins (Q4_K_R),
    leaving the head (Q6_K_RT) alone, and `base` puts the tile-major tensors and every byte back."""
    from strata.weights import repack
    from strata.weights.quant_tensor import QuantTensor

    gen = torch.Generator().manual_seed(3)
    rows = {n: torch.randint(0, 256, (2, 8, 1440), dtype=torch.uint8, generator=gen)
            for n in ("L0.moe.gate_exps", "L0.moe.up_exps")}
    rows["head"] = torch.randint(0, 256, (32, 2240), dtype=torch.uint8, generator=gen)
    kinds = {"L0.moe.gate_exps": repack.Q4_K_RT_ID, "L0.moe.up_exps": repack.Q4_K_RT_ID, "head": repack.Q6_K_RT_ID}
    tensors = {}
    for n, r in rows.items():
        layout = repack.TILE_LAYOUTS[kinds[n]]
        shape = (*r.shape[:-1], r.shape[-1] // (layout.step if kinds[n] == repack.Q6_K_RT_ID else 144) * 256)
        tiled = repack.tile_major(r, layout.tile, layout.step)
        tensors[n] = QuantTensor(n, tiled.view(*r.shape[:-2], r.shape[-2] // layout.tile, layout.tile, -1),
                                 kinds[n], shape)
    before = dict(tensors)
    monkeypatch.setitem(sv.WEIGHTS, "w", type("W", (), {"tensors": tensors})())
    try:
        sv.apply("row-major:glu")
        for n in ("L0.moe.gate_exps", "L0.moe.up_exps"):
            assert tensors[n].type_id == repack.Q4_K_R_ID and torch.equal(tensors[n].data, rows[n])
            assert tensors[n].data.data_ptr() == before[n].data.data_ptr()  # in place
        assert tensors["head"] is before["head"]
    finally:
        sv.apply("base")
    assert all(tensors[n] is before[n] for n in tensors) and not sv.ROW_MAJOR
    for n, r in rows.items():
        layout = repack.TILE_LAYOUTS[kinds[n]]
        assert torch.equal(tensors[n].tiled_rows(), repack.tile_major(r, layout.tile, layout.step))


def test_argmax_torch_variant_takes_greedy_tokens_call() -> None:
    """`argmax:torch` swaps in a `graph.greedy_token` with the same call (logits, out): the captured step passes
    the chosen id's buffer as `out` (the swap was once bare `torch.Tensor.argmax`, which took `out` as a dim)."""
    logits = torch.tensor([0.5, 3.0, -1.0, 2.5])
    try:
        sv.apply("argmax:torch")
        assert graph.greedy_token is graph.torch_greedy_token
        out = torch.zeros((), dtype=torch.int64)
        assert graph.greedy_token(logits, out) is out and int(out) == 1
        assert int(graph.greedy_token(logits)) == 1
    finally:
        sv.apply("base")


def test_combine_removed_variant_swaps_the_moe_combine_and_freezes_it_under_capture(monkeypatch) -> None:
    """`combine:removed` swaps only `Ops.moe_combine`: outside a capture (a warm-up) it computes the combine;
    while capturing it launches nothing and returns the first warm-up's output, the same tensor every time: a
    later warm-up must not replace (and so free) what an earlier captured graph reads (`_frozen`)."""
    g = torch.Generator().manual_seed(0)
    routed, shared = torch.randn(1, 64, generator=g), torch.randn(1, 64, generator=g)
    gate = torch.randn(1, 1, generator=g)
    try:
        swaps = sv.apply("combine:removed")
        assert set(swaps) == {"moe_combine"}
        capturing = [False]
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
        combine = swaps["moe_combine"]
        torch.testing.assert_close(combine(routed, gate, shared), moe_combine_ref(routed, gate, shared))
        capturing[0] = True
        held = combine(-routed, gate, shared)
        torch.testing.assert_close(held, moe_combine_ref(routed, gate, shared))
        capturing[0] = False  # another form's warm-up, with other values
        torch.testing.assert_close(combine(-routed, gate, shared), moe_combine_ref(-routed, gate, shared))
        capturing[0] = True
        assert combine(routed, gate, shared) is held
    finally:
        sv.apply("base")


def test_shared_removed_keeps_the_first_warm_ups_shared_output(monkeypatch) -> None:
    """`shared:removed` (`_frozen_shared`): a later warm-up does not replace the shared output an earlier captured
    graph reads; while capturing only the routed branch runs."""
    monkeypatch.setattr(sv._frozen_shared, "cache", {})
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    x = torch.zeros(1, 4)
    calls = []
    first = sv._frozen_shared(x, [lambda: calls.append("routed") or "y", lambda: torch.ones(1, 4)])
    sv._frozen_shared(x, [lambda: "y", lambda: torch.full((1, 4), 2.0)])  # another form's warm-up
    capturing[0] = True
    routed, held = sv._frozen_shared(x, [lambda: calls.append("routed") or "y", lambda: calls.append("shared")])
    assert first[1].tolist() == [[1.0] * 4] and routed == "y" and torch.equal(held, torch.ones(1, 4))
    assert calls == ["routed", "routed"]
