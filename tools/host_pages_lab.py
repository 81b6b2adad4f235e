"""What a decode token's PLE row gather costs the host, by how the table's pages are mapped (CPU; run on the
device box, whose hosts differ).

`strata bench` keeps the synthetic PLE table (320M rows, ~23 GB) in untouched zero pages, so each token's 16 rows
mostly land on pages no token touched before, and every such read is a page fault. The bench's hosts staged a
token in 0.02-0.17 ms; this lab times the same gather (16 random rows of 72 bytes into a buffer, numpy) over:

* untouched: anonymous zero pages, never touched (the bench's table);
* hugepage: the same, advised MADV_HUGEPAGE before any read (a read then maps a 2 MB zero page where transparent
  huge pages allow it);
* resident: rows of a 1 GB range whose pages were all touched first (a table held in RAM);

and prints the host's transparent-huge-page settings.

    python tools/host_pages_lab.py --out host-pages.json
"""

from __future__ import annotations

import argparse
import json
import mmap
import platform
import sys
import time
from pathlib import Path

import numpy as np

ROWS, ROW_BYTES, PER_TOKEN = 320_001_536, 72, 16


def thp_settings() -> dict[str, str]:
    out = {}
    for name in ("enabled", "defrag"):
        try:
            out[name] = Path(f"/sys/kernel/mm/transparent_hugepage/{name}").read_text().strip()
        except OSError as e:
            out[name] = f"unreadable: {e}"
    return out


def table(rows: int, advice: int | None) -> tuple[mmap.mmap, np.ndarray]:
    m = mmap.mmap(-1, rows * ROW_BYTES)
    if advice is not None:
        m.madvise(advice)
    return m, np.frombuffer(m, dtype=np.uint8).reshape(rows, ROW_BYTES)


def gather_us(t: np.ndarray, rows: int, tokens: int, rng: np.random.Generator) -> list[float]:
    """Microseconds per token of 16 random rows gathered into one buffer, for each of `tokens` tokens."""
    buf = np.empty((PER_TOKEN, ROW_BYTES), dtype=np.uint8)
    picks = rng.integers(0, rows, size=(tokens, PER_TOKEN))
    times = []
    for r in picks:
        t0 = time.perf_counter()
        np.take(t, r, axis=0, out=buf)
        times.append((time.perf_counter() - t0) * 1e6)
    return times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--tokens", type=int, default=2000)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    rows_out = []

    def case(name: str, t: np.ndarray, rows: int) -> None:
        us = gather_us(t, rows, args.tokens, rng)
        us.sort()
        row = {"table": name, "rows": rows, "tokens": args.tokens, "median_us": us[len(us) // 2],
               "p90_us": us[int(len(us) * 0.9)], "mean_us": sum(us) / len(us)}
        rows_out.append(row)
        print(f"{name:<12}{rows:>12} rows  median {row['median_us']:8.2f} us  p90 {row['p90_us']:8.2f}  "
              f"mean {row['mean_us']:8.2f}", flush=True)

    m, t = table(ROWS, None)
    case("untouched", t, ROWS)
    del t
    m.close()
    m, t = table(ROWS, getattr(mmap, "MADV_HUGEPAGE", None))
    case("hugepage", t, ROWS)
    del t
    m.close()
    small = (1 << 30) // ROW_BYTES
    m, t = table(small, None)
    t[:, 0] = 1  # touch every page
    case("resident", t, small)
    del t
    m.close()
    report = {"host": platform.node(), "python": platform.python_version(), "thp": thp_settings(),
              "row_bytes": ROW_BYTES, "rows_per_token": PER_TOKEN, "cases": rows_out}
    print(json.dumps(report["thp"]))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
