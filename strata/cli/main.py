"""`strata` command line: one subcommand per module in this package, each with `add_parser` and `run`."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from strata.cli.common import OOM_HINTS
from strata.errors import StrataError

# Subcommand name -> module in strata.cli. Each module defines add_parser(subparsers) and run(args) -> int.
COMMANDS = {
    "logits": "logits",
    "inspect": "inspect",
    "perplexity": "perplexity",
    "bench": "bench",
    "convert": "convert",
    "generate": "generate",
    "chat": "chat",
    "serve": "serve",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="strata", description="Inference engine for qwen4_exp models (Qwen3.8-Flash-Next).")
    parser.add_argument("--debug", action="store_true", help="show full tracebacks on errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, module in COMMANDS.items():
        importlib.import_module(f"strata.cli.{module}").add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except BrokenPipeError:  # output piped into e.g. `head`, which closed early: not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (StrataError, ValueError, OSError) as e:
        if args.debug:
            raise
        print(f"strata {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except RuntimeError as e:  # torch.OutOfMemoryError, named without importing torch here
        if type(e).__name__ != "OutOfMemoryError" or args.debug:
            raise
        hint = OOM_HINTS.get(args.command, OOM_HINTS["model"])
        print(f"strata {args.command}: error: out of device memory: {str(e).splitlines()[0]}\n  {hint}",
              file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
