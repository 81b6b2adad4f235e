"""Counters, the /v1/status report and the /metrics Prometheus text.

Written by hand rather than with prometheus_client: a dozen series do not justify a dependency, and the text
format is simple (https://prometheus.io/docs/instrumenting/exposition_formats/).
"""

from __future__ import annotations

import os
import threading
import time
from collections import defaultdict
from typing import TYPE_CHECKING, Any

import torch

from strata.runtime.engine import Engine
from strata.weights.tensor import iter_leaves

if TYPE_CHECKING:
    from strata.serve.scheduler import Job

# Endpoints counted under their own label; anything else is "other", so a scan of random paths cannot grow the
# number of series without bound.
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/models", "/v1/status", "/health",
             "/metrics", "/")


def process_rss_bytes() -> int | None:
    """Resident memory of this process (Linux /proc; None elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def weight_placement(engine: Engine) -> dict[str, int]:
    """Stored weight bytes by the device they live on."""
    out: dict[str, int] = defaultdict(int)
    for t in engine.weights.tensors.values():
        for leaf in iter_leaves(t):
            device = next((str(v.device) for v in vars(leaf).values() if isinstance(v, torch.Tensor)), "file")
            out[device] += leaf.nbytes
    return dict(out)


def memory_info(engine: Engine) -> dict[str, Any]:
    info: dict[str, Any] = {"process_rss_bytes": process_rss_bytes()}
    if engine.device.type == "cuda" and torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info(engine.device)
        info.update({"cuda_allocated_bytes": torch.cuda.memory_allocated(engine.device),
                     "cuda_reserved_bytes": torch.cuda.memory_reserved(engine.device),
                     "cuda_free_bytes": free, "cuda_total_bytes": total})
    return info


def geometry(engine: Engine) -> dict[str, Any]:
    cfg = engine.cfg
    n_gdn = sum(cfg.is_linear(i) for i in range(cfg.num_hidden_layers))
    return {"layers": cfg.num_hidden_layers, "gdn_layers": n_gdn, "qsa_layers": cfg.num_hidden_layers - n_gdn,
            "hidden": cfg.hidden_size, "vocab": cfg.vocab_size, "context": cfg.max_position_embeddings,
            "experts": cfg.num_experts, "experts_per_token": cfg.num_experts_per_tok}


class Metrics:
    """Request and token counters plus the last finished request's numbers. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.started = time.time()
        self.requests: dict[tuple[str, int], int] = defaultdict(int)
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.generated_tokens = 0
        self.jobs: dict[str, int] = defaultdict(int)  # by outcome
        self.prompt_seconds = 0.0
        self.decode_seconds = 0.0
        self.last: dict[str, Any] | None = None

    def count_request(self, path: str, status: int) -> None:
        endpoint = path if path in ENDPOINTS else "other"
        with self._lock:
            self.requests[(endpoint, status)] += 1

    def record_job(self, job: Job) -> None:
        """Called by the scheduler when a job ends (done, cancelled or failed)."""
        gen = job.generation
        t = gen.timings
        decode_n, decode_s = t.decode_tokens, t.decode_seconds
        if job.status != "done" and job.first_token_at is not None:
            # Generation fills in its decode timing only when it ends normally; measure a stopped one here.
            decode_n, decode_s = job.generated, (job.finished or time.monotonic()) - job.first_token_at
        last = {"id": job.id, "endpoint": job.endpoint, "status": job.status,
                "prompt_tokens": len(job.prompt_ids), "cached_tokens": t.cached_tokens,
                "prefilled_tokens": t.prompt_tokens, "completion_tokens": len(gen.token_ids),
                "prompt_seconds": t.prompt_seconds, "prompt_tokens_per_s": t.prompt_tokens_per_s,
                "decode_seconds": decode_s,
                "decode_tokens_per_s": decode_n / decode_s if decode_n and decode_s > 0 else None,
                "queue_seconds": (job.started or job.created) - job.created,
                "total_seconds": (job.finished or time.monotonic()) - job.created,
                "finish_reason": gen.finish_reason}
        with self._lock:
            self.jobs[job.status] += 1
            self.prompt_tokens += len(job.prompt_ids)
            self.cached_tokens += t.cached_tokens
            self.generated_tokens += len(gen.token_ids)
            self.prompt_seconds += t.prompt_seconds
            self.decode_seconds += decode_s
            self.last = last

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {"uptime_s": time.time() - self.started,
                    "requests": sum(self.requests.values()),
                    "jobs": dict(self.jobs), "prompt_tokens": self.prompt_tokens,
                    "cached_tokens": self.cached_tokens, "generated_tokens": self.generated_tokens,
                    "last_request": dict(self.last) if self.last else None}

    def prometheus(self, queue: dict[str, Any], cache: dict[str, int], memory: dict[str, Any]) -> str:
        """The Prometheus text exposition of every series."""
        lines: list[str] = []

        def series(name: str, kind: str, help_: str, samples: list[tuple[str, float | int | None]]) -> None:
            lines.append(f"# HELP {name} {help_}")
            lines.append(f"# TYPE {name} {kind}")
            for labels, value in samples:
                if value is not None:
                    lines.append(f"{name}{labels} {float(value):.9g}" if isinstance(value, float)
                                 else f"{name}{labels} {value}")

        with self._lock:
            reqs = sorted(self.requests.items())
            jobs = sorted(self.jobs.items())
            last = dict(self.last) if self.last else {}
            totals = (self.prompt_tokens, self.cached_tokens, self.generated_tokens, self.prompt_seconds,
                      self.decode_seconds)
        series("strata_requests_total", "counter", "HTTP requests answered, by endpoint and status.",
               [(f'{{endpoint="{e}",status="{s}"}}', n) for (e, s), n in reqs])
        series("strata_generations_total", "counter", "Generations that ended, by outcome.",
               [(f'{{outcome="{o}"}}', n) for o, n in jobs])
        series("strata_prompt_tokens_total", "counter", "Prompt tokens of finished generations.", [("", totals[0])])
        series("strata_prompt_tokens_cached_total", "counter",
               "Prompt tokens reused from saved conversation states (not prefilled).", [("", totals[1])])
        series("strata_generation_tokens_total", "counter", "Tokens generated.", [("", totals[2])])
        series("strata_prompt_seconds_total", "counter", "Seconds spent in prefill.", [("", totals[3])])
        series("strata_decode_seconds_total", "counter", "Seconds spent decoding.", [("", totals[4])])
        series("strata_last_prompt_tokens_per_second", "gauge", "Prefill speed of the last generation.",
               [("", last.get("prompt_tokens_per_s"))])
        series("strata_last_decode_tokens_per_second", "gauge", "Decode speed of the last generation.",
               [("", last.get("decode_tokens_per_s"))])
        series("strata_queue_waiting", "gauge", "Requests waiting for a slot.", [("", queue["waiting"])])
        series("strata_slots_busy", "gauge", "Sequence slots generating now.", [("", queue["busy"])])
        series("strata_slots", "gauge", "Sequence slots.", [("", queue["slots"])])
        series("strata_cache_entries", "gauge", "Saved conversation states.", [("", cache["entries"])])
        series("strata_cache_bytes", "gauge", "Bytes held by saved conversation states.", [("", cache["bytes"])])
        series("strata_process_resident_bytes", "gauge", "Resident memory of the server process.",
               [("", memory.get("process_rss_bytes"))])
        series("strata_cuda_allocated_bytes", "gauge", "CUDA memory allocated by torch.",
               [("", memory.get("cuda_allocated_bytes"))])
        return "\n".join(lines) + "\n"
