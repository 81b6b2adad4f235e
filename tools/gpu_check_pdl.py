"""GPU check that programmatic dependent launch changes no bit (run on the device box).

PDL lets each kernel start while the previous one ends; a kernel that read or wrote something before its
`pdl.wait` that it may not would race, and a race shows as results that differ from the plainly launched
step. So: a synthetic model at the real geometry (fewer layers, bf16), its captured decode step run for a number
of tokens from the same filled state with PDL off, then on (captured as two graphs split at the first PLE layer,
captured as one graph, and eager): every token's logits must be equal bit for bit. So must they with the GDN
step's weights and gate inputs loaded late (`gdn.EARLY_LOADS`), a switch that only moves loads, and without its
state slab asked of L2 before its wait (`gdn.PREFETCH_STATE`), a hint that moves no value. Prints one line per
variant and writes JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from strata.kernels import gdn, pdl  # noqa: E402
from strata.model.model import Model  # noqa: E402
from strata.runtime.bench import fill_state  # noqa: E402
from strata.runtime.graph import DecodeStep  # noqa: E402
from strata.runtime.placement import fast_ops, gpu_layout  # noqa: E402
from strata.runtime.synthetic import TypeMix, real_config, synthetic_weights  # noqa: E402


def run_tokens(model: Model, context: int, tokens: int, capture: bool, split: bool = True) -> list[torch.Tensor]:
    step = DecodeStep(model, capacity=context + tokens + 8, capture=capture, split=split)
    fill_state(step, context, torch.Generator(device=model.device).manual_seed(1))
    tok, out = 11, []
    for _ in range(tokens):
        logits = step.step(tok).clone()
        out.append(logits)
        tok = int(logits.float().argmax())
    del step
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    cfg = real_config(num_hidden_layers=args.layers, layer_types=None)
    w = gpu_layout(synthetic_weights(cfg, TypeMix(), dev), inplace=True, dtype=torch.bfloat16)  # as placed
    model = Model(w, torch.bfloat16, dev, fast_ops())
    with pdl.enabled(False):
        plain = run_tokens(model, args.context, args.tokens, capture=True)
    rows = []
    for name, capture, split, switches in (("pdl captured", True, True, ()), ("pdl one graph", True, False, ()),
                                           ("pdl eager", False, True, ()),
                                           ("gdn late loads", True, True, ((gdn, "EARLY_LOADS", False),)),
                                           ("gdn no prefetch", True, True, ((gdn, "PREFETCH_STATE", False),))):
        before = [getattr(m, a) for m, a, _ in switches]
        for m, a, v in switches:
            setattr(m, a, v)
        try:
            with pdl.enabled(True):
                got = run_tokens(model, args.context, args.tokens, capture, split)
        finally:
            for (m, a, _), v in zip(switches, before, strict=True):
                setattr(m, a, v)
        diff = [int((a != b).sum()) for a, b in zip(plain, got, strict=True)]
        rows.append({"variant": name, "pdl_active": pdl.active(dev), "tokens": args.tokens,
                     "tokens_differing": sum(d > 0 for d in diff), "max_logits_differing": max(diff),
                     "ok": not any(diff)})
    for r in rows:
        print(f"{r['variant']:<14} active={r['pdl_active']} tokens={r['tokens']} "
              f"differing={r['tokens_differing']} ok={r['ok']}")
    if args.out:
        Path(args.out).write_text(json.dumps({"layers": args.layers, "context": args.context, "rows": rows},
                                             indent=2))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
