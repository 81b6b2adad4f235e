"""GPU correctness check of the whole model (run on the device box).

For each model (the fixture HF checkpoint and GGUF files when present, and tiny random configs): the GPU
path (Triton kernels, float32 compute) against the CPU reference path (float32): prefill and decode logits
within a tolerance, greedy tokens equal; the captured decode step equals the uncaptured one exactly, and so does
the step that gathers its PLE rows on the GPU (`--ple-table device`, and from page-locked host memory: `pinned`)
the host-staged one, and the steps run ahead of the host (`DecodeStep.ids_ahead`; all of the step with the tables
on the GPU, the front of the split step with them on the host) the steps that read each id before the next.
`--activations q8` runs both sides in the Q8-activation mode (the GPU's `gemv_q8x` kernels against the CPU's
`linear_q8_ref`). The mode is discontinuous: an input within a few fp32 ulps of a rounding boundary lands on the
other integer on the two sides, a step of 1/127 of its run's largest value, so on the quantized fixture GGUFs two
correct implementations differ by up to a few 1e-3 of the largest logit (on an H100 and an H200 the GPU differed by
0.6-4.9e-3, bench/results/2026-12-05-h*-model-check-q8-*.json). For such models (where the mode changes the
output: `mode_rel_diff`, the CPU's q8 logits against its float ones) the row's tolerance is how far the CPU
reference itself moves when each of its products is perturbed by JITTER of its row's largest value (the size of
fp32 accumulation-order differences; `strata.model.ops.jittered_linear`), over SEEDS seeds, times MARGIN; TOL
where that is smaller. Prints a table and writes JSON to --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from strata.model.ops import Ops, jittered_linear, with_activations  # noqa: E402
from strata.runtime.engine import Engine, load_weights  # noqa: E402
from strata.runtime.graph import DecodeStep  # noqa: E402

# float32 compute on both sides; kernels differ only in accumulation order (and, for quantized weights,
# in dequantizing inside the GEMV instead of before it): 1e-4 of the largest |logit|, as for transformers.
TOL = 1e-4
JITTER = 2.0**-20  # per product, of its row's largest value: ~1e-6, above the GPU GEMVs' 1e-8..4e-7 against float64
SEEDS = 8
MARGIN = 2.0  # the spread of SEEDS draws understates the tail of rare flips


def compare(path: str, ids: list[int], steps: int = 16, activations: str = "float", w=None,
            jitter: bool = False) -> dict:
    """One model's row (`path` names it; its weights are loaded from it unless given as w). jitter: the tolerance
    is TOL or MARGIN times the reference's jitter spread, as for a model the q8 mode changes."""
    w = load_weights(path) if w is None else w
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
    logits_c = []
    for _ in range(steps):
        lc, lg = cpu.decode(tok_c, st_c), gpu.decode(tok_g, st_g).cpu()
        logits_c.append(lc)
        dec_err = max(dec_err, float((lg - lc).abs().max() / lc.abs().max()))
        seq_c.append(tok_c)
        seq_g.append(tok_g)
        tok_c, tok_g = int(lc.argmax()), int(lg.argmax())
    spread, tol = None, TOL
    if mode_diff or jitter:  # allow what jittering the reference's own products moves
        spread = max(jitter_spread(w, ids, seq_c, ref, torch.stack(logits_c), activations, seed)
                     for seed in range(SEEDS))
        tol = max(TOL, MARGIN * spread)
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
    captured_equal = bool(torch.equal(a, b) and torch.equal(a2, b2))
    ple_device_equal = ple_device_equals_host(w, ids, activations, [b, b2]) if gpu.cfg.ple else None
    ple_pinned_equal = ple_device_equals_host(w, ids, activations, [b, b2], "pinned") if gpu.cfg.ple else None
    ahead_equal = ahead_equals_one_by_one(w, ids, activations)
    split_ahead_equal = ahead_equals_one_by_one(w, ids, activations, "resident") if gpu.cfg.ple else None
    return {"model": path, "activations": activations, "tokens": len(ids), "prefill_rel_err": prefill_err,
            "decode_rel_err": dec_err, "mode_rel_diff": mode_diff, "jitter_spread": spread, "tolerance": tol,
            "greedy_equal": seq_c == seq_g, "captured_equals_uncaptured": captured_equal,
            "ple_device_equals_host": ple_device_equal, "ple_pinned_equals_host": ple_pinned_equal,
            "ahead_equals_one_by_one": ahead_equal, "split_ahead_equals_one_by_one": split_ahead_equal,
            "ok": prefill_err < tol and dec_err < tol and seq_c == seq_g and captured_equal
            and ple_device_equal is not False and ple_pinned_equal is not False and ahead_equal
            and split_ahead_equal is not False}


