"""Anthropic-compatible endpoint: POST /v1/messages, streaming and not.

The conversation is turned into chat-template messages (system prompt first; tool_result blocks become "tool"
messages; assistant thinking, text and tool_use blocks become reasoning_content, content and tool_calls), and
the reply is turned back into blocks: thinking, text, tool_use. Usage follows Anthropic's accounting:
`input_tokens` are the prompt tokens actually processed and `cache_read_input_tokens` those reused from a saved
conversation state, so the two add up to the prompt.

Thinking is off unless the request asks for it (`thinking: {"type": "enabled" | "adaptive"}`), as on Anthropic's
API; `output_config.effort` reaches templates that read `reasoning_effort`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from strata.serve.context import ServerContext, new_id, sse_events
from strata.serve.errors import ANTHROPIC, ApiError, error_body
from strata.serve.openai_api import SSE_HEADERS
from strata.serve.scheduler import Job, JobResult
from strata.serve.schemas import ATextBlock, MessagesRequest, parse_body
from strata.serve.tools import Event, OutputParser, ParsedToolCall, parse_output

router = APIRouter()


def _ctx(request: Request) -> ServerContext:
    return request.app.state.ctx


def _event(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


def _texts(blocks: list[ATextBlock] | str | None) -> str:
    if blocks is None or isinstance(blocks, str):
        return blocks or ""
    return "\n".join(b.text for b in blocks)


def template_messages(req: MessagesRequest) -> list[dict[str, Any]]:
    """The request's system prompt and messages as chat-template messages."""
    out: list[dict[str, Any]] = []
    if req.system:
        out.append({"role": "system", "content": _texts(req.system)})
    for i, m in enumerate(req.messages):
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        texts: list[str] = []
        reasoning: list[str] = []
        calls: list[dict[str, Any]] = []
        for block in m.content:
            where = f"messages.{i}: a {block.type} block"
            if block.type == "text":
                texts.append(block.text)
            elif block.type == "tool_result":
                if m.role != "user":
                    raise ApiError(400, f"{where} belongs in a user message")
                content = _texts(block.content)
                out.append({"role": "tool", "tool_call_id": block.tool_use_id,
                            "content": f"Error: {content}" if block.is_error else content})
            elif block.type == "tool_use":
                if m.role != "assistant":
                    raise ApiError(400, f"{where} belongs in an assistant message")
                calls.append({"id": block.id, "type": "function",
                              "function": {"name": block.name, "arguments": block.input}})
            elif block.type == "thinking":
                if m.role != "assistant":
                    raise ApiError(400, f"{where} belongs in an assistant message")
                reasoning.append(block.thinking)
            # redacted_thinking: there is nothing readable to give the template.
        if m.role == "user":
            if texts:
                out.append({"role": "user", "content": "\n".join(texts)})
        else:
            msg: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
            if reasoning:
                msg["reasoning_content"] = "\n".join(reasoning)
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
    return out


def _tool_specs(req: MessagesRequest) -> list[dict[str, Any]] | None:
    """Anthropic tools in the OpenAI function form chat templates are written for."""
    if not req.tools or (req.tool_choice is not None and req.tool_choice.type == "none"):
        return None
    return [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                              "parameters": t.input_schema}} for t in req.tools]


def _template_kwargs(ctx: ServerContext, req: MessagesRequest, tools: list[dict[str, Any]] | None) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"enable_thinking": req.thinking is not None and req.thinking.type != "disabled"}
    effort = req.output_config.effort if req.output_config is not None else None
    if effort is not None and kwargs["enable_thinking"] and ctx.template_reads("reasoning_effort", tools):
        kwargs["reasoning_effort"] = effort
    return kwargs


def _check_supported(req: MessagesRequest) -> None:
    if req.tool_choice is not None and req.tool_choice.type in ("any", "tool"):
        raise ApiError(400, "tool_choice must be auto or none: this server cannot force a tool call")
    if req.output_config is not None and req.output_config.format is not None:
        raise ApiError(400, "output_config.format (structured output) is not supported by this server")
    if req.thinking is not None and req.thinking.type == "enabled":
        if req.thinking.budget_tokens is None or req.thinking.budget_tokens < 1:
            raise ApiError(400, "thinking.budget_tokens: a positive integer is required when thinking is enabled")


def _tool_use_id(call: ParsedToolCall) -> str:
    return "toolu_" + call.id.removeprefix("call_")


def _stop(result: JobResult, has_calls: bool) -> tuple[str, str | None]:
    """stop_reason and stop_sequence."""
    if has_calls:
        return "tool_use", None
    if result.finish_reason == "stop":
        if isinstance(result.stop_reason, str):
            return "stop_sequence", result.stop_reason
        return "end_turn", None
    return "max_tokens", None


