"""The output parser: thinking, text and tool calls, whole and streamed in pieces of every size."""

from __future__ import annotations

import pytest

from strata.serve.tools import (
    OutputParser,
    generation_opens_think,
    parse_output,
    parse_tool_call,
    tool_arguments,
)

WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]

REPLY = ("Let me check the weather.\n</think>\n\nChecking now.\n<tool_call>\n"
         '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>\n'
         '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}\n</tool_call>')


def _stream(text: str, size: int, **kw: object) -> tuple[str, str, list[tuple[str, dict]]]:
    p = OutputParser(**kw)  # type: ignore[arg-type]
    events = []
    for i in range(0, len(text), size):
        events += p.push(text[i:i + size])
    events += p.finish()
    reasoning = "".join(e.text for e in events if e.kind == "reasoning")
    content = "".join(e.text for e in events if e.kind == "content")
    calls = [(e.call.name, e.call.arguments) for e in events if e.kind == "tool_call"]
    return reasoning, content, calls


def test_whole_reply_splits_into_thinking_content_and_calls() -> None:
    out = parse_output(REPLY, thinking=True, tools=True, tool_specs=WEATHER)
    assert out.reasoning == "Let me check the weather."
    assert out.content == "Checking now."
    assert [(c.name, c.arguments) for c in out.calls] == [("get_weather", {"city": "Paris", "days": 2}),
                                                         ("get_weather", {"city": "Oslo"})]
    assert out.calls[0].id != out.calls[1].id


@pytest.mark.parametrize("size", [1, 2, 3, 5, 7, 11, 64])
def test_streaming_in_any_piece_size_gives_the_same_result(size: int) -> None:
    whole = parse_output(REPLY, thinking=True, tools=True, tool_specs=WEATHER)
    reasoning, content, calls = _stream(REPLY, size, thinking=True, tools=True, tool_specs=WEATHER)
    assert (reasoning, content) == (whole.reasoning, whole.content)
    assert calls == [(c.name, c.arguments) for c in whole.calls]


def test_model_written_think_block_and_plain_text() -> None:
    out = parse_output("<think>hmm</think>\n\nHello <b>world</b>", thinking=False)
    assert (out.reasoning, out.content, out.calls) == ("hmm", "Hello <b>world</b>", [])
    # a <think> after the answer has started is just text
    assert parse_output("Say <think> twice").content == "Say <think> twice"


def test_tool_calls_are_text_when_no_tools_were_offered() -> None:
    text = '<tool_call>{"name": "x", "arguments": {}}</tool_call>'
    out = parse_output(text, tools=False)
    assert out.content == text and out.calls == []


def test_unreadable_or_cut_off_calls_stay_text() -> None:
    bad = "Before <tool_call>{not json}</tool_call> after"
    out = parse_output(bad, tools=True)
    assert out.calls == [] and out.content == bad
    cut = 'Sure <tool_call>{"name": "get_weather", "argum'
    out = parse_output(cut, tools=True)
    assert out.calls == [] and out.content == cut


def test_xml_dialect_with_schema_types() -> None:
    body = ("\n<function=get_weather>\n<parameter=city>\n2024\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n</function>\n")
    call = parse_tool_call(body, {"get_weather": {"city"}})
    assert call is not None and call.name == "get_weather"
    assert call.arguments == {"city": "2024", "days": 3}  # city is a string in the schema; days is read as JSON
    out = parse_output(f"<tool_call>{body}</tool_call>", tools=True, tool_specs=WEATHER)
    assert out.calls[0].arguments == {"city": "2024", "days": 3}


def test_generation_prompt_detection() -> None:
    bare = "<|im_start|>user\nHi <think> there<|im_end|>\n"
    assert generation_opens_think(bare + "<|im_start|>assistant\n<think>\n", bare)
    assert not generation_opens_think(bare + "<|im_start|>assistant\n<think>\n\n</think>\n\n", bare)
    assert not generation_opens_think(bare + "<|im_start|>assistant\n", bare)


def test_tool_arguments_for_templates() -> None:
    assert tool_arguments('{"a": 1}') == {"a": 1}
    assert tool_arguments("[1]") == "[1]"
    assert tool_arguments("not json") == "not json"
    assert tool_arguments({"a": 1}) == {"a": 1}
