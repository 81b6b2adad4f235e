"""The web app in a real browser: headless Chromium (Debian's `chromium` package) driven by Playwright loads `/`,
completes one chat turn with the reply streamed in (its thinking collapsed), stops a long turn with the Stop
button, and shows live numbers in the monitor.

Needs `apt-get install -y chromium` and `pip install playwright` (Playwright's own browser download is not
used). Missing either is a failure, not a skip: CI must run this test.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator

import httpx
import pytest

from strata.api import LLM
from strata.serve.context import ServeOptions
from tests.test_serve_support import API_KEY, Running, chat_llm, serve  # noqa: F401  (fixture)

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run"]


def chromium_path() -> str:
    path = shutil.which("chromium") or "/usr/bin/chromium"
    if not os.access(path, os.X_OK):
        pytest.fail("Chromium is missing: the browser test needs Debian's chromium package "
                    "(apt-get install -y chromium)")
    return path


@pytest.fixture(scope="module")
def page_and_server(chat_llm: LLM) -> Iterator[tuple[object, Running]]:  # noqa: F811
    executable = chromium_path()
    try:
        from playwright.sync_api import expect, sync_playwright  # noqa: F401
    except ImportError:
        pytest.fail("the browser test needs the playwright package (pip install playwright)")
    with serve(chat_llm, ServeOptions(model_name="tiny", api_key=API_KEY)) as srv, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=executable, args=CHROMIUM_FLAGS, headless=True)
        try:
            page = browser.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            # The page runs under its Content-Security-Policy; a violation would show up here.
            page.on("console", lambda m: errors.append(m.text) if "Content Security Policy" in m.text else None)
            yield page, srv
            assert errors == [], errors
        finally:
            browser.close()


def test_one_chat_turn_then_stop_and_monitor(page_and_server: tuple[object, Running], chat_llm: LLM) -> None:  # noqa: F811
    from playwright.sync_api import expect

    page, srv = page_and_server
    page.goto(srv.url + "/")
    page.click("details.settings > summary")
    page.fill("#api-key", API_KEY)
    page.dispatch_event("#api-key", "change")
    expect(page.locator("#model")).to_have_text("tiny")

    with srv.script.text(chat_llm, "Let me see.\n</think>\n\nHello from strata!"):
        page.fill("#prompt", "Hi there")
        page.click("#send")
        page.wait_for_selector(".msg.assistant[data-state=done]", timeout=30_000)
    reply = page.locator(".msg.assistant").first
    assert reply.locator(".content").inner_text() == "Hello from strata!"
    thinking = reply.locator("details.thinking")
    assert thinking.is_visible() and thinking.get_attribute("open") is None  # shown, collapsed
    assert reply.locator(".thinking-text").text_content() == "Let me see."
    assert "reused" in reply.locator(".meta").inner_text()
    assert page.locator(".msg.user").first.inner_text() == "Hi there"

    # A long reply, stopped from the page: the server sees the client leave and cancels the generation.
    page.fill("#max-tokens", "3000")
    page.uncheck("#think")  # thinking off: the reply is plain text from the first token
    with srv.script.text(chat_llm, "word " * 1500):
        page.fill("#prompt", "Talk for a long time")
        page.click("#send")
        expect(page.locator(".msg.assistant").nth(1).locator(".content")).to_contain_text("word word word")
        page.click("#stop")
        page.wait_for_selector(".msg.assistant[data-state=stopped]", timeout=10_000)

    def cancelled() -> int:
        return httpx.get(srv.url + "/v1/status", headers={"x-api-key": API_KEY}).json()["queue"]["cancelled_total"]

    page.wait_for_timeout(50)
    for _ in range(200):
        if cancelled() == 1:
            break
        page.wait_for_timeout(50)
    assert cancelled() == 1

    # The monitor polls /v1/status every second.
    expect(page.locator("#m-decode")).to_contain_text("tok/s", timeout=10_000)
    assert "1/1" in page.inner_text("#m-queue") or "0/1" in page.inner_text("#m-queue")
    assert "cpu" in page.inner_text("#m-placement")