def ple_device_equals_host(w, ids: list[int], activations: str, host: list[torch.Tensor], mode: str = "device",
                           ) -> bool:
    """With the PLE tables in the GPU's memory (`--ple-table device`) or in page-locked host memory it reads
    (`pinned`), the captured step that hashes and gathers its rows itself gives the host-staged captured step's
    logits (`host`: the last prompt id, then the argmax) bit for bit."""
    gpu = Engine(w, "float32", "cuda", activations=activations, ple_table=mode)
    step = DecodeStep(gpu.model, capacity=len(ids) + 8, capture=True)
    if step.tables is None or step.split is not None:
        raise AssertionError("the step with its PLE tables on the GPU does not gather them itself")
    step.prefill(torch.tensor(ids[:-1]))
    got = [step.step(ids[-1]).clone()]
    got.append(step.step(int(got[0].argmax())).clone())
    return all(torch.equal(x, y) for x, y in zip(got, host, strict=True))


def ahead_equals_one_by_one(w, ids: list[int], activations: str, ple_table: str = "device", tokens: int = 12,
                            ) -> bool | None:
    """The captured steps run ahead of the host (`DecodeStep.ids_ahead`: each step's inputs fed on the device
    from the previous choice; with the PLE tables in the GPU's memory all of the step, with them on the host
    (`ple_table` "resident") the front of the split step) choose the ids that the captured step chooses one id
    at a time, greedy and by a seeded device draw, and leave the same state: the logits of one more step, after
    the one-by-one step is fed the last id too, are equal bit for bit. None where a host-table step does not
    split (its first layer is a PLE layer)."""
    gpu = Engine(w, "float32", "cuda", activations=activations, ple_table=ple_table if w.cfg.ple else "auto")
    for sampled in (False, True):
        seqs, nexts = [], []
        for ahead in (False, True):
            step = DecodeStep(gpu.model, capacity=len(ids) + tokens + 8, capture=True)
            if ple_table == "resident" and w.cfg.ple and step.split is None:
                return None
            if not step.can_run_ahead or (ple_table == "resident" and step.tables is not None):
                raise AssertionError(f"the captured step with the PLE tables {ple_table} cannot run ahead")
            if sampled:
                step.sampler.configure(0.9, 20, 0.95, 0.0, 5)
            step.prefill(torch.tensor(ids[:-1]))
            if ahead:
                gen = step.ids_ahead(ids[-1], sampled)
                got = [next(gen) for _ in range(tokens)]
                gen.close()
            else:
                got, tok = [], ids[-1]
                for _ in range(tokens):
                    tok = step.next_token_id(tok, sampled)
                    got.append(tok)
                step.step(got[-1])
            seqs.append(got)
            nexts.append(step.step(7).clone())
            del step
        if seqs[0] != seqs[1] or not torch.equal(*nexts):
            return False
    return True


def jitter_spread(w, ids: list[int], tokens: list[int], ref_prefill: torch.Tensor, ref_decode: torch.Tensor,
                  activations: str, seed: int) -> float:
    """How far the CPU reference's logits (prefill of ids, then decode of `tokens`: the reference's own greedy
    tokens) move with every product jittered (`jittered_linear`, JITTER): the largest relative difference."""
    base = with_activations(Ops(), activations)
    cpu = Engine(w, "float32", "cpu", ops=dataclasses.replace(base, linear=jittered_linear(base.linear, JITTER, seed)))
    st = cpu.new_state()
    pre = cpu.prefill(ids, st, all_logits=True)
    dec = torch.stack([cpu.decode(t, st) for t in tokens])
    return max(float((pre - ref_prefill).abs().max() / ref_prefill.abs().max()),
               float((dec - ref_decode).abs().max() / ref_decode.abs().max()))


TILED_MODEL = "synthetic-tile-major"


