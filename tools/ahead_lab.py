"""Where a decode step run ahead of the host spends its time (run on the device box).

The synthetic model at the real geometry with the PLE tables where the GPU reads them (`--ple-table pinned` or
`device`), its captured step at 4K, timed in one process:

  replay normal                 the one-by-one graph replayed back to back (its first node copies the staged inputs)
  replay ahead                  the run-ahead graph back to back (its first launch feeds the inputs on the device)
  ahead + park                  the same, each followed by the copy of the chosen id to the host and its event
  ahead + park + sync           the same, the host waiting for each id before the next launch (no running ahead)
  ids_ahead (host interval)     `DecodeStep.ids_ahead`, the interval between two ids read on the host
  one by one (host interval)    `DecodeStep.next_token_id` per id, the same interval

    python tools/ahead_lab.py --ple-table pinned --commit HASH --out ahead-lab.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from strata.model.model import Model  # noqa: E402
from strata.runtime import bench  # noqa: E402
from strata.runtime.host_memory import place_ple_tables  # noqa: E402
from strata.runtime.placement import fast_ops, gpu_layout  # noqa: E402
from strata.runtime.synthetic import TypeMix, real_config, synthetic_weights  # noqa: E402


def graph_ms(fn, n: int) -> float:  # noqa: ANN001 - a callable launching one step
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    a.record()
    for _ in range(n):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ple-table", default="pinned", choices=("pinned", "device"))
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--commit", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev, T = torch.device("cuda"), args.tokens
    cfg = real_config() if args.layers == 48 else real_config(num_hidden_layers=args.layers, layer_types=None)
    w = gpu_layout(synthetic_weights(cfg, TypeMix(), dev), inplace=True, dtype=torch.bfloat16)
    w, how = place_ple_tables(w, args.ple_table, dev)
    model = Model(w, torch.bfloat16, dev, fast_ops())
    step, tok, _ = bench._ready_step(model, 4096, T, 3 * args.repeats + 1, 0, True)
    if not step.can_run_ahead:
        raise SystemExit("the step cannot run ahead")
    ids = step.ids_ahead(tok)
    for _ in range(4):  # captures the run-ahead graph
        tok = next(ids)
    ids.close()
    normal, ahead = step.graphs["logits"][0], step.graphs["logits+ahead"][0]

    def park() -> None:
        ahead.replay()
        step._park(0)

    def park_sync() -> None:
        park()
        step._slot_done[0].synchronize()

    res: dict[str, list[float]] = {}
    for _ in range(args.repeats):
        res.setdefault("replay normal", []).append(graph_ms(normal.replay, T))
        res.setdefault("replay ahead", []).append(graph_ms(ahead.replay, T))
        res.setdefault("ahead + park", []).append(graph_ms(park, T))
        res.setdefault("ahead + park + sync", []).append(graph_ms(park_sync, T))
        ids = step.ids_ahead(tok)
        next(ids)
        t0 = time.perf_counter()
        for _ in range(T):
            tok = next(ids)
        res.setdefault("ids_ahead (host interval)", []).append((time.perf_counter() - t0) * 1e3 / T)
        ids.close()
        tok = step.next_token_id(tok)
        t0 = time.perf_counter()
        for _ in range(T):
            tok = step.next_token_id(tok)
        res.setdefault("one by one (host interval)", []).append((time.perf_counter() - t0) * 1e3 / T)
    for k, v in res.items():
        print(f"{k:<30} " + " ".join(f"{x:.3f}" for x in v))
    if args.out:
        Path(args.out).write_text(json.dumps({"commit": args.commit or bench.git_commit(),
                                              "gpu": torch.cuda.get_device_name(dev), "ple_table": how,
                                              "layers": args.layers, "context": 4096, "tokens": T,
                                              "ms_per_token": res}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
