"""`strata convert`: an HF checkpoint to one GGUF file in llama.cpp's qwen4exp layout."""

from __future__ import annotations

import argparse
from pathlib import Path

from strata.errors import StrataError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("convert", help="convert an HF checkpoint to GGUF (llama.cpp's qwen4exp layout)",
                       description="Write an HF qwen4_exp checkpoint as one GGUF file with llama.cpp's tensor "
                                   "names, metadata keys and transforms. The file is written under a temporary "
                                   "name and renamed only when complete.")
    p.add_argument("--model", metavar="PATH", required=True, help="HF checkpoint folder")
    p.add_argument("--out", required=True, help="output .gguf path")
    p.add_argument("--outtype", choices=["f32", "bf16", "f16", "q8_0"], default="bf16",
                   help="storage type of the weight matrices (norms and small vectors stay f32; default bf16)")
    p.add_argument("--force", action="store_true", help="overwrite an existing output file")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from strata.weights.gguf_writer import convert_hf_to_gguf

    out = Path(args.out)
    if out.exists() and not args.force:
        raise StrataError(f"{out} exists; pass --force to overwrite it")
    if not Path(args.model).is_dir():
        raise StrataError(f"--model must be an HF checkpoint folder, got {args.model}")
    path = convert_hf_to_gguf(args.model, out, args.outtype)
    print(f"wrote {path} ({path.stat().st_size:,} bytes, {args.outtype})")
    return 0
