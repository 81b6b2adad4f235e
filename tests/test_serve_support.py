"""Shared pieces of the server tests (no tests here): a ChatML chat template, a real uvicorn server on a free
loopback port in a background thread, and `Script`, the scheduler seam that makes the model emit given text.

The bundled model has random weights and no chat template, so the tests bring a template in the style the
trained model will have (ChatML, `enable_thinking` opening a `<think>` block in the generation prompt, Hermes
`<tool_call>` JSON), and script the model's choices where a test needs a particular reply (a tool call,
thinking). A scripted reply still runs through the engine, sampler, detokenizer, parser and HTTP layers; only
the logits are replaced by a one-hot on the scripted token.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from strata.api import LLM
from strata.serve.app import create_app
from strata.serve.context import ServeOptions, ServerContext

CHATML = r"""
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
    {{- '# Tools\n\nYou may call functions. Signatures:\n<tools>' }}
    {%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}
    {{- '\n</tools>\n\nReply with <tool_call>\n{"name": NAME, "arguments": {...}}\n</tool_call><|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'user' %}
        {{- '<|im_start|>user\n' + message.content + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant\n' + (message.content or '') }}
        {%- for tc in message.tool_calls or [] %}
            {%- set f = tc.function if tc.function is defined else tc %}
            {{- '\n<tool_call>\n{"name": "' + f.name + '", "arguments": ' }}
            {{- f.arguments if f.arguments is string else f.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking %}{{- '<think>\n' }}{%- endif %}
{%- endif %}
"""

API_KEY = "test-key-5d1c"


@pytest.fixture(scope="session")
def chat_llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    """The bundled model with the ChatML test template."""
    path = Path(tmp_path_factory.mktemp("template")) / "chatml.jinja"
    path.write_text(CHATML)
    return LLM(chat_template=path)


class Script:
    """The scheduler's steer hook: while `ids` is set, every job emits exactly those tokens, then <|im_end|>."""

    def __init__(self) -> None:
        self.ids: list[int] | None = None
        self.eos = -1

    def __call__(self, job: object, step: int, logits: torch.Tensor) -> torch.Tensor:
        if self.ids is None:
            return logits
        target = self.ids[step] if step < len(self.ids) else self.eos
        forced = torch.full_like(logits, -1e4)
        forced[target] = 0.0
        return forced

    @contextmanager
    def text(self, llm: LLM, text: str) -> Iterator[list[int]]:
        """Script `text` (as the tokenizer encodes it) for the requests made inside the block."""
        self.ids = llm.encode(text)
        self.eos = llm.tokenizer.token_to_id("<|im_end|>")
        assert self.eos in llm.tokenizer.eos_ids, "the test template ends turns with <|im_end|>, an EOS id"
        try:
            yield self.ids
        finally:
            self.ids = None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Running:
    url: str
    ctx: ServerContext
    script: Script


@contextmanager
def serve(llm: LLM, options: ServeOptions | None = None) -> Iterator[Running]:
    """A real server (uvicorn, its own event loop) on a free loopback port for the duration of the block."""
    import uvicorn

    script = Script()
    app = create_app(llm, options or ServeOptions(model_name="tiny"), steer=script)
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="uvicorn-test", daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield Running(f"http://127.0.0.1:{port}", app.state.ctx, script)
    finally:
        server.should_exit = True
        thread.join(timeout=20)


def greedy_alone(llm: LLM, ids: Sequence[int], max_tokens: int) -> str:
    """What the model says for `ids` run by itself (no server, no saved state)."""
    from strata.text.sampling import SamplingParams

    return llm.generate(list(ids), SamplingParams(max_tokens=max_tokens, greedy=True)).text
