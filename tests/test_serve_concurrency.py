"""Many clients at once, and clients that leave: every sequence keeps its own state, and a client that
disconnects frees its slot for the next request."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai

from strata.api import LLM
from strata.serve.context import ServeOptions
from strata.serve.tools import parse_output
from strata.text.sampling import SamplingParams
from tests.test_serve_support import Running, chat_llm, serve  # noqa: F401  (fixture)



def no_eos(llm: LLM) -> dict[str, int]:
    """A logit_bias that keeps the model from ending early, so a long generation stays long."""
    return {str(i): -100 for i in llm.tokenizer.eos_ids}


def wait_for(predicate, timeout: float = 10.0) -> bool:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def queue(srv: Running) -> dict:
    return httpx.get(srv.url + "/v1/status").json()["queue"]


def test_sixteen_clients_each_get_what_they_get_alone(chat_llm: LLM) -> None:  # noqa: F811
    prompts = [f"Client {i} asks: " + "why " * (i % 5) + chr(ord("a") + i) for i in range(16)]
    alone = [chat_llm.generate(p, SamplingParams(max_tokens=12, greedy=True)).text for p in prompts]
    chats = [[{"role": "user", "content": p}] for p in prompts]
    alone_chat = [parse_output(chat_llm.generate(chat_llm.chat_ids(m), SamplingParams(max_tokens=12, greedy=True))
                               .text).content for m in chats]
    with serve(chat_llm, ServeOptions(model_name="tiny", max_concurrency=4)) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        barrier = threading.Barrier(16)

        def one(i: int) -> str:
            barrier.wait()
            if i % 2:  # half complete text, half chat with streaming
                return client.completions.create(model="tiny", prompt=prompts[i], max_tokens=12,
                                                  temperature=0).choices[0].text
            stream = client.chat.completions.create(model="tiny", messages=chats[i], max_tokens=12, temperature=0,
                                                    stream=True)
            return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

        with ThreadPoolExecutor(16) as pool:
            got = list(pool.map(one, range(16)))
        expected = [alone_chat[i] if i % 2 == 0 else alone[i] for i in range(16)]
        assert got == expected
        status = httpx.get(srv.url + "/v1/status").json()
        assert status["totals"]["jobs"] == {"done": 16}
        assert status["queue"]["busy"] == 0 and status["queue"]["waiting"] == 0


def test_disconnects_cancel_and_free_the_slot(chat_llm: LLM) -> None:  # noqa: F811
    with serve(chat_llm, ServeOptions(model_name="tiny", max_concurrency=1)) as srv:
        long_request = {"model": "tiny", "prompt": "Go on and on", "max_tokens": 4000, "temperature": 0,
                        "logit_bias": no_eos(chat_llm), "stream": True}
        # A streaming client reads a little, then hangs up; a second one, queued behind it, hangs up first.
        with httpx.stream("POST", srv.url + "/v1/completions", json=long_request, timeout=30) as first:
            lines = first.iter_lines()
            assert next(lines).startswith("data: ")
            with httpx.Client(timeout=30) as other:
                queued = other.build_request("POST", srv.url + "/v1/completions", json=long_request)
                r = other.send(queued, stream=True)
                assert wait_for(lambda: queue(srv)["waiting"] == 1)
                r.close()
            assert wait_for(lambda: queue(srv)["cancelled_total"] == 0 and queue(srv)["busy"] == 1)
        # Both gone: the running one stops within a step, the queued one is skipped.
        assert wait_for(lambda: queue(srv)["cancelled_total"] == 2 and queue(srv)["busy"] == 0)
        last = httpx.get(srv.url + "/v1/status").json()["last_request"]
        assert last["status"] == "cancelled" and last["completion_tokens"] < 4000

        # A non-streaming client that gives up is cancelled too.
        def impatient() -> None:
            try:
                httpx.post(srv.url + "/v1/completions", json={**long_request, "stream": False}, timeout=0.5)
            except httpx.TimeoutException:
                pass

        t = threading.Thread(target=impatient)
        t.start()
        t.join()
        assert wait_for(lambda: queue(srv)["cancelled_total"] == 3 and queue(srv)["busy"] == 0)

        # The slot is free: the next request runs at once.
        t0 = time.monotonic()
        r = httpx.post(srv.url + "/v1/completions", json={"model": "tiny", "prompt": "Next", "max_tokens": 3},
                       timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        assert time.monotonic() - t0 < 5


def test_a_job_decoding_ahead_is_counted_and_cancellable() -> None:
    """A job's ids decoded ahead (`Engine.decode_ahead`) are counted as generated, a cancel stops them before the
    next id is taken (closing the engine's generator), and a steer hook, which needs the logits, gets none."""
    import pytest

    from strata.serve.scheduler import Cancelled, _JobEngine

    closed = []

    class Engine:
        def decode_ahead(self, token, state, draw=None):  # noqa: ANN001, ANN202
            def ids():
                try:
                    yield from range(token + 1, token + 100)
                finally:
                    closed.append(True)
            return ids()

    class Job:
        def __init__(self) -> None:
            self.cancel_event = threading.Event()
            self.generated = 0

    job = Job()
    ids = _JobEngine(Engine(), job, cache=None, steer=None).decode_ahead(10, state=None)
    assert [next(ids), next(ids), next(ids)] == [11, 12, 13] and job.generated == 3
    job.cancel_event.set()
    with pytest.raises(Cancelled):
        next(ids)
    assert closed == [True] and job.generated == 3
    assert _JobEngine(Engine(), Job(), cache=None, steer=lambda *a: None).decode_ahead(10, state=None) is None
