"""GPU check of the fused decode kernels at the real geometry (run on the device box, < 2 minutes).

For each kernel: correctness against its reference twin on random inputs (float32, where both sides compute the
same math and differ only in accumulation order, so the bound is tight; and bfloat16, the production dtype,
where rounded intermediates may flip by one ulp), capture in a CUDA graph (decode runs as one graph) and a
replay that must equal the eager call, and timings with CUDA events (warm-up, then the median): eager per call,
per call inside a graph of 10 back-to-back calls (what the captured step pays), and the reference's eager time.
Tuning knobs are swept where they exist. Each check is isolated: a failure is recorded and the next one runs.
Prints a table and writes JSON to --out; exits 1 when any check failed.

Geometry: H=2560, S=4, R=320; GDN nk=16 nv=48 dk=dv=128, conv 4; QSA Hq=24 Hkv=2 hd=256, indexer 4 x 128,
budget 2048, ratio 4 (selection width 2051), at contexts 4K and 128K inside a 128K-capacity cache.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from strata.config import ModelConfig
from strata.kernels import attention, gdn, hyper, sample
from strata.kernels.select import select_blocks, select_blocks_wide
from strata.model.attention import attend_ref
from strata.model.gdn import GDNParams, gdn_core_ref
from strata.model.hyper import hc_read_ref
from strata.model.ops import linear_ref
from strata.model.qsa import select_tokens
from strata.runtime.state import GDNState, QSAState
from strata.weights.tensor import DenseTensor

DEV = torch.device("cuda")
CAPACITY = 128 * 1024
CONTEXTS = {"4K": 4096, "128K": CAPACITY}
# relative max error bounds (max |got - want| / max |want|): fp32 = accumulation order only; bf16 = a flipped
# rounding of a bf16 intermediate (2^-8 relative) propagated through the rest of the op
TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}
SWEEP_DEADLINE_S = 60.0  # past this, skip the tuning sweeps ...
CHECK_DEADLINE_S = 100.0  # ... and past this, start no further check: the whole run stays under 2 minutes
START = time.perf_counter()


def real_config() -> ModelConfig:
    layers = ("linear_attention",) * 3 + ("indexed_attention",)
    return ModelConfig(
        vocab_size=248320, hidden_size=2560, num_hidden_layers=4, num_attention_heads=24, num_key_value_heads=2,
        head_dim=256, layer_types=layers, linear_conv_kernel_dim=4, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=48, num_experts=512,
        num_experts_per_tok=10, moe_intermediate_size=512, shared_expert_intermediate_size=512, hc_count=4,
        hc_lowrank=320, partial_rotary_factor=0.25, indexer_n_heads=4, indexer_kv_heads=1, indexer_head_dim=128,
        indexer_budget=2048, indexer_compress_ratio=4, eos_token_id=1)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.float(), want.float()
    return float((got - want).abs().max() / want.abs().max().clamp(min=1e-30))


def time_eager(fn: Callable[[], object], warmup: int = 5, iters: int = 30) -> float:
    """Median microseconds of one call, each bracketed by CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def capture(fn: Callable[[], object], calls: int = 1) -> torch.cuda.CUDAGraph:
    """A CUDA graph of `calls` back-to-back calls (warmed up on a side stream first, as DecodeStep does)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    return g


def time_graph(fn: Callable[[], object], calls: int = 10, iters: int = 20) -> float:
    """Median microseconds per call when `calls` calls replay as one graph."""
    g = capture(fn, calls)
    return time_eager(g.replay, warmup=3, iters=iters) / calls


def sweep(out: dict, name: str, fn: Callable[[], object]) -> None:
    """Time one tuning variant into out["variants_graph_us"] (an error string if it fails; skipped past the
    deadline)."""
    table = out.setdefault("variants_graph_us", {})
    if time.perf_counter() - START > SWEEP_DEADLINE_S:
        return
    try:
        table[name] = time_graph(fn)
    except Exception as e:  # noqa: BLE001  (a variant that does not compile must not fail the check)
        table[name] = f"{type(e).__name__}: {e}"[:200]


# --------------------------------------------------------------------------------------------------- checks
def check_gdn(cfg: ModelConfig) -> dict:
    C, nv = cfg.gdn_conv_dim, cfg.linear_num_value_heads
    dk, dv, K = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim
    g = torch.Generator(device=DEV).manual_seed(0)
    rnd = lambda *s: torch.randn(*s, generator=g, device=DEV)
    out: dict = {"errors": {}}
    for dt in (torch.float32, torch.bfloat16):
        for order in ("grouped", "tiled"):
            prm = GDNParams((rnd(C, K) * 0.5).to(dt), -torch.rand(nv, generator=g, device=DEV) * 2, rnd(nv),
                            rnd(dv), order)
            ref = GDNState(rnd(C, K - 1).to(dt), rnd(nv, dk, dv))
            ours = ref.clone()
            worst = 0.0
            for _ in range(3):
                x, z, b, a = rnd(1, C).to(dt), rnd(1, nv * dv).to(dt), rnd(1, nv).to(dt), rnd(1, nv).to(dt)
                want = gdn_core_ref(x, z, b, a, prm, ref, cfg)
                got = gdn.gdn_step(x, z, b, a, prm, ours, cfg)
                worst = max(worst, rel_err(got, want), rel_err(ours.recurrent, ref.recurrent),
                            rel_err(ours.conv, ref.conv))
            out["errors"][f"{str(dt)[6:]}/{order}"] = worst
            if worst > TOL[dt]:
                raise AssertionError(f"gdn {dt} {order}: rel err {worst:.2e} > {TOL[dt]}")
    # graph replay equals eager (same state in, same state out)
    dt = torch.bfloat16
    prm = GDNParams((rnd(C, K) * 0.5).to(dt), -torch.rand(nv, generator=g, device=DEV) * 2, rnd(nv), rnd(dv),
                    "grouped")
    x, z, b, a = rnd(1, C).to(dt), rnd(1, nv * dv).to(dt), rnd(1, nv).to(dt), rnd(1, nv).to(dt)
    st = GDNState(rnd(C, K - 1).to(dt), rnd(nv, dk, dv))
    snap = st.clone()
    holder: dict = {}

    def step() -> None:
        holder["y"] = gdn.gdn_step(x, z, b, a, prm, st, cfg)

    graph = capture(step)
    st.conv.copy_(snap.conv)
    st.recurrent.copy_(snap.recurrent)
    graph.replay()
    y_graph, s_graph = holder["y"].clone(), st.recurrent.clone()
    st.conv.copy_(snap.conv)
    st.recurrent.copy_(snap.recurrent)
    step()
    if not (torch.equal(y_graph, holder["y"]) and torch.equal(s_graph, st.recurrent)):
        raise AssertionError("gdn: graph replay differs from the eager call")
    out["kernel_us"] = time_eager(step)
    out["graph_us"] = time_graph(step)
    out["ref_us"] = time_eager(lambda: gdn_core_ref(x, z, b, a, prm, st, cfg))
    out["bytes"] = 2 * nv * dk * dv * 4
    for bv in (16, 32, 64):
        sweep(out, f"block_v={bv}", lambda bv=bv: gdn.gdn_step(x, z, b, a, prm, st, cfg, block_v=bv))
    return out


def qsa_inputs(cfg: ModelConfig, ctx: int, dt: torch.dtype, seed: int) -> tuple:
    """A capacity-sized QSA cache, and the selection of a query near the end of the context: 512 random distinct
    complete blocks and the c - 1 tail rows, the last of them past the query (invalid), laid out as
    select_tokens lays it out."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    c, kb = cfg.indexer_compress_ratio, cfg.block_topk
    st = QSAState.empty(cfg, dt, DEV, CAPACITY)
    st.k.normal_(generator=g)
    st.v.normal_(generator=g)
    pos = ctx - 3  # (pos + 1) % c == 2: two valid tail rows, the query's own included
    nbq = (pos + 1) // c
    blocks = torch.randperm(nbq, generator=g, device=DEV)[:kb]
    chosen = (blocks[:, None] * c + torch.arange(c, device=DEV)).flatten()
    tail = nbq * c + torch.arange(c - 1, device=DEV)
    idx = torch.cat([chosen, tail])[None]
    ok = torch.cat([torch.ones_like(chosen, dtype=torch.bool), tail <= pos])[None]
    q = torch.randn(1, cfg.num_attention_heads, cfg.head_dim, generator=g, device=DEV).to(dt)
    return st, q, idx, ok


