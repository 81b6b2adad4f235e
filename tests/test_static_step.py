"""The fixed-capacity decode step (what the GPU captures as a graph) equals the growing-state decode path."""

from __future__ import annotations

import pytest
import torch

from strata.errors import StrataError
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


def test_split_step_equals_the_whole_step(engine):
    """The step split at the first PLE layer (front layers, then the rest on the carried state: what the GPU
    captures as two graphs) gives the same logits as the step run whole, bit for bit. (The "hc4" model's first
    PLE layer is layer 1, so it splits; "tiny" has a PLE layer 0, so there is nothing to run before it.)"""
    first_ple = min(engine.cfg.ple)
    ids = torch.randint(2, engine.cfg.vocab_size, (12,), generator=torch.Generator().manual_seed(5))
    outs = []
    for split in (True, False):
        step = DecodeStep(engine.model, capacity=32, capture=False, split=split)
        assert step.split == (first_ple if split and first_ple > 0 else None)
        outs.append([step.prefill(ids[:4])] + [step.step(int(t)) for t in ids[4:]])
    assert all(torch.equal(a, b) for a, b in zip(*outs, strict=True))


def test_device_ple_gather_equals_host_staging(engine):
    """A step that hashes its n-grams and gathers its PLE rows on the device (from the histories the host
    stages; `Ops.ple_gather`, as with `--ple-table device`) gives the host-staged step's logits bit for bit,
    through EOS ids, and is not split. (The Triton gather in the step: tests/test_kernels_hc_ple.py.)"""
    assert_device_gather_equals_host(engine.model, engine.cfg)


def assert_device_gather_equals_host(model, cfg) -> None:  # noqa: ANN001 - a Model and its config
    """The model's step with its PLE tables as one tensor each (`--ple-table device` on a GPU; on the CPU here)
    gathering on its device, against the host-staged step of the model as given."""
    one = reference.with_device_tables(model)
    ids = torch.randint(2, cfg.vocab_size, (14,), generator=torch.Generator().manual_seed(7))
    ids[6] = ids[9] = cfg.ple_eos
    outs = []
    for on in (False, True):
        step = DecodeStep(one if on else model, capacity=32, capture=False, ple_gather=on)
        assert (step.tables is not None) == on and (step.split is None or not on)
        outs.append([step.prefill(ids[:4])] + [step.step(int(t)) for t in ids[4:]])
        assert step.state.ple[min(cfg.ple)].context.tolist() == ids[-(cfg.ngram_size - 1):].tolist()
    assert all(torch.equal(a, b) for a, b in zip(*outs, strict=True))


def test_device_ple_gather_refuses_host_tables_off_the_device(engine, monkeypatch):
    """Asked to gather on a device its tables are not on, the step names the table and the flag."""
    import strata.runtime.graph as graph

    monkeypatch.setattr(graph, "raw_rows", lambda t: None)
    with pytest.raises(StrataError, match=r"ple\.table.*not one contiguous tensor.*--ple-table device"):
        DecodeStep(engine.model, capacity=8, capture=False, ple_gather=True)
    assert DecodeStep(engine.model, capacity=8, capture=False).tables is None  # the default falls back


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


def test_engine_graph_mode_decodes_through_the_fixed_step(engine, monkeypatch):
    """Engine(graphs=True) (the CUDA default) gives fixed-capacity states whose decode runs the captured step
    (eagerly here, on the CPU), with the same logits as the growing-state path, and refuses past its context.
    Ids are redrawn until no top-k tie occurs: tied blocks may be ordered differently when the candidate list
    is capacity-sized (the reference leaves that order undefined)."""
    from strata.runtime.engine import Engine as E
    from tests.test_parity import TIE, MarginRecorder

    fixed = E(engine.weights, graphs=True, context=48)
    cfg = engine.cfg
    for seed in range(20):
        ids = torch.randint(2, cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(seed)).tolist()
        rec = MarginRecorder(monkeypatch)
        st = engine.new_state()
        engine.prefill(ids[:6], st)
        for t in ids[6:]:
            engine.decode(t, st)
        if rec.min_gap > TIE:
            break
    s_ref, s_fix = engine.new_state(), fixed.new_state()
    assert fixed.max_context == 48 and s_fix.fixed_capacity(48) and not s_ref.fixed_capacity(48)
    ref = [engine.prefill(ids[:6], s_ref)] + [engine.decode(t, s_ref) for t in ids[6:]]
    got = [fixed.prefill(ids[:6], s_fix)] + [fixed.decode(t, s_fix) for t in ids[6:]]
    assert s_fix.decode_step is not None and s_fix.clone().decode_step is None
    diff = (torch.stack(got) - torch.stack(ref)).abs().max() / torch.stack(ref).abs().max()
    assert diff < 1e-5
    for t in range(8):
        fixed.decode(3, s_fix)
    with pytest.raises(Exception, match="capacity"):
        fixed.decode(3, s_fix)


def test_context_flag_reaches_the_engine(engine, tmp_path, capsys):
    from strata.cli.main import main
    from strata.runtime.engine import Engine as E

    with pytest.raises(Exception, match="positive number of positions"):
        E(engine.weights, context=0)
    assert E(engine.weights, graphs=True, context=10**9).max_context == engine.cfg.max_position_embeddings
    assert main(["logits", "--ids", "1,2,3", "--context", "0", "--out", str(tmp_path / "x.npy")]) == 2
    assert "positive number of positions" in capsys.readouterr().err


def test_next_token_id_records_no_event(engine, monkeypatch):
    """`next_token_id` reads the chosen id on the host, which waits for the whole step, so its replays record no
    event for the next token's staging; `next_token` (a device tensor the caller may not read) still does. The
    replays are stand-ins here (graph replay needs CUDA): what is checked is the host's bookkeeping around them."""
    step = DecodeStep(engine.model, capacity=16, capture=False)
    ids = torch.randint(2, engine.cfg.vocab_size, (6,), generator=torch.Generator().manual_seed(2))
    want = [int(step.next_token(int(t))) for t in ids]  # eager, on the CPU
    step = DecodeStep(engine.model, capacity=16, capture=False)
    got = [step.next_token_id(int(t)) for t in ids]
    assert got == want

    class Replay:
        def __init__(self):
            self.calls = 0

        def replay(self):
            self.calls += 1

    reads = []
    monkeypatch.setattr(step, "_host_read", lambda: reads.append(1))
    front, rest = Replay(), Replay()
    step.capture, step.graphs["logits"], step.outs["logits"] = True, (front, rest), (None, torch.tensor(7))
    step._copied = "pending"  # an event from an earlier token; `_ready` would wait on it
    monkeypatch.setattr(step, "_ready", lambda: None)
    assert step.next_token_id(3) == 7 and reads == [] and step._copied is None
    assert int(step.next_token(3)) == 7 and reads == [1]
    assert front.calls == rest.calls == 2
