"""Host time of one decode token's PLE staging (CPU): the table rows gathered into the step's host buffer by
`stored_rows_into` (numpy over the rows' bytes) against the tensor path it replaces (`stored_rows`, then a copy),
for the bundled model (BF16 table) and an IQ4_NL table of as many rows at the real geometry's width (random
bytes). Prints microseconds per call and writes JSON to --out.

With --real-geometry it also times what the decode step's host does for each token at the real geometry
(`ple_rows_into`: the n-gram hash, the context's update and the gather of 16 rows into the step's byte buffer)
over a zero table of the real row count in untouched host pages (as `strata bench` builds it: each token's rows
mostly land on pages no token touched before), for random tokens.

    python tools/bench_staging.py --out staging.json
    python tools/bench_staging.py --real-geometry --out staging.json
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


def real_geometry_staging(tokens: int, table_rows_base: int | None) -> dict:
    """us per token of `ple_rows_into` at the real geometry (three runs over fresh random tokens)."""
    import random

    from strata.model.ple import ple_rows_into
    from strata.runtime.state import PLEState
    from strata.runtime.synthetic import TypeMix, real_config, zero_table

    cfg = real_config(**({"ngram_vocab_size_base": table_rows_base} if table_rows_base else {}))
    layer, geo = next(iter(cfg.ple.items()))
    table = zero_table(f"L{layer}.ple.table", (geo.rows, cfg.ple_head_dim), TypeMix().ple_table, "cpu")
    state = PLEState.empty(cfg, torch.bfloat16, "cpu")
    out = torch.zeros(cfg.ngram_heads, table.data.shape[1], dtype=torch.uint8)
    raw = out.numpy()  # the step's buffer as it hands it over (numpy bytes), or the tensor where that is refused
    w = {table.name: table}
    try:
        ple_rows_into(1, w, layer, cfg, state, raw)
    except AttributeError:
        raw = out
    rng = random.Random(0)
    runs = []
    for _ in range(3):
        toks = [rng.randrange(cfg.vocab_size) for _ in range(tokens)]
        t0 = time.perf_counter()
        for tok in toks:
            ple_rows_into(tok, w, layer, cfg, state, raw)
        runs.append((time.perf_counter() - t0) / tokens * 1e6)
    print(f"real geometry: {geo.rows} rows x {table.data.shape[1]} bytes, ple_rows_into {min(runs):7.1f} us per token"
          f" (buffer: {type(raw).__name__})")
    return {"table_rows": geo.rows, "row_bytes": table.data.shape[1], "tokens": tokens,
            "buffer": type(raw).__name__, "us_per_token": runs}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=None)
    ap.add_argument("--real-geometry", action="store_true", help="also time a token's staging at the real geometry")
    ap.add_argument("--tokens", type=int, default=5000, help="tokens per run of --real-geometry")
    ap.add_argument("--table-rows-base", type=int, default=None,
                    help="--real-geometry with this n-gram vocabulary base instead of the real one (a smaller table)")
    ap.add_argument("--commit", default=None, help="the commit to record (where the tree has no .git)")
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
    real = real_geometry_staging(args.tokens, args.table_rows_base) if args.real_geometry else None
    commit = args.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                           text=True).stdout.strip()
    report = {"what": __doc__.split("\n\n")[0], "machine": platform.machine(), "torch": torch.__version__,
              "commit": commit, "results": out_rows, **({"real_geometry": real} if real else {})}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
