"""How fast one launch can merely read the routed GLU's bytes (run on the device box).

The routed GLU (10 experts' Q4_K gate/up rows, 18.4 MB) takes ~14-16 us alone on an H100 (tools/moe_lab.py), 42%
of the copy bandwidth, while a Q8_0_R GEMV of 44.8 MB reaches 86%. Before rebuilding the GLU this lab asks what a
launch of that size can reach at all: a kernel that only streams the bytes (each program sums its contiguous
share as int32 words and stores one word) over several program counts, warps and loads in flight per thread,
48 launches back to back in a CUDA graph (each reads its own copy, so L2 is cold as in the step), with and
without programmatic dependent launch, next to the tile-major GLU itself and a device copy of the same bytes.
If the best stream is near the GLU's time, the GLU is at what one launch of its size can do and only overlap with
other launches can shorten the step; if far below it, the GLU's own structure is what to change.

Then the whole MoE window's bytes (GLU, then down): as two launches without a dependency and as one; and with the
down depending on the GLU's results, as two launches (the down's programs load their share before their PDL wait,
as the routed down projections do) against one launch of persistent programs that claim items in order and hand
over through a counter (`_window_kernel`): what a routed-MoE kernel of one launch could win on the handoff alone.

    python tools/stream_lab.py --out stream-lab.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from strata.kernels import gemv as G  # noqa: E402
from strata.kernels import pdl  # noqa: E402
from strata.runtime.bench import copy_bandwidth, git_commit  # noqa: E402
from tools.gpu_check_gemv import time_graph  # noqa: E402
from tools.handoff_lab import nap  # noqa: E402

LAYERS, SLOTS, HIDDEN, INTER = 48, 10, 2560, 640
GLU_BYTES = 2 * SLOTS * INTER * (HIDDEN // 256 * 144)  # 18,432,000
DOWN_BYTES = SLOTS * HIDDEN * (INTER // 32 * 24)  # 12,288,000
SLACK_WORDS = 4096  # past the measured bytes, so that any program count covers them with equal shares


@triton.jit
def _stream_kernel(src_ptr, out_ptr, words_per_program, VEC: tl.constexpr, UNROLL: tl.constexpr,
                   GDC: tl.constexpr = False):
    """Sum of one program's contiguous int32 words: every thread loads UNROLL vectors of VEC words per step, all
    issued before any is used (the loop body's loads are independent)."""
    pdl.started(GDC)
    pdl.wait(GDC)
    pid = tl.program_id(0)
    base = src_ptr + pid.to(tl.int64) * words_per_program
    step: tl.constexpr = VEC * UNROLL * 32  # per warp-row; the layout spreads it over the program's threads
    offs = tl.arange(0, step)
    acc = tl.zeros([step], tl.int32)
    for start in range(0, words_per_program, step):
        acc += tl.load(base + start + offs, mask=start + offs < words_per_program, other=0)
    tl.store(out_ptr + pid, tl.sum(acc, axis=0))


@triton.jit
def _preloaded_kernel(src_ptr, dep_ptr, out_ptr, words_per_program, n_dep, BW: tl.constexpr,
                      GDC: tl.constexpr = False):
    """The routed down's shape: a program's whole share loaded before its PDL wait, then one value the previous
    launch wrote (the dependency) added to its sum."""
    pdl.started(GDC)
    pid = tl.program_id(0)
    offs = tl.arange(0, BW)
    w = tl.load(src_ptr + pid.to(tl.int64) * words_per_program + offs, mask=offs < words_per_program, other=0)
    pdl.wait(GDC)
    tl.store(out_ptr + pid, tl.sum(w, axis=0) + tl.load(dep_ptr + pid % n_dep))


@triton.jit
def _window_kernel(src_ptr, out_ptr, cnt_ptr, n_glu, n_items, glu_words, down_words, down_base,
                   VEC: tl.constexpr, UNROLL: tl.constexpr, BW: tl.constexpr, GDC: tl.constexpr = False):
    """The MoE window's bytes in one launch of persistent programs: items claimed in order from cnt[0], first
    n_glu "GLU" items (glu_words streamed, a sum stored, cnt[1] raised), then "down" items (down_words loaded at
    once, then a wait until cnt[1] == n_glu, then one GLU item's sum added): claimed GLU items are all being
    worked on by running programs before any down item is claimed, so the waits end. The last program to finish
    (cnt[2]) puts the counters back to zero for the next launch."""
    pdl.started(GDC)
    pdl.wait(GDC)
    step: tl.constexpr = VEC * UNROLL * 32
    offs = tl.arange(0, step)
    doffs = tl.arange(0, BW)
    item = tl.atomic_add(cnt_ptr, 1, sem="relaxed", scope="gpu")
    while item < n_items:
        if item < n_glu:
            base = src_ptr + item.to(tl.int64) * glu_words
            acc = tl.zeros([step], tl.int32)
            for start in range(0, glu_words, step):
                acc += tl.load(base + start + offs, mask=start + offs < glu_words, other=0)
            tl.store(out_ptr + item, tl.sum(acc, axis=0))
            tl.debug_barrier()
            tl.atomic_add(cnt_ptr + 1, 1, sem="release", scope="gpu")
        else:
            d = item - n_glu
            w = tl.load(src_ptr + down_base + d.to(tl.int64) * down_words + doffs, mask=doffs < down_words, other=0)
            c = tl.atomic_add(cnt_ptr + 1, 0, sem="acquire", scope="gpu")
            while c < n_glu:
                c = tl.atomic_add(cnt_ptr + 1, nap(c) * 0, sem="acquire", scope="gpu")
            tl.store(out_ptr + item, tl.sum(w, axis=0) + tl.load(out_ptr + d % n_glu))
        item = tl.atomic_add(cnt_ptr, 1, sem="relaxed", scope="gpu")
    if tl.atomic_add(cnt_ptr + 2, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - 1:
        tl.atomic_xchg(cnt_ptr, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(cnt_ptr + 1, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(cnt_ptr + 2, 0, sem="relaxed", scope="gpu")


def window(src: torch.Tensor, out: torch.Tensor, cnt: torch.Tensor, programs: int, warps: int, n_glu: int,
           n_down: int) -> None:
    """One launch of `_window_kernel` over src: GLU_BYTES in n_glu items, then DOWN_BYTES in n_down items."""
    glu_words, down_words = GLU_BYTES // 4 // n_glu, DOWN_BYTES // 4 // n_down
    _window_kernel[(programs,)](src, out, cnt, n_glu, n_glu + n_down, glu_words, down_words, GLU_BYTES // 4,
                                VEC=4, UNROLL=2 * warps, BW=triton.next_power_of_2(down_words), num_warps=warps,
                                **pdl.launch(src.device))


def glu_then_down(src: torch.Tensor, out: torch.Tensor, n_glu: int, n_down: int, warps: int) -> None:
    """The same bytes as two launches: the GLU's streamed by n_glu programs, the down's by n_down programs that
    load their share before their PDL wait, as the routed down projections do."""
    stream(src[:GLU_BYTES // 4 + SLACK_WORDS], out, n_glu, warps, 2)
    down_words = DOWN_BYTES // 4 // n_down
    _preloaded_kernel[(n_down,)](src[GLU_BYTES // 4:], out, out[n_glu:], down_words, n_glu,
                                 BW=triton.next_power_of_2(down_words), num_warps=warps, **pdl.launch(src.device))


def stream(src: torch.Tensor, out: torch.Tensor, programs: int, warps: int, unroll: int) -> None:
    words = triton.cdiv(src.numel() - SLACK_WORDS, programs)  # the last program reads a little of the slack
    _stream_kernel[(programs,)](src, out, words, VEC=4, UNROLL=unroll * warps, num_warps=warps,
                                **pdl.launch(src.device))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--commit", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    bw = copy_bandwidth(dev)
    rows = []

    def case(what: str, calls: list, nbytes: int, per: int = 1, **extra) -> None:
        s = time_graph(calls) * per  # seconds per `per` consecutive calls
        rows.append({"launch": what, "us": s * 1e6, "bytes": nbytes, "fraction_of_copy": nbytes / s / bw, **extra})
        print(f"{what:<58}{s * 1e6:>9.2f} us{nbytes / s / bw:>8.2f} of copy", flush=True)

    out = torch.empty(8192, dtype=torch.int32, device=dev)
    for nbytes, name in ((GLU_BYTES, "glu bytes"), (DOWN_BYTES, "down bytes")):
        bufs = [torch.randint(-2**31, 2**31 - 1, (nbytes // 4 + SLACK_WORDS,), dtype=torch.int32, device=dev,
                              generator=gen) for _ in range(LAYERS)]
        for use_pdl in (False, True):
            pdl.set_enabled(use_pdl)
            for programs in (132, 264, 528, 800, 1600, 3200):
                for warps in (2, 4, 8):
                    for unroll in (1, 2, 4):
                        if programs * warps > 132 * 64:
                            continue
                        case(f"stream {name} p={programs} w={warps} u={unroll} pdl={int(use_pdl)}",
                             [lambda b=b, p=programs, w=warps, u=unroll: stream(b, out, p, w, u) for b in bufs],
                             nbytes, programs=programs, warps=warps, unroll=unroll, pdl=use_pdl)
        dst = torch.empty_like(bufs[0])
        case(f"torch copy {name} (read + write)", [lambda b=b: dst.copy_(b) for b in bufs], 2 * nbytes)
        del bufs, dst
        torch.cuda.empty_cache()

    # the MoE window's bytes (GLU, then down) as two dependent launches against one launch of both
    both = [torch.randint(-2**31, 2**31 - 1, ((GLU_BYTES + DOWN_BYTES) // 4 + SLACK_WORDS,), dtype=torch.int32,
                          device=dev, generator=gen) for _ in range(LAYERS // 2)]
    glu_words, down_words = GLU_BYTES // 4, DOWN_BYTES // 4
    for use_pdl in (False, True):
        pdl.set_enabled(use_pdl)
        for programs, warps in ((800, 4), (1600, 2), (1600, 4)):
            pairs = []
            for b in both:
                pairs.append(lambda b=b, p=programs, w=warps: stream(b[:glu_words + SLACK_WORDS], out, p, w, 2))
                pairs.append(lambda b=b, p=programs, w=warps: stream(b[glu_words:], out, p, w, 2))
            case(f"glu then down bytes, 2 launches p={programs} w={warps} pdl={int(use_pdl)} (per pair)",
                 pairs, GLU_BYTES + DOWN_BYTES, per=2, programs=programs, warps=warps, pdl=use_pdl)
            case(f"glu and down bytes, 1 launch p={programs} w={warps} pdl={int(use_pdl)}",
                 [lambda b=b, p=programs, w=warps: stream(b, out, p, w, 2) for b in both],
                 GLU_BYTES + DOWN_BYTES, programs=programs, warps=warps, pdl=use_pdl)
    # the same with the down's dependency on the GLU: two launches (the down's share loaded before its PDL wait)
    # against one launch of persistent programs handing over through a counter
    cnt = torch.zeros(3, dtype=torch.int32, device=dev)
    big_out = torch.empty(16384, dtype=torch.int32, device=dev)
    pdl.set_enabled(True)
    for n_glu, n_down, warps in ((1600, 800, 4), (1600, 3200, 1), (800, 800, 4)):
        case(f"glu then down, dependent, 2 launches {n_glu}+{n_down} w={warps}",
             [lambda b=b: glu_then_down(b, big_out, n_glu, n_down, warps) for b in both],
             GLU_BYTES + DOWN_BYTES, n_glu=n_glu, n_down=n_down, warps=warps)
    for programs, warps in ((528, 4), (1056, 4), (1056, 2), (2112, 2)):
        for n_glu, n_down in ((1600, 800), (1600, 3200)):
            case(f"glu then down, dependent, 1 launch p={programs} w={warps} {n_glu}+{n_down}",
                 [lambda b=b: window(b, big_out, cnt, programs, warps, n_glu, n_down) for b in both],
                 GLU_BYTES + DOWN_BYTES, programs=programs, warps=warps, n_glu=n_glu, n_down=n_down)
    assert not cnt.any(), "the window kernel left its counters raised"
    del both
    torch.cuda.empty_cache()

    pdl.set_enabled(True)
    x = torch.randn(1, HIDDEN, generator=gen, device=dev).to(torch.bfloat16)
    stacks = [torch.randint(0, 256, (2, SLOTS, INTER, HIDDEN // 256 * 144), dtype=torch.uint8, device=dev,
                            generator=gen) for _ in range(LAYERS)]
    ids = torch.arange(SLOTS, dtype=torch.int32, device=dev)
    case("Q4_K_RT glu 10x640x2560 pdl=1", [lambda s=s: G.gemv_experts_glu(x, s[0], s[1], ids, "Q4_K_RT", HIDDEN,
                                                                         out_dtype=torch.bfloat16) for s in stacks],
         GLU_BYTES)
    pdl.set_enabled(False)
    case("Q4_K_RT glu 10x640x2560 pdl=0", [lambda s=s: G.gemv_experts_glu(x, s[0], s[1], ids, "Q4_K_RT", HIDDEN,
                                                                         out_dtype=torch.bfloat16) for s in stacks],
         GLU_BYTES)
    report = {"commit": args.commit or git_commit(), "gpu": torch.cuda.get_device_name(dev),
              "copy_bandwidth_bytes_per_s": bw, "layers": LAYERS, "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
