"""Where the row-register GEMVs' programs spend a captured decode step (run on the device box).

The timeline of a replay (`strata bench --timeline`) gives each launch's first start and last end; inside a
launch, what the programs wait for is not in it. Here the launches of the chosen classes (`gemv_rr.PROBE`:
"ids" the routed GLU, "settled-ids" the routed down projections, "plain" every other row-register GEMV) record
one row per program (`gemv_rr.Probe`: SM, start, PDL wait passed, K loop ended, end; global-timer ns) in a step
captured at the real geometry (synthetic model, bf16), and one replay's rows are summarised per launch, then as
the median over the launches of the same matrix (the 48 layers):

* start: when the launch's programs start, after its first program (p50, p90, max), and the most programs one SM
  ran; waited: when they pass their PDL wait (launches by unsettled expert ids);
* loop: each program's K loop (from its wait, or its start) and the time from its loop to its end (stores, split-K
  tickets, the slot sum);
* end: when the programs end, after the first start (p50, max: the launch's span);
* at: the launch's first start after the replay's first probed program (where it sits in the token);
* per SM: programs per SM, each SM's span (its first loop start to its last end) and how it grows with the SM's
  program count (`sm_stats`): spans that grow with the count mean the launch is bound by what an SM issues.

    python tools/step_probe.py --classes ids,settled-ids --out probe.json

The probe adds five stores per program; compare its replay time with an unprobed one (printed) before reading
small differences. The global timer's resolution is printed too (the smallest step between distinct readings).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from strata.kernels import gemv_rr, pdl  # noqa: E402
from strata.model.model import Model  # noqa: E402
from strata.runtime import bench  # noqa: E402
from strata.runtime.placement import fast_ops, gpu_layout  # noqa: E402
from strata.runtime.synthetic import TypeMix, real_config, synthetic_weights  # noqa: E402

SM, START, WAITED, LOOPED, END = range(5)


def _pct(v: np.ndarray, q: float) -> float:
    return float(np.percentile(v, q)) / 1e3 if v.size else 0.0


def launch_stats(rows: np.ndarray, t0: int) -> dict:
    """One launch's programs (rows of `Probe.FIELDS`) in microseconds: see the module docstring."""
    s0 = int(rows[:, START].min())
    start = rows[:, START] - s0
    waited = rows[:, WAITED]
    has_wait = bool((waited > 0).all())
    loop_from = waited if has_wait else rows[:, START]
    out = {"programs": int(rows.shape[0]), "at": (s0 - t0) / 1e3,
           "start_p50": _pct(start, 50), "start_p90": _pct(start, 90), "start_max": _pct(start, 100),
           "loop_p50": _pct(rows[:, LOOPED] - loop_from, 50), "loop_p90": _pct(rows[:, LOOPED] - loop_from, 90),
           "after_loop_p50": _pct(rows[:, END] - rows[:, LOOPED], 50),
           "end_p50": _pct(rows[:, END] - s0, 50), "end_max": _pct(rows[:, END] - s0, 100)}
    if has_wait:
        out["waited_p50"] = _pct(waited - s0, 50)
        out["waited_max"] = _pct(waited - s0, 100)
    out.update(sm_stats(rows, loop_from))
    return out


def sm_stats(rows: np.ndarray, loop_from: np.ndarray) -> dict:
    """How the launch's work sat on its SMs: the SMs used, programs per SM (min, p50, max), each SM's span from
    its programs' first loop start to their last end (p50, max), and how the span grows with the SM's program
    count (least-squares us per program, and the correlation). A launch bound by what one SM can issue has spans
    that grow with the count; one bound by memory has spans that do not."""
    sm = rows[:, SM].astype(np.int64)
    used = np.unique(sm)
    counts = np.array([(sm == s).sum() for s in used], dtype=np.float64)
    spans = np.array([(rows[sm == s, END].max() - loop_from[sm == s].min()) / 1e3 for s in used])
    out = {"sms": int(used.size), "min_per_sm": int(counts.min()), "per_sm_p50": float(np.median(counts)),
           "max_per_sm": int(counts.max()),
           "sm_span_p50": float(np.median(spans)), "sm_span_max": float(spans.max())}
    if used.size > 2 and counts.std() > 0 and spans.std() > 0:
        out["us_per_program"] = float(np.polyfit(counts, spans, 1)[0])
        out["span_count_r"] = float(np.corrcoef(counts, spans)[0, 1])
    return out


