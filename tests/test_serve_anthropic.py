"""POST /v1/messages, driven by the official `anthropic` client against a real server.

Plain replies are the model's own output checked against the model run alone; thinking and tool_use replies are
scripted through the scheduler's steer seam (see test_serve_support.Script)."""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import httpx
import pytest

from strata.api import LLM
from strata.serve.context import ServeOptions
from strata.serve.tools import parse_output
from strata.text.sampling import SamplingParams
from tests.test_serve_support import API_KEY, Running, chat_llm, serve  # noqa: F401  (fixture)

WEATHER = {"name": "get_weather", "description": "Current weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
WEATHER_AS_FUNCTION = {"type": "function", "function": {"name": "get_weather", "description": WEATHER["description"],
                                                        "parameters": WEATHER["input_schema"]}}
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


@pytest.fixture(scope="module")
def srv(chat_llm: LLM) -> Iterator[Running]:  # noqa: F811
    with serve(chat_llm, ServeOptions(model_name="tiny", api_key=API_KEY)) as running:
        yield running


@pytest.fixture(scope="module")
def client(srv: Running) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=srv.url, api_key=API_KEY, max_retries=0)


def test_message_is_the_models_own_output(client: anthropic.Anthropic, chat_llm: LLM) -> None:  # noqa: F811
    srv_messages = [{"role": "user", "content": "Hello there"}]
    m = client.messages.create(model="tiny", max_tokens=12, system="Be brief.", messages=srv_messages,
                               extra_body={"temperature": 0})
    template_view = [{"role": "system", "content": "Be brief."}, *srv_messages]
    ids = chat_llm.chat_ids(template_view, enable_thinking=False)
    c = chat_llm.generate(ids, SamplingParams(max_tokens=12, greedy=True))
    assert m.type == "message" and m.role == "assistant" and m.model == "tiny"
    assert [b.type for b in m.content] == ["text"]
    assert m.content[0].text == parse_output(c.text).content
    assert m.stop_reason == ("max_tokens" if c.finish_reason == "length" else "end_turn")
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == len(ids)
    assert m.usage.output_tokens == len(c.token_ids)


def test_streaming_matches_non_streaming(client: anthropic.Anthropic) -> None:
    kw = {"model": "tiny", "max_tokens": 10, "messages": [{"role": "user", "content": "Stream me"}],
          "extra_body": {"temperature": 0}}
    whole = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens


def test_stop_sequences(client: anthropic.Anthropic, srv: Running, chat_llm: LLM) -> None:  # noqa: F811
    with srv.script.text(chat_llm, "one two three four"):
        m = client.messages.create(model="tiny", max_tokens=30, stop_sequences=[" three"],
                                   messages=[{"role": "user", "content": "count"}])
    assert m.content[0].text == "one two"
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", " three")


def test_thinking_blocks(client: anthropic.Anthropic, srv: Running, chat_llm: LLM) -> None:  # noqa: F811
    kw = {"model": "tiny", "max_tokens": 60, "messages": [{"role": "user", "content": "Think first"}],
          "thinking": {"type": "enabled", "budget_tokens": 1024}}
    with srv.script.text(chat_llm, "Pondering the question.\n</think>\n\nDone."):
        m = client.messages.create(**kw)
        with client.messages.stream(**kw) as stream:
            kinds = [e.type for e in stream]
            final = stream.get_final_message()
    for msg in (m, final):
        assert [b.type for b in msg.content] == ["thinking", "text"]
        assert msg.content[0].thinking == "Pondering the question."
        assert msg.content[1].text == "Done."
        assert msg.stop_reason == "end_turn"
    assert "thinking" in kinds and kinds[-1] == "message_stop"
    ids = chat_llm.chat_ids([{"role": "user", "content": "Think first"}], enable_thinking=True)
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == len(ids)


def test_tool_use_round_trip(client: anthropic.Anthropic, srv: Running, chat_llm: LLM) -> None:  # noqa: F811
    messages: list[dict] = [{"role": "user", "content": "Weather in Oslo?"}]
    with srv.script.text(chat_llm, "Let me check.\n" + CALL_TEXT):
        m = client.messages.create(model="tiny", max_tokens=80, tools=[WEATHER], messages=messages)
        with client.messages.stream(model="tiny", max_tokens=80, tools=[WEATHER], messages=messages) as stream:
            final = stream.get_final_message()
    for msg in (m, final):
        assert msg.stop_reason == "tool_use"
        assert [b.type for b in msg.content] == ["text", "tool_use"]
        assert msg.content[0].text == "Let me check."
        use = msg.content[1]
        assert use.name == "get_weather" and use.input == {"city": "Oslo"} and use.id.startswith("toolu_")

    use = m.content[1]
    followup = messages + [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "-3 C, snow"}]}]
    r = client.messages.create(model="tiny", max_tokens=6, tools=[WEATHER], messages=followup,
                               extra_body={"temperature": 0})
    template_view = messages + [
        {"role": "assistant", "content": "Let me check.", "tool_calls": [
            {"id": use.id, "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "tool_call_id": use.id, "content": "-3 C, snow"}]
    ids = chat_llm.chat_ids(template_view, tools=[WEATHER_AS_FUNCTION], enable_thinking=False)
    assert "<tool_response>\n-3 C, snow\n</tool_response>" in chat_llm.decode(ids)
    assert r.usage.input_tokens + r.usage.cache_read_input_tokens == len(ids)
    assert r.usage.cache_read_input_tokens > 0


def test_errors_have_anthropic_shape(client: anthropic.Anthropic, srv: Running) -> None:
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="nope", max_tokens=5, messages=[{"role": "user", "content": "x"}])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "not_found_error"
    r = httpx.post(srv.url + "/v1/messages", json={"model": "tiny", "messages": []},
                   headers={"x-api-key": API_KEY})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in r.json()["error"]["message"]
    r = httpx.post(srv.url + "/v1/messages", json={"model": "tiny", "max_tokens": 5,
                                                   "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
