"""The model's output format -> structured replies: thinking, text and tool calls.

Qwen-family chat models write

    <think>
    reasoning
    </think>

    answer text
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

The opening `<think>` is often written by the chat template's generation prompt rather than by the model, so the
parser is told whether generation starts inside a think block. Tool calls come in two dialects, both accepted:
Hermes/Qwen3 JSON (above) and the Qwen3-Coder XML form (`<function=NAME><parameter=ARG>VALUE</parameter>
</function>`). A call whose body cannot be read is passed through as text rather than dropped, so nothing the
model wrote is lost.

`OutputParser` works on text as it streams: it holds back only what could still be the start of a tag (or a
whitespace run whose fate depends on what follows), and emits a tool call once its closing tag arrives.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"

_XML_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.S)
_XML_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.S)


@dataclass(frozen=True)
class ParsedToolCall:
    """A tool call read from the model's text. `arguments` is the decoded JSON object."""

    name: str
    arguments: dict[str, Any]
    id: str = field(default_factory=lambda: "call_" + secrets.token_hex(12))

    @property
    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)


@dataclass(frozen=True)
class Event:
    """One piece of parsed output: kind is "reasoning" or "content" (with `text`) or "tool_call" (with `call`)."""

    kind: str
    text: str = ""
    call: ParsedToolCall | None = None


def generation_opens_think(prompt: str, prompt_without_generation: str | None = None) -> bool:
    """Whether generation starts inside a think block: the generation prompt (the text the template adds for
    the assistant's turn) opens `<think>` without closing it."""
    tail = prompt
    if prompt_without_generation is not None and prompt.startswith(prompt_without_generation):
        tail = prompt[len(prompt_without_generation):]
    i = tail.rfind(THINK_OPEN)
    return i >= 0 and tail.find(THINK_CLOSE, i) < 0


def _string_params(tools: Sequence[Mapping[str, Any]] | None) -> dict[str, set[str]]:
    """For each tool, the parameters its JSON schema declares as strings (XML-dialect values stay text for
    these; other values are read as JSON when they parse)."""
    out: dict[str, set[str]] = {}
    for tool in tools or ():
        fn = tool.get("function", tool)
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            continue
        schema = fn.get("parameters") or fn.get("input_schema") or {}
        props = schema.get("properties") if isinstance(schema, Mapping) else None
        names = set()
        if isinstance(props, Mapping):
            for pname, p in props.items():
                if isinstance(p, Mapping) and p.get("type") == "string":
                    names.add(pname)
        out[fn["name"]] = names
    return out


def parse_tool_call(body: str, string_params: Mapping[str, set[str]] | None = None) -> ParsedToolCall | None:
    """The call inside one `<tool_call>...</tool_call>`, or None when it is not a readable call."""
    text = body.strip()
    if text.startswith("{"):
        try:
            obj = json.loads(text)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                return None
        if not isinstance(args, dict):
            return None
        return ParsedToolCall(obj["name"], args)
    m = _XML_FUNCTION.search(text)
    if m is None or not m.group(1).strip():
        return None
    name = m.group(1).strip()
    strings = (string_params or {}).get(name, set())
    args: dict[str, Any] = {}
    for pm in _XML_PARAMETER.finditer(m.group(2)):
        pname, raw = pm.group(1).strip(), pm.group(2)
        value = raw[1:] if raw.startswith("\n") else raw
        value = value[:-1] if value.endswith("\n") else value
        if pname not in strings:
            try:
                args[pname] = json.loads(value)
                continue
            except ValueError:
                pass
        args[pname] = value
    return ParsedToolCall(name, args)


