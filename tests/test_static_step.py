"""The fixed-capacity decode step (what the GPU captures as a graph) equals the growing-state decode path."""

from __future__ import annotations

import pytest
import torch

from strata.model.experts import experts_gather, experts_ref
from strata.runtime.engine import Engine
from strata.runtime.graph import DecodeStep
from strata.weights.hf import load_hf
from tests import reference


@pytest.fixture(scope="module", params=["tiny", "hc4"])
def engine(request, tmp_path_factory):
    folder = reference.save(reference.build(request.param), tmp_path_factory.mktemp(request.param))
    return Engine(load_hf(folder))


def test_static_step_matches_dynamic_decode(engine):
    cfg = engine.cfg
    n = 3 * cfg.selection_width + 4
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(2, cfg.vocab_size, (n,), generator=g)
    ids[n // 2] = cfg.ple_eos if cfg.ple_eos is not None else 1
    prompt = 5
    state = engine.new_state()
    ref = [engine.prefill(ids[:prompt].tolist(), state)] + [engine.decode(int(t), state) for t in ids[prompt:]]
    step = DecodeStep(engine.model, capacity=64, capture=False)
    ours = [step.prefill(ids[:prompt])] + [step.step(int(t)) for t in ids[prompt:]]
    diff = (torch.stack(ours).float() - torch.stack(ref)).abs().max() / torch.stack(ref).abs().max()
    assert diff < 1e-5


def test_expert_gather_twin_matches_reference(engine):
    w, cfg = engine.weights, engine.cfg
    g = torch.Generator().manual_seed(0)
    a = torch.randn(5, cfg.hidden_size, generator=g)
    top_i = torch.randint(0, cfg.num_experts, (5, cfg.num_experts_per_tok), generator=g)
    top_w = torch.rand(5, cfg.num_experts_per_tok, generator=g)
    args = (a, top_i, top_w, w["L0.moe.gate_exps"], w["L0.moe.up_exps"], w["L0.moe.down_exps"],
            engine.model.ops.linear)
    assert torch.allclose(experts_gather(*args), experts_ref(*args), atol=1e-5)


def test_capacity_is_enforced(engine):
    step = DecodeStep(engine.model, capacity=8, capture=False)
    step.prefill(torch.arange(2, 10))
    with pytest.raises(Exception, match="capacity"):
        step.step(3)
