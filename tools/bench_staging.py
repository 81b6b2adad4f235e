"""Host time of one decode token's PLE staging (CPU): the table rows gathered into the step's host buffer by
`stored_rows_into` (numpy over the rows' bytes) against the tensor path it replaces (`stored_rows`, then a copy),
for the bundled model (BF16 table) and an IQ4_NL table of as many rows at the real geometry's width (random
bytes). Prints microseconds per call and writes JSON to --out.

    python tools/bench_staging.py --out staging.json
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from strata.runtime.engine import DEFAULT_MODEL, load_weights  # noqa: E402
from strata.weights.quant_tensor import QuantTensor  # noqa: E402


def per_call_us(fn, calls: int = 2000) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    w = load_weights(str(DEFAULT_MODEL))
    name = next(n for n in w.tensors if n.endswith("ple.table"))
    tables = {"bundled " + w[name].kind: w[name]}
    n, cols = w[name].shape[0], 160  # the real geometry's row width (the bundled model's is 16)
    blocks = torch.randint(0, 256, (n, cols // 32 * 18), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    tables["IQ4_NL x160"] = QuantTensor("iq4", blocks, 20, (n, cols))  # random bytes: a gather does not read them
    rows = list(range(3, 3 + 7 * 8, 7))  # 8 rows, as one token of the bundled model hashes to
    out_rows = []
    for label, t in tables.items():
        want = t.stored_rows(torch.tensor(rows))
        buf = torch.empty_like(want).pin_memory() if torch.cuda.is_available() else torch.empty_like(want)
        t.stored_rows_into(rows, buf)
        assert torch.equal(buf, want)
        fast = [per_call_us(lambda t=t, buf=buf: t.stored_rows_into(rows, buf)) for _ in range(3)]
        slow = [per_call_us(lambda t=t, buf=buf: buf.copy_(t.stored_rows(torch.tensor(rows)))) for _ in range(3)]
        out_rows.append({"table": label, "rows": len(rows), "us_stored_rows_into": fast, "us_tensor_path": slow})
        print(f"{label:<16} stored_rows_into {min(fast):7.1f} us   tensor path {min(slow):7.1f} us")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    report = {"what": __doc__.split("\n\n")[0], "machine": platform.machine(), "torch": torch.__version__,
              "commit": commit, "results": out_rows}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
