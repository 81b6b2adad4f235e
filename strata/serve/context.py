"""What every endpoint shares: the loaded model, the server's options and limits, and the steps from a validated
request to a running job (model check, sampling parameters, chat rendering, limits, waiting for the result
while watching for the client to leave)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from starlette.requests import Request

from strata.api import LLM
from strata.errors import StrataError
from strata.serve.cache import PrefixCache
from strata.serve.errors import ApiError
from strata.serve.metrics import Metrics
from strata.serve.scheduler import Job, JobResult, Scheduler, Steer
from strata.serve.tools import generation_opens_think
from strata.text.sampling import SamplingParams

DEFAULT_BODY_BYTES = 8 * 1024 * 1024
DEFAULT_CACHE_BYTES = 1024 * 1024 * 1024


@dataclass(frozen=True)
class ServeOptions:
    """How the server behaves. model_name: the id clients send as `model` (default: the model folder's name).
    api_key: required on every API route when set. max_prompt_tokens / max_tokens_limit: per-request caps (None:
    the model's context). max_body_bytes: largest request body. cache_bytes: bound on saved conversation states
    (0 disables reuse). max_concurrency: sequence slots. max_queue: requests that may wait for a slot before new
    ones get 503. loopback_hosts_only: answer only requests whose Host header names this machine (localhost,
    127.x, ::1); a server bound to loopback without a key sets it to refuse the DNS-rebinding requests a web page
    elsewhere could aim at it."""

    model_name: str | None = None
    api_key: str | None = None
    max_concurrency: int = 1
    max_queue: int = 64
    max_prompt_tokens: int | None = None
    max_tokens_limit: int | None = None
    max_body_bytes: int = DEFAULT_BODY_BYTES
    cache_bytes: int = DEFAULT_CACHE_BYTES
    loopback_hosts_only: bool = False


@dataclass(frozen=True)
class ChatPrompt:
    """A rendered chat: its token ids, whether generation starts inside a think block, and where the
    conversation so far ends (before the generation prompt): the next turn of the chat starts with those tokens
    even when the template re-renders this turn's reply differently (e.g. without its thinking), so the state
    there is worth saving."""

    ids: list[int]
    thinking: bool
    checkpoints: tuple[int, ...] = ()


class ServerContext:
    """The model and everything built around it for one server."""

    def __init__(self, llm: LLM, options: ServeOptions, steer: Steer | None = None):
        self.llm = llm
        self.options = options
        self.model_name = options.model_name or Path(llm.path).name or "strata"
        self.context_length = llm.engine.max_context
        self.max_prompt_tokens = min(options.max_prompt_tokens or self.context_length - 1, self.context_length - 1)
        self.max_tokens_limit = options.max_tokens_limit or self.context_length
        self.created = int(time.time())
        self.metrics = Metrics()
        self.cache = PrefixCache(options.cache_bytes)
        self.scheduler = Scheduler(llm, self.cache, slots=options.max_concurrency, max_queue=options.max_queue,
                                   steer=steer, on_finish=self.metrics.record_job)

    # --- checks -----------------------------------------------------------------------------------------------

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise ApiError(404, f"model {name[:200]!r} does not exist; this server serves {self.model_name!r}",
                           code="model_not_found", param="model")

    def check_prompt(self, ids: Sequence[int]) -> None:
        if len(ids) > self.max_prompt_tokens:
            raise ApiError(400, f"the prompt has {len(ids)} tokens; this server accepts at most "
                                f"{self.max_prompt_tokens}", code="context_length_exceeded", param="messages")

    def max_tokens(self, requested: int | None, prompt_len: int, field: str = "max_tokens") -> int:
        """The token budget: as requested (checked against the server's cap) or, when absent, what the cap and
        the context leave."""
        if requested is None:
            return max(1, min(self.max_tokens_limit, self.context_length - prompt_len))
        if requested < 1:
            raise ApiError(400, f"{field} must be >= 1, got {requested}", param=field)
        if requested > self.max_tokens_limit:
            raise ApiError(400, f"{field} is {requested}; this server allows at most {self.max_tokens_limit}",
                           param=field)
        return requested

    def sampling(self, **fields: Any) -> SamplingParams:
        """SamplingParams from request fields (None: the default); a bad value is a 400 naming the field."""
        given = {k: v for k, v in fields.items() if v is not None}
        if "top_k" in given and given["top_k"] == -1:  # vLLM's spelling of "off"
            given["top_k"] = 0
        try:
            params = SamplingParams(**given)
        except StrataError as e:
            raise ApiError(400, str(e)) from None
        vocab = self.llm.engine.cfg.vocab_size
        bad = [i for i in params.logit_bias if i >= vocab]
        if bad:
            raise ApiError(400, f"logit_bias token id {bad[0]} is outside the vocabulary [0, {vocab})",
                           param="logit_bias")
        return params

    # --- prompts ----------------------------------------------------------------------------------------------

    def chat_prompt(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None,
                    template_kwargs: Mapping[str, Any]) -> ChatPrompt:
        """Render and encode a conversation; template errors (e.g. a role order it refuses) are 400s."""
        if self.llm.chat_template is None:
            raise ApiError(400, "this model has no chat template, so it cannot chat; use /v1/completions, or "
                                "start the server with --chat-template FILE")
        try:
            text = self.llm.chat_prompt(messages, tools=tools, **template_kwargs)
            try:
                bare = self.llm.chat_prompt(messages, tools=tools, add_generation_prompt=False, **template_kwargs)
            except StrataError:
                bare = None  # some templates refuse to end on a user turn without a generation prompt
            ids = self.llm.tokenizer.encode(text, add_special_tokens=False)
        except StrataError as e:
            raise ApiError(400, str(e)) from None
        if not ids:
            raise ApiError(400, "the conversation renders to an empty prompt")
        checkpoints: tuple[int, ...] = ()
        if bare is not None and text.startswith(bare):
            bare_ids = self.llm.tokenizer.encode(bare, add_special_tokens=False)
            if 0 < len(bare_ids) < len(ids) and ids[:len(bare_ids)] == bare_ids:
                checkpoints = (len(bare_ids),)
        return ChatPrompt(ids, generation_opens_think(text, bare), checkpoints)

    def template_reads(self, name: str, tools: Sequence[Any] | None) -> bool:
        template = self.llm.chat_template
        return template is not None and name in template.variables(tools)

    # --- running ----------------------------------------------------------------------------------------------

    def start_job(self, endpoint: str, prompt_ids: list[int], params: SamplingParams,
                  checkpoints: Sequence[int] = ()) -> Job:
        """Check the prompt, build the job (the sampler's and engine's own checks become 400s) and queue it."""
        self.check_prompt(prompt_ids)
        try:
            job = self.scheduler.create(endpoint, prompt_ids, params, checkpoints)
        except StrataError as e:
            raise ApiError(400, str(e)) from None
        self.scheduler.submit(job)
        return job

    async def result(self, request: Request, job: Job) -> JobResult:
        """Wait for a job's result; cancels it if the client disconnects first."""
        async with watch_disconnect(request, job):
            async for kind, payload in job.events():
                if kind == "done":
                    return payload
                if kind == "error":
                    raise payload
                if kind == "cancelled":
                    raise ApiError(503, "the request was cancelled: the server is shutting down")
        raise ApiError(500, "the generation ended without a result")


class watch_disconnect:  # noqa: N801  (used as `async with`, reads like a function)
    """While active, a task listens for the client's disconnect and cancels the job when it comes. The ASGI
    server reports a disconnect on `receive()` once the request body has been read, whether or not the response
    has started, so a queued job and a job still prefilling are cancelled as well as a streaming one."""

    def __init__(self, request: Request, job: Job):
        self.request = request
        self.job = job
        self.task: asyncio.Task[None] | None = None

    async def _listen(self) -> None:
        while True:
            message = await self.request.receive()
            if message["type"] == "http.disconnect":
                self.job.cancel()
                return

    async def __aenter__(self) -> watch_disconnect:
        self.task = asyncio.create_task(self._listen())
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if self.task is not None:
            self.task.cancel()
        if self.job.status not in ("done", "failed"):
            self.job.cancel()


def new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


async def sse_events(request: Request, job: Job) -> AsyncIterator[tuple[str, Any]]:
    """A job's events for a streaming response, cancelling the job when the response ends early (the client
    went away, or the stream was closed for any reason)."""
    async with watch_disconnect(request, job):
        async for event in job.events():
            yield event
