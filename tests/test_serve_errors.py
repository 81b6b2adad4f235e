"""Bad requests get the right 4xx with a JSON error object in the path's API shape, never a 5xx or a trace;
the CLI refuses to listen beyond loopback without a key."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from strata.api import LLM
from strata.cli.main import COMMANDS, main
from strata.cli.serve import check_bind
from strata.errors import StrataError
from strata.serve.context import ServeOptions
from tests.test_serve_support import API_KEY, Running, chat_llm, serve  # noqa: F401  (fixture)

AUTH = {"Authorization": f"Bearer {API_KEY}"}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
MESSAGES = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def srv(chat_llm: LLM) -> Iterator[Running]:  # noqa: F811
    options = ServeOptions(model_name="tiny", api_key=API_KEY, max_body_bytes=32 * 1024, max_prompt_tokens=200,
                           max_tokens_limit=4)
    with serve(chat_llm, options) as running:
        yield running


@pytest.fixture(scope="module")
def http(srv: Running) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=srv.url, headers=AUTH, timeout=30) as client:
        yield client


def openai_error(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"} and isinstance(body["error"]["message"], str)
    assert "Traceback" not in r.text
    return body["error"]


def anthropic_error(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
    return body["error"]


def test_api_key(srv: Running) -> None:
    url = srv.url + "/v1/chat/completions"
    assert "API key is required" in openai_error(httpx.post(url, json=CHAT), 401)["message"]
    assert openai_error(httpx.post(url, json=CHAT, headers={"Authorization": "Bearer wrong"}), 401)["code"] == \
        "invalid_api_key"
    assert httpx.post(url, json=CHAT, headers={"x-api-key": API_KEY}).status_code == 200
    assert httpx.post(url, json=CHAT, headers=AUTH).status_code == 200
    assert anthropic_error(httpx.post(srv.url + "/v1/messages", json=MESSAGES, headers={"x-api-key": "no"}),
                           401)["type"] == "authentication_error"
    openai_error(httpx.get(srv.url + "/v1/status"), 401)
    openai_error(httpx.get(srv.url + "/metrics"), 401)
    # the page and the liveness probe are public
    assert httpx.get(srv.url + "/health").json()["status"] == "ok"
    page = httpx.get(srv.url + "/")
    assert page.status_code == 200 and "<title>strata</title>" in page.text
    assert "default-src 'none'" in page.headers["content-security-policy"]


def test_invalid_json_and_wrong_types(http: httpx.Client) -> None:
    headers = {"Content-Type": "application/json"}
    assert "not valid JSON" in openai_error(http.post("/v1/chat/completions", content=b"{oops", headers=headers),
                                            400)["message"]
    openai_error(http.post("/v1/chat/completions", content=b"[1, 2]", headers=headers), 400)
    openai_error(http.post("/v1/chat/completions", content=b'{"temperature": NaN}', headers=headers), 400)
    openai_error(http.post("/v1/chat/completions", content=b"\xff\xfe", headers=headers), 400)
    anthropic_error(http.post("/v1/messages", content=b"{", headers=headers), 400)
    err = openai_error(http.post("/v1/chat/completions", json={**CHAT, "temperature": "hot"}), 400)
    assert err["param"] == "temperature" and "temperature" in err["message"]
    openai_error(http.post("/v1/chat/completions", json={**CHAT, "max_tokens": True}), 400)
    openai_error(http.post("/v1/chat/completions", json={**CHAT, "messages": "hi"}), 400)
    openai_error(http.post("/v1/chat/completions", json={**CHAT, "max_token": 3}), 400)  # a typo is not ignored
    openai_error(http.post("/v1/chat/completions", json={**CHAT, "seed": -1}), 400)
    openai_error(http.post("/v1/chat/completions", json={**CHAT, "logit_bias": {"999999": 1}}), 400)
    openai_error(http.post("/v1/completions", json={"model": "tiny", "prompt": ""}), 400)
    openai_error(http.post("/v1/completions", json={"model": "tiny", "prompt": [99999]}), 400)
    anthropic_error(http.post("/v1/messages", json={**MESSAGES, "max_tokens": "2"}), 400)
    anthropic_error(http.post("/v1/messages", json={**MESSAGES, "messages": [
        {"role": "user", "content": [{"type": "image", "source": {}}]}]}), 400)
    assert "Content-Type" in openai_error(http.post("/v1/completions", content=b"{}",
                                                    headers={"Content-Type": "text/plain"}), 415)["message"]


def test_unknown_model_routes_and_methods(http: httpx.Client) -> None:
    assert openai_error(http.post("/v1/chat/completions", json={**CHAT, "model": "gpt-x"}), 404)["code"] == \
        "model_not_found"
    openai_error(http.get("/v1/models/gpt-x"), 404)
    assert anthropic_error(http.post("/v1/messages", json={**MESSAGES, "model": "claude"}), 404)["type"] == \
        "not_found_error"
    openai_error(http.get("/v1/nothing-here"), 404)
    openai_error(http.get("/v1/chat/completions"), 405)


def test_limits(http: httpx.Client) -> None:
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * 40_000}]}
    openai_error(http.post("/v1/chat/completions", json=big), 413)
    anthropic_error(http.post("/v1/messages", json={**MESSAGES, "system": "y" * 40_000}), 413)

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit applies as the body streams in
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(40):
            yield b"z" * 1024
        yield b'"}'

    openai_error(http.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"}), 413)
    long_prompt = {**CHAT, "messages": [{"role": "user", "content": "word " * 300}]}
    assert openai_error(http.post("/v1/chat/completions", json=long_prompt), 400)["code"] == \
        "context_length_exceeded"
    assert "at most 4" in openai_error(http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 5}),
                                       400)["message"]
    openai_error(http.post("/v1/chat/completions", json={**CHAT, "n": 3}), 400)
    anthropic_error(http.post("/v1/messages", json={**MESSAGES, "max_tokens": 0}), 400)


def test_foreign_host_header_is_refused_on_a_keyless_loopback_server(chat_llm: LLM) -> None:  # noqa: F811
    with serve(chat_llm, ServeOptions(model_name="tiny", loopback_hosts_only=True)) as running:
        assert httpx.get(running.url + "/v1/models").status_code == 200
        assert httpx.get(running.url + "/v1/models", headers={"Host": "localhost:1"}).status_code == 200
        openai_error(httpx.get(running.url + "/v1/models", headers={"Host": "evil.example:80"}), 403)


# --- property-based fuzz of the request schemas ----------------------------------------------------------------

json_scalars = st.none() | st.booleans() | st.integers(-2**70, 2**70) | \
    st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12)
junk = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=3) |
                    st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=8)


def mostly(valid: st.SearchStrategy) -> st.SearchStrategy:
    """Valid values eleven times in twelve, anything JSON otherwise: requests get past validation often enough to
    reach the template, the sampler and the engine."""
    return st.sampled_from(range(12)).flatmap(lambda i: junk if i == 7 else valid)


text = st.text(max_size=30)
tool = st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": st.sampled_from(["get_weather", "x", "bad name!"])},
    optional={"parameters": st.just({"type": "object", "properties": {"city": {"type": "string"}}}),
              "description": text})})
openai_message = st.fixed_dictionaries(
    {"role": mostly(st.sampled_from(["system", "developer", "user", "assistant", "tool"])),
     "content": mostly(text | st.none() | st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image"]),
                                                                          "text": text}), max_size=2))},
    optional={"tool_call_id": mostly(text), "reasoning_content": mostly(text),
              "tool_calls": mostly(st.lists(st.fixed_dictionaries(
                  {"id": text, "type": st.just("function"),
                   "function": st.fixed_dictionaries({"name": text, "arguments": st.sampled_from(
                       ['{"city": "Paris"}', "{}", "not json", "[1]"])})}), max_size=2))})
anthropic_block = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": mostly(text)}),
    st.fixed_dictionaries({"type": st.just("thinking"), "thinking": mostly(text)}, optional={"signature": text}),
    st.fixed_dictionaries({"type": st.just("tool_use"), "id": mostly(text), "name": mostly(text),
                           "input": mostly(st.dictionaries(text, json_scalars, max_size=2))}),
    st.fixed_dictionaries({"type": st.just("tool_result"), "tool_use_id": mostly(text)},
                          optional={"content": mostly(text | st.lists(st.fixed_dictionaries(
                              {"type": st.just("text"), "text": text}), max_size=2)), "is_error": st.booleans()}),
    st.fixed_dictionaries({"type": st.sampled_from(["image", "document", "x"])}))
anthropic_message = st.fixed_dictionaries({"role": mostly(st.sampled_from(["user", "assistant"])),
                                           "content": mostly(text | st.lists(anthropic_block, min_size=1,
                                                                             max_size=3))})
sampling = {"temperature": mostly(st.floats(0, 2)), "top_p": mostly(st.floats(0, 1)),
            "top_k": mostly(st.integers(-2, 50)), "seed": mostly(st.integers(-5, 2**64)),
            "stop": mostly(text | st.lists(st.text(max_size=4), max_size=3)),
            "logit_bias": mostly(st.dictionaries(st.integers(-5, 600).map(str), st.floats(-200, 200), max_size=3)),
            "max_tokens": mostly(st.integers(0, 5)), "stream": mostly(st.booleans()),
            "n": mostly(st.integers(1, 2)), "presence_penalty": mostly(st.floats(-2.5, 2.5)),
            "repetition_penalty": mostly(st.floats(0, 3)), "min_p": mostly(st.floats(0, 1.5)),
}
model = mostly(st.sampled_from(["tiny", "tiny", "tiny", "other"]))

chat_bodies = st.fixed_dictionaries(
    {"model": model, "messages": mostly(st.lists(openai_message, min_size=1, max_size=3))},
    optional={**sampling, "tools": mostly(st.lists(tool, max_size=2)),
              "tool_choice": mostly(st.sampled_from(["auto", "none", "required"])),
              "reasoning_effort": mostly(st.sampled_from(["none", "low", "high", "extreme"])),
              "chat_template_kwargs": mostly(st.dictionaries(st.sampled_from(["enable_thinking", "x"]), json_scalars,
                                                             max_size=2)),
              "stream_options": mostly(st.fixed_dictionaries({"include_usage": st.booleans()}))})
completion_bodies = st.fixed_dictionaries(
    {"model": model, "prompt": mostly(text | st.lists(st.integers(-3, 600), max_size=5) | st.lists(text, max_size=2))},
    optional={**sampling, "echo": mostly(st.booleans()), "suffix": mostly(text)})
message_bodies = st.fixed_dictionaries(
    {"model": model, "max_tokens": mostly(st.integers(-1, 6)),
     "messages": mostly(st.lists(anthropic_message, min_size=1, max_size=3))},
    optional={"system": mostly(text), "stream": mostly(st.booleans()),
              "thinking": mostly(st.fixed_dictionaries({"type": st.sampled_from(["enabled", "disabled", "adaptive"])},
                                                       optional={"budget_tokens": st.integers(-1, 2000)})),
              "stop_sequences": mostly(st.lists(st.text(max_size=4), max_size=2)),
              "tools": mostly(st.lists(st.fixed_dictionaries({"name": st.sampled_from(["get_weather", "bad name"]),
                                                              "input_schema": st.just({"type": "object"})}),
                                       max_size=2)),
              "tool_choice": mostly(st.fixed_dictionaries({"type": st.sampled_from(["auto", "any", "none"])})),
              "temperature": mostly(st.floats(0, 1)), "top_k": mostly(st.integers(0, 10))})
requests = st.one_of(st.tuples(st.just("/v1/chat/completions"), chat_bodies),
                     st.tuples(st.just("/v1/completions"), completion_bodies),
                     st.tuples(st.just("/v1/messages"), message_bodies))


@settings(max_examples=400, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(request=requests)
def test_fuzzed_requests_never_get_a_5xx(http: httpx.Client, request: tuple[str, dict]) -> None:
    path, body = request
    r = http.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})
    assert r.status_code < 500, (path, body, r.text)
    if r.status_code >= 400:
        (anthropic_error if path == "/v1/messages" else openai_error)(r, r.status_code)
    elif body.get("stream") is True:
        assert "data: " in r.text  # a stream that started may still carry an error event, but never a 5xx


# --- the command line -------------------------------------------------------------------------------------------

def test_cli_refuses_non_loopback_without_a_key(capsys: pytest.CaptureFixture[str], tmp_path) -> None:  # noqa: ANN001
    assert COMMANDS["serve"] == "serve"
    assert main(["serve", "--host", "0.0.0.0"]) == 2
    assert "without an API key" in capsys.readouterr().err
    empty = tmp_path / "key"
    empty.write_text("\n")
    assert main(["serve", "--host", "0.0.0.0", "--api-key-file", str(empty)]) == 2
    assert "is empty" in capsys.readouterr().err
    for host in ("127.0.0.1", "localhost", "::1", "127.0.0.2"):
        check_bind(host, None)
    check_bind("0.0.0.0", "secret")
    with pytest.raises(StrataError):
        check_bind("192.168.1.10", None)
    with pytest.raises(StrataError):
        check_bind("example.org", "")