def check_attend(cfg: ModelConfig, ctx: int) -> dict:
    out: dict = {"errors": {}}
    for dt in (torch.float32, torch.bfloat16):
        st, q, idx, ok = qsa_inputs(cfg, ctx, dt, 1)
        want = attend_ref(q, st, idx, ok, cfg)
        for split in (None, 32, 256, 4096):
            e = rel_err(attention.attend(q, st, idx, ok, cfg, split=split), want)
            out["errors"][f"{str(dt)[6:]}/split={split}"] = e
            if e > TOL[dt]:
                raise AssertionError(f"attend {dt} split={split}: rel err {e:.2e} > {TOL[dt]}")
        del st
    st, q, idx, ok = qsa_inputs(cfg, ctx, torch.bfloat16, 2)
    holder: dict = {}

    def call() -> None:
        holder["o"] = attention.attend(q, st, idx, ok, cfg)

    graph = capture(call)
    graph.replay()
    o_graph = holder["o"].clone()
    call()
    if not torch.equal(o_graph, holder["o"]):
        raise AssertionError("attend: graph replay differs from the eager call")
    W = idx.shape[1]
    out["kernel_us"] = time_eager(call)
    out["graph_us"] = time_graph(call)
    out["ref_us"] = time_eager(lambda: attend_ref(q, st, idx, ok, cfg))
    out["bytes"] = 2 * W * cfg.num_key_value_heads * cfg.head_dim * 2
    for split in (32, 64, 128, 256):
        sweep(out, f"split={split}", lambda split=split: attention.attend(q, st, idx, ok, cfg, split=split))
    return out


