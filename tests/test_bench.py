"""The parts of `strata bench` that need no GPU: the floor's byte count, the synthetic real-geometry weights and
the stage-timing op table (the timing itself runs on the device box; see bench/results/)."""

from __future__ import annotations

import dataclasses
import weakref

import pytest
import torch

from strata.model.ops import Ops, branches_ref
from strata.runtime import bench
from strata.runtime.engine import load_weights
from strata.runtime.placement import gpu_layout
from strata.runtime.synthetic import TypeMix, real_config, synthetic_weights
from strata.weights.inventory import inventory


def test_token_bytes_adds_state_and_cache_traffic(fixtures_dir):
    w = load_weights(fixtures_dir / "tiny-MIXED.gguf")
    short, long = bench.token_bytes(w, 8), bench.token_bytes(w, 4096)
    assert short["weights"] == long["weights"] == inventory(w).bytes_per_token
    cfg = w.cfg
    assert short["gdn_state"] == 3 * cfg.linear_num_value_heads * cfg.linear_key_head_dim ** 2 * 4 * 2
    assert long["qsa_cache"] > short["qsa_cache"] > 0  # selected rows saturate at B + c - 1, pooled keys grow
    assert long["total"] == long["weights"] + long["gdn_state"] + long["qsa_cache"]


def test_synthetic_weights_have_the_stated_types_and_run():
    cfg = real_config(num_hidden_layers=4, hidden_size=256, vocab_size=1024, num_experts=16,
                      moe_intermediate_size=256, shared_expert_intermediate_size=256, linear_num_key_heads=2,
                      linear_num_value_heads=4, num_attention_heads=4, head_dim=256, ple_embed_dim=256,
                      heads_per_ngram=2, ngram_vocab_size_base=1000, indexer_budget=64, eos_token_id=1,
                      hc_lowrank=32)
    mix = TypeMix()
    w = synthetic_weights(cfg, mix, "cpu")
    w.check()
    assert w["L0.moe.gate_exps"].kind == "Q4_K" and w["L0.moe.down_exps"].kind == "Q5_1"
    assert w["L3.attn.q"].kind == "Q8_0" and w["L0.hc_attn.up"].kind == "BF16" and w["head"].kind == "Q6_K"
    assert w["L0.moe.router"].kind == "F32" and w["L0.gdn.A"].kind == "F32"
    from strata.model.model import Model

    with torch.inference_mode():
        logits = Model(w).forward(torch.arange(2, 12), Model(w).new_state())
    assert torch.isfinite(logits).all()
    # the bench stores it as GPU placement does: the head as Q6_K_R, the projection groups fused and repacked, the
    # expert stacks and Q8_0 matrices word-ordered
    placed = gpu_layout(w)
    assert placed["head"].kind == "Q6_K_R" and placed["L0.gdn.qkv"].kind == "Q8_0_R"
    assert placed["L0.moe.down_exps"].kind == "Q5_1_R" and placed["L1.ple.table"] is w["L1.ple.table"]
    assert placed["L0.moe.gate_exps"].kind == placed["L0.moe.up_exps"].kind == "Q4_K_R"
    with torch.inference_mode():
        assert torch.allclose(Model(placed).forward(torch.arange(2, 12), Model(placed).new_state()), logits,
                              rtol=1e-5, atol=1e-5 * logits.abs().max().item())


def test_timed_ops_wraps_every_entry():
    """Every op is timed, but `branches`, which runs its branches one after the other so that the ops inside
    are timed each on its own."""
    wrapped = bench.timed_ops(Ops(), real_config(), bench.StageTimes())
    for f in dataclasses.fields(Ops):
        if f.name == "branches":
            assert getattr(wrapped, f.name) is branches_ref
            continue
        assert getattr(wrapped, f.name) is not getattr(Ops(), f.name), f.name


