"""The OpenAI-compatible endpoints, driven by the official `openai` client against a real server.

Plain replies are the bundled model's own (random-weight) output, checked token for token against the same
model run without the server. Replies that need a shape the random model cannot produce (thinking, a tool call)
are scripted through the scheduler's steer seam (see test_serve_support.Script).
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest

from strata.api import LLM
from strata.serve.context import ServeOptions
from strata.serve.tools import parse_output
from strata.text.sampling import SamplingParams
from tests.test_serve_support import API_KEY, Running, chat_llm, serve  # noqa: F401  (fixture)

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def srv(chat_llm: LLM) -> Iterator[Running]:  # noqa: F811
    with serve(chat_llm, ServeOptions(model_name="tiny", api_key=API_KEY)) as running:
        yield running


@pytest.fixture(scope="module")
def client(srv: Running) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=API_KEY, max_retries=0)


def alone(llm: LLM, ids: list[int], max_tokens: int, **kw: object) -> tuple[str, int, str]:
    """(text, generated token count, finish reason) of the model run by itself."""
    c = llm.generate(ids, SamplingParams(max_tokens=max_tokens, greedy=True, **kw))  # type: ignore[arg-type]
    return c.text, len(c.token_ids), c.finish_reason


def test_models(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert client.models.retrieve("tiny").owned_by == "strata"


def test_chat_is_the_models_own_output_with_usage(client: openai.OpenAI, chat_llm: LLM) -> None:  # noqa: F811
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
    ids = chat_llm.chat_ids(messages)
    text, n, finish = alone(chat_llm, ids, 12)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == parse_output(text).content
    assert r.choices[0].finish_reason == finish
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), n)
    assert r.usage.total_tokens == len(ids) + n
    assert r.object == "chat.completion" and r.model == "tiny"


def test_chat_streaming_matches_non_streaming(client: openai.OpenAI) -> None:
    kw = {"model": "tiny", "messages": [{"role": "user", "content": "Stream me"}], "max_tokens": 10,
          "temperature": 0}
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_completions_plain_and_streaming(client: openai.OpenAI, chat_llm: LLM) -> None:  # noqa: F811
    text, n, finish = alone(chat_llm, chat_llm.encode("def fib(n):"), 9)
    r = client.completions.create(model="tiny", prompt="def fib(n):", max_tokens=9, temperature=0)
    assert r.choices[0].text == text and r.choices[0].finish_reason == finish
    assert r.usage.completion_tokens == n and r.usage.prompt_tokens == len(chat_llm.encode("def fib(n):"))
    pieces = list(client.completions.create(model="tiny", prompt="def fib(n):", max_tokens=9, temperature=0,
                                            stream=True))
    assert "".join(p.choices[0].text for p in pieces) == text
    ids = chat_llm.encode("token ids")
    r = client.completions.create(model="tiny", prompt=ids, max_tokens=5, temperature=0)
    assert r.choices[0].text == alone(chat_llm, ids, 5)[0]


def test_stop_seed_and_logit_bias(client: openai.OpenAI, chat_llm: LLM) -> None:  # noqa: F811
    prompt = "Once upon"
    full, _, _ = alone(chat_llm, chat_llm.encode(prompt), 24)
    stop = next(full[i:i + 2] for i in range(3, len(full) - 2) if full[i:i + 2].strip())
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0, stop=[stop])
    assert r.choices[0].text == full[:full.index(stop)] and r.choices[0].finish_reason == "stop"

    def sampled(seed: int) -> str:
        return client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=1.0, top_p=0.9,
                                         seed=seed).choices[0].text

    assert sampled(7) == sampled(7)
    expected = chat_llm.generate(prompt, SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=7)).text
    assert sampled(7) == expected

    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0,
                                  logit_bias={"65": 100})
    assert r.choices[0].text == chat_llm.decode([65] * 4)


def test_n_above_one_is_refused(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], n=2)
    assert e.value.status_code == 400 and "n must be 1" in e.value.body["message"]


def test_reasoning_effort_maps_to_enable_thinking(srv: Running, client: openai.OpenAI, chat_llm: LLM) -> None:  # noqa: F811
    messages = [{"role": "user", "content": "Think first"}]
    with srv.script.text(chat_llm, "Weighing it up.\n</think>\n\nThe answer is 4."):
        on = client.chat.completions.create(model="tiny", messages=messages, max_tokens=40, temperature=0,
                                            reasoning_effort="high")
        streamed = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=40,
                                                       reasoning_effort="high", stream=True))
    msg = on.choices[0].message
    assert msg.content == "The answer is 4."
    assert msg.reasoning_content == "Weighing it up."  # type: ignore[attr-defined]
    assert on.usage.prompt_tokens == len(chat_llm.chat_ids(messages, enable_thinking=True))
    deltas = [c.choices[0].delta for c in streamed if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "Weighing it up."
    assert "".join(d.content or "" for d in deltas) == "The answer is 4."

    with srv.script.text(chat_llm, "Just the answer."):
        off = client.chat.completions.create(model="tiny", messages=messages, max_tokens=40,
                                             reasoning_effort="none")
    assert off.choices[0].message.content == "Just the answer."
    assert getattr(off.choices[0].message, "reasoning_content", None) is None
    assert off.usage.prompt_tokens == len(chat_llm.chat_ids(messages, enable_thinking=False))


def test_tool_call_round_trip(srv: Running, client: openai.OpenAI, chat_llm: LLM) -> None:  # noqa: F811
    messages: list[dict] = [{"role": "user", "content": "Weather in Paris?"}]
    with srv.script.text(chat_llm, "I will look it up.\n" + CALL_TEXT):
        r = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER_TOOL], max_tokens=80)
        chunks = list(client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER_TOOL],
                                                     max_tokens=80, stream=True))
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "I will look it up."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}

    streamed_calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [(tc.index, tc.function.name, json.loads(tc.function.arguments)) for tc in streamed_calls] == \
        [(0, "get_weather", {"city": "Paris"})]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    # The tool's result goes back as a "tool" message; the template renders it as a <tool_response>.
    followup = messages + [choice.message.model_dump(exclude_none=True),
                           {"role": "tool", "tool_call_id": call.id, "content": "22 C and sunny"}]
    r2 = client.chat.completions.create(model="tiny", messages=followup, tools=[WEATHER_TOOL], max_tokens=6,
                                        temperature=0)
    template_view = messages + [{"role": "assistant", "content": "I will look it up.", "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "22 C and sunny"}]
    ids = chat_llm.chat_ids(template_view, tools=[WEATHER_TOOL])
    assert "<tool_response>\n22 C and sunny\n</tool_response>" in chat_llm.decode(ids)
    assert r2.usage.prompt_tokens == len(ids)
    text, _, _ = alone(chat_llm, ids, 6)
    assert r2.choices[0].message.content == parse_output(text, tools=True).content
    # The scripted call re-renders token for token, so the whole first turn was reused.
    assert r2.usage.prompt_tokens_details.cached_tokens >= len(chat_llm.chat_ids(messages, tools=[WEATHER_TOOL]))


def test_tool_choice_none_leaves_tools_out(srv: Running, client: openai.OpenAI, chat_llm: LLM) -> None:  # noqa: F811
    messages = [{"role": "user", "content": "Weather?"}]
    with srv.script.text(chat_llm, CALL_TEXT):
        r = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER_TOOL],
                                           tool_choice="none", max_tokens=80)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content == CALL_TEXT
    assert r.usage.prompt_tokens == len(chat_llm.chat_ids(messages))
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER_TOOL],
                                       tool_choice="required")


def test_status_and_metrics(srv: Running, chat_llm: LLM) -> None:  # noqa: F811
    headers = {"Authorization": f"Bearer {API_KEY}"}
    status = httpx.get(srv.url + "/v1/status", headers=headers).json()
    assert status["model"] == "tiny" and status["geometry"]["vocab"] == chat_llm.engine.cfg.vocab_size
    assert status["placement"]["device"] == "cpu" and status["memory"]["process_rss_bytes"] > 0
    assert status["queue"]["slots"] == 1 and status["last_request"]["decode_tokens_per_s"] is not None
    assert status["totals"]["generated_tokens"] > 0
    metrics = httpx.get(srv.url + "/metrics", headers=headers)
    assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain")
    assert 'strata_requests_total{endpoint="/v1/chat/completions",status="200"}' in metrics.text
    assert "# TYPE strata_generation_tokens_total counter" in metrics.text
