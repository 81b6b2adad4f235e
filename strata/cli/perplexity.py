"""`strata perplexity`: perplexity of a model on a text file, and KL divergence against a saved reference run.

The way to put a number on what a dtype, a quantised model file or a kernel change costs: run once with
`--save-logits base.npz` on the reference (float32, the original checkpoint), then again on the variant with
`--kl-base base.npz`. The windowing and the top-K storage are described in strata.runtime.evaluate.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from strata.cli.common import add_model_args
from strata.errors import StrataError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "perplexity", help="perplexity on a text file; KL divergence against a saved reference run",
        description="Tokenize a text file with the model's tokenizer, run it in non-overlapping windows of --ctx "
                    "tokens and report perplexity. --save-logits keeps the run's top-K log-probabilities; a "
                    "later run with --kl-base (another --dtype or model file) reports KL(base || this), top-1 "
                    "agreement and both perplexities.")
    add_model_args(p)
    p.add_argument("--text-file", required=True, metavar="FILE", help="UTF-8 text to evaluate")
    p.add_argument("--tokenizer", metavar="PATH",
                   help="tokenizer.json (default: the one in the model folder, or beside a model file)")
    p.add_argument("--ctx", type=int, default=None,
                   help="tokens per window (default: the base's with --kl-base, else 512)")
    p.add_argument("--max-tokens", type=int, default=None, metavar="N",
                   help="evaluate only the first N tokens of the text")
    p.add_argument("--save-logits", metavar="FILE.npz", help="store this run's top-K log-probabilities")
    p.add_argument("--kl-base", metavar="FILE.npz", help="report KL divergence against this stored run")
    p.add_argument("--kl-topk", type=int, default=None, metavar="K",
                   help="log-probabilities kept per position by --save-logits (default 64; the vocabulary size "
                        "or more stores full distributions and makes the KL exact)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the text report")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from strata.runtime import evaluate as ev
    from strata.runtime.engine import DEFAULT_MODEL, Engine

    if args.ctx is not None and args.ctx < 2:
        raise StrataError(f"--ctx must be at least 2, got {args.ctx}")
    if args.max_tokens is not None and args.max_tokens < 2:
        raise StrataError(f"--max-tokens must be at least 2, got {args.max_tokens}")
    if args.kl_topk is not None and args.kl_topk < 1:
        raise StrataError(f"--kl-topk must be at least 1, got {args.kl_topk}")
    if args.kl_topk is not None and not args.save_logits:
        raise StrataError("--kl-topk sets what --save-logits stores; it needs --save-logits")
    base = ev.Reference.load(args.kl_base) if args.kl_base else None
    ctx = args.ctx if args.ctx is not None else (base.ctx if base is not None else ev.DEFAULT_CTX)
    text = ev.read_text(args.text_file)
    if not text.strip():
        raise StrataError(f"{args.text_file} holds no text")
    model_path = args.model if args.model is not None else DEFAULT_MODEL
    tokenizer = ev.find_tokenizer(model_path, args.tokenizer)
    t0 = time.perf_counter()
    ids = ev.tokenize(tokenizer, text)
    t_tok = time.perf_counter() - t0
    if args.max_tokens is not None:
        ids = ids[:args.max_tokens]
    engine = Engine.load(args.model, args.dtype, args.device, context=args.context, activations=args.activations,
                         ple_table=args.ple_table, progress=sys.stderr.isatty())
    engine.check_ids(ids)
    if base is not None:
        ev.check_base(base, ids, ctx, engine.cfg.vocab_size)
    quiet = args.json
    n_windows = len(ev.windows(len(ids), ctx))
    if not quiet:
        print(f"perplexity: {args.text_file}: {len(ids)} tokens (tokenized in {1000 * t_tok:.0f} ms with "
              f"{tokenizer})")
        print(f"perplexity: calculating perplexity over {n_windows} windows, n_ctx={ctx}, model {model_path}, "
              f"dtype {args.dtype}, device {args.device}")

    def progress(i: int, n: int, ppl: float) -> None:
        end = "\n" if i == n else ""
        print(f"[{i}]{ppl:.4f}" + ("," if i < n else ""), end=end, flush=True)

    keep = (args.kl_topk or ev.DEFAULT_KL_TOPK) if args.save_logits else 0
    result = ev.evaluate(engine, ids, ctx, keep_topk=keep, base=base, on_window=None if quiet else progress)
    if args.save_logits:
        assert result.reference is not None
        result.reference.meta = {"model": str(model_path), "dtype": args.dtype, "device": args.device,
                                 "text_file": str(args.text_file), "tokenizer": str(tokenizer)}
        result.reference.save(args.save_logits)
    stats = result.kl_stats()
    if quiet:
        print(json.dumps({
            "model": str(model_path), "dtype": args.dtype, "device": args.device, "text_file": str(args.text_file),
            "tokens": result.tokens, "scored": result.scored, "ctx": ctx, "windows": result.windows,
            "ppl": result.ppl, "ppl_stderr": result.ppl_stderr, "mean_nll": result.mean_nll,
            "seconds": round(result.seconds, 3), "tokens_per_second": result.tokens / max(result.seconds, 1e-9),
            "saved_logits": args.save_logits, "kl_base": args.kl_base, "kl": stats,
        }))
        return 0
    err = f" +/- {result.ppl_stderr:.5f}" if result.ppl_stderr is not None else ""
    print(f"Final estimate: PPL = {result.ppl:.4f}{err}")
    print(f"tokens: {result.tokens} ({result.scored} scored), {result.windows} windows, {result.seconds:.2f} s, "
          f"{result.tokens / max(result.seconds, 1e-9):.1f} tokens/s")
    if args.save_logits:
        print(f"saved the top-{keep if keep < engine.cfg.vocab_size else 'all'} log-probabilities of "
              f"{result.scored} positions to {args.save_logits}")
    if stats is not None:
        what = "full distributions" if stats["exact"] else f"top-{stats['topk']} of {stats['vocab_size']}"
        se = f" +/- {_num(stats['mean_stderr'])}" if stats["mean_stderr"] is not None else ""
        print(f"====== KL divergence against {args.kl_base} ({what}) ======")
        print(f"Mean    KLD: {_num(stats['mean'])}{se}")
        print(f"Median  KLD: {_num(stats['median'])}")
        print(f"99.0%   KLD: {_num(stats['p99'])}")
        print(f"Maximum KLD: {_num(stats['max'])}")
        print(f"Same top-1:  {100 * stats['top1_agreement']:.3f} +/- {100 * stats['top1_stderr']:.3f} %")
        print(f"PPL(base) = {stats['base_ppl']:.4f}, PPL(this) = {stats['ppl']:.4f}, "
              f"ln(PPL ratio) = {stats['ln_ppl_ratio']:+.6f}")
    sys.stdout.flush()
    return 0


def _num(x: float) -> str:
    """Six decimals, or three significant digits for the tiny KLs of a dtype change (not a row of zeros)."""
    return f"{x:.6f}" if x == 0 or abs(x) >= 1e-3 else f"{x:.3e}"
