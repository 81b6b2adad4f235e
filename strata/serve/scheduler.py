"""The request queue and the sequence slots that run generations.

Each slot is a worker thread that takes the next queued job and runs its `Generation` to the end. The engine
runs one sequence per call, so N slots mean N sequences decoding side by side (the model's math releases the GIL
in torch ops); the default of one slot serves requests in arrival order. Every job has its own `SequenceState`:
either a fresh one or a private clone of a saved state from the prefix cache, never one another job holds.

Cancellation: the API layer calls `Job.cancel()` when the client goes away. The job's engine adapter checks the
flag before each prefill chunk and each decode step, so a cancelled job stops within one forward pass and frees
its slot; a job cancelled while still queued is skipped.

Seam: `steer(job, step, logits) -> logits` may rewrite the logits of every step before sampling (step 0 is the
prompt's last position). The server never sets it; tests use it to script the model's choices (e.g. a tool
call from a model with random weights) while the engine, sampler, detokenizer and HTTP layers all run for real.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from strata.api import LLM
from strata.errors import StrataError
from strata.model.model import SequenceState
from strata.runtime.engine import Engine
from strata.runtime.graph import DeviceDraw
from strata.serve.cache import PrefixCache
from strata.serve.errors import ApiError
from strata.text.generate import Generation, Timings
from strata.text.sampling import SamplingParams

log = logging.getLogger("strata.serve")

PREFILL_CHUNK = 512

Steer = Callable[["Job", int, torch.Tensor], torch.Tensor]


class Cancelled(Exception):
    """Raised inside a worker when its job's client has gone away."""


@dataclass(frozen=True)
class JobResult:
    """What a finished job produced (the text is the detokenized, stop-trimmed text of the generation)."""

    text: str
    token_ids: list[int]
    prompt_tokens: int
    cached_tokens: int
    finish_reason: str
    stop_reason: int | str | None
    timings: Timings

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)


class _JobEngine:
    """The engine as one job sees it: cancellable between forward passes, saving the post-prompt state to the
    prefix cache, counting steps for the monitor, and passing logits through the optional steer hook. Everything
    else is the shared engine's."""

    def __init__(self, engine: Engine, job: Job, cache: PrefixCache, steer: Steer | None):
        self._engine = engine
        self._job = job
        self._cache = cache
        self._steer = steer
        self._step = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def _check(self) -> None:
        if self._job.cancel_event.is_set():
            raise Cancelled()

    def _steered(self, logits: torch.Tensor) -> torch.Tensor:
        step, self._step = self._step, self._step + 1
        return self._steer(self._job, step, logits) if self._steer is not None else logits

    def prefill(self, ids: Sequence[int], state: SequenceState, chunk_size: int = PREFILL_CHUNK,
                all_logits: bool = False) -> torch.Tensor:
        """Prefill in chunks, checking for cancellation between them and saving a copy of the state at each of
        the job's checkpoints (chunk boundaries do not change the result)."""
        ids = list(ids)
        base = len(state.tokens)
        cuts = {p - base for p in self._job.checkpoints if 0 < p - base < len(ids)}
        bounds = sorted(set(range(chunk_size, len(ids), chunk_size)) | cuts | {len(ids)})
        logits = None
        start = 0
        for end in bounds:
            self._check()
            logits = self._engine.prefill(ids[start:end], state, chunk_size)
            self._job.prefilled = end
            if end in cuts:
                self._cache.put_copy(state)
            start = end
        assert logits is not None, "Generation never prefills an empty prompt"
        self._job.first_token_at = time.monotonic()
        return self._steered(logits)

    def decode(self, token: int, state: SequenceState) -> torch.Tensor:
        self._check()
        logits = self._engine.decode(token, state)
        self._job.generated += 1
        return self._steered(logits)

    def decode_ahead(self, token: int, state: SequenceState, draw: DeviceDraw | None = None,
                     ) -> Iterator[int] | None:
        """The engine's ids decoded ahead (unless a steer hook needs the logits), counted, and cancellable
        before each next id is taken (the step for the id last taken is already running)."""
        if self._steer is not None:
            return None
        self._check()
        ids = self._engine.decode_ahead(token, state, draw)
        return None if ids is None else self._counted(ids)

    def _counted(self, ids: Iterator[int]) -> Iterator[int]:
        try:
            for nxt in ids:
                self._job.generated += 1
                self._step += 1
                yield nxt
                self._check()
        finally:
            ids.close()