def tiled_row(args) -> dict:
    """A synthetic model (the bench's type mix) whose routed gate/up stacks and head the GPU stores tile-major
    (Q4_K_RT, Q6_K_RT: rows of 512 weights; the head's row threshold lowered to its vocabulary), no fixture or
    random config being that wide. Every token takes every expert: with random weights and 2 of 8 experts the
    routing of this model nearly ties at one prompt position (the CPU reference's own logits there move by up to
    6e-4 when its products are jittered by 1e-6; the GPU's by 4.9e-2, bench/results/2026-12-06-h100-model-check-
    1ed74c8.json), and even so its logits move by up to 7e-5 under that jitter, so the row's tolerance is the
    q8 rows' (`compare`'s jitter)."""
    from strata.runtime import placement
    from strata.runtime.synthetic import TypeMix, real_config, synthetic_weights

    cfg = real_config(num_hidden_layers=4, hidden_size=512, vocab_size=512, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=128, linear_num_key_heads=1, linear_num_value_heads=2,
                      linear_key_head_dim=64, num_experts=4, num_experts_per_tok=4, moe_intermediate_size=128,
                      shared_expert_intermediate_size=256, hc_lowrank=32, ple_embed_dim=256, heads_per_ngram=2,
                      ngram_vocab_size_base=1000, indexer_budget=16, indexer_head_dim=64, eos_token_id=1)
    before = placement.TILE_MAJOR_HEAD_MIN_ROWS
    placement.TILE_MAJOR_HEAD_MIN_ROWS = 16
    try:
        w = synthetic_weights(cfg, TypeMix(), "cpu")
        placed = placement.gpu_layout(w)
        kinds = sorted({placed[n].kind for n in placed.tensors if getattr(placed[n], "tiled", False)})
        if kinds != ["Q4_K_RT", "Q6_K_RT"]:
            raise AssertionError(f"expected tile-major Q4_K_RT and Q6_K_RT tensors, got {kinds}")
        return compare(TILED_MODEL, list(range(2, 60)), activations=args.activations, w=w, jitter=True)
    finally:
        placement.TILE_MAJOR_HEAD_MIN_ROWS = before


def _optional(rows: list[dict], row: dict, key: str, width: int) -> str:
    """The table cell of a column only some rows have: blank where this row lacks it, none where no row has it."""
    if all(r.get(key) is None for r in rows):
        return ""
    return f"{row[key]:>{width}.2e}" if row.get(key) is not None else " " * width


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
    models.append(TILED_MODEL)
    for m in models:
        try:
            use = ids if m.startswith(str(fx)) else list(range(2, 60))
            rows.append(compare(m, use, activations=args.activations) if m != TILED_MODEL else tiled_row(args))
        except Exception as e:  # noqa: BLE001 - report and continue with the next model
            rows.append({"model": m, "ok": False, "error": f"{type(e).__name__}: {e}",
                         "trace": traceback.format_exc()[-2000:]})
    print(f"{'model':<48}{'prefill':>10}{'decode':>10}{'tolerance':>11}{'greedy':>8}{'graph==eager':>14}"
          f"{'ple device':>12}{'pinned':>8}{'ahead':>7}{'split ahead':>13}"
          + (f"{'q8 vs float':>13}" if any(r.get("mode_rel_diff") is not None for r in rows) else "")
          + (f"{'jitter':>10}" if any(r.get("jitter_spread") is not None for r in rows) else ""))
    for r in rows:
        if "error" in r:
            print(f"{Path(r['model']).name:<48} ERROR {r['error'][:120]}")
        else:
            print(f"{Path(r['model']).name:<48}{r['prefill_rel_err']:>10.2e}{r['decode_rel_err']:>10.2e}"
                  f"{r['tolerance']:>11.1e}{str(r['greedy_equal']):>8}{str(r['captured_equals_uncaptured']):>14}"
                  f"{str(r.get('ple_device_equals_host')):>12}{str(r.get('ple_pinned_equals_host')):>8}"
                  f"{str(r.get('ahead_equals_one_by_one')):>7}{str(r.get('split_ahead_equals_one_by_one')):>13}"
                  + _optional(rows, r, "mode_rel_diff", 13) + _optional(rows, r, "jitter_spread", 10))
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
