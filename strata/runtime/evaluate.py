"""Perplexity and KL divergence over a text: the numbers that say what a dtype, a quantisation or a kernel
change costs in quality.

Perplexity follows llama.cpp's perplexity tool in spirit: the token stream is cut into consecutive,
non-overlapping windows of `ctx` tokens, each window is a fresh sequence, and PPL = exp(mean NLL). Two choices
differ and are stated so numbers are not compared across tools by mistake: every prediction in a window is
scored (llama.cpp scores only the second half), and a last partial window is kept when it has >= 2 tokens
(llama.cpp drops it), so every token of a short text counts.

KL divergence needs the reference run's distributions. Storing full logits costs 4·V bytes per token (400 MB
for 25k tokens at V = 4096), so a reference keeps, per scored position, the top-K log-probabilities and their
ids (K = min(--kl-topk, V); K = V stores the full distribution and the KL is exact) and the log of the mass
outside them. The KL of a later run is computed over those K tokens plus one bucket holding the rest of the
mass of each side:

    KL ≈ Σ_{i in top-K(base)} p_i (log p_i − log q_i) + r_p (log r_p − log r_q),   r = mass outside the top-K

which is exact when the base's top-K holds all its mass and otherwise a lower bound of the full KL (the
log-sum inequality). Log-probabilities are taken in float64 from the engine's float32 logits and the rest
masses as log-sum-exps (not 1 − Σ, whose rounding noise would swamp the tiny KLs of a dtype change); a run
against itself gives exactly 0.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from strata.errors import StrataError

DEFAULT_CTX = 512
DEFAULT_KL_TOPK = 64
REFERENCE_FORMAT = "strata-logits-v1"


# ---------------------------------------------------------------------------------------------- input

def find_tokenizer(model_path: str | Path, tokenizer: str | Path | None = None) -> Path:
    """The tokenizer.json to use: the explicit one, else the one in the model folder (or beside a model file)."""
    if tokenizer is not None:
        path = Path(tokenizer)
    else:
        model_path = Path(model_path)
        path = (model_path if model_path.is_dir() else model_path.parent) / "tokenizer.json"
    if not path.is_file():
        raise StrataError(f"no tokenizer at {path}; pass --tokenizer PATH/tokenizer.json")
    return path


def read_text(path: str | Path) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise StrataError(f"cannot read {path}: no such file") from None
    except UnicodeDecodeError as e:
        raise StrataError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise StrataError(f"cannot read {path}: {e.strerror}") from None


def tokenize(tokenizer_path: str | Path, text: str) -> list[int]:
    """Token ids of `text` with the model's own tokenizer.json (no special tokens added; special-token
    strings in the text are recognised as those tokens, as the tokenizer defines)."""
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_file(str(tokenizer_path))
    except Exception as e:  # noqa: BLE001 -- tokenizers raises a bare Exception for a malformed file
        raise StrataError(f"cannot load tokenizer {tokenizer_path}: {e}") from None
    return tok.encode(text, add_special_tokens=False).ids


def windows(n_tokens: int, ctx: int) -> list[tuple[int, int]]:
    """[start, end) of consecutive windows of `ctx` tokens; a last partial window needs >= 2 tokens."""
    if ctx < 2:
        raise StrataError(f"the context must be at least 2 tokens, got {ctx}")
    out = [(s, min(s + ctx, n_tokens)) for s in range(0, n_tokens, ctx)]
    return [(s, e) for s, e in out if e - s >= 2]


# ---------------------------------------------------------------------------------------------- reference

@dataclass
class Reference:
    """What `--save-logits` stores: the tokens, the windowing, and per scored position the base run's top-K
    log-probabilities (sorted, largest first), their ids, its argmax and its NLL of the actual next token."""

    ids: np.ndarray  # (N,) int64, every token of the evaluated text
    ctx: int
    topk_ids: np.ndarray  # (M, K) int32
    topk_logprobs: np.ndarray  # (M, K) float64
    rest_logprob: np.ndarray  # (M,) float64, log of the probability outside the top-K (-inf when K = V)
    argmax: np.ndarray  # (M,) int32
    nll: np.ndarray  # (M,) float64
    vocab_size: int
    meta: dict = field(default_factory=dict)

    @property
    def topk(self) -> int:
        return int(self.topk_ids.shape[1])

    @property
    def ppl(self) -> float:
        return math.exp(float(self.nll.mean()))

    def save(self, path: str | Path) -> None:
        try:
            with open(path, "wb") as f:
                np.savez_compressed(
                    f, format=np.array(REFERENCE_FORMAT), ids=self.ids.astype(np.int64), ctx=np.array(self.ctx),
                    topk_ids=self.topk_ids.astype(np.int32), topk_logprobs=self.topk_logprobs.astype(np.float64),
                    rest_logprob=self.rest_logprob.astype(np.float64),
                    argmax=self.argmax.astype(np.int32), nll=self.nll.astype(np.float64),
                    vocab_size=np.array(self.vocab_size), meta=np.array(json.dumps(self.meta)))
        except OSError as e:
            raise StrataError(f"cannot write {path}: {e.strerror}") from None

    @classmethod
    def load(cls, path: str | Path) -> Reference:
        try:
            with np.load(path, allow_pickle=False) as z:
                if "format" not in z.files or str(z["format"]) != REFERENCE_FORMAT:
                    raise StrataError(f"{path} is not a logits file written by `strata perplexity --save-logits`")
                ref = cls(ids=z["ids"], ctx=int(z["ctx"]), topk_ids=z["topk_ids"],
                          topk_logprobs=z["topk_logprobs"], rest_logprob=z["rest_logprob"], argmax=z["argmax"],
                          nll=z["nll"],
                          vocab_size=int(z["vocab_size"]), meta=json.loads(str(z["meta"])))
        except FileNotFoundError:
            raise StrataError(f"cannot read {path}: no such file") from None
        except (OSError, ValueError, KeyError) as e:
            raise StrataError(f"cannot read {path} as a logits file: {e}") from None
        m = ref.nll.shape[0]
        if (ref.topk_ids.shape != ref.topk_logprobs.shape or ref.topk_ids.shape[0] != m
                or ref.argmax.shape != (m,) or ref.rest_logprob.shape != (m,)):
            raise StrataError(f"{path} is inconsistent: its arrays disagree on the number of positions")
        return ref


# ---------------------------------------------------------------------------------------------- evaluation

@dataclass
class Evaluation:
    """One run over a text. Per scored position: NLL, and against a base, KL and top-1 agreement."""

    tokens: int
    ctx: int
    windows: int
    nll: np.ndarray  # (M,) float64
    seconds: float
    reference: Reference | None = None  # filled when asked to keep the top-K (for --save-logits)
    kl: np.ndarray | None = None  # (M,) float64, against `base`
    top1: np.ndarray | None = None  # (M,) bool
    base: Reference | None = None

    @property
    def scored(self) -> int:
        return int(self.nll.shape[0])

    @property
    def mean_nll(self) -> float:
        return float(self.nll.mean())

    @property
    def ppl(self) -> float:
        return math.exp(self.mean_nll)

    @property
    def ppl_stderr(self) -> float | None:
        """Standard error of PPL by the delta method, ppl · std(NLL) / sqrt(M), as llama.cpp reports it."""
        if self.scored < 2:
            return None
        return self.ppl * float(self.nll.std(ddof=1)) / math.sqrt(self.scored)

    def kl_stats(self) -> dict | None:
        if self.kl is None or self.top1 is None or self.base is None:
            return None
        kl, n = self.kl, self.scored
        p = float(self.top1.mean())
        return {
            "mean": float(kl.mean()), "mean_stderr": float(kl.std(ddof=1) / math.sqrt(n)) if n > 1 else None,
            "median": float(np.median(kl)), "p99": float(np.quantile(kl, 0.99)), "max": float(kl.max()),
            "top1_agreement": p, "top1_stderr": math.sqrt(p * (1 - p) / n), "base_ppl": self.base.ppl,
            "ppl": self.ppl, "ln_ppl_ratio": self.mean_nll - float(self.base.nll.mean()),
            "topk": self.base.topk, "vocab_size": self.base.vocab_size, "exact": self.base.topk >= self.base.vocab_size,
        }


def check_base(base: Reference, ids: Sequence[int], ctx: int, vocab_size: int) -> None:
    """The base must describe the same tokens, windows and vocabulary, or the KL would compare unrelated rows."""
    if base.ctx != ctx:
        raise StrataError(f"the base was computed with --ctx {base.ctx}, this run uses {ctx}; use the same context")
    if base.ids.shape[0] != len(ids) or not np.array_equal(base.ids, np.asarray(ids, dtype=np.int64)):
        raise StrataError(f"the base was computed on other tokens ({base.ids.shape[0]} tokens, this run has "
                          f"{len(ids)}): use the same text file, tokenizer and --max-tokens")
    if base.vocab_size != vocab_size:
        raise StrataError(f"the base model has a vocabulary of {base.vocab_size}, this one {vocab_size}")


def evaluate(engine, ids: Sequence[int], ctx: int = DEFAULT_CTX, keep_topk: int = 0,
             base: Reference | None = None,
             on_window: Callable[[int, int, float], None] | None = None) -> Evaluation:
    """Run `ids` through `engine` in windows of `ctx` tokens (each a fresh sequence) and score every
    next-token prediction. `keep_topk` > 0 keeps a `Reference` of the run (for --save-logits); `base` computes
    KL(base ‖ this run) and top-1 agreement per position. `on_window(i, n, running_ppl)` reports progress."""
    ids = list(ids)
    spans = windows(len(ids), ctx)
    if not spans:
        raise StrataError(f"the text has {len(ids)} token(s); at least 2 are needed to score a prediction")
    vocab = engine.cfg.vocab_size
    if base is not None:
        check_base(base, ids, ctx, vocab)
    k = min(keep_topk, vocab)
    nll_parts, kl_parts, top1_parts, top_ids, top_lp, rests, argmaxes = [], [], [], [], [], [], []
    pos = 0  # scored positions so far (row into the base)
    t0 = time.perf_counter()
    running = 0.0
    for i, (s, e) in enumerate(spans):
        logits = engine.prefill(ids[s:e], engine.new_state(), all_logits=True)
        logp = torch.log_softmax(logits[:-1].cpu().double(), dim=-1)
        target = torch.tensor(ids[s + 1:e], dtype=torch.int64)
        nll = -logp.gather(1, target[:, None])[:, 0].numpy()
        nll_parts.append(nll)
        amax = logp.argmax(-1).numpy().astype(np.int32)
        if k:
            v, j = logp.topk(k, dim=-1)
            top_lp.append(v.numpy())
            top_ids.append(j.numpy().astype(np.int32))
            rests.append(_rest_logprob(logp, j).numpy())
            argmaxes.append(amax)
        if base is not None:
            rows = slice(pos, pos + nll.shape[0])
            b_ids = torch.from_numpy(base.topk_ids[rows].astype(np.int64))
            b_lp = torch.from_numpy(base.topk_logprobs[rows])
            b_rest = torch.from_numpy(base.rest_logprob[rows])
            t_lp = logp.gather(1, b_ids)
            t_rest = _rest_logprob(logp, b_ids)
            head = (b_lp.exp() * (b_lp - t_lp)).sum(-1)
            tail = torch.where(torch.isfinite(b_rest), b_rest.exp() * (b_rest - t_rest.clamp_min(-745.0)),
                               torch.zeros_like(b_rest))
            kl_parts.append((head + tail).numpy())
            top1_parts.append(amax == base.argmax[rows])
        pos += nll.shape[0]
        running += float(nll.sum())
        if on_window is not None:
            on_window(i + 1, len(spans), math.exp(running / pos))
    seconds = time.perf_counter() - t0
    ev = Evaluation(tokens=len(ids), ctx=ctx, windows=len(spans), nll=np.concatenate(nll_parts), seconds=seconds)
    if k:
        ev.reference = Reference(ids=np.asarray(ids, dtype=np.int64), ctx=ctx, topk_ids=np.concatenate(top_ids),
                                 topk_logprobs=np.concatenate(top_lp), rest_logprob=np.concatenate(rests),
                                 argmax=np.concatenate(argmaxes),
                                 nll=ev.nll, vocab_size=vocab)
    if base is not None:
        ev.base = base
        ev.kl = np.concatenate(kl_parts)
        ev.top1 = np.concatenate(top1_parts)
    return ev


def _rest_logprob(logp: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """log Σ exp(logp) over the entries of each row NOT in `ids` (-inf when `ids` covers the row)."""
    return logp.scatter(1, ids, float("-inf")).logsumexp(-1)
