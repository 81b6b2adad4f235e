"""`strata perplexity` on the bundled default model: the reported PPL is exp(mean NLL) of every next-token
prediction in non-overlapping windows, the KL of a run against itself is exactly 0, a bfloat16 run differs from
float32 by a small but non-zero KL, and bad input is refused with a message instead of a traceback."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from strata.cli.main import main
from strata.runtime.engine import DEFAULT_MODEL, Engine
from strata.runtime.evaluate import Reference

TEXT = '''def fibonacci(n):
    """Return the n-th Fibonacci number."""
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        if not self.items:
            raise IndexError("pop from an empty stack")
        return self.items.pop()
'''
CTX = 40  # the text is not a multiple of it, so the last window is a partial one


def run_cli(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str, str]:
    rc = main(["perplexity", *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def run_json(capsys: pytest.CaptureFixture, *args: str) -> dict:
    rc, out, err = run_cli(capsys, *args, "--json")
    assert rc == 0, err
    return json.loads(out)


@pytest.fixture(scope="module")
def text_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("ppl") / "text.py"
    path.write_text(TEXT)
    return path


def test_perplexity_is_exp_mean_nll(capsys: pytest.CaptureFixture, text_file: Path) -> None:
    got = run_json(capsys, "--text-file", str(text_file), "--ctx", str(CTX))

    ids = Tokenizer.from_file(str(DEFAULT_MODEL / "tokenizer.json")).encode(TEXT, add_special_tokens=False).ids
    assert len(ids) % CTX >= 2, "the test text should end in a partial window"
    engine = Engine.load(None, "float32")
    nll = []
    for s in range(0, len(ids), CTX):
        w = ids[s:s + CTX]
        logp = engine.prefill(w, engine.new_state(), all_logits=True).double().log_softmax(-1)
        nll += [-float(logp[i, w[i + 1]]) for i in range(len(w) - 1)]
    assert got["tokens"] == len(ids)
    assert got["scored"] == len(nll) == len(ids) - math.ceil(len(ids) / CTX)
    assert got["windows"] == math.ceil(len(ids) / CTX)
    assert got["ppl"] == pytest.approx(math.exp(sum(nll) / len(nll)), rel=1e-6)
    assert got["mean_nll"] == pytest.approx(sum(nll) / len(nll), rel=1e-6)


def test_max_tokens_truncates(capsys: pytest.CaptureFixture, text_file: Path) -> None:
    got = run_json(capsys, "--text-file", str(text_file), "--ctx", "16", "--max-tokens", "33")
    assert (got["tokens"], got["windows"], got["scored"]) == (33, 2, 15 + 15)  # token 33 is a lone window


def test_text_report_reads_like_llama_cpp(capsys: pytest.CaptureFixture, text_file: Path) -> None:
    rc, out, _ = run_cli(capsys, "--text-file", str(text_file), "--ctx", str(CTX))
    assert rc == 0
    assert "[1]" in out and "Final estimate: PPL = " in out


def test_kl_against_itself_is_zero(capsys: pytest.CaptureFixture, text_file: Path, tmp_path: Path) -> None:
    base = tmp_path / "base.npz"
    first = run_json(capsys, "--text-file", str(text_file), "--ctx", str(CTX), "--save-logits", str(base))
    ref = Reference.load(base)
    assert ref.topk == min(64, Engine.load(None).cfg.vocab_size)
    assert ref.nll.shape[0] == first["scored"]
    again = run_json(capsys, "--text-file", str(text_file), "--kl-base", str(base))
    kl = again["kl"]
    assert again["ctx"] == CTX  # taken from the base
    assert kl["mean"] == 0.0 and kl["max"] == 0.0
    assert kl["top1_agreement"] == 1.0
    assert kl["base_ppl"] == pytest.approx(first["ppl"], rel=1e-12)
    assert again["ppl"] == pytest.approx(first["ppl"], rel=1e-12)


def test_bfloat16_kl_is_small_but_not_zero(capsys: pytest.CaptureFixture, text_file: Path, tmp_path: Path) -> None:
    base = tmp_path / "f32.npz"
    run_json(capsys, "--text-file", str(text_file), "--ctx", str(CTX), "--save-logits", str(base),
             "--kl-topk", "1000000")  # more than the vocabulary: full distributions, exact KL
    got = run_json(capsys, "--text-file", str(text_file), "--kl-base", str(base), "--dtype", "bfloat16")
    kl = got["kl"]
    assert kl["exact"]
    assert 0.0 < kl["mean"] < 0.05
    assert kl["max"] < 1.0
    assert kl["top1_agreement"] >= 0.8
    assert abs(kl["ln_ppl_ratio"]) < 0.05


def test_kl_matches_full_distribution_formula(capsys: pytest.CaptureFixture, text_file: Path,
                                              tmp_path: Path) -> None:
    """With full distributions stored, the reported KL is Σ p (log p − log q) computed here directly."""
    base = tmp_path / "full.npz"
    run_json(capsys, "--text-file", str(text_file), "--ctx", str(CTX), "--max-tokens", str(CTX),
             "--save-logits", str(base), "--kl-topk", "1000000")
    got = run_json(capsys, "--text-file", str(text_file), "--kl-base", str(base), "--max-tokens", str(CTX),
                   "--dtype", "bfloat16")
    ids = Reference.load(base).ids.tolist()
    engine32, engine16 = Engine.load(None, "float32"), Engine.load(None, "bfloat16")
    p = engine32.prefill(ids, engine32.new_state(), all_logits=True)
    q = engine16.prefill(ids, engine16.new_state(), all_logits=True)
    lp, lq = p[:-1].double().log_softmax(-1), q[:-1].double().log_softmax(-1)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    assert got["kl"]["mean"] == pytest.approx(float(kl.mean()), rel=1e-6)
    assert got["kl"]["max"] == pytest.approx(float(kl.max()), rel=1e-6)


@pytest.mark.parametrize("case", ["missing file", "empty text", "one token", "ctx 1", "max tokens 1"])
def test_bad_input_is_refused(capsys: pytest.CaptureFixture, tmp_path: Path, text_file: Path, case: str) -> None:
    path = tmp_path / "t.txt"
    args = ["--text-file", str(path)]
    expect = {"missing file": "cannot read", "empty text": "holds no text", "one token": "at least 2",
              "ctx 1": "--ctx must be at least 2", "max tokens 1": "--max-tokens must be at least 2"}[case]
    if case == "empty text":
        path.write_text(" \n")
    elif case == "one token":
        path.write_text("a")
    elif case in ("ctx 1", "max tokens 1"):
        args = ["--text-file", str(text_file), "--ctx" if case == "ctx 1" else "--max-tokens", "1"]
    rc, _, err = run_cli(capsys, *args)
    assert rc == 2
    assert expect in err
    assert "Traceback" not in err


def test_base_from_other_tokens_is_refused(capsys: pytest.CaptureFixture, text_file: Path, tmp_path: Path) -> None:
    base = tmp_path / "base.npz"
    run_json(capsys, "--text-file", str(text_file), "--ctx", str(CTX), "--save-logits", str(base))
    rc, _, err = run_cli(capsys, "--text-file", str(text_file), "--kl-base", str(base), "--max-tokens", "20")
    assert rc == 2 and "other tokens" in err
    rc, _, err = run_cli(capsys, "--text-file", str(text_file), "--kl-base", str(base), "--ctx", "20")
    assert rc == 2 and "--ctx" in err
    not_npz = tmp_path / "x.npz"
    np.savez(not_npz, a=np.zeros(2))
    rc, _, err = run_cli(capsys, "--text-file", str(text_file), "--kl-base", str(not_npz))
    assert rc == 2 and "not a logits file" in err


def test_single_token_windows_are_not_scored() -> None:
    from strata.runtime.evaluate import windows

    assert windows(9, 4) == [(0, 4), (4, 8)]  # the lone 9th token predicts nothing
    assert windows(10, 4) == [(0, 4), (4, 8), (8, 10)]