def test_format_table():
    report = {"gpu": "X", "copy_bandwidth_bytes_per_s": 4e12, "model": "m", "ops": "triton", "type_mix": "t",
              "decode": [{"context": 4096, "ms_per_token": 2.0, "tok_per_s": 500.0, "graph_replay_ms": 1.9,
                          "bytes_per_token": {"total": 6e9}, "floor_ms": 1.5, "fraction_of_floor": 0.75,
                          "stages_ms": {"experts": {"gdn": 0.5, "qsa": 0.2}}, "stages_sum_ms": 0.7}],
              "prefill": {"tokens": 512, "seconds": 0.25, "tok_per_s": 2048.0, "runs_s": [0.26, 0.25, 0.24],
                          "first_pass_s": 3.5, "kernels": {"launches": 900, "kernel_ms": 240.0,
                                                           "top": [{"kernel": "_experts_gemm_kernel", "count": 96,
                                                                    "ms": 120.0}]}}}
    text = bench.format_table(report)
    assert "75.0%" in text and "experts" in text and "   1.900 " in text  # the replay column
    assert "2048.0 tok/s (median of 3; first pass, with compilation: 3.50 s)" in text
    assert "900 kernels" in text and "_experts_gemm_kernel" in text


def test_each_context_keeps_what_fits_and_names_what_did_not():
    def measure(ctx: int) -> dict:
        if ctx > 100_000:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 6.00 GiB\nmore detail")
        return {"context": ctx}

    done, skipped = bench.each_context(measure, [4096, 131072, 32768], torch.device("cpu"))
    assert done == [{"context": 4096}, {"context": 32768}]  # the context after the failed one still ran
    assert skipped == [{"context": 131072, "error": "out of device memory: CUDA out of memory. Tried to allocate "
                                                    "6.00 GiB"}]
    with pytest.raises(ValueError):  # anything else is not a context that did not fit
        bench.each_context(lambda ctx: int("x"), [4096], torch.device("cpu"))
    report = {"gpu": "X", "copy_bandwidth_bytes_per_s": 4e12, "model": "m", "ops": "triton", "type_mix": "t",
              "decode": [], "decode_skipped": skipped}
    assert "  131072 skipped: out of device memory" in bench.format_table(report)


def test_each_context_frees_the_failed_context_before_emptying_the_cache(monkeypatch):
    class Caches:  # stands for the failed context's device tensors
        pass

    alive = []

    def measure(ctx: int) -> dict:
        caches = Caches()
        alive.append(weakref.ref(caches))
        raise torch.OutOfMemoryError("CUDA out of memory.")

    emptied = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(alive[-1]() is None))
    done, skipped = bench.each_context(measure, [4096, 8192], torch.device("cuda"))
    assert not done and [s["context"] for s in skipped] == [4096, 8192]
    assert emptied == [True, True]  # the caches were garbage when the allocator's cache was emptied


