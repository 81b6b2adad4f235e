"""A decode step run ahead of the host (`DecodeStep.ids_ahead`): its inputs advanced on the device from the id the
previous step chose give the ids, the state and the logits of the step the host stages token by token.

The steps run eagerly on the CPU (the GPU replays the same work as graphs); the feed's Triton kernel runs under
the interpreter against its reference.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: run the kernels on the CPU

import pytest
import torch

from strata.errors import StrataError
from strata.runtime.engine import Engine
from strata.runtime.graph import DecodeStep, feed_ref
from strata.weights.hf import load_hf
from tests import reference


@pytest.fixture(scope="module", params=["tiny", "hc4", "nople"])
def engine(request, tmp_path_factory):
    folder = reference.save(reference.build(request.param), tmp_path_factory.mktemp(request.param))
    return Engine(load_hf(folder))


def _step(engine: Engine, capacity: int, rows: str = "device") -> DecodeStep:
    """A step that can run ahead: a model without PLE layers as it is; one with them gathering its rows itself
    (`rows` "device": all of the step runs ahead), or split at its first PLE layer with the rows staged by the host
    ("host": the front runs ahead)."""
    if rows == "host" or not engine.cfg.ple:
        step = DecodeStep(engine.model, capacity=capacity, capture=False)
        assert step.tables is None and (step.split is not None or not engine.cfg.ple)
    else:
        step = DecodeStep(reference.with_device_tables(engine.model), capacity=capacity, capture=False,
                          ple_gather=True)
    assert step.can_run_ahead
    return step


def _prompt(engine: Engine, n: int, seed: int) -> torch.Tensor:
    ids = torch.randint(2, engine.cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))
    if engine.cfg.ple:
        ids[n // 2] = ids[n - 2] = engine.cfg.ple_eos  # the n-gram histories carry EOS ids
    return ids


def test_feed_advances_the_inputs_as_the_host_stages_them(engine):
    """After a token the host staged, the feed of the next id leaves the step's inputs (id, position, every PLE
    layer's n-gram history) exactly as staging that id does, EOS ids included."""
    step = _step(engine, capacity=32)
    step.prefill(_prompt(engine, 4, 1))
    eos = engine.cfg.ple_eos if engine.cfg.ple else 1
    for token, nxt in [(5, 9), (eos, 7), (3, eos), (eos, eos), (200, 6)]:
        step._stage(token)
        fed = step._ints.clone()
        feed_ref(fed, torch.tensor(nxt), step._starts, engine.cfg.ngram_size)
        step._stage(nxt)
        assert torch.equal(fed, step._ints), (token, nxt)
    assert len(step._starts) == len(engine.cfg.ple)


# (the model, where its PLE rows come from): "tiny"'s first layer is a PLE layer, so its step does not split
RUN_AHEAD_CASES = [("tiny", "device"), ("hc4", "device"), ("hc4", "host"), ("nople", "device")]


@pytest.mark.parametrize(("engine", "rows"), RUN_AHEAD_CASES, indirect=["engine"])
def test_ids_ahead_equal_the_ids_read_one_by_one(engine, rows):
    """The ids run ahead are the greedy ids of `next_token_id`, past the indexer budget; afterwards the state
    holds every id yielded (the last one fed too), and the next step's logits equal those of a step that was
    fed the same ids one by one (so a split step stopped after an id ran no layer on an id it did not give)."""
    cfg = engine.cfg
    n, k = 2 * cfg.selection_width + 3, 9
    prompt = _prompt(engine, n, 2)
    one_by_one = _step(engine, capacity=64, rows=rows)
    one_by_one.prefill(prompt)
    want, tok = [], 17
    for _ in range(k):
        tok = one_by_one.next_token_id(tok)
        want.append(tok)
    ahead = _step(engine, capacity=64, rows=rows)
    ahead.prefill(prompt)
    ids = ahead.ids_ahead(17)
    got = [next(ids) for _ in range(k)]
    ids.close()
    assert got == want
    assert ahead.state.tokens == [*prompt.tolist(), 17, *want]
    assert one_by_one.state.tokens == [*prompt.tolist(), 17, *want[:-1]]
    one_by_one.step(want[-1])  # one_by_one is now fed what ahead was
    assert torch.equal(ahead.step(5), one_by_one.step(5))
    for mine, theirs in zip(ahead.state.ple.values(), one_by_one.state.ple.values(), strict=True):
        assert torch.equal(mine.context, theirs.context)


