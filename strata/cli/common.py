"""Arguments and helpers shared by several subcommands."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from strata.errors import StrataError

OOM_HINTS = {
    "bench": "the synthetic model at the real geometry takes ~76 GiB and each context's caches more (a 128K step "
             "peaks at ~83 GiB): try shorter --contexts or fewer --layers",
    "model": "the weights and the caches, allocated for --context positions, must fit: try a shorter --context, "
             "a smaller quantization of the model, or --device cpu",
}
"""What to try when a command runs out of device memory, by command."""


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", metavar="PATH", default=None,
                   help="HF checkpoint folder or GGUF file (default: the small model bundled with strata)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="compute dtype (default: float32)")
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda (default: cpu)")
    p.add_argument("--context", type=int, default=None, metavar="N",
                   help="on CUDA, the positions each sequence's decode state holds (its caches are allocated once "
                        "so decode replays a captured CUDA graph; default 32768, at most the model's context)")
    p.add_argument("--activations", default="float", choices=["float", "q8"],
                   help="how the inputs of products with block-quantized weights are taken: float (exact products of "
                        "the stored weights; default) or q8 (rounded to int8 in runs of 32 first, as llama.cpp's GPU "
                        "matmuls do: integer dot products, faster decode on a GPU; ~1e-5 in KL on the test models)")
    add_ple_table_arg(p)


def add_ple_table_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ple-table", default="auto", choices=["auto", "resident", "mapped", "device", "pinned"],
                   help="the PLE n-gram tables (tens of GB at full size): resident reads every page into memory at "
                        "load, so no decode token waits on a page fault for its table rows (the table's size in RAM, "
                        "a full read of it); mapped reads rows from the model file's pages as tokens hash to them; "
                        "auto (default) is resident where the tables fit in 80%% of the available memory; device "
                        "copies them into the GPU's memory (where it has room beside the model), and the captured "
                        "decode step hashes and gathers each token's rows itself (no host work per token; the steps "
                        "run ahead of the host); pinned does the same with the tables in page-locked host memory "
                        "that the GPU reads over PCIe (the tables' size in RAM)")


def parse_ids(text: str) -> list[int]:
    """'1,2,3' -> [1, 2, 3], with a clear error for anything else."""
    try:
        ids = [int(x) for x in text.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise StrataError(f"--ids must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise StrataError("--ids is empty")
    return ids


def read_ids_file(path: str) -> list[int]:
    """A JSON file holding a list of ids or an object with an "ids" list (like prompt.json)."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as e:
        raise StrataError(f"cannot read {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise StrataError(f"{path} is not valid JSON ({e})") from None
    if isinstance(data, dict):
        data = data.get("ids")
    if not isinstance(data, list) or not data or not all(isinstance(i, int) for i in data):
        raise StrataError(f"{path} must hold a non-empty list of integer ids (or an object with one under 'ids')")
    return data