def test_layer_paths_reads_the_critical_path_off_a_timeline():
    # two GDN layers (the second's qkvz GEMV ends 10 us later) around a QSA layer; the shared expert's GEMV ends
    # before the out projection that started before it; a last layer without its combine is left out
    def gdn(t0, qkvz):
        return [["_hc_down_kernel", t0, t0 + 7], ["_hc_up_kernel", t0 + 1, t0 + 10], ["_rr_kernel", t0 + 6, t0 + qkvz],
                ["_gdn_step_kernel", t0 + qkvz - 1, t0 + qkvz + 8], ["_rr_kernel", t0 + qkvz + 1, t0 + qkvz + 20],
                ["_gemv_kernel", t0 + qkvz + 2, t0 + qkvz + 12], ["_combine_kernel", t0 + qkvz + 20, t0 + qkvz + 22]]
    qsa = [["_hc_down_kernel", 100, 107], ["_select_kernel", 105, 130], ["_combine_kernel", 130, 131]]
    paths = bench.layer_paths(gdn(0, 25) + qsa + gdn(200, 35) + [["_hc_down_kernel", 300, 307]])
    assert set(paths) == {"gdn", "qsa"}
    g = paths["gdn"]
    assert (g["layers"], g["alike"], g["span_us"]) == (2, 2, 52.0)  # spans 47 and 57
    assert g["steps"] == [["_hc_down_kernel", 7.0, 7.0, 0.0], ["_hc_up_kernel", 10.0, 3.0, 1.0],
                          ["_rr_kernel", 30.0, 20.0, 6.0], ["_gdn_step_kernel", 38.0, 8.0, 29.0],
                          ["_gemv_kernel", 42.0, 4.0, 32.0], ["_rr_kernel", 50.0, 8.0, 31.0],
                          ["_combine_kernel", 52.0, 2.0, 50.0]]
    assert sum(share for _, _, share, _ in g["steps"]) == g["span_us"]
    assert paths["qsa"]["steps"] == [["_hc_down_kernel", 7.0, 7.0, 0.0], ["_select_kernel", 30.0, 23.0, 5.0],
                                     ["_combine_kernel", 31.0, 1.0, 30.0]]
    report = {"gpu": "X", "copy_bandwidth_bytes_per_s": 4e12, "model": "m", "ops": "triton", "type_mix": "t",
              "decode": [{"context": 4096, "ms_per_token": 2.0, "tok_per_s": 500.0, "graph_replay_ms": 1.9,
                          "bytes_per_token": {"total": 6e9}, "floor_ms": 1.5, "fraction_of_floor": 0.75,
                          "replay_kernels": {"layers": paths}}]}
    text = bench.format_table(report)
    assert "gdn layer (2 of 2 alike): 52.0 us" in text and "_select_kernel" in text


def test_layer_paths_takes_the_most_common_launch_sequence():
    # five GDN layers: the middle one launches an extra kernel (left out of the medians, not chosen as the shape);
    # in the fourth the two overlapping GEMVs end in the other order (same launches: still alike)
    def gdn(t0, first_end, second_end, extra=False):
        layer = [["_hc_down_kernel", t0, t0 + 5], ["_gdn_step_kernel", t0 + 4, t0 + 10],
                 ["_rr_kernel", t0 + 11, t0 + first_end], ["_gemv_kernel", t0 + 12, t0 + second_end]]
        layer += [["_route_kernel", t0 + 13, t0 + 14]] if extra else []
        return layer + [["_combine_kernel", t0 + 30, t0 + 32]]
    timeline = gdn(0, 20, 25) + gdn(100, 20, 25) + gdn(200, 20, 25, extra=True) + gdn(300, 26, 22) + gdn(400, 20, 25)
    g = bench.layer_paths(timeline)["gdn"]
    assert (g["layers"], g["alike"], g["span_us"]) == (5, 4, 32.0)
    assert [n for n, *_ in g["steps"]] == ["_hc_down_kernel", "_gdn_step_kernel", "_rr_kernel", "_gemv_kernel",
                                           "_combine_kernel"]
    assert g["steps"][2] == ["_rr_kernel", 20.0, 10.0, 11.0]  # ends: 20, 20, 26, 20; shares: 10, 10, 4, 10
    assert g["steps"][3] == ["_gemv_kernel", 25.0, 5.0, 12.0]  # ends: 25, 25, 22, 25; shares: 5, 5, 12, 5


def test_prefill_chunks_is_a_chunked_prefill(fixtures_dir):
    """The prefill loop the bench times (and tools/step_variants compares logits by): the last position's logits
    of one call over the whole prompt, and the state it leaves decodes on alike."""
    from strata.model.model import Model

    w = load_weights(fixtures_dir / "tiny-f32.gguf")
    m = Model(w)
    ids = torch.arange(2, 13)
    whole, chunked = m.new_state(), m.new_state()
    ref = m.forward(ids, whole)[-1]
    got = bench.prefill_chunks(m, ids, chunked, 4)
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    nxt = torch.tensor([5])
    assert torch.allclose(m.forward(nxt, chunked), m.forward(nxt, whole), rtol=1e-5, atol=1e-4)
