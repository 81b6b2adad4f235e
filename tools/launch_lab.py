"""Host time of the decode step's graph launch calls, before and after a profiler session (run on the device box).

`strata bench` once reported a host share per token that grew with the context (0.2 ms at 4K, 0.5-0.7 at 128K):
it profiled the first context before timing the others, and once `torch.profiler` has run in a process, every
later launch call is slower (its activity tracing stays attached). This lab shows it directly: for each context in
order it captures the step, times each graph's `replay()` call (with the GPU idle, back to back, and the rest graph
right after the front one), and for a context written with a trailing "p" then runs a profiler session over two
steps, so the contexts after it are timed in a profiled process:

    python tools/launch_lab.py 4096,131072p,4096,131072 --out launch-lab.json

(bench/results/2026-12-05-h200-launch-lab-88f1a67.json: the rest graph's launch call 0.0075 ms at 4K before the
profiler ran, 0.186 ms after it; 0.0087 and 0.215 ms at 128K.)
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from strata.kernels import pdl  # noqa: E402
from strata.model.model import Model  # noqa: E402
from strata.runtime import bench  # noqa: E402
from strata.runtime.graph import DecodeStep  # noqa: E402
from strata.runtime.placement import fast_ops, gpu_layout  # noqa: E402
from strata.runtime.synthetic import TypeMix, real_config, synthetic_weights  # noqa: E402


def launch_ms(call, idle: bool, repeats: int = 20, before=None) -> float:
    """Median host milliseconds of `call()` (with the device idle before each call, or back to back; `before()`
    run untimed just before it)."""
    times = []
    for _ in range(repeats):
        if idle:
            torch.cuda.synchronize()
        if before is not None:
            before()
        t0 = time.perf_counter()
        call()
        times.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("contexts", help="comma-separated contexts, in order; a trailing p profiles after timing")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    pdl.set_enabled(True)
    w = gpu_layout(synthetic_weights(real_config(), TypeMix(), dev), inplace=True, dtype=torch.bfloat16)
    model = Model(w, torch.bfloat16, dev, fast_ops(streams=True))
    rows = []
    for spec in args.contexts.split(","):
        ctx = int(spec.rstrip("p"))
        step = DecodeStep(model, capacity=ctx + 200, capture=True)
        bench.fill_state(step, ctx, torch.Generator(device=dev).manual_seed(0))
        tok = 11
        for _ in range(8):
            tok = int(step.next_token(tok))
        front, rest = step.graphs["logits"]
        row = {"graph0_idle_launch_ms": launch_ms(front.replay, True),
               "graph0_back_to_back_launch_ms": launch_ms(front.replay, False),
               "graph1_idle_launch_ms": launch_ms(rest.replay, True),
               "graph1_back_to_back_launch_ms": launch_ms(rest.replay, False),
               "rest_after_front_launch_ms": launch_ms(rest.replay, True, before=front.replay),
               "context": ctx}
        if spec.endswith("p"):
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(2):
                    tok = int(step.next_token(tok))
            row["profiled_after"] = len(prof.events())
        rows.append(row)
        print(spec, json.dumps(row), flush=True)
        del step, front, rest
        gc.collect()
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
