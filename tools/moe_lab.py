"""Routed-expert launches alone, by where their expert pages lie (run on the device box).

In the decode step the routed GLU takes ~13 us after the routing whatever its instruction count (the q8 mode's
loop is 11.3 us against 12.7 in float on an H100, tools/step_probe.py): a fixed part dominates. This lab times
the GLU (Q4_K_R gate/up, 10 slots of 640 x 2560) and the down projections with their slot sum (Q5_1_R, 10 slots of
2560 x 640) as 48 back-to-back launches in a CUDA graph, one per layer, over expert stacks of the real geometry
(512 experts a layer), with the slots' experts chosen four ways:

* spread: each layer its own stack, 10 random experts of 512 (the step: cold L2, pages all over ~45 GB);
* first10: each layer its own stack, experts 0-9 (cold L2, but each launch reads one contiguous run of pages);
* one-stack: every launch the same stack and the same 10 random experts (L2 and address translation warm);
* and, for scale, a plain row-register GEMV of the same bytes (Q4_K_R 12800 x 2560) in 48 copies, also with K
  split in 5 (one loop step per program), and as 64000 x 512 (each program's bytes contiguous: one step of 8
  rows of 512).

If `spread` is much slower than `first10`, the pages the experts lie on (address translation) cost the time, not
their bytes. The GLU, the 12800 x 2560 GEMV and the Q6_K_R head (248320 x 2560, two copies alternating) are also
timed as their tile-major types (Q4_K_RT, Q6_K_RT: `repack.TILE_LAYOUTS`, a program's words of one K-loop step
together; random bytes either way). Up to 95b6bc3 the lab also timed Q8_0_R and Q5_1_R launches tile-major
(bench/results/2026-12-06-h100-moe-lab-a10d125.json), which no type stores.

    python tools/moe_lab.py --out moe-lab.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from strata.kernels import gemv as G  # noqa: E402
from strata.kernels import pdl  # noqa: E402
from strata.runtime.bench import copy_bandwidth, git_commit  # noqa: E402
from tools.gpu_check_gemv import time_graph  # noqa: E402

LAYERS, EXPERTS, SLOTS, HIDDEN, INTER = 48, 512, 10, 2560, 640
ROW_BYTES = {"Q4_K_R": HIDDEN // 256 * 144, "Q5_1_R": INTER // 32 * 24}


def stacks(kind: str, rows: int, layers: int, gen: torch.Generator) -> list[torch.Tensor]:
    """`layers` expert stacks (EXPERTS, rows, row bytes) of random bytes (the time does not depend on values)."""
    return [torch.randint(0, 256, (EXPERTS, rows, ROW_BYTES[kind]), dtype=torch.uint8, device="cuda", generator=gen)
            for _ in range(layers)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--commit", default=None)
    args = ap.parse_args()
    pdl.set_enabled(True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    dev = torch.device("cuda")
    bw = copy_bandwidth(dev)
    rand_ids = [torch.randperm(EXPERTS, generator=gen, device="cuda")[:SLOTS].to(torch.int32) for _ in range(LAYERS)]
    first10 = torch.arange(SLOTS, dtype=torch.int32, device="cuda")
    x = torch.randn(1, HIDDEN, generator=gen, device="cuda").to(torch.bfloat16)
    xs = torch.randn(SLOTS, INTER, generator=gen, device="cuda").to(torch.bfloat16)
    sw = torch.softmax(torch.randn(SLOTS, generator=gen, device="cuda"), 0)
    rows = []

    def case(what: str, layout: str, calls: list, nbytes: int) -> None:
        s = time_graph(calls)
        rows.append({"launch": what, "experts": layout, "us": s * 1e6, "bytes": nbytes,
                     "fraction_of_copy": nbytes / s / bw})
        print(f"{what:<34}{layout:<12}{s * 1e6:>9.2f} us{nbytes / s / bw:>8.2f} of copy", flush=True)

    gate, up = stacks("Q4_K_R", INTER, LAYERS, gen), stacks("Q4_K_R", INTER, LAYERS, gen)
    glu_bytes = 2 * SLOTS * INTER * ROW_BYTES["Q4_K_R"]

    def glu(layer: int, ids: torch.Tensor):
        return lambda: G.gemv_experts_glu(x, gate[layer], up[layer], ids, "Q4_K_R", HIDDEN, out_dtype=torch.bfloat16)
    case("Q4_K_R glu 10x640x2560", "spread", [glu(i, rand_ids[i]) for i in range(LAYERS)], glu_bytes)
    case("Q4_K_R glu 10x640x2560", "first10", [glu(i, first10) for i in range(LAYERS)], glu_bytes)
    case("Q4_K_R glu 10x640x2560", "one-stack", [glu(0, rand_ids[0]) for _ in range(LAYERS)], glu_bytes)

    def glu_tiled(layer: int, ids: torch.Tensor):
        return lambda: G.gemv_experts_glu(x, gate[layer], up[layer], ids, "Q4_K_RT", HIDDEN,
                                          out_dtype=torch.bfloat16)
    case("Q4_K_RT glu 10x640x2560", "spread", [glu_tiled(i, rand_ids[i]) for i in range(LAYERS)], glu_bytes)
    del gate, up
    torch.cuda.empty_cache()

    flat = [torch.randint(0, 256, (2 * SLOTS * INTER, ROW_BYTES["Q4_K_R"]), dtype=torch.uint8, device="cuda",
                          generator=gen) for _ in range(LAYERS)]
    case("Q4_K_R 12800x2560 (same bytes)", "contiguous",
         [lambda w=w: G.gemv(x, w, "Q4_K_R", HIDDEN, out_dtype=torch.bfloat16) for w in flat], glu_bytes)
    case("Q4_K_RT 12800x2560 (same bytes)", "contiguous",
         [lambda w=w: G.gemv(x, w, "Q4_K_RT", HIDDEN, out_dtype=torch.bfloat16) for w in flat], glu_bytes)
    case("Q4_K_R 12800x2560 split 5", "contiguous",
         [lambda w=w: G.gemv(x, w, "Q4_K_R", HIDDEN, out_dtype=torch.bfloat16, split_k=5) for w in flat], glu_bytes)
    del flat
    short = [torch.randint(0, 256, (2 * SLOTS * INTER * 5, ROW_BYTES["Q4_K_R"] // 5), dtype=torch.uint8,
                           device="cuda", generator=gen) for _ in range(LAYERS)]
    x512 = x[:, :512].contiguous()
    case("Q4_K_R 64000x512 (same bytes)", "contiguous",
         [lambda w=w: G.gemv(x512, w, "Q4_K_R", 512, out_dtype=torch.bfloat16) for w in short], glu_bytes)
    del short
    qkvz = [torch.randint(0, 256, (16480, HIDDEN // 256 * 272), dtype=torch.uint8, device="cuda", generator=gen)
            for _ in range(LAYERS)]
    case("Q8_0_R 16480x2560", "contiguous",
         [lambda w=w: G.gemv(x, w, "Q8_0_R", HIDDEN, out_dtype=torch.bfloat16) for w in qkvz], qkvz[0].numel())
    del qkvz
    torch.cuda.empty_cache()

    down = stacks("Q5_1_R", HIDDEN, LAYERS, gen)
    down_bytes = SLOTS * HIDDEN * ROW_BYTES["Q5_1_R"]

    def dsum(layer: int, ids: torch.Tensor):
        return lambda: G.gemv_experts_sum(xs, down[layer], ids, sw, "Q5_1_R", INTER, out_dtype=torch.bfloat16)
    case("Q5_1_R down+sum 10x2560x640", "spread", [dsum(i, rand_ids[i]) for i in range(LAYERS)], down_bytes)
    case("Q5_1_R down+sum 10x2560x640", "first10", [dsum(i, first10) for i in range(LAYERS)], down_bytes)
    case("Q5_1_R down+sum 10x2560x640", "one-stack", [dsum(0, rand_ids[0]) for _ in range(LAYERS)], down_bytes)
    del down
    torch.cuda.empty_cache()
    head = [torch.randint(0, 256, (248320, HIDDEN // 256 * 224), dtype=torch.uint8, device="cuda", generator=gen)
            for _ in range(2)]
    calls = [lambda w=w: G.gemv(x, w, "Q6_K_R", HIDDEN, out_dtype=torch.bfloat16) for w in head] * 4
    case("Q6_K_R 248320x2560 (head)", "contiguous", calls, head[0].numel())
    calls = [lambda w=w: G.gemv(x, w, "Q6_K_RT", HIDDEN, out_dtype=torch.bfloat16) for w in head] * 4
    case("Q6_K_RT 248320x2560 (head)", "contiguous", calls, head[0].numel())
    report = {"commit": args.commit or git_commit(), "gpu": torch.cuda.get_device_name(dev),
              "copy_bandwidth_bytes_per_s": bw, "layers": LAYERS, "experts": EXPERTS, "slots": SLOTS, "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
