"""OpenAI-compatible endpoints: /v1/chat/completions, /v1/completions, /v1/models.

Responses follow OpenAI's shapes field for field, so the official client (and anything built on it) reads them
as it reads OpenAI's: `reasoning_content` carries the thinking (the field vLLM and DeepSeek use),
`usage.prompt_tokens_details.cached_tokens` the prompt tokens reused from a saved conversation state, and tool
calls arrive as `tool_calls` with JSON-string arguments (in one streamed delta per call, when it is complete).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import APIRouter
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from strata.errors import StrataError
from strata.serve.context import ServerContext, new_id, sse_events
from strata.serve.errors import OPENAI, ApiError, error_body
from strata.serve.scheduler import Job, JobResult
from strata.serve.schemas import ChatMessage, ChatRequest, CompletionRequest, parse_body
from strata.serve.tools import Event, OutputParser, ParsedToolCall, parse_output, tool_arguments

router = APIRouter()

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _ctx(request: Request) -> ServerContext:
    return request.app.state.ctx


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def _check_n(n: int | None) -> None:
    if n is not None and n != 1:
        raise ApiError(400, f"n must be 1 (one choice per request), got {n}", param="n")


# --- models -----------------------------------------------------------------------------------------------------

def _model_card(ctx: ServerContext) -> dict[str, Any]:
    return {"id": ctx.model_name, "object": "model", "created": ctx.created, "owned_by": "strata"}


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    return {"object": "list", "data": [_model_card(_ctx(request))]}


@router.get("/v1/models/{model_id:path}")
async def get_model(request: Request, model_id: str) -> dict[str, Any]:
    ctx = _ctx(request)
    ctx.check_model(model_id)
    return _model_card(ctx)


# --- chat -------------------------------------------------------------------------------------------------------

def _text(content: str | Sequence[Any] | None) -> str | None:
    if content is None or isinstance(content, str):
        return content
    return "".join(part.text for part in content)


def template_message(m: ChatMessage) -> dict[str, Any]:
    """A request message as chat templates expect it: text content, "developer" read as "system", tool-call
    arguments as objects."""
    out: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": _text(m.content)}
    if m.name is not None:
        out["name"] = m.name
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.reasoning_content is not None:
        out["reasoning_content"] = m.reasoning_content
    if m.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.function.name,
                                           "arguments": tool_arguments(c.function.arguments)}}
                             for c in m.tool_calls]
    return out


def _check_chat_supported(req: ChatRequest) -> None:
    _check_n(req.n)
    if req.logprobs or req.top_logprobs:
        raise ApiError(400, "logprobs are not supported by this server", param="logprobs")
    if req.response_format is not None and req.response_format.type != "text":
        raise ApiError(400, "response_format other than text is not supported by this server",
                       param="response_format")
    if req.tool_choice is not None and req.tool_choice not in ("auto", "none"):
        raise ApiError(400, "tool_choice must be 'auto' or 'none': this server cannot force a tool call",
                       param="tool_choice")


def _template_kwargs(ctx: ServerContext, req: ChatRequest, tools: Sequence[Any] | None) -> dict[str, Any]:
    """chat_template_kwargs, then reasoning_effort mapped onto the template: "none"/"minimal" turn thinking off,
    any other level turns it on and is passed as `reasoning_effort` to templates that read it."""
    kwargs: dict[str, Any] = dict(req.chat_template_kwargs or {})
    effort = req.reasoning_effort
    if effort is not None:
        kwargs["enable_thinking"] = effort not in ("none", "minimal")
        if kwargs["enable_thinking"] and ctx.template_reads("reasoning_effort", tools):
            kwargs["reasoning_effort"] = effort
    return kwargs


def _tool_call_json(call: ParsedToolCall, index: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"id": call.id, "type": "function",
                           "function": {"name": call.name, "arguments": call.arguments_json}}
    return out if index is None else {"index": index, **out}


def _finish_reason(result: JobResult, has_calls: bool) -> str:
    if has_calls:
        return "tool_calls"
    return "stop" if result.finish_reason == "stop" else "length"


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    ctx = _ctx(request)
    req = parse_body(await request.body(), ChatRequest)
    ctx.check_model(req.model)
    _check_chat_supported(req)
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    use_tools = tools is not None and req.tool_choice != "none"
    offered = tools if use_tools else None
    # Rendering and tokenizing a long conversation takes a while: off the event loop, so streams keep flowing.
    prompt = await run_in_threadpool(ctx.chat_prompt, [template_message(m) for m in req.messages], offered,
                                     _template_kwargs(ctx, req, offered))
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    params = ctx.sampling(max_tokens=ctx.max_tokens(requested, len(prompt.ids), field),
                          temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
                          presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                          repetition_penalty=req.repetition_penalty, logit_bias=req.logit_bias, seed=req.seed,
                          stop=req.stop)
    job = ctx.start_job("/v1/chat/completions", prompt.ids, params, prompt.checkpoints)
    cid, created = new_id("chatcmpl-"), int(time.time())
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        parser = OutputParser(prompt.thinking, use_tools, offered)
        return StreamingResponse(_chat_stream(ctx, request, job, parser, cid, created, include_usage),
                                 media_type="text/event-stream", headers=SSE_HEADERS)
    result = await ctx.result(request, job)
    parsed = parse_output(result.text, prompt.thinking, use_tools, offered)
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content if parsed.content or not parsed.calls
                               else None, "refusal": None}
    if parsed.reasoning:
        message["reasoning_content"] = parsed.reasoning
    if parsed.calls:
        message["tool_calls"] = [_tool_call_json(c) for c in parsed.calls]
    return JSONResponse({
        "id": cid, "object": "chat.completion", "created": created, "model": ctx.model_name,
        "system_fingerprint": None,
        "choices": [{"index": 0, "message": message, "logprobs": None,
                     "finish_reason": _finish_reason(result, bool(parsed.calls))}],
        "usage": usage(result.prompt_tokens, result.completion_tokens, result.cached_tokens)})


def _chat_delta(event: Event, calls_so_far: int) -> dict[str, Any]:
    if event.kind == "reasoning":
        return {"reasoning_content": event.text}
    if event.kind == "content":
        return {"content": event.text}
    assert event.call is not None
    return {"tool_calls": [_tool_call_json(event.call, calls_so_far)]}


async def _chat_stream(ctx: ServerContext, request: Request, job: Job, parser: OutputParser, cid: str,
                       created: int, include_usage: bool) -> AsyncIterator[str]:
    def chunk(delta: dict[str, Any], finish: str | None = None) -> str:
        body: dict[str, Any] = {"id": cid, "object": "chat.completion.chunk", "created": created,
                                "model": ctx.model_name, "system_fingerprint": None,
                                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
        if include_usage:
            body["usage"] = None
        return sse(body)

    calls = 0
    async for kind, payload in sse_events(request, job):
        if kind == "start":
            yield chunk({"role": "assistant", "content": ""})
        elif kind == "text" or kind == "done":
            events = parser.push(payload) if kind == "text" else parser.finish()
            for ev in events:
                yield chunk(_chat_delta(ev, calls))
                calls += ev.kind == "tool_call"
            if kind == "done":
                yield chunk({}, _finish_reason(payload, calls > 0))
                if include_usage:
                    yield sse({"id": cid, "object": "chat.completion.chunk", "created": created,
                               "model": ctx.model_name, "system_fingerprint": None, "choices": [],
                               "usage": usage(payload.prompt_tokens, payload.completion_tokens,
                                              payload.cached_tokens)})
                yield "data: [DONE]\n\n"
        elif kind == "error":
            yield sse(error_body(payload, OPENAI))
            yield "data: [DONE]\n\n"


# --- completions ------------------------------------------------------------------------------------------------

def _completion_prompt(ctx: ServerContext, prompt: str | list[Any]) -> list[int]:
    """The one prompt of a request (text, token ids, or a list holding exactly one of those)."""
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) != 1:
            raise ApiError(400, "one prompt per request: send a string or a list of token ids", param="prompt")
        prompt = prompt[0]
    try:
        return ctx.llm.prompt_ids(prompt)
    except StrataError as e:
        raise ApiError(400, str(e), param="prompt") from None


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    ctx = _ctx(request)
    req = parse_body(await request.body(), CompletionRequest)
    ctx.check_model(req.model)
    _check_n(req.n)
    if req.best_of is not None and req.best_of != 1:
        raise ApiError(400, "best_of must be 1", param="best_of")
    if req.echo:
        raise ApiError(400, "echo is not supported by this server", param="echo")
    if req.logprobs:
        raise ApiError(400, "logprobs are not supported by this server", param="logprobs")
    if req.suffix:
        raise ApiError(400, "suffix (fill-in-the-middle) is not supported by this server", param="suffix")
    ids = await run_in_threadpool(_completion_prompt, ctx, req.prompt)
    params = ctx.sampling(max_tokens=ctx.max_tokens(req.max_tokens if req.max_tokens is not None else
                                                    min(16, ctx.max_tokens_limit), len(ids)),
                          temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
                          presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                          repetition_penalty=req.repetition_penalty, logit_bias=req.logit_bias, seed=req.seed,
                          stop=req.stop)
    job = ctx.start_job("/v1/completions", ids, params)
    cid, created = new_id("cmpl-"), int(time.time())
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(_completion_stream(ctx, request, job, cid, created, include_usage),
                                 media_type="text/event-stream", headers=SSE_HEADERS)
    result = await ctx.result(request, job)
    return JSONResponse({
        "id": cid, "object": "text_completion", "created": created, "model": ctx.model_name,
        "system_fingerprint": None,
        "choices": [{"text": result.text, "index": 0, "logprobs": None,
                     "finish_reason": _finish_reason(result, False)}],
        "usage": usage(result.prompt_tokens, result.completion_tokens, result.cached_tokens)})


async def _completion_stream(ctx: ServerContext, request: Request, job: Job, cid: str, created: int,
                             include_usage: bool) -> AsyncIterator[str]:
    def chunk(text: str, finish: str | None = None) -> str:
        body: dict[str, Any] = {"id": cid, "object": "text_completion", "created": created,
                                "model": ctx.model_name, "system_fingerprint": None,
                                "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish}]}
        if include_usage:
            body["usage"] = None
        return sse(body)

    async for kind, payload in sse_events(request, job):
        if kind == "text":
            yield chunk(payload)
        elif kind == "done":
            yield chunk("", _finish_reason(payload, False))
            if include_usage:
                yield sse({"id": cid, "object": "text_completion", "created": created, "model": ctx.model_name,
                           "choices": [], "usage": usage(payload.prompt_tokens, payload.completion_tokens,
                                                         payload.cached_tokens)})
            yield "data: [DONE]\n\n"
        elif kind == "error":
            yield sse(error_body(payload, OPENAI))
            yield "data: [DONE]\n\n"