def timer_step(data: np.ndarray) -> float:
    """The smallest step between distinct global-timer readings, ns (its resolution, at best)."""
    v = np.unique(data[:, START:].reshape(-1))
    v = v[v > 0]
    d = np.diff(v)
    return float(d[d > 0].min()) if d.size and (d > 0).any() else 0.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--classes", default="ids,settled-ids", help="launch classes to probe (ids, settled-ids, plain)")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--activations", choices=("float", "q8"), default="float")
    ap.add_argument("--out", default=None)
    ap.add_argument("--commit", default=None, help="commit id to record (default: git rev-parse HEAD)")
    args = ap.parse_args()
    classes = [c for c in args.classes.split(",") if c]
    unknown = set(classes) - set(gemv_rr.RELEASE)
    if unknown:
        raise SystemExit(f"unknown launch classes {sorted(unknown)}; known: {sorted(gemv_rr.RELEASE)}")
    dev = torch.device("cuda")
    pdl.set_enabled(True)
    w = gpu_layout(synthetic_weights(real_config(), TypeMix(), dev), inplace=True, dtype=torch.bfloat16)
    model = Model(w, torch.bfloat16, dev, fast_ops(streams=True, activations=args.activations))
    replay_ms = {}
    for probed in (False, True):
        gemv_rr.PROBE.clear()
        probe = gemv_rr.Probe(dev, rows=1 << 21) if probed else None
        if probed:
            gemv_rr.PROBE.update({c: probe for c in classes})
        step, tok, _ = bench._ready_step(model, args.context, 16, 1, 0, True)
        for _ in range(8):
            tok = int(step.next_token(tok))
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(32):
            step.replay()
        b.record()
        b.synchronize()
        replay_ms["probed" if probed else "unprobed"] = a.elapsed_time(b) / 32
        if probed:
            probe.buf.zero_()
            tok = int(step.next_token(tok))
            torch.cuda.synchronize()
        del step
        gc.collect()
        torch.cuda.empty_cache()
    gemv_rr.PROBE.clear()
    data = probe.buf.cpu().numpy()
    ours = [(label, cls, first, grid) for label, cls, first, grid in probe.launches
            if data[first:first + grid[0] * grid[1] * grid[2], START].min() > 0]  # the replayed graph's launches
    t0 = min(int(data[f:f + g[0] * g[1] * g[2], START].min()) for _, _, f, g in ours)
    per_label: dict[str, list[dict]] = {}
    for label, cls, first, grid in ours:
        st = launch_stats(data[first:first + grid[0] * grid[1] * grid[2]], t0)
        per_label.setdefault(f"{label} [{cls}]", []).append(st)
    summary = {}
    for label, sts in per_label.items():
        keys = [k for k in sts[0] if all(k in s for s in sts)]
        summary[label] = {"launches": len(sts), **{k: statistics.median(s[k] for s in sts) for k in keys if k != "at"}}
    print(f"replay ms: unprobed {replay_ms['unprobed']:.3f}, probed {replay_ms['probed']:.3f}; timer step "
          f"{timer_step(data[[i for _, _, f, g in ours for i in range(f, f + g[0] * g[1] * g[2])]]):.0f} ns")
    for cols in (("programs", "max_per_sm", "start_p50", "start_max", "waited_p50", "waited_max", "loop_p50",
                  "loop_p90", "after_loop_p50", "end_p50", "end_max"),
                 ("min_per_sm", "per_sm_p50", "max_per_sm", "sm_span_p50", "sm_span_max", "us_per_program",
                  "span_count_r")):
        print(f"{'launch (median over launches, us)':<34}{'n':>3}" + "".join(f"{c[:14]:>15}" for c in cols))
        for label, s in summary.items():
            print(f"{label:<34}{s['launches']:>3}" + "".join(f"{s.get(c, float('nan')):>15.2f}" for c in cols))
    report = {"commit": args.commit or bench.git_commit(), "gpu": torch.cuda.get_device_name(dev),
              "context": args.context, "activations": args.activations, "classes": classes, "replay_ms": replay_ms,
              "summary": summary, "launches": {k: v for k, v in per_label.items()}}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
