"""What a weight format costs on the bundled model: perplexity and KL against the float32 reference.

The bundled model cannot be written as a llama.cpp GGUF (its GDN output gate is SiLU, which llama.cpp's
qwen4exp graph does not express), so the formats are applied in memory instead: every weight matrix whose row
width is a whole number of blocks is quantized with the gguf package's reference quantizer (the same round-to-
nearest llama-quantize uses for these types without an importance matrix) and run through strata's own
dequantize-on-use path; the router and all norms/vectors stay float, as in llama.cpp's files.

    .venv/bin/python tools/quality_formats.py --out bench/results/quality-formats.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from strata.runtime.engine import DEFAULT_MODEL, Engine, load_weights  # noqa: E402
from strata.runtime.evaluate import evaluate, read_text, tokenize  # noqa: E402
from strata.weights.inventory import role_of  # noqa: E402
from strata.weights.quant_tensor import QuantTensor  # noqa: E402
from strata.weights.schema import Weights  # noqa: E402

FORMATS = ["Q8_0", "Q5_1", "Q5_0", "Q4_1", "Q4_0"]
KEEP_FLOAT = ("router",)


def quantize_matrix(name: str, dense: torch.Tensor, fmt: str) -> QuantTensor | None:
    from gguf import GGMLQuantizationType, quants

    qtype = GGMLQuantizationType[fmt]
    if dense.shape[-1] % 32:
        return None
    rows = dense.reshape(-1, dense.shape[-1]).float().numpy()
    packed = quants.quantize(rows, qtype)
    data = torch.from_numpy(np.ascontiguousarray(packed)).reshape(*dense.shape[:-1], packed.shape[-1])
    return QuantTensor(name, data, qtype.value, tuple(dense.shape))


def quantized(w: Weights, fmt: str) -> tuple[Weights, int]:
    out, n = {}, 0
    for name, t in w.tensors.items():
        if len(t.shape) >= 2 and role_of(name) not in KEEP_FLOAT and t.kind in ("BF16", "F16", "F32") \
                and not name.endswith(("conv",)):
            q = quantize_matrix(name, t.dense(torch.float32), fmt)
            if q is not None:
                out[name], n = q, n + 1
                continue
        out[name] = t
    return Weights(w.cfg, out, w.gdn_value_order, w.source + f" ({fmt} in memory)"), n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--text-file", default=str(DEFAULT_MODEL / "heldout.txt"))
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(2)
    w = load_weights(args.model)
    ids = tokenize(Path(args.model) / "tokenizer.json", read_text(args.text_file))
    base = evaluate(Engine(w), ids, args.ctx, keep_topk=64).reference
    rows = [{"format": "float32 (reference)", "ppl": base.ppl, "matrices": 0}]
    for fmt in FORMATS:
        qw, n = quantized(w, fmt)
        ev = evaluate(Engine(qw), ids, args.ctx, base=base)
        st = ev.kl_stats()
        rows.append({"format": fmt, "matrices": n, "bytes": qw.nbytes, "ppl": ev.ppl, "kl_mean": st["mean"],
                     "kl_p99": st["p99"], "top1_agreement": st["top1_agreement"]})
        print(f"{fmt:<6} {n:>4} matrices  ppl {ev.ppl:8.3f}  KL {st['mean']:.3e}  p99 {st['p99']:.3e}  "
              f"top1 {st['top1_agreement']:.3f}", flush=True)
    report = {"model": args.model, "text": args.text_file, "tokens": len(ids), "ctx": args.ctx, "rows": rows,
              "method": __doc__.split("\n\n")[1].replace("\n", " ")}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
