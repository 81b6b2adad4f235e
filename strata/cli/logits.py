"""`strata logits`: float32 logits of every position, for comparing strata with other engines."""

from __future__ import annotations

import argparse
import sys

import numpy as np

from strata.cli.common import add_model_args, parse_ids, read_ids_file
from strata.errors import StrataError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("logits", help="write the logits of every position to a .npy file",
                       description="Write float32 logits, shape [n_tokens, vocab], for every position.")
    add_model_args(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--ids", help="comma-separated token ids")
    src.add_argument("--ids-file", help="JSON file: a list of ids, or an object with an 'ids' list")
    p.add_argument("--out", required=True, help="output .npy path")
    p.add_argument("--mode", choices=["prefill", "decode"], default="prefill",
                   help="prefill: the whole sequence as one prompt; decode: the first token as a prompt, every "
                        "later token through the single-token decode path (default: prefill)")
    p.add_argument("--chunk-size", type=int, default=512, help="prefill chunk size (default: 512)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from strata.runtime.engine import Engine

    ids = parse_ids(args.ids) if args.ids is not None else read_ids_file(args.ids_file)
    engine = Engine.load(args.model, args.dtype, args.device, context=args.context, activations=args.activations,
                         ple_table=args.ple_table, progress=sys.stderr.isatty())
    engine.check_ids(ids)
    state = engine.new_state()
    if args.mode == "prefill":
        logits = engine.prefill(ids, state, chunk_size=args.chunk_size, all_logits=True)
    else:
        rows = [engine.prefill(ids[:1], state)]
        rows += [engine.decode(t, state) for t in ids[1:]]
        import torch

        logits = torch.stack(rows)
    out = logits.cpu().numpy().astype(np.float32)
    if not np.isfinite(out).all():
        raise StrataError("the model produced non-finite logits")
    try:
        np.save(args.out, out)
    except OSError as e:
        raise StrataError(f"cannot write {args.out}: {e.strerror}") from None
    print(f"wrote {args.out}: {out.shape[0]} x {out.shape[1]} float32 logits ({args.mode})")
    return 0