class Job:
    """One request's generation, from queue to result. Events for the API layer arrive on an asyncio queue:
    ("start", cached_tokens), ("text", piece)..., then ("done", JobResult), ("error", ApiError) or
    ("cancelled", None)."""

    def __init__(self, scheduler: Scheduler, endpoint: str, prompt_ids: list[int], params: SamplingParams,
                 checkpoints: Sequence[int] = ()):
        self.id = uuid.uuid4().hex
        # Saved for reuse: the given points and the prompt less its last token. The latter is the longest state
        # a repeat of this exact prompt can continue (a continued state must leave at least one token to run).
        self.checkpoints = tuple(sorted({*checkpoints, len(prompt_ids) - 1}))
        self.endpoint = endpoint
        self.prompt_ids = prompt_ids
        self.params = params
        self.cancel_event = threading.Event()
        self.status = "new"
        self.created = time.monotonic()
        self.started: float | None = None
        self.first_token_at: float | None = None
        self.finished: float | None = None
        self.cached_tokens = 0
        self.prefilled = 0
        self.generated = 0
        self.result: JobResult | None = None
        self._engine = _JobEngine(scheduler.llm.engine, self, scheduler.cache, scheduler.steer)
        # Built now so that a request the sampler or the engine would refuse fails before it is queued.
        self.generation = Generation(self._engine, scheduler.llm.tokenizer, prompt_ids, params)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._events: asyncio.Queue[tuple[str, Any]] | None = None

    def cancel(self) -> None:
        """Ask the job to stop (thread-safe; takes effect before the next forward pass)."""
        self.cancel_event.set()

    @property
    def cancelled(self) -> bool:
        return self.cancel_event.is_set()

    def _bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._events = asyncio.Queue()

    def _emit(self, kind: str, payload: Any = None) -> None:
        """Hand an event to the API layer's event loop (called from the worker thread)."""
        loop, events = self._loop, self._events
        if loop is None or events is None:
            return
        try:
            loop.call_soon_threadsafe(events.put_nowait, (kind, payload))
        except RuntimeError:  # the event loop has closed: the server is shutting down
            pass

    async def events(self) -> AsyncIterator[tuple[str, Any]]:
        """The job's events until its last one (done, error or cancelled)."""
        assert self._events is not None, "submit the job first"
        while True:
            kind, payload = await self._events.get()
            yield kind, payload
            if kind in ("done", "error", "cancelled"):
                return

    def progress(self) -> dict[str, Any]:
        """A live view for /v1/status."""
        now = time.monotonic()
        decode_s = now - self.first_token_at if self.first_token_at is not None else 0.0
        return {"id": self.id, "endpoint": self.endpoint, "status": self.status,
                "prompt_tokens": len(self.prompt_ids), "cached_tokens": self.cached_tokens,
                "prefilled_tokens": self.prefilled, "generated_tokens": self.generated,
                "decode_tokens_per_s": self.generated / decode_s if self.generated and decode_s > 0 else None,
                "elapsed_s": now - (self.started or self.created)}