def check_select(cfg: ModelConfig, ctx: int) -> dict:
    c, kb, di = cfg.indexer_compress_ratio, cfg.block_topk, cfg.indexer_head_dim
    g = torch.Generator(device=DEV).manual_seed(3)
    dt = torch.bfloat16
    blocks = torch.randn(CAPACITY // c, di, generator=g, device=DEV).to(dt)  # the capacity-sized buffer
    q = torch.randn(1, cfg.indexer_n_heads, di, generator=g, device=DEV).to(dt)
    positions = torch.tensor([ctx - 1], device=DEV)
    nbq = ctx // c
    want = torch.relu(torch.einsum("lhd,md->lhm", q.float(), blocks.float())).sum(1) / math.sqrt(di)
    got = attention.block_scores(q, blocks, positions, cfg)
    out: dict = {"errors": {"scores": rel_err(got[:, :nbq], want[:, :nbq])}}
    if out["errors"]["scores"] > 1e-5 or not torch.isinf(got[:, nbq:]).all():
        raise AssertionError(f"block scores: rel err {out['errors']['scores']:.2e}, or visible mask wrong")
    a_idx, a_ok = attention.select_tokens(q, blocks, positions, cfg)
    b_idx, b_ok = select_tokens(q, blocks, positions, cfg)
    same = len(set(a_idx[0, :kb * c].tolist()) & set(b_idx[0, :kb * c].tolist())) / (kb * c)
    out["selection_overlap"] = same  # near-ties at the k-th block may flip on accumulation order
    if same < 0.99 or not torch.equal(a_ok, b_ok) or not torch.equal(a_idx[:, kb * c:], b_idx[:, kb * c:]):
        raise AssertionError(f"selection differs from select_tokens beyond near-ties (overlap {same:.4f})")
    holder: dict = {}

    def call() -> None:
        holder["s"] = attention.select_tokens(q, blocks, positions, cfg)

    graph = capture(call)
    graph.replay()
    s_graph = holder["s"][0].clone()
    call()
    if not torch.equal(s_graph, holder["s"][0]):
        raise AssertionError("select: graph replay differs from the eager call")
    out["kernel_us"] = time_eager(call)
    out["graph_us"] = time_graph(call)
    out["ref_us"] = time_eager(lambda: select_tokens(q, blocks, positions, cfg))
    out["bytes"] = nbq * di * 2
    out["scores_only_graph_us"] = time_graph(lambda: attention.block_scores(q, blocks, positions, cfg))
    scores = attention.block_scores(q, blocks, positions, cfg)
    k = min(kb, scores.shape[1])
    out["topk_only_graph_us"] = time_graph(lambda: scores.topk(k, dim=-1))
    # the selection kernel alone (top-k + expansion + tail), at its default and at other chunk/warp settings;
    # every setting must give the default's output exactly (same set, same ascending block order)
    base = select_blocks(scores, positions, k, c)
    out["select_only_graph_us"] = time_graph(lambda: select_blocks(scores, positions, k, c))
    sweep = {}
    for block, warps in ((1024, 16), (1024, 8), (512, 8), (2048, 16), (1024, 32)):
        got = select_blocks(scores, positions, k, c, block=block, num_warps=warps)
        if not (torch.equal(got[0], base[0]) and torch.equal(got[1], base[1])):
            raise AssertionError(f"select_blocks block={block} warps={warps} differs from the default")
        sweep[f"{block}x{warps}"] = time_graph(lambda b=block, w=warps: select_blocks(scores, positions, k, c,
                                                                                      block=b, num_warps=w))
    out["select_sweep_graph_us"] = sweep
    # the many-program form (what select_tokens runs past SELECT_KERNEL_MAX_BLOCKS): exactly the same output
    wide = {}
    for chunk in (512, 1024, 2048):
        got = select_blocks_wide(scores, positions, k, c, chunk=chunk)
        if not (torch.equal(got[0], base[0]) and torch.equal(got[1], base[1])):
            raise AssertionError(f"select_blocks_wide chunk={chunk} differs from select_blocks")
        wide[str(chunk)] = time_graph(lambda ch=chunk: select_blocks_wide(scores, positions, k, c, chunk=ch))
    out["select_wide_graph_us"] = wide
    return out


def check_hc(cfg: ModelConfig, inject: bool) -> dict:
    S, H, R = cfg.hc_count, cfg.hidden_size, cfg.hc_lowrank
    g = torch.Generator(device=DEV).manual_seed(4)
    rnd = lambda *s: torch.randn(*s, generator=g, device=DEV)
    out: dict = {"errors": {}}
    for dt in (torch.float32, torch.bfloat16):
        x = rnd(1, S * H).to(dt)
        norm = 1 + 0.2 * rnd(S * H)
        down = DenseTensor("down", (rnd(R, S * H) / math.sqrt(S * H) * 4).to(dt))
        up = DenseTensor("up", (rnd(S * H, R) / math.sqrt(R) * 2).to(dt))
        inj = DenseTensor("inject", (rnd(S, S * H) / math.sqrt(S * H) * 4).to(dt)) if inject else None
        a_ref, i_ref = hc_read_ref(x, norm, down, up, inj, S, cfg.rms_norm_eps, linear_ref)
        a, i = hyper.hc_read(x, norm, down, up, inj, S, cfg.rms_norm_eps)
        e = rel_err(a, a_ref)
        if inject:
            e = max(e, rel_err(i, i_ref))
        out["errors"][str(dt)[6:]] = e
        if e > TOL[dt]:
            raise AssertionError(f"hc_read {dt}: rel err {e:.2e} > {TOL[dt]}")
    holder: dict = {}

    def call() -> None:
        holder["a"] = hyper.hc_read(x, norm, down, up, inj, S, cfg.rms_norm_eps)[0]

    graph = capture(call)
    graph.replay()
    a_graph = holder["a"].clone()
    call()
    if not torch.equal(a_graph, holder["a"]):
        raise AssertionError("hc_read: graph replay differs from the eager call")
    out["kernel_us"] = time_eager(call)
    out["graph_us"] = time_graph(call)
    out["ref_us"] = time_eager(lambda: hc_read_ref(x, norm, down, up, inj, S, cfg.rms_norm_eps, linear_ref))
    out["bytes"] = (2 * R * S * H + (S * S * H if inject else 0)) * 2
    if inject:
        for kw in hyper.hc_read_configs(S, H, R, attention.sm_count(DEV))[1:]:
            sweep(out, ",".join(f"{k}={v}" for k, v in kw.items()),
                  lambda kw=kw: hyper.hc_read(x, norm, down, up, inj, S, cfg.rms_norm_eps, **kw))
    return out


def check_sample(cfg: ModelConfig) -> dict:
    V = cfg.vocab_size
    g = torch.Generator(device=DEV).manual_seed(5)
    logits = torch.randn(V, generator=g, device=DEV) * 3
    if int(sample.greedy(logits)) != int(logits.argmax()):
        raise AssertionError("greedy differs from argmax")
    s = sample.DeviceSampler(DEV)
    s.configure(0.8, top_k=50, top_p=0.9, min_p=0.01, seed=7)
    x = logits / 0.8
    allowed = set(x.topk(50).indices.tolist())
    holder: dict = {}

    def call() -> None:
        holder["t"] = s(logits)

    graph = capture(call)  # advances the offset twice while warming up; fine, it is a stream position
    tokens = []
    for _ in range(200):
        graph.replay()
        tokens.append(int(holder["t"]))
    if not set(tokens) <= allowed or len(set(tokens)) < 2:
        raise AssertionError(f"sampled tokens outside top-k or degenerate: {sorted(set(tokens))[:10]}")
    out: dict = {"distinct_tokens_in_200": len(set(tokens)), "offset_after": int(s.offset)}
    out["kernel_us"] = time_eager(call)
    out["graph_us"] = time_graph(call)
    out["greedy_graph_us"] = time_graph(lambda: sample.greedy(logits))
    out["bytes"] = V * 4
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    cfg = real_config()
    checks: list[tuple[str, Callable[[], dict]]] = [
        ("gdn_step", lambda: check_gdn(cfg)),
        ("hc_read", lambda: check_hc(cfg, True)),
        ("hc_read_final", lambda: check_hc(cfg, False)),
        *[(f"attend_{n}", lambda n=n: check_attend(cfg, CONTEXTS[n])) for n in CONTEXTS],
        *[(f"select_{n}", lambda n=n: check_select(cfg, CONTEXTS[n])) for n in CONTEXTS],
        ("sample", lambda: check_sample(cfg)),
    ]
    results = []
    for name, fn in checks:
        t0 = time.perf_counter()
        if t0 - START > CHECK_DEADLINE_S:
            results.append({"name": name, "ok": False, "error": "skipped: the 2-minute budget is spent"})
            continue
        try:
            r = {"name": name, "ok": True, **fn()}
        except Exception as e:  # noqa: BLE001  (one failing kernel must not hide the others)
            r = {"name": name, "ok": False, "error": f"{type(e).__name__}: {e}",
                 "traceback": traceback.format_exc(limit=6)}
        r["check_s"] = round(time.perf_counter() - t0, 2)
        results.append(r)
        torch.cuda.empty_cache()
    print(f"{'kernel':16} {'ok':4} {'eager us':>9} {'graph us':>9} {'ref us':>9} {'GB/s':>7}  max rel err")
    for r in results:
        us = r.get("graph_us")
        bw = f"{r['bytes'] / us / 1e3:7.0f}" if us and r.get("bytes") else f"{'':7}"
        errs = ", ".join(f"{k} {v:.1e}" for k, v in r.get("errors", {}).items())
        fmt = lambda v: f"{v:9.1f}" if isinstance(v, float) else f"{'-':>9}"
        print(f"{r['name']:16} {'ok' if r['ok'] else 'FAIL':4} {fmt(r.get('kernel_us'))} {fmt(us)} "
              f"{fmt(r.get('ref_us'))} {bw}  {errs or r.get('error', '')}")
        if r.get("select_sweep_graph_us"):
            print("    select sweep " + ", ".join(f"{n} {v:.1f}" for n, v in r["select_sweep_graph_us"].items()))
        if r.get("select_wide_graph_us"):
            print("    select wide (chunk) " + ", ".join(f"{n} {v:.1f}" for n, v in r["select_wide_graph_us"].items()))
        if r.get("variants_graph_us"):
            print("    " + ", ".join(f"{n} {v:.1f}" if isinstance(v, float) else f"{n} {v}"
                                     for n, v in r["variants_graph_us"].items()))
        for k in ("scores_only_graph_us", "topk_only_graph_us", "select_only_graph_us", "greedy_graph_us",
                  "selection_overlap"):
            if k in r:
                print(f"    {k} {r[k]:.3f}")
    total = time.perf_counter() - START
    print(f"total {total:.1f} s on {torch.cuda.get_device_name()}")
    doc = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": __import__("triton").__version__, "total_s": total, "results": results}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(doc, indent=2))
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
