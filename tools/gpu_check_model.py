"""GPU correctness check of the whole model (run on the device box).

For each model (the fixture HF checkpoint and GGUF files when present, and tiny random configs): the GPU
path (Triton kernels, float32 compute) against the CPU reference path (float32): prefill and decode logits
within a tolerance, greedy tokens equal; and the captured decode step equals the uncaptured one exactly.
`--activations q8` runs both sides in the Q8-activation mode (the GPU's `gemv_q8x` kernels against the CPU's
`linear_q8_ref`). An input within a few fp32 ulps of a rounding boundary may round to the other integer on the two
sides, a step of 1/127 of its run's largest value: on the quantized fixture GGUFs that moved logits by 1.7-4.9e-3
on an H100 (bench/results/2026-12-05-h100-model-check-q8-f57c61d.json), beyond TOL, so such rows fail until a
tolerance for the mode is justified; `mode_rel_diff` (the CPU's q8 logits against its float ones) gives the scale
of the mode's own effect beside it. Prints a table and writes JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from strata.runtime.engine import Engine, load_weights  # noqa: E402
from strata.runtime.graph import DecodeStep  # noqa: E402

# float32 compute on both sides; kernels differ only in accumulation order (and, for quantized weights,
# in dequantizing inside the GEMV instead of before it): 1e-4 of the largest |logit|, as for transformers.
TOL = 1e-4


def compare(path: str, ids: list[int], steps: int = 16, activations: str = "float") -> dict:
    w = load_weights(path)
    cpu = Engine(w, "float32", "cpu", activations=activations)
    gpu = Engine(w, "float32", "cuda", activations=activations)
    st_c, st_g = cpu.new_state(), gpu.new_state()
    ref = cpu.prefill(ids, st_c, all_logits=True)
    out = gpu.prefill(ids, st_g, all_logits=True).cpu()
    prefill_err = float((out - ref).abs().max() / ref.abs().max())
    mode_diff = None
    if activations != "float":
        flt = Engine(w, "float32", "cpu")
        mode_diff = float((flt.prefill(ids, flt.new_state(), all_logits=True) - ref).abs().max() / ref.abs().max())
    # greedy decode, both paths, from the same prompt
    tok_c = tok_g = int(ref[-1].argmax())
    seq_c, seq_g, dec_err = [], [], 0.0
    for _ in range(steps):
        lc, lg = cpu.decode(tok_c, st_c), gpu.decode(tok_g, st_g).cpu()
        dec_err = max(dec_err, float((lg - lc).abs().max() / lc.abs().max()))
        seq_c.append(tok_c)
        seq_g.append(tok_g)
        tok_c, tok_g = int(lc.argmax()), int(lg.argmax())
    # captured vs uncaptured step, same state, same token
    eager = DecodeStep(gpu.model, capacity=len(ids) + 8, capture=False)
    graph = DecodeStep(gpu.model, capacity=len(ids) + 8, capture=True)
    p = torch.tensor(ids[:-1])
    eager.prefill(p)
    graph.prefill(p)
    a = eager.step(ids[-1]).clone()
    b = graph.step(ids[-1]).clone()
    a2 = eager.step(int(a.argmax())).clone()
    b2 = graph.step(int(b.argmax())).clone()
    return {"model": path, "activations": activations, "tokens": len(ids), "prefill_rel_err": prefill_err, "decode_rel_err": dec_err,
            "mode_rel_diff": mode_diff, "greedy_equal": seq_c == seq_g, "captured_equals_uncaptured": bool(torch.equal(a, b) and
                                                                                 torch.equal(a2, b2)),
            "ok": prefill_err < TOL and dec_err < TOL and seq_c == seq_g and torch.equal(a, b)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--fixtures", default="fixtures", help="folder holding qwen4exp-tiny fixture files")
    ap.add_argument("--activations", default="float", choices=("float", "q8"))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    fx = Path(args.fixtures)
    ids = json.loads((fx / "prompt.json").read_text())["ids"] if (fx / "prompt.json").exists() else None
    models = []
    if ids:
        models += [str(fx / "hf")] + sorted(str(p) for p in fx.glob("*.gguf"))
    tmp = Path(tempfile.mkdtemp())
    try:
        from tests import reference

        for name in sorted(reference.CONFIGS):
            folder = reference.save(reference.build(name), tmp / name)
            models.append(str(folder))
    except ImportError as e:  # transformers missing on the box: skip the random configs, say so
        print(f"random configs skipped: {e}", file=sys.stderr)
    for m in models:
        try:
            use = ids if m.startswith(str(fx)) else list(range(2, 60))
            rows.append(compare(m, use, activations=args.activations))
        except Exception as e:  # noqa: BLE001 - report and continue with the next model
            rows.append({"model": m, "ok": False, "error": f"{type(e).__name__}: {e}",
                         "trace": traceback.format_exc()[-2000:]})
    print(f"{'model':<60}{'prefill':>10}{'decode':>10}{'greedy':>8}{'graph==eager':>14}"
          + (f"{'q8 vs float':>13}" if args.activations != "float" else ""))
    for r in rows:
        if "error" in r:
            print(f"{Path(r['model']).name:<60} ERROR {r['error'][:120]}")
        else:
            print(f"{Path(r['model']).name:<60}{r['prefill_rel_err']:>10.2e}{r['decode_rel_err']:>10.2e}"
                  f"{str(r['greedy_equal']):>8}{str(r['captured_equals_uncaptured']):>14}"
                  + (f"{r['mode_rel_diff']:>13.2e}" if r.get("mode_rel_diff") is not None else ""))
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