class Scheduler:
    """A bounded queue in front of `slots` worker threads. `on_finish(job)` is called (in the worker) for
    every job that ran, whatever its outcome, so metrics see cancellations and failures too."""

    def __init__(self, llm: LLM, cache: PrefixCache, *, slots: int = 1, max_queue: int = 64,
                 steer: Steer | None = None, on_finish: Callable[[Job], None] | None = None):
        if slots < 1:
            raise StrataError(f"the number of sequence slots must be >= 1, got {slots}")
        if max_queue < 0:
            raise StrataError(f"the queue length must be >= 0, got {max_queue}")
        self.llm = llm
        self.cache = cache
        self.slots = slots
        self.max_queue = max_queue
        self.steer = steer
        self.on_finish = on_finish
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self._waiting: list[Job] = []
        self._running: list[Job] = []
        self._threads: list[threading.Thread] = []
        self.cancelled_total = 0

    # --- lifecycle --------------------------------------------------------------------------------------------

    def start(self) -> None:
        if self._threads:
            return
        for i in range(self.slots):
            t = threading.Thread(target=self._worker, name=f"strata-slot-{i}", daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self) -> None:
        """Cancel everything and end the workers."""
        with self._lock:
            for job in [*self._waiting, *self._running]:
                job.cancel()
        for _ in self._threads:
            self._queue.put(None)
        for t in self._threads:
            t.join(timeout=30)
        self._threads.clear()

    # --- requests ---------------------------------------------------------------------------------------------

    def create(self, endpoint: str, prompt_ids: list[int], params: SamplingParams,
               checkpoints: Sequence[int] = ()) -> Job:
        """A job for this prompt; a StrataError here is the request's fault (400). `checkpoints`: prompt
        lengths after which the prefilled state is saved for reuse (besides the whole prompt)."""
        return Job(self, endpoint, prompt_ids, params, checkpoints)

    def submit(self, job: Job) -> None:
        """Queue `job`, or refuse with 503 when the queue is full. Call from the event loop that consumes it."""
        job._bind(asyncio.get_running_loop())
        with self._lock:
            if len(self._waiting) >= self.max_queue and len(self._running) >= self.slots:
                raise ApiError(503, f"the server is busy: {len(self._waiting)} requests are waiting; try again "
                                    "later", code="overloaded")
            job.status = "queued"
            self._waiting.append(job)
        self._queue.put(job)

    def queue_info(self) -> dict[str, Any]:
        with self._lock:
            return {"slots": self.slots, "busy": len(self._running), "waiting": len(self._waiting),
                    "max_waiting": self.max_queue, "cancelled_total": self.cancelled_total,
                    "running": [j.progress() for j in self._running]}

    # --- workers ----------------------------------------------------------------------------------------------

    def _worker(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            job = self._queue.get()
            if job is None:
                return
            with self._lock:
                self._waiting.remove(job)
                if job.cancelled:
                    job.status = "cancelled"
                    self.cancelled_total += 1
                else:
                    self._running.append(job)
            if job.status == "cancelled":
                job._emit("cancelled")
                continue
            try:
                self._run(job)
            finally:
                with self._lock:
                    self._running.remove(job)
                    if job.status == "cancelled":
                        self.cancelled_total += 1
                job.finished = time.monotonic()
                if self.on_finish is not None:
                    try:
                        self.on_finish(job)
                    except Exception:  # noqa: BLE001  (metrics must never take a slot down)
                        log.exception("on_finish failed for job %s", job.id)

    def _run(self, job: Job) -> None:
        job.status = "running"
        job.started = time.monotonic()
        gen = job.generation
        try:
            state = self.cache.lookup(job.prompt_ids)
            if state is not None:
                gen.state = state
                job.cached_tokens = len(state.tokens)
            job._emit("start", job.cached_tokens)
            for piece in gen:
                job._emit("text", piece)
            if gen.state is not None:
                self.cache.put(gen.state)
            job.result = JobResult(gen.text, list(gen.token_ids), len(job.prompt_ids), gen.timings.cached_tokens,
                                   gen.finish_reason or "length", gen.stop_reason, gen.timings)
            job.status = "done"
            job._emit("done", job.result)
        except Cancelled:
            job.status = "cancelled"
            job._emit("cancelled")
        except StrataError as e:
            job.status = "failed"
            job._emit("error", ApiError(400, str(e)))
        except Exception:  # noqa: BLE001  (reported to the client as a 500 without internals; logged here)
            log.exception("generation failed for job %s", job.id)
            job.status = "failed"
            job._emit("error", ApiError(500, "internal error while generating; see the server log"))