def _partial_tag(text: str, tags: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `tags`."""
    best = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:n]):
                best = n
                break
    return best


class _Channel:
    """Text of one kind (reasoning or content) with its edges trimmed as templates trim them: leading whitespace
    dropped, trailing whitespace held until more text follows (and dropped at a tag or at the end)."""

    def __init__(self, kind: str):
        self.kind = kind
        self.started = False
        self.held = ""

    def push(self, text: str, out: list[Event]) -> None:
        if not self.started:
            text = text.lstrip()
            if not text:
                return
            self.started = True
        text = self.held + text
        body = text.rstrip()
        self.held = text[len(body):]
        if body:
            out.append(Event(self.kind, body))

    def cut(self) -> None:
        """A tag or the end follows: the held whitespace was trailing."""
        self.held = ""


class OutputParser:
    """Streaming splitter of generated text into reasoning, content and tool-call events.

    thinking: generation starts inside a think block (see `generation_opens_think`). tools: parse tool calls
    (only when the request offered tools; otherwise a literal `<tool_call>` stays text). tool_specs: the offered
    tools, used to keep string-typed XML parameters as text.
    """

    def __init__(self, thinking: bool = False, tools: bool = False,
                 tool_specs: Sequence[Mapping[str, Any]] | None = None):
        self.mode = "reasoning" if thinking else "content"
        self.tools = tools
        self.string_params = _string_params(tool_specs)
        self.buffer = ""
        self.reasoning = _Channel("reasoning")
        self.content = _Channel("content")
        self.calls: list[ParsedToolCall] = []
        self._seen_content = False  # any non-space content yet (a <think> is only honoured before it)
        self._before_call = ""  # whitespace before an open <tool_call>: dropped if it is a call, else kept

    def _tags(self) -> list[str]:
        if self.mode == "reasoning":
            return [THINK_CLOSE]
        if self.mode == "call":
            return [CALL_CLOSE]
        tags = [CALL_OPEN] if self.tools else []
        if not self._seen_content and not self.calls:
            tags.append(THINK_OPEN)
        return tags

    def push(self, text: str) -> list[Event]:
        """Events for the next piece of generated text."""
        self.buffer += text
        out: list[Event] = []
        while True:
            tags = self._tags()
            hits = [(self.buffer.find(t), t) for t in tags]
            hits = [(i, t) for i, t in hits if i >= 0]
            if not hits:
                break
            i, tag = min(hits)
            before, self.buffer = self.buffer[:i], self.buffer[i + len(tag):]
            self._on_tag(tag, before, out)
        if self.mode != "call":
            keep = _partial_tag(self.buffer, self._tags())
            ready, self.buffer = self.buffer[:len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
            self._emit(ready, out)
        return out

    def _emit(self, text: str, out: list[Event]) -> None:
        if not text:
            return
        if self.mode == "reasoning":
            self.reasoning.push(text, out)
        else:
            if text.strip():
                self._seen_content = True
            self.content.push(text, out)

    def _on_tag(self, tag: str, before: str, out: list[Event]) -> None:
        if tag == THINK_CLOSE:
            self._emit(before, out)
            self.reasoning.cut()
            self.mode = "content"
        elif tag == THINK_OPEN:
            if before.strip():  # the answer has begun: a <think> inside it is text
                self._emit(before + tag, out)
                return
            self.content.cut()
            self.mode = "reasoning"
        elif tag == CALL_OPEN:
            self._emit(before, out)
            self._before_call, self.content.held = self.content.held, ""
            self.mode = "call"
        elif tag == CALL_CLOSE:
            call = parse_tool_call(before, self.string_params)
            self.mode = "content"
            if call is None:
                self.content.push(self._before_call + CALL_OPEN + before + CALL_CLOSE, out)
                self._seen_content = True
            else:
                self.calls.append(call)
                out.append(Event("tool_call", call=call))

    def finish(self) -> list[Event]:
        """Events for what was held back, once generation has ended."""
        out: list[Event] = []
        rest, self.buffer = self.buffer, ""
        if self.mode == "call":
            # A call cut off (max_tokens, a stop string) is not a call; keep what the model wrote.
            self.mode = "content"
            self.content.push(self._before_call + CALL_OPEN + rest, out)
        else:
            self._emit(rest, out)
        return out


@dataclass
class ParsedOutput:
    """A whole reply, parsed: what non-streaming responses are built from."""

    reasoning: str
    content: str
    calls: list[ParsedToolCall]


def parse_output(text: str, thinking: bool = False, tools: bool = False,
                 tool_specs: Sequence[Mapping[str, Any]] | None = None) -> ParsedOutput:
    """Parse a complete reply (the non-streaming path runs the same parser as streaming)."""
    p = OutputParser(thinking, tools, tool_specs)
    events = p.push(text) + p.finish()
    return ParsedOutput("".join(e.text for e in events if e.kind == "reasoning"),
                        "".join(e.text for e in events if e.kind == "content"),
                        [e.call for e in events if e.kind == "tool_call" and e.call is not None])


def tool_arguments(value: Any) -> Any:
    """Tool-call arguments for the chat template: templates iterate over a mapping, so a JSON-object string (as
    OpenAI clients send them) is decoded; anything else is passed on as it came."""
    if isinstance(value, str):
        try:
            decoded = json.loads(value)
        except ValueError:
            return value
        return decoded if isinstance(decoded, dict) else value
    return value
