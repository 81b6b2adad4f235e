"""Conversation reuse: the next turn of a chat continues a saved state instead of prefilling the whole
conversation, and gives what a cold run over the whole conversation gives."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
import torch

from strata.api import LLM
from strata.model.model import SequenceState
from strata.serve.cache import PrefixCache, state_bytes
from strata.serve.context import ServeOptions
from strata.serve.tools import parse_output
from strata.text.sampling import SamplingParams
from tests.test_serve_support import Running, chat_llm, serve  # noqa: F401  (fixture)

REPLY = "Once upon a time there was a tiny model."


@pytest.fixture(scope="module")
def srv(chat_llm: LLM) -> Iterator[Running]:  # noqa: F811
    with serve(chat_llm, ServeOptions(model_name="tiny")) as running:
        yield running


@pytest.fixture(scope="module")
def client(srv: Running) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)


def last_request(srv: Running) -> dict:
    return httpx.get(srv.url + "/v1/status").json()["last_request"]


def cold_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    return llm.engine.prefill(ids, llm.engine.new_state())


def test_second_turn_prefills_only_the_new_tokens(srv: Running, client: openai.OpenAI, chat_llm: LLM) -> None:  # noqa: F811
    srv.ctx.cache.clear()
    turn1 = [{"role": "user", "content": "Tell me a story"}]
    with srv.script.text(chat_llm, REPLY) as reply_ids:
        r1 = client.chat.completions.create(model="tiny", messages=turn1, max_tokens=64, reasoning_effort="none")
    assert r1.choices[0].message.content == REPLY
    turn2 = turn1 + [{"role": "assistant", "content": REPLY}, {"role": "user", "content": "And then?"}]
    r2 = client.chat.completions.create(model="tiny", messages=turn2, max_tokens=8, temperature=0,
                                        reasoning_effort="none")

    p1 = chat_llm.chat_ids(turn1, enable_thinking=False)
    p2 = chat_llm.chat_ids(turn2, enable_thinking=False)
    done = len(p1) + len(reply_ids)  # every token the server ran in turn 1 (the final EOS is never run)
    assert p2[:done] == p1 + reply_ids
    new = p2[done:]
    assert chat_llm.decode(new) == "<|im_end|>\n<|im_start|>user\nAnd then?<|im_end|>\n<|im_start|>assistant\n"
    status = last_request(srv)
    assert (status["cached_tokens"], status["prefilled_tokens"]) == (done, len(new))
    assert status["prompt_tokens"] == len(p2)
    assert r2.usage.prompt_tokens_details.cached_tokens == done and r2.usage.prompt_tokens == len(p2)

    # Same tokens as a cold run over the whole conversation ...
    cold = chat_llm.generate(p2, SamplingParams(max_tokens=8, greedy=True))
    assert r2.choices[0].message.content == parse_output(cold.text).content
    assert r2.usage.completion_tokens == len(cold.token_ids)
    # ... and the same logits: the saved turn-1 state continued over the new tokens, against a cold prefill.
    warm_state = srv.ctx.cache.lookup(p1 + reply_ids + [0])
    assert warm_state is not None and warm_state.tokens == p1 + reply_ids
    warm = chat_llm.engine.prefill(new, warm_state)
    cold_l = cold_logits(chat_llm, p2)
    torch.testing.assert_close(warm, cold_l, atol=1e-4, rtol=1e-4)
    assert int(warm.argmax()) == int(cold_l.argmax()) == cold.token_ids[0]


def test_real_model_reply_reuses_at_least_the_first_prompt(srv: Running, client: openai.OpenAI,
                                                           chat_llm: LLM) -> None:  # noqa: F811
    """The random model's own reply need not re-encode to the tokens it generated; the turn still continues
    the longest saved state that the new conversation starts with, and the result is the cold run's."""
    srv.ctx.cache.clear()
    turn1 = [{"role": "user", "content": "Say something"}]
    r1 = client.chat.completions.create(model="tiny", messages=turn1, max_tokens=10, temperature=0,
                                        reasoning_effort="none")
    keys = srv.ctx.cache.keys()
    turn2 = turn1 + [{"role": "assistant", "content": r1.choices[0].message.content},
                     {"role": "user", "content": "More"}]
    p1 = chat_llm.chat_ids(turn1, enable_thinking=False)
    p2 = chat_llm.chat_ids(turn2, enable_thinking=False)
    expected = max(len(k) for k in keys if len(k) < len(p2) and tuple(p2[:len(k)]) == k)
    assert expected >= len(p1) - 1
    r2 = client.chat.completions.create(model="tiny", messages=turn2, max_tokens=8, temperature=0,
                                        reasoning_effort="none")
    assert last_request(srv)["cached_tokens"] == expected == r2.usage.prompt_tokens_details.cached_tokens
    cold = chat_llm.generate(p2, SamplingParams(max_tokens=8, greedy=True))
    assert r2.choices[0].message.content == parse_output(cold.text).content