def _usage(result: JobResult) -> dict[str, Any]:
    return {"input_tokens": result.prompt_tokens - result.cached_tokens, "output_tokens": result.completion_tokens,
            "cache_read_input_tokens": result.cached_tokens, "cache_creation_input_tokens": 0}


@router.post("/v1/messages")
async def messages(request: Request) -> Response:
    ctx = _ctx(request)
    req = parse_body(await request.body(), MessagesRequest)
    ctx.check_model(req.model)
    _check_supported(req)
    tools = _tool_specs(req)
    prompt = await run_in_threadpool(ctx.chat_prompt, template_messages(req), tools,
                                     _template_kwargs(ctx, req, tools))
    params = ctx.sampling(max_tokens=ctx.max_tokens(req.max_tokens, len(prompt.ids)), temperature=req.temperature,
                          top_p=req.top_p, top_k=req.top_k, stop=req.stop_sequences)
    job = ctx.start_job("/v1/messages", prompt.ids, params, prompt.checkpoints)
    mid = new_id("msg_")
    if req.stream:
        parser = OutputParser(prompt.thinking, tools is not None, tools)
        return StreamingResponse(_stream(ctx, request, job, parser, mid), media_type="text/event-stream",
                                 headers=SSE_HEADERS)
    result = await ctx.result(request, job)
    parsed = parse_output(result.text, prompt.thinking, tools is not None, tools)
    content: list[dict[str, Any]] = []
    if parsed.reasoning:
        content.append({"type": "thinking", "thinking": parsed.reasoning, "signature": ""})
    if parsed.content or not parsed.calls:
        content.append({"type": "text", "text": parsed.content})
    for call in parsed.calls:
        content.append({"type": "tool_use", "id": _tool_use_id(call), "name": call.name, "input": call.arguments})
    stop_reason, stop_sequence = _stop(result, bool(parsed.calls))
    return JSONResponse({"id": mid, "type": "message", "role": "assistant", "model": ctx.model_name,
                         "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
                         "usage": _usage(result)})


class _Blocks:
    """Turns parser events into Anthropic's content_block_start / _delta / _stop events."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None
        self.calls = 0

    def _close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [_event("content_block_stop", {"index": self.index})]

    def _start(self, kind: str, block: dict[str, Any]) -> list[str]:
        out = self._close()
        self.index += 1
        self.open = kind
        return out + [_event("content_block_start", {"index": self.index, "content_block": block})]

    def feed(self, ev: Event) -> list[str]:
        out: list[str] = []
        if ev.kind == "reasoning":
            if self.open != "thinking":
                out += self._start("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            out.append(_event("content_block_delta", {"index": self.index,
                                                      "delta": {"type": "thinking_delta", "thinking": ev.text}}))
        elif ev.kind == "content":
            if self.open != "text":
                out += self._start("text", {"type": "text", "text": ""})
            out.append(_event("content_block_delta", {"index": self.index,
                                                      "delta": {"type": "text_delta", "text": ev.text}}))
        else:
            assert ev.call is not None
            self.calls += 1
            out += self._start("tool_use", {"type": "tool_use", "id": _tool_use_id(ev.call), "name": ev.call.name,
                                            "input": {}})
            out.append(_event("content_block_delta", {
                "index": self.index, "delta": {"type": "input_json_delta", "partial_json": ev.call.arguments_json}}))
            out += self._close()
        return out

    def end(self) -> list[str]:
        out = self._close()
        if self.index < 0:  # an empty reply is still one (empty) text block, as Anthropic sends it
            out += self._start("text", {"type": "text", "text": ""}) + self._close()
        return out


async def _stream(ctx: ServerContext, request: Request, job: Job, parser: OutputParser,
                  mid: str) -> AsyncIterator[str]:
    blocks = _Blocks()
    async for kind, payload in sse_events(request, job):
        if kind == "start":
            cached = payload
            yield _event("message_start", {"message": {
                "id": mid, "type": "message", "role": "assistant", "model": ctx.model_name, "content": [],
                "stop_reason": None, "stop_sequence": None,
                "usage": {"input_tokens": len(job.prompt_ids) - cached, "output_tokens": 0,
                          "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}}})
            yield _event("ping", {})
        elif kind == "text" or kind == "done":
            for ev in parser.push(payload) if kind == "text" else parser.finish():
                for line in blocks.feed(ev):
                    yield line
            if kind == "done":
                for line in blocks.end():
                    yield line
                stop_reason, stop_sequence = _stop(payload, blocks.calls > 0)
                yield _event("message_delta", {"delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                                               "usage": _usage(payload)})
                yield _event("message_stop", {})
        elif kind == "error":
            yield _event("error", {"error": error_body(payload, ANTHROPIC)["error"]})
