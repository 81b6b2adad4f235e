"""Chat templates render byte for byte as transformers' apply_chat_template renders them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from strata.errors import StrataError
from strata.text.chat import ChatTemplate
from strata.text.tokenizer import Tokenizer

# Written for these tests in the style of Qwen's own templates: tools listed as JSON in the system turn, XML-style
# tool calls, tool results folded into user turns, reasoning kept only after the last real user query, a
# generation prompt that opens or closes the think block per enable_thinking, and the helpers such templates use
# (namespace, raise_exception, tojson, items, loop controls, string methods).
QWEN_STYLE = r"""
{%- if not messages %}{{ raise_exception('No messages provided.') }}{% endif %}
{%- if tools and tools is iterable and tools is not mapping %}
    {{- '<|im_start|>system\n# Tools\n\nYou have access to these functions:\n\n<tools>' }}
    {%- for tool in tools %}
        {{- '\n' }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- '\n</tools>\n\nTo call one, reply:\n<tool_call>\n<function=NAME>\n<parameter=ARG>\nVALUE\n</parameter>\n</function>\n</tool_call>' }}
    {%- if messages[0].role == 'system' and messages[0].content | trim %}
        {{- '\n\n' + messages[0].content | trim }}
    {%- endif %}
    {%- if reasoning_effort is defined %}{{- '\n\nReasoning effort: ' + reasoning_effort }}{% endif %}
    {{- '<|im_end|>\n' }}
{%- elif messages[0].role == 'system' or reasoning_effort is defined %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}{{- messages[0].content | trim }}{% endif %}
    {%- if reasoning_effort is defined %}{{- '\n\nReasoning effort: ' + reasoning_effort }}{% endif %}
    {{- '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == 'user' and message.content is string
          and not (message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- if ns.multi_step_tool %}{{ raise_exception('No user query found in messages.') }}{% endif %}
{%- for message in messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if message.role == 'system' %}
        {%- if not loop.first %}{{ raise_exception('System message must be at the beginning.') }}{% endif %}
        {%- continue %}
    {%- elif message.role == 'user' %}
        {{- '<|im_start|>user\n' + content + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {{- '<|im_start|>assistant\n<think>\n' + reasoning_content | trim + '\n</think>\n\n' + content | trim }}
        {%- else %}
            {{- '<|im_start|>assistant\n' + content | trim }}
        {%- endif %}
        {%- if message.tool_calls and message.tool_calls is iterable and message.tool_calls is not mapping %}
            {%- for tool_call in message.tool_calls %}
                {%- if tool_call.function is defined %}{% set tool_call = tool_call.function %}{% endif %}
                {%- if loop.first %}
                    {%- if content | trim %}{{- '\n\n' }}{% endif %}
                {%- else %}
                    {{- '\n' }}
                {%- endif %}
                {{- '<tool_call>\n<function=' + tool_call.name + '>\n' }}
                {%- if tool_call.arguments is mapping %}
                    {%- for name, value in tool_call.arguments | items %}
                        {{- '<parameter=' + name + '>\n' }}
                        {%- if value is mapping or (value is sequence and value is not string) %}
                            {{- value | tojson }}
                        {%- else %}
                            {{- value | string }}
                        {%- endif %}
                        {{- '\n</parameter>\n' }}
                    {%- endfor %}
                {%- else %}
                    {{- tool_call.arguments | string + '\n' }}
                {%- endif %}
                {{- '</function>\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or loop.previtem.role != 'tool' %}{{- '<|im_start|>user' }}{% endif %}
        {{- '\n<tool_response>\n' + content + '\n</tool_response>' }}
        {%- if loop.last or loop.nextitem.role != 'tool' %}{{- '<|im_end|>\n' }}{% endif %}
    {%- else %}
        {{- raise_exception('Unexpected message role: ' + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- else %}
        {{- '<think>\n' }}
    {%- endif %}
{%- endif %}
"""

# Reads the tokenizer's named special tokens, which apply_chat_template passes as variables.
SPECIALS = ("{{ bos_token is defined }}|{{ eos_token }}|{{ pad_token }}|{{ unk_token is defined }}|"
            "{% for m in messages %}{{ m['role'] }}:{{ m['content'] }}{{ eos_token }}{% endfor %}")

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Weather for a city — in °C, <b>no HTML escaping</b> & \"quotes\"",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "City name, e.g. Zürich or 東京"},
            "days": {"type": "integer"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "search", "description": "Search the web",
                                      "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}},
]

CONVERSATIONS = {
    "system_user": [{"role": "system", "content": "  You are terse.  "}, {"role": "user", "content": "Hi!"}],
    "multi_turn_thinking_in_history": [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"},
        {"role": "user", "content": "and 3+3? 🤔 你好"},
        {"role": "assistant", "content": "6", "reasoning_content": "three plus three"},
        {"role": "user", "content": "thanks"},
    ],
    "tools_and_results": [
        {"role": "system", "content": "Use tools when useful."},
        {"role": "user", "content": "Weather in Zürich and Paris?"},
        {"role": "assistant", "content": None, "reasoning_content": "two cities, two calls", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich", "days": 2}}},
            {"type": "function", "function": {"name": "get_weather",
                                              "arguments": {"city": "Paris", "extra": {"units": ["C", "F"]}}}},
        ]},
        {"role": "tool", "content": "{\"temp\": 21}"},
        {"role": "tool", "content": "{\"temp\": 25}"},
        {"role": "assistant", "content": "Zürich 21 °C, Paris 25 °C."},
        {"role": "user", "content": "Search for news."},
        {"role": "assistant", "content": "Searching.", "thinking": "reasoning under another name", "tool_calls": [
            {"function": {"name": "search", "arguments": "{\"q\": \"news\"}"}}]},
        {"role": "tool", "content": "nothing new"},
    ],
    "tool_loop_after_last_query": [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "reasoning_content": "\none call\n", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "content": "{\"temp\": -3}"},
    ],
}


def _hf_folder(tmp_path: Path, fixtures_dir: Path, template: str | None, in_config: bool = False) -> Path:
    """A copy of the fixture tokenizer with `template` as chat_template.jinja or in tokenizer_config.json."""
    folder = tmp_path / "tok"
    folder.mkdir(exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json"):
        shutil.copy(fixtures_dir / "hf" / name, folder / name)
    if template is not None and in_config:
        cfg = json.loads((folder / "tokenizer_config.json").read_text())
        cfg["chat_template"] = template
        (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    elif template is not None:
        (folder / "chat_template.jinja").write_text(template)
    return folder


def _pair(folder: Path) -> tuple[ChatTemplate | None, Tokenizer, object]:
    from transformers import AutoTokenizer

    tok = Tokenizer.from_dir(folder)
    return ChatTemplate.from_dir(folder, tok.special_tokens_map, tok.config), tok, AutoTokenizer.from_pretrained(folder)


def test_fixture_tokenizer_template_matches_transformers(fixtures_dir: Path) -> None:
    """The fixture carries no chat template: both sides agree there is none."""
    strata_t, _, hf = _pair(fixtures_dir / "hf")
    assert strata_t is None and hf.chat_template is None


@pytest.fixture(scope="module")
def qwen_style(tmp_path_factory: pytest.TempPathFactory, fixtures_dir: Path) -> tuple[ChatTemplate, Tokenizer, object]:
    return _pair(_hf_folder(tmp_path_factory.mktemp("qwen"), fixtures_dir, QWEN_STYLE))


@pytest.mark.parametrize("conv", sorted(CONVERSATIONS))
@pytest.mark.parametrize("with_tools", [False, True])
@pytest.mark.parametrize("gen_prompt", [False, True])
@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": True}, {"enable_thinking": False},
                                    {"enable_thinking": False, "reasoning_effort": "high"}],
                         ids=["default", "think_on", "think_off", "effort"])
def test_qwen_style_template_matches_transformers(qwen_style, conv: str, with_tools: bool, gen_prompt: bool,
                                                   kwargs: dict) -> None:
    template, tok, hf = qwen_style
    messages = CONVERSATIONS[conv]
    tools = TOOLS if with_tools else None
    ours = template.render(messages, tools=tools, add_generation_prompt=gen_prompt, **kwargs)
    theirs = hf.apply_chat_template(messages, tools=tools, add_generation_prompt=gen_prompt, tokenize=False,
                                    **kwargs)
    assert ours == theirs
    # The ids the prompt becomes agree too (no combining marks here, where the split regexes differ).
    hf_ids = hf.apply_chat_template(messages, tools=tools, add_generation_prompt=gen_prompt, tokenize=True,
                                    return_dict=False, **kwargs)
    assert tok.encode(ours, add_special_tokens=False) == list(hf_ids)


def test_thinking_switch_changes_the_generation_prompt(qwen_style) -> None:
    template, _, _ = qwen_style
    msgs = CONVERSATIONS["system_user"]
    on = template.render(msgs, add_generation_prompt=True, enable_thinking=True)
    off = template.render(msgs, add_generation_prompt=True, enable_thinking=False)
    assert on.endswith("<|im_start|>assistant\n<think>\n")
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert "enable_thinking" in template.variables()


def test_special_tokens_and_config_template_match_transformers(tmp_path: Path, fixtures_dir: Path) -> None:
    """A template kept in tokenizer_config.json, reading the special-token variables."""
    template, _, hf = _pair(_hf_folder(tmp_path, fixtures_dir, SPECIALS, in_config=True))
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert template.render(msgs) == hf.apply_chat_template(msgs, tokenize=False)
    assert template.render(msgs) == "False|<|im_end|>|<|endoftext|>|False|user:a<|im_end|>assistant:b<|im_end|>"


def test_jinja_file_wins_over_tokenizer_config(tmp_path: Path, fixtures_dir: Path) -> None:
    folder = _hf_folder(tmp_path, fixtures_dir, "config{{ messages[0].content }}", in_config=True)
    (folder / "chat_template.jinja").write_text("file{{ messages[0].content }}")
    template, _, hf = _pair(folder)
    msgs = [{"role": "user", "content": "x"}]
    assert template.render(msgs) == hf.apply_chat_template(msgs, tokenize=False) == "filex"


def test_generation_tag_and_strftime(tmp_path: Path, fixtures_dir: Path) -> None:
    source = ("{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}"
              "|{{ strftime_now('%Y') }}|{{ dict(a=1) | tojson }}")
    template, _, hf = _pair(_hf_folder(tmp_path, fixtures_dir, source))
    msgs = [{"role": "assistant", "content": "é<"}]
    assert template.render(msgs) == hf.apply_chat_template(msgs, tokenize=False)


def test_failing_templates_raise_clear_errors(qwen_style) -> None:
    template, _, _ = qwen_style
    with pytest.raises(StrataError, match="Unexpected message role: robot"):
        template.render([{"role": "user", "content": "hi"}, {"role": "robot", "content": "beep"}])
    with pytest.raises(StrataError, match="No user query found"):
        template.render([{"role": "assistant", "content": "hi"}])
    with pytest.raises(StrataError, match="empty conversation"):
        template.render([])
    with pytest.raises(StrataError, match="syntax error at line 1"):
        ChatTemplate({"default": "{% if %}"}).render([{"role": "user", "content": "x"}])
    with pytest.raises(StrataError, match="failed to render: TypeError"):
        ChatTemplate({"default": "{{ messages[0].content + 1 }}"}).render([{"role": "user", "content": "x"}])
    with pytest.raises(StrataError, match="underscore"):
        ChatTemplate({"default": "{% set ns = namespace(_x=1) %}"}).render([{"role": "user", "content": "x"}])


def test_named_templates_are_picked_like_transformers() -> None:
    t = ChatTemplate({"default": "D", "tool_use": "T"})
    msgs = [{"role": "user", "content": "x"}]
    assert t.render(msgs) == "D"
    assert t.render(msgs, tools=[{"name": "f"}]) == "T"
    assert t.render(msgs, name="tool_use") == "T"
    with pytest.raises(StrataError, match="no template named"):
        t.render(msgs, name="nope")
    with pytest.raises(StrataError, match="no default"):
        ChatTemplate({"a": "A", "b": "B"}).render(msgs)