def test_thinking_turn_reuses_the_conversation_before_the_reply(srv: Running, client: openai.OpenAI,
                                                                chat_llm: LLM) -> None:  # noqa: F811
    """Templates drop earlier turns' thinking, so the reply re-renders differently; the state saved where the
    conversation ended before the generation prompt is what the next turn continues."""
    srv.ctx.cache.clear()
    turn1 = [{"role": "user", "content": "Why?"}]
    with srv.script.text(chat_llm, "Because.\n</think>\n\nIt is so."):
        r1 = client.chat.completions.create(model="tiny", messages=turn1, max_tokens=40, reasoning_effort="high")
    assert r1.choices[0].message.content == "It is so."
    turn2 = turn1 + [{"role": "assistant", "content": "It is so."}, {"role": "user", "content": "Sure?"}]
    client.chat.completions.create(model="tiny", messages=turn2, max_tokens=4, temperature=0,
                                   reasoning_effort="high")
    bare = chat_llm.chat_ids(turn1, add_generation_prompt=False)
    assert last_request(srv)["cached_tokens"] == len(bare)


def test_repeated_prompt_runs_one_token(srv: Running, client: openai.OpenAI, chat_llm: LLM) -> None:  # noqa: F811
    srv.ctx.cache.clear()
    ids = chat_llm.encode("The same prompt twice")
    a = client.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0)
    b = client.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0)
    assert a.choices[0].text == b.choices[0].text
    assert (last_request(srv)["cached_tokens"], last_request(srv)["prefilled_tokens"]) == (len(ids) - 1, 1)


# --- the cache itself -------------------------------------------------------------------------------------------

def _state(llm: LLM, ids: list[int]) -> SequenceState:
    s = llm.engine.new_state()
    llm.engine.prefill(ids, s)
    return s


def test_cache_longest_strict_prefix_private_copies_and_lru_bound(chat_llm: LLM) -> None:  # noqa: F811
    a, b, c = _state(chat_llm, [1, 2]), _state(chat_llm, [1, 2, 3, 4]), _state(chat_llm, [7, 8])
    size = state_bytes(b)
    cache = PrefixCache(max_bytes=2 * size + size // 2)  # room for two states
    cache.put(a)
    cache.put(b)
    assert cache.lookup([1, 2, 3]).tokens == [1, 2]
    got = cache.lookup([1, 2, 3, 4, 5])
    assert got is not None and got.tokens == [1, 2, 3, 4]
    assert cache.lookup([1, 2, 3, 4]).tokens == [1, 2]  # strict: an equal key leaves nothing to run
    assert cache.lookup([9]) is None
    chat_llm.engine.decode(5, got)  # the copy advances; the saved state does not
    assert cache.lookup([1, 2, 3, 4, 5]).tokens == [1, 2, 3, 4]
    cache.put(c)  # over the bound: the least recently used state ([1, 2, 3, 4] was used last) goes
    assert set(cache.keys()) == {(1, 2, 3, 4), (7, 8)}
    assert cache.stats().bytes <= cache.max_bytes
    off = PrefixCache(0)
    off.put_copy(a)
    assert off.keys() == []
