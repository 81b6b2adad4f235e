"""The generation loop, the Python API and the `strata generate` / `strata chat` commands."""

from __future__ import annotations

import importlib.util
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from strata import LLM, SamplingParams
from strata.cli.main import main
from strata.errors import StrataError
from strata.runtime.engine import DEFAULT_MODEL, Engine
from strata.runtime.graph import DecodeStep
from tests.conftest import FIXTURES

REPO = Path(__file__).resolve().parent.parent


def _load_qwen_style() -> str:
    """The Qwen-style test template, read from its test module by path (tests/ need not be a package)."""
    spec = importlib.util.spec_from_file_location("_strata_text_chat_tests", Path(__file__).with_name("test_text_chat.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.QWEN_STYLE


QWEN_STYLE = _load_qwen_style()


@pytest.fixture(scope="module")
def fixture_llm(fixtures_dir: Path) -> LLM:
    return LLM(fixtures_dir / "hf")


@pytest.fixture(scope="module")
def bundled() -> LLM:
    return LLM()


def _no_eos_flags() -> list[str]:
    """--logit-bias flags that ban the bundled model's EOS ids, so a generation runs to its token budget."""
    from strata.text.tokenizer import Tokenizer

    return [a for i in Tokenizer.from_dir(DEFAULT_MODEL).eos_ids for a in ("--logit-bias", f"{i}=-100")]


def _cli(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cli_greedy_matches_transformers(capsys: pytest.CaptureFixture, fixtures_dir: Path) -> None:
    prompt = json.loads((fixtures_dir / "prompt.json").read_text())["ids"]
    reference = json.loads((fixtures_dir / "transformers.greedy.json").read_text())
    margins = json.loads((fixtures_dir / "summary.json").read_text())["transformers"]["greedy_top1_top2_margin"]
    # Steps after the first near-tie (margin < 0.005) may legitimately differ between engines.
    n = next((i for i, m in enumerate(margins) if m < 0.005), len(margins))
    assert n > 0
    rc, out, _ = _cli(capsys, "generate", "--model", str(fixtures_dir / "hf"), "--ids", ",".join(map(str, prompt)),
                      "--max-tokens", "16", "--greedy", "--json")
    assert rc == 0
    result = json.loads(out)
    assert result["prompt_ids"] == prompt
    assert result["generated_ids"][:n] == reference[:n]
    assert result["finish_reason"] == "length" and len(result["generated_ids"]) == 16
    assert result["timings"]["prompt_tokens_per_s"] > 0 and result["timings"]["decode_tokens_per_s"] > 0
    assert isinstance(result["text"], str)


def test_strata_generate_hello_subprocess() -> None:
    """The installed `strata` entry point (beside this Python) with the bundled model."""
    script = Path(sys.executable).parent / "strata"
    cmd = [str(script)] if script.is_file() else [sys.executable, "-m", "strata.cli.main"]
    r = subprocess.run([*cmd, "generate", "Hello", "--max-tokens", "8"],
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    assert r.stdout.endswith("\n") and r.stderr == ""


def test_cli_generate_text_streams(capsys: pytest.CaptureFixture) -> None:
    # EOS banned, so the random-weight model cannot end before writing something.
    argv = ["generate", "Hello", "--seed", "1", "--max-tokens", "8", *_no_eos_flags()]
    rc, out, err = _cli(capsys, *argv, "-v")
    assert rc == 0 and out.endswith("\n") and out.strip() and "tok/s" in err
    assert _cli(capsys, *argv) == (0, out, "")


@pytest.mark.parametrize("argv,message", [
    (["--model", "/nonexistent/model", "hi"], "does not exist"),
    ([""], "empty prompt"),
    (["--max-tokens", "0", "hi"], "--max-tokens must be"),
    (["--ids", "1,2,100000"], "outside the vocabulary"),
    (["--ids", "1,x"], "comma-separated integers"),
    (["--top-p", "2", "hi"], "--top-p must be"),
    (["--logit-bias", "5", "hi"], "ID=BIAS"),
    (["--model", str(FIXTURES / "hf"), "--chat", "hi"], "no chat template"),
    (["--think", "on", "hi"], "need --chat"),
    (["--chat", "--ids", "1"], "--chat needs a text prompt"),
    (["--ids", "1", "hi"], "exactly one of"),
])
def test_cli_bad_input_is_a_clear_error(capsys: pytest.CaptureFixture, argv: list[str], message: str) -> None:
    rc, _, err = _cli(capsys, "generate", *argv)
    assert rc == 2 and message in err and "Traceback" not in err


def test_cli_template_that_fails_to_render(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    bad = tmp_path / "bad.jinja"
    bad.write_text("{{ raise_exception('this template refuses: ' + messages[0].content) }}")
    rc, _, err = _cli(capsys, "generate", "--chat", "--chat-template", str(bad), "hello")
    assert rc == 2 and "chat template failed to render: this template refuses: hello" in err
    bad.write_text("{% for %}")
    rc, _, err = _cli(capsys, "generate", "--chat", "--chat-template", str(bad), "hello")
    assert rc == 2 and "syntax error" in err


def test_cli_chat_flag_wraps_the_prompt(capsys: pytest.CaptureFixture, tmp_path: Path, bundled: LLM) -> None:
    t = tmp_path / "qwen.jinja"
    t.write_text(QWEN_STYLE)
    rc, out, _ = _cli(capsys, "generate", "--chat", "--chat-template", str(t), "--system", "Be brief.",
                      "--think", "off", "--max-tokens", "3", "--json", "Hi")
    assert rc == 0
    expected = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert json.loads(out)["prompt_ids"] == bundled.tokenizer.encode(expected, add_special_tokens=False)


def test_stop_strings_eos_and_length(fixture_llm: LLM, fixtures_dir: Path) -> None:
    prompt = json.loads((fixtures_dir / "prompt.json").read_text())["ids"]
    full = fixture_llm.generate(prompt, SamplingParams(max_tokens=16, greedy=True))
    assert full.finish_reason == "length" and len(full.token_ids) == 16
    assert full.usage.total_tokens == len(prompt) + 16
    text = full.text.replace("\ufffd", "")
    stop = text[len(text) // 2:len(text) // 2 + 3]
    cut = fixture_llm.generate(prompt, SamplingParams(max_tokens=16, greedy=True, stop=[stop]))
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == full.text[:full.text.find(stop)]
    assert cut.token_ids == full.token_ids[:len(cut.token_ids)]
    eos = fixture_llm.generate(prompt, SamplingParams(max_tokens=16, logit_bias={510: 100}))
    assert (eos.token_ids, eos.text, eos.finish_reason, eos.stop_reason) == ([510], "", "stop", 510)


def test_api_stream_equals_generate_and_seed_reproduces(bundled: LLM) -> None:
    p = SamplingParams(max_tokens=12, seed=42, temperature=0.9)
    c = bundled.generate("Hello", p)
    assert "".join(bundled.stream("Hello", p)) == c.text
    assert c.seed == 42 and bundled.generate("Hello", p).token_ids == c.token_ids
    assert bundled.generate("Hello", SamplingParams(max_tokens=12, seed=43, temperature=0.9)).token_ids != c.token_ids
    with pytest.raises(StrataError, match="empty prompt"):
        bundled.generate("")
    with pytest.raises(StrataError, match="empty prompt"):
        bundled.generate([])
    with pytest.raises(StrataError, match="outside the vocabulary"):
        bundled.generate([1, bundled.engine.cfg.vocab_size])


def test_api_chat_with_template(tmp_path: Path) -> None:
    t = tmp_path / "qwen.jinja"
    t.write_text(QWEN_STYLE)
    llm = LLM(chat_template=t)
    msgs = [{"role": "user", "content": "Hi"}]
    c = llm.chat(msgs, SamplingParams(max_tokens=4, greedy=True), enable_thinking=False)
    assert c.prompt_ids == llm.tokenizer.encode(llm.chat_prompt(msgs, enable_thinking=False), add_special_tokens=False)
    assert llm.chat_prompt(msgs, enable_thinking=False).endswith("<think>\n\n</think>\n\n")


def test_continuing_a_state_gives_the_same_tokens(fixture_llm: LLM, fixtures_dir: Path) -> None:
    """A chat turn continues the previous turn's state: the result equals prefilling the whole prompt."""
    prompt = json.loads((fixtures_dir / "prompt.json").read_text())["ids"]
    p = SamplingParams(max_tokens=6, greedy=True)
    first = fixture_llm.start(prompt[:40], p).run()
    # The state holds the prompt and every generated token but the last (that one was never fed).
    assert first.state.tokens == prompt[:40] + first.token_ids[:5]
    second_prompt = prompt[:40] + first.token_ids + prompt[40:]
    cont = fixture_llm.start(second_prompt, p, state=first.state).run()
    assert cont.timings.cached_tokens == 45 and cont.timings.prompt_tokens == len(second_prompt) - 45
    fresh = fixture_llm.start(second_prompt, p).run()
    assert cont.token_ids == fresh.token_ids
    # A state that is not a prefix of the prompt is not used.
    other = fixture_llm.start(prompt, p, state=fixture_llm.start(prompt[1:30], p).run().state).run()
    assert other.timings.cached_tokens == 0
    assert other.token_ids == fixture_llm.start(prompt, p).run().token_ids


def test_chat_repl(capsys: pytest.CaptureFixture, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    t = tmp_path / "qwen.jinja"
    t.write_text(QWEN_STYLE)
    calls = {"n": 0}
    real_decode = Engine.decode

    def decode_interrupted_once(self: Engine, token: int, state: object) -> object:
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real_decode(self, token, state)

    monkeypatch.setattr(Engine, "decode", decode_interrupted_once)
    lines = ["/help", "/think maybe", "/think off", "first question", "second question", "/reset", "/bogus",
             "third", "/exit", "never read"]
    script = "".join(f"{line}\n" for line in lines)
    monkeypatch.setattr(sys, "stdin", io.StringIO(script))
    rc, out, err = _cli(capsys, "chat", "--chat-template", str(t), "--max-tokens", "4", "--seed", "0",
                        *_no_eos_flags())
    assert rc == 0, err
    assert "/reset" in out and "(thinking off)" in out and "usage: /think on|off" in out
    assert "(stopped)" in out  # Ctrl-C ended the first answer, the session went on
    assert "(conversation cleared)" in out and "unknown command /bogus" in out
    assert calls["n"] == 3 + 3 + 3  # interrupted at the 3rd decode; two more answers of 4 tokens (3 decodes)


def test_chat_repl_eof_and_no_template(capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch,
                                       tmp_path: Path) -> None:
    t = tmp_path / "plain.jinja"
    t.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    monkeypatch.setattr(sys, "stdin", io.StringIO("/think on\nhello\n"))
    rc, out, _ = _cli(capsys, "chat", "--chat-template", str(t), "--max-tokens", "2")
    assert rc == 0 and "no enable_thinking switch" in out
    rc, _, err = _cli(capsys, "chat", "--model", str(FIXTURES / "hf"))
    assert rc == 2 and "no chat template" in err


def test_chat_without_a_template_is_refused(fixture_llm: LLM) -> None:
    with pytest.raises(StrataError, match="no chat template"):
        fixture_llm.chat([{"role": "user", "content": "hi"}])


def test_import_strata_is_cheap() -> None:
    code = "import sys, strata; assert 'torch' not in sys.modules; print(strata.SamplingParams.__name__)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO,
                       check=False)
    assert r.returncode == 0 and r.stdout.strip() == "SamplingParams", r.stderr


def test_generation_stops_at_the_context_length() -> None:
    llm = LLM()
    object.__setattr__(llm.engine.cfg, "max_position_embeddings", 10)  # this instance only
    no_eos = {i: -100.0 for i in llm.tokenizer.eos_ids}
    g = llm.start(list(range(1, 9)), SamplingParams(max_tokens=50, logit_bias=no_eos, seed=0)).run()
    # 8 prompt tokens + 2 fed generated tokens fill the 10 positions; the token predicted there is the last.
    assert (len(g.token_ids), g.finish_reason, g.state.length) == (3, "length", 10)
    with pytest.raises(StrataError, match="context is 10"):
        llm.generate(list(range(11)))


def test_greedy_choice_inside_the_static_step_equals_host_sampling(fixtures_dir: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """With a fixed-capacity state the greedy choice is the step's own argmax (only the id leaves the device);
    a request that needs the logits (a penalty) still samples them on the host. The host stages the PLE rows
    here, so the step splits at the first PLE layer and its front runs ahead, fed the previous choice on the
    device."""
    from strata.runtime import graph
    from tests import reference

    prompt = json.loads((fixtures_dir / "prompt.json").read_text())["ids"]
    host = LLM(fixtures_dir / "hf")
    static = LLM(fixtures_dir / "hf")
    static.engine = Engine.load(fixtures_dir / "hf", graphs=True, context=len(prompt) + 16)
    greedy = SamplingParams(max_tokens=12, greedy=True)
    want = host.generate(prompt, greedy).token_ids
    penalised = SamplingParams(max_tokens=6, greedy=True, repetition_penalty=1.3)
    want_penalised = host.generate(prompt, penalised).token_ids
    calls = reference.count_calls(monkeypatch, {"feed": (graph, "feed"), "first": (DecodeStep, "_run"),
                                                "logits": (DecodeStep, "step")})
    assert static.generate(prompt, greedy).token_ids == want
    # the first decode is staged by the host; the front of the step for each of the 11 ids after it was fed
    assert calls == {"feed": 11, "first": 1, "logits": 0}
    assert static.engine._decode_step(static.engine.new_state()).split is not None
    calls.update(dict.fromkeys(calls, 0))
    assert static.generate(prompt, penalised).token_ids == want_penalised
    assert calls["feed"] == 0 and calls["logits"] == 5


def test_generation_runs_ahead_where_the_step_feeds_itself(fixtures_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the captured step can advance its own inputs (here: the PLE tables as one tensor each on the model's
    device, as `--ple-table device` leaves them on a GPU), a greedy generation takes its ids from
    `DecodeStep.ids_ahead`: the same ids as the host path, and the state holds the last generated id too (the
    step that fed it ran while the host read it), so a chat's next turn still continues it."""
    import functools

    from strata.runtime import graph
    from tests import reference

    prompt = json.loads((fixtures_dir / "prompt.json").read_text())["ids"]
    host = LLM(fixtures_dir / "hf")
    ahead = LLM(fixtures_dir / "hf")
    ahead.engine = Engine.load(fixtures_dir / "hf", graphs=True, context=len(prompt) + 40)
    ahead.engine.model = reference.with_device_tables(ahead.engine.model)
    real_init = DecodeStep.__init__
    monkeypatch.setattr(DecodeStep, "__init__", functools.partialmethod(real_init, ple_gather=True))
    calls = reference.count_calls(monkeypatch, {"feed": (graph, "feed"), "one_by_one": (DecodeStep, "next_token_id")})
    greedy = SamplingParams(max_tokens=12, greedy=True)
    want = host.start(prompt, greedy).run()
    got = ahead.start(prompt, greedy).run()
    assert got.token_ids == want.token_ids and got.finish_reason == "length"
    # the first decode is staged by the host; each of the 11 ids after it was fed by a step run ahead
    assert calls == {"feed": 11, "one_by_one": 0}
    assert got.state.tokens == [*prompt, *got.token_ids] and want.state.tokens == [*prompt, *want.token_ids[:-1]]
    turn = [*got.state.tokens, 7, 8]
    again = ahead.start(turn, SamplingParams(max_tokens=3, greedy=True), state=got.state).run()
    assert again.timings.cached_tokens == len(turn) - 2 and again.token_ids == host.generate(
        turn, SamplingParams(max_tokens=3, greedy=True)).token_ids
    # at the context length: as many ids as the one-by-one step gives (the last one chosen at the last position)
    short = Engine.load(fixtures_dir / "hf", graphs=True, context=len(prompt) + 6)
    one_by_one = LLM(fixtures_dir / "hf")
    one_by_one.engine = short
    ahead.engine = Engine.load(fixtures_dir / "hf", graphs=True, context=len(prompt) + 6)
    ahead.engine.model = reference.with_device_tables(ahead.engine.model)
    many = SamplingParams(max_tokens=50, greedy=True)
    with monkeypatch.context() as m:
        m.setattr(DecodeStep, "__init__", functools.partialmethod(real_init, ple_gather=False, split=False))
        want_short = one_by_one.start(prompt, many).run()
    got_short = ahead.start(prompt, many).run()
    assert got_short.token_ids == want_short.token_ids and len(got_short.token_ids) == 7
    assert got_short.finish_reason == want_short.finish_reason == "length"
    assert got_short.state.length == len(prompt) + 6