@pytest.mark.parametrize(("engine", "ahead"), [*RUN_AHEAD_CASES, ("tiny", None), ("hc4", None)], indirect=["engine"])
def test_ids_ahead_end_at_the_capacity(engine, ahead):
    """The ids end with the one chosen at the last position, not fed: as many as `next_token_id` gives until
    the state is full (then it refuses), and the same ids, whether all of the step runs ahead, its front, or
    none (host rows, one graph)."""
    prompt = _prompt(engine, 4, 3)
    one_by_one = _step(engine, capacity=8)
    one_by_one.prefill(prompt)
    want, tok = [], 11
    while one_by_one.state.length < 8:
        tok = one_by_one.next_token_id(tok)
        want.append(tok)
    with pytest.raises(StrataError, match="capacity of 8"):
        one_by_one.next_token_id(tok)
    step = _step(engine, 8, ahead) if ahead else DecodeStep(engine.model, capacity=8, capture=False, split=False)
    step.prefill(prompt)
    assert step.can_run_ahead == bool(ahead) or not engine.cfg.ple
    got = list(step.ids_ahead(11))  # positions 4 (the id 11) .. 7 (the third id), then the fourth id
    assert got == want and len(got) == 4
    assert step.state.length == 8 and step.state.tokens[4:] == [11, *got[:3]]


@pytest.mark.parametrize("engine", ["hc4"], indirect=True)
def test_without_device_rows_or_split_each_id_is_read_before_the_next_step(engine):
    """Where the host stages PLE rows for a step of one graph, the step cannot feed itself: `ids_ahead` gives
    `next_token_id`'s ids, and the last id yielded is not fed."""
    step = DecodeStep(engine.model, capacity=32, capture=False, split=False)
    assert not step.can_run_ahead and step.split is None and step.tables is None
    prompt = _prompt(engine, 5, 4)
    step.prefill(prompt)
    ids = step.ids_ahead(21)
    got = [next(ids) for _ in range(5)]
    ref = DecodeStep(engine.model, capacity=32, capture=False, split=False)
    ref.prefill(prompt)
    want, tok = [], 21
    for _ in range(5):
        tok = ref.next_token_id(tok)
        want.append(tok)
    assert got == want and step.state.tokens == [*prompt.tolist(), 21, *want[:-1]]


@pytest.mark.parametrize(("layers", "n"), [(0, 3), (1, 3), (2, 3), (3, 2), (2, 4)])
def test_feed_kernel_equals_reference(layers: int, n: int):
    """The feed in one launch (`strata.kernels.feed`) against `feed_ref`, with the histories laid out as the step
    lays them (each padded to 16 bytes)."""
    from strata.kernels.feed import feed

    stride = -(-n // 2) * 2
    starts = tuple(2 + i * stride for i in range(layers))
    g = torch.Generator().manual_seed(layers * 10 + n)
    ints = torch.randint(-2**40, 2**40, (2 + layers * stride + 2,), generator=g)
    token = torch.tensor(123456789012)
    want = ints.clone()
    feed_ref(want, token, starts, n)
    feed(ints, token, starts, n)
    assert torch.equal(ints, want)
    with pytest.raises(ValueError, match="evenly spaced"):
        feed(ints, token, (2, 2 + stride, 3 + 3 * stride), n)
