"""What one kernel-to-kernel handoff costs in a captured chain: the PDL wait against a flag the producer raises.

The decode step is a chain of ~13 dependent launches per layer, each ending a few microseconds after the one it
waits for whatever its bytes (docs/performance.md, What is next). Two ways to hand data from one launch to the
next are timed here on a chain of identical small kernels captured in one CUDA graph, each reading every output
of the kernel before it and writing one value per program:

  pdl     the decode step's rule: `started` first, then `pdl.wait` (the previous grid complete and flushed)
  flag    `started` first, then spin on the previous kernel's counter until every one of its programs has
          raised it (an acquire load); each program raises its own kernel's counter after its store (release)
  plain   no PDL: each launch waits for the previous one to finish before its programs are scheduled
  free    PDL and no dependency at all (reads whatever is there): the launch chain's own floor

With `--work BYTES` each program first streams BYTES of a weight buffer (before its wait: stored bytes), so a
launch has a realistic body. Output: microseconds per kernel (graph replay time / chain length) per mode,
programs per launch and work:

    python tools/handoff_lab.py --programs 1,132,1024 --work 0,16384 --out handoff.json
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

from strata.kernels import pdl  # noqa: E402

MODES = {"pdl": 0, "flag": 1, "plain": 0, "free": 2}


@triton.jit
def nap(c):
    """A short sleep between polls, so spinning programs leave the SM's issue slots to the producers."""
    return tl.inline_asm_elementwise("nanosleep.u32 64; mov.b32 $0, $1;", "=r,r", [c], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _link_kernel(src_ptr, dst_ptr, w_ptr, cnt_in, cnt_out, ack_in, G_SRC, G,
                 MODE: tl.constexpr, WORK: tl.constexpr, BG: tl.constexpr, GDC: tl.constexpr = False):
    pid = tl.program_id(0)
    pdl.started(GDC)
    acc = tl.zeros([1024], tl.float32)
    if WORK > 0:  # stored bytes: may precede the wait
        for i in tl.static_range(0, WORK // 4096):
            acc += tl.load(w_ptr + pid * (WORK // 4) + i * 1024 + tl.arange(0, 1024))
    if MODE == 0:
        pdl.wait(GDC)
    elif MODE == 1:
        c = tl.atomic_add(cnt_in, 0, sem="acquire", scope="gpu")
        while c < G_SRC:
            c = tl.atomic_add(cnt_in, nap(c) * 0, sem="acquire", scope="gpu")
        # the last of this launch's programs to get here puts the producer's counter back for the next replay
        if tl.atomic_add(ack_in, 1, sem="relaxed", scope="gpu") == G - 1:
            tl.atomic_xchg(cnt_in, 0, sem="relaxed", scope="gpu")
            tl.atomic_xchg(ack_in, 0, sem="relaxed", scope="gpu")
    offs = tl.arange(0, BG)
    x = tl.sum(tl.load(src_ptr + offs, mask=offs < G_SRC, other=0.0), axis=0)
    tl.store(dst_ptr + pid, x * 0.5 + tl.sum(acc, axis=0) * 1e-9 + pid)
    if MODE == 1:
        tl.debug_barrier()
        tl.atomic_add(cnt_out, 1, sem="release", scope="gpu")


def chain_us(mode: str, programs: int, work: int, length: int, replays: int,
             dev: torch.device) -> tuple[float, torch.Tensor]:
    """Microseconds per kernel of a captured chain of `length` launches (the median replay), and the chain's
    outputs after the last replay."""
    bufs = torch.zeros(length + 1, programs, device=dev)
    w = torch.randn(programs * max(work, 4) // 4, device=dev, generator=torch.Generator(dev).manual_seed(0))
    cnt = torch.zeros(length + 1, dtype=torch.int32, device=dev)
    ack = torch.zeros(length + 1, dtype=torch.int32, device=dev)
    cnt[0] = programs  # the chain's input is ready
    use_pdl = mode != "plain"
    launch = {"GDC": True, "launch_pdl": True} if use_pdl else {}
    bg = triton.next_power_of_2(programs)

    def run() -> None:
        for k in range(length):
            _link_kernel[(programs,)](bufs[k], bufs[k + 1], w, cnt[k:], cnt[k + 1:], ack[k:], programs, programs,
                                      MODE=MODES[mode], WORK=work, BG=bg, num_warps=4, **launch)

    first = mode == "flag"
    run()  # compile
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            run()
    torch.cuda.synchronize()
    cnt.zero_()
    cnt[0] = programs
    ack.zero_()
    for _ in range(3):
        graph.replay()
        if first:  # the chain's input counter is consumed by the first launch; raise it again
            cnt[0] = programs
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        if first:
            cnt[0] = programs
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / length)
    times.sort()
    return times[len(times) // 2], bufs.clone()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--programs", default="1,132,1024")
    ap.add_argument("--work", default="0,16384", help="bytes each program streams before its wait (multiples of 4096)")
    ap.add_argument("--modes", default="free,pdl,flag,plain")
    ap.add_argument("--length", type=int, default=200)
    ap.add_argument("--replays", type=int, default=30)
    ap.add_argument("--commit", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    rows = []
    for work in (int(v) for v in args.work.split(",")):
        for programs in (int(v) for v in args.programs.split(",")):
            ref = None
            row = {"programs": programs, "work_bytes": work}
            for mode in args.modes.split(","):
                us, out = chain_us(mode, programs, work, args.length, args.replays, dev)
                row[f"{mode}_us"] = round(us, 3)
                if mode in ("pdl", "flag", "plain"):  # the dependent modes must compute the same chain
                    if ref is None:
                        ref = out
                    row[f"{mode}_same"] = bool(torch.equal(ref, out))
            rows.append(row)
            print(json.dumps(row), flush=True)
    result = {"commit": args.commit, "gpu": torch.cuda.get_device_name(dev), "length": args.length, "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
