"""Decode and prefill speed, reported against the memory-bandwidth floor (shared/design/performance-model.md).

bytes_per_token comes from the loaded model itself (its real storage types), plus the GDN state traffic and
the QSA cache rows a token reads at the context length; the floor divides it by a device-to-device copy
bandwidth measured in the same process just before. Decode is timed as the captured step replayed token after
token (CUDA events, median of several runs), and the per-stage table times each op of one step on its own
(each op call captured and replayed), attributed to GDN or QSA layers.
"""

from __future__ import annotations

import dataclasses
import json
import re
import statistics
import subprocess
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from strata.config import ModelConfig
from strata.model.model import Model
from strata.model.ops import Ops, branches_ref
from strata.runtime.graph import DecodeStep
from strata.weights.inventory import inventory, role_of
from strata.weights.schema import Weights


def copy_bandwidth(device: torch.device, nbytes: int = 2 << 30, repeats: int = 10) -> float:
    """Bytes read + written per second of a large device-to-device copy. Its buffers go back to the device before
    it returns (out of the caching allocator too), so a model built next has the whole card."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / statistics.median(times)


def token_bytes(w: Weights, context: int) -> dict[str, float]:
    """Bytes one decode token reads: weights (dense whole, k/E of experts, embedding/PLE rows), GDN recurrent
    state read + written, and the QSA rows selected at `context` plus the pooled indexer keys scored."""
    cfg = w.cfg
    inv = inventory(w)
    n_gdn = sum(cfg.is_linear(i) for i in range(cfg.num_hidden_layers))
    n_qsa = cfg.num_hidden_layers - n_gdn
    gdn_state = n_gdn * cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4 * 2
    qsa = 0.0
    if n_qsa:
        elt = 2  # model-dtype cache
        rows = min(context, cfg.selection_width)
        qsa = n_qsa * (rows * 2 * cfg.num_key_value_heads * cfg.head_dim * elt
                       + (context // cfg.indexer_compress_ratio) * cfg.indexer_head_dim * elt)
    return {"weights": inv.bytes_per_token, "gdn_state": gdn_state, "qsa_cache": qsa,
            "total": inv.bytes_per_token + gdn_state + qsa}


def fill_state(step: DecodeStep, context: int, gen: torch.Generator) -> None:
    """Put the step's state at `context` tokens with random cache contents: decode work depends on the
    context length, not on the cached values, so this stands in for a prefill of `context` tokens."""
    st = step.state
    for layer in st.layers:
        for name, t in vars(layer).items():
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                t.copy_(torch.randn(t.shape, generator=gen, device=t.device, dtype=torch.float32).mul_(0.1))
    for p in st.ple.values():
        p.conv.normal_(0, 0.1, generator=gen)
    st.length = context
    st.tokens = [1] * context


@dataclass
class StageTimes:
    """Per-op device times of one decode step, by stage and layer kind (ms)."""

    ms: dict[tuple[str, str], float] = field(default_factory=lambda: defaultdict(float))
    _depth: int = 0
    _layer_kind: str = "-"


_OP_STAGES = {"mlp": "shared", "attend": "qsa.attend", "select_tokens": "qsa.select", "gdn_core": "gdn.core", "hc_read": "hc",
              "route": "router", "moe_combine": "shared", "norm_rope": "qsa.norm_rope", "norm_ropes": "qsa.norm_rope",
              "hc_write": "hc", "ple_mix": "ple", "hc_write_read": "hc", "decode_rows": "ple", "qsa_store": "qsa.store"}


def _stage_of_linear(name: str) -> str:
    role = role_of(re.sub(r"\[.*\]$", "", name))
    return {"hyper-connections": "hc", "gdn": "gdn.proj", "qsa": "qsa.proj", "router": "router",
            "shared-expert": "shared", "ple": "ple", "head": "head", "embed": "embed",
            "experts": "experts"}.get(role, role)


def timed_ops(base: Ops, cfg: ModelConfig, times: StageTimes, replays: int = 20) -> Ops:
    """An op table that runs each outermost op call normally, then captures that call alone into a graph and
    times its replays. Only for measurement: replays repeat in-place state updates."""

    def kind_from(args) -> str | None:
        for a in args:
            if isinstance(a, list) and a:
                a = a[0]
            name = getattr(a, "name", None)
            if isinstance(name, str) and (m := re.match(r"L(\d+)\.", name)):
                return "gdn" if cfg.is_linear(int(m.group(1))) else "qsa"
        return None

    def wrap(fn, stage):
        def call(*args, **kwargs):
            if times._depth:
                return fn(*args, **kwargs)
            k = kind_from(args)
            if k:
                times._layer_kind = k
            label = stage(args) if callable(stage) else stage
            kind = times._layer_kind if label not in ("head", "embed") else "-"
            times._depth += 1
            try:
                out = fn(*args, **kwargs)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    fn(*args, **kwargs)
                g.replay()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                for _ in range(replays):
                    g.replay()
                b.record()
                b.synchronize()
                times.ms[(label, kind)] += a.elapsed_time(b) / replays
            finally:
                times._depth -= 1
            return out
        return call

    entries = {}
    for f in dataclasses.fields(base):
        fn = getattr(base, f.name)
        if f.name == "branches":  # one after the other, so the ops inside are timed each on its own
            entries[f.name] = branches_ref
        elif f.name == "linear":
            entries[f.name] = wrap(fn, lambda args: _stage_of_linear(args[1].name))
        elif f.name == "linears":
            entries[f.name] = wrap(fn, lambda args: _stage_of_linear(args[1][0].name))
        else:
            entries[f.name] = wrap(fn, _OP_STAGES.get(f.name, f.name))
    return Ops(**entries)


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _ready_step(model: Model, context: int, tokens: int, runs: int, seed: int, split: bool,
                ) -> tuple[DecodeStep, int, float]:
    """A captured decode step at `context` (random state), warmed up: (step, next token, capture seconds)."""
    gen = torch.Generator(device=model.device).manual_seed(seed)
    step = DecodeStep(model, capacity=context + tokens * (2 * runs + 2) + 8, capture=True, split=split)
    fill_state(step, context, gen)
    tok = 11
    t0 = time.perf_counter()
    step.step(tok)  # captures
    capture_s = time.perf_counter() - t0
    for _ in range(tokens // 4):
        tok = step.next_token_id(tok)
    return step, tok, capture_s


def profile_decode(model: Model, context: int, tokens: int = 64, runs: int = 3, seed: int = 0, split: bool = True,
                   timeline: bool = False) -> dict:
    """The kernels of one eager step and of one graph replay at `context` ("kernels", "replay_kernels"; with
    `timeline` every kernel of the replay, `replay_profile`). Run it after all timings: once the profiler has run
    in a process, every later launch call on the host is slower (its activity tracing stays attached)."""
    step = _ready_step(model, context, tokens, runs, seed, split)[0]
    return {"kernels": kernel_profile(step), "replay_kernels": replay_profile(step, timeline=timeline)}


def bench_decode(model: Model, context: int, tokens: int = 64, runs: int = 3, seed: int = 0,
                 stage_table: bool = True, split: bool = True) -> dict:
    """Decode ms/token at `context` through the captured step (split at the first PLE layer unless `split` is
    False) as a generation runs it (ahead of the host where the step can feed itself, `DecodeStep.ids_ahead`;
    then also one id read before the next step, "one_by_one"), the host's share of a token, and the per-stage
    table. The kernel profiles are `profile_decode`'s."""
    dev = model.device
    step, tok, capture_s = _ready_step(model, context, tokens, runs, seed, split)
    # A token's time is the interval between two ids read on the host (argmax in the graph; the host reads each
    # id, as a stream does), from the first id read: a step run ahead is still running when the last is read.
    timed: dict[bool, list[float]] = {}
    for ahead in (True, False) if step.can_run_ahead else (False,):
        for _ in range(runs):
            ids = step.ids_ahead(tok) if ahead else None
            tok = next(ids) if ids is not None else step.next_token_id(tok)
            w0 = time.perf_counter()
            for _ in range(tokens):
                tok = next(ids) if ids is not None else step.next_token_id(tok)
            timed.setdefault(ahead, []).append((time.perf_counter() - w0) * 1e3 / tokens)
            if ids is not None:
                ids.close()
            torch.cuda.synchronize()
    per_token_ms = timed[step.can_run_ahead]
    # the host's share of a token: staging (hash, table rows, copies) with the replay calls, waiting for the token
    host = {"stage_and_replay_calls": 0.0, "token_wait": 0.0}
    phases: dict[str, float] = {}
    with torch.inference_mode():
        for _ in range(tokens):
            t0 = time.perf_counter()
            out = step._run(tok, "logits", phases, record=False)[1]  # as `next_token_id`
            t1 = time.perf_counter()
            tok = int(out)
            t2 = time.perf_counter()
            host["stage_and_replay_calls"] += (t1 - t0) * 1e3 / tokens
            host["token_wait"] += (t2 - t1) * 1e3 / tokens
    host["phases"] = {k: v * 1e3 / tokens for k, v in phases.items()}  # ms per token: the parts of the first
    # device-only: replays back to back, no host work between them
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(tokens):
        step.replay()
    b.record()
    b.synchronize()
    replay_ms = a.elapsed_time(b) / tokens
    out = {"context": context, "tokens_timed": tokens * runs, "ms_per_token": statistics.median(per_token_ms),
           "ms_per_token_runs": per_token_ms,
           "graph_replay_ms": replay_ms, "graphs_per_step": len(step.graphs["logits"]), "capture_s": capture_s,
           "host_ms_per_token": host, "run_ahead": step.can_run_ahead}
    if step.can_run_ahead:
        out["one_by_one"] = {"ms_per_token": statistics.median(timed[False]), "ms_per_token_runs": timed[False]}
    out["tok_per_s"] = 1e3 / out["ms_per_token"]
    if stage_table:
        times = StageTimes()
        prof = Model(model.w, model.dtype, model.device, timed_ops(step.model.ops, model.cfg, times))
        inputs = step.inputs
        torch.cuda.synchronize()
        with torch.inference_mode():
            prof.run(inputs, step.state, static=True)
            prof.logits(torch.zeros(1, model.cfg.hidden_size, dtype=model.dtype, device=dev))
        table = defaultdict(dict)
        for (stage, kind), ms in sorted(times.ms.items()):
            table[stage][kind] = round(ms, 4)
        out["stages_ms"] = dict(table)
        out["stages_sum_ms"] = sum(times.ms.values())
    del step
    torch.cuda.empty_cache()
    return out


def each_context(measure: Callable[[int], dict], contexts: list[int],
                 device: torch.device) -> tuple[list[dict], list[dict]]:
    """`measure(ctx)` for each context, keeping what fits: a context whose caches do not fit the device is
    recorded as skipped (with torch's message) and the rest still run, so one long context that runs out of
    memory does not lose the shorter ones' figures. Returns (results, skipped)."""
    done, skipped = [], []
    for ctx in contexts:
        try:
            done.append(measure(ctx))
            continue
        except torch.OutOfMemoryError as e:
            skipped.append({"context": ctx, "error": "out of device memory: " + str(e).splitlines()[0]})
        # outside the except clause: its traceback holds the failed context's tensors until the clause ends
        print(f"ctx {ctx:>7}: skipped: {skipped[-1]['error']}", file=sys.stderr)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return done, skipped


def kernel_profile(step: DecodeStep, top: int = 40) -> dict:
    """The kernels one eager decode step launches (torch profiler): how many, their summed device time, and the
    largest by total time. Launches x per-launch overhead is what the captured step pays beyond kernel time."""
    from torch.profiler import ProfilerActivity, profile

    with torch.inference_mode():
        step._compute()  # warm: every kernel compiled
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step._compute()
            torch.cuda.synchronize()
    return _kernel_table(prof, top)


def _kernel_table(prof, top: int) -> dict:
    """The CUDA kernels a torch profiler recorded: count, summed device time, the `top` largest by total."""
    kernels: dict[str, list[float]] = defaultdict(list)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels[e.name].append(e.device_time_total / 1e3)
    total = sum(sum(v) for v in kernels.values())
    ranked = sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[:top]
    return {"launches": sum(len(v) for v in kernels.values()), "kernel_ms": total,
            "top": [{"kernel": k[:80], "count": len(v), "ms": round(sum(v), 4)} for k, v in ranked]}


def replay_profile(step: DecodeStep, top: int = 40, timeline: bool = False) -> dict:
    """Where one graph replay's time goes when kernels overlap (PDL, side streams): kernels sorted by end time,
    each charged the time by which it moves the latest end so far (its *marginal* time; the charges add up to
    the replay's span). A kernel hidden behind others is charged ~0 however long it runs. With `timeline`, also
    every kernel as [name, start us, end us] from the replay's start, in start order (to find which launch of a
    kernel, e.g. which of a layer's GEMVs, the time goes to)."""
    from torch.profiler import ProfilerActivity, profile

    step.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step.replay()
        torch.cuda.synchronize()
    spans = sorted(((e.time_range.end, e.time_range.start, e.name) for e in prof.events()
                    if e.device_type == torch.autograd.DeviceType.CUDA), key=lambda t: t[0])
    if not spans:
        return {"launches": 0}
    marginal: dict[str, list[float]] = defaultdict(list)
    frontier = min(s for _, s, _ in spans)
    start = frontier
    for end, _, name in spans:
        marginal[name].append(max(0.0, end - frontier) / 1e3)
        frontier = max(frontier, end)
    ranked = sorted(marginal.items(), key=lambda kv: -sum(kv[1]))[:top]
    out = {"launches": len(spans), "span_ms": (frontier - start) / 1e3,
           "top": [{"kernel": k[:80], "count": len(v), "marginal_ms": round(sum(v), 4)} for k, v in ranked]}
    if timeline:
        out["timeline"] = [[name[:60], round(s - start, 2), round(end - start, 2)]
                           for end, s, name in sorted(spans, key=lambda t: t[1])]
        out["layers"] = layer_paths(out["timeline"])
    return out


LAYER_END_KERNEL = "_combine_kernel"
"""The last launch of every decoder layer (the MoE combine): where `layer_paths` cuts a replay's timeline."""


QSA_KERNELS = {"_block_scores_kernel", "_select_kernel", "_rank_select_kernel", "_wide_pass_kernel"}
"""Kernels only a QSA layer launches (the indexer's block scores and each of the selection's paths)."""


def layer_paths(timeline: list[list]) -> dict:
    """The critical path of a decoder layer, read off a replay's timeline ([name, start us, end us] in start
    order): the timeline cut after each `LAYER_END_KERNEL`, each layer classed by the kernels in it ("gdn" with
    `_gdn_step_kernel`, "qsa" with one of `QSA_KERNELS`, else "other"). Within a class the layers that launch
    the most common sequence of kernels (in start order, which follows the stream order; end order varies where
    launches overlap) are "alike"; per launch, the medians over those layers of when it ends after the layer's
    first start, how much it moves the layer's latest end so far (its share of the critical path) and when it
    starts (with PDL: when it was let in, which can be long before its inputs are ready), listed by median end.
    Launches that overlap others get the share by which they outlast them."""
    layers, cur = [], []
    for name, s, e in timeline:
        cur.append((name, float(s), float(e)))
        if name.startswith(LAYER_END_KERNEL):
            layers.append(cur)
            cur = []
    kinds: dict[str, list[list[tuple[str, float, float, float]]]] = defaultdict(list)
    for layer in layers:
        names = {n for n, _, _ in layer}
        kind = "gdn" if "_gdn_step_kernel" in names else "qsa" if names & QSA_KERNELS else "other"
        t0 = frontier = min(s for _, s, _ in layer)
        share = {}
        for i in sorted(range(len(layer)), key=lambda i: layer[i][2]):
            share[i] = max(0.0, layer[i][2] - frontier)
            frontier = max(frontier, layer[i][2])
        kinds[kind].append([(n, e - t0, share[i], s - t0) for i, (n, s, e) in enumerate(layer)])
    out = {}
    med = statistics.median
    for kind, ls in kinds.items():
        shapes = Counter(tuple(st[0] for st in steps) for steps in ls)
        shape = max(shapes, key=lambda sh: (shapes[sh], -len(sh)))
        same = [steps for steps in ls if tuple(st[0] for st in steps) == shape]
        rows = [[n, *(round(med([st[i][j] for st in same]), 2) for j in (1, 2, 3))] for i, n in enumerate(shape)]
        out[kind] = {"layers": len(ls), "alike": len(same),
                     "span_us": round(med([max(st[1] for st in steps) for steps in ls]), 2),
                     "steps": sorted(rows, key=lambda r: r[1])}
    return out


@torch.inference_mode()
def prefill_chunks(model: Model, ids: torch.Tensor, state, chunk: int) -> torch.Tensor:
    """ids through the model into `state` in chunks of `chunk` tokens (eager); the last position's logits."""
    for s in range(0, ids.numel(), chunk):
        out = model.forward(ids[s:s + chunk], state, last_only=True)
    return out[-1]


def bench_prefill(model: Model, tokens: int, seed: int = 0, runs: int = 3, profile: bool = False,
                  top: int = 30, chunk: int = 512) -> dict:
    """Prefill tok/s of one prompt of `tokens` random ids (eager, in chunks of `chunk`): the median of `runs` timed
    passes, each into a fresh state, after one untimed pass (Triton compiles a kernel on its first launch, and
    prefill launches kernels decode does not). With `profile`, the kernels of one more pass (torch profiler)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.cfg.vocab_size, (tokens,), generator=gen)

    def one_pass() -> float:
        state = model.new_state(capacity=tokens + 8)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        prefill_chunks(model, ids, state, chunk)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    first = one_pass()
    times = [one_pass() for _ in range(runs)]
    dt = statistics.median(times)
    out = {"tokens": tokens, "chunk": chunk, "seconds": dt, "tok_per_s": tokens / dt,
           "runs_s": [round(t, 4) for t in times],
           "first_pass_s": round(first, 4)}
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            one_pass()
        out["kernels"] = _kernel_table(prof, top)
    return out


def write_report(report: dict, path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(report, indent=2, default=str))


def format_table(report: dict) -> str:
    """A short text table of a report: one line per context, then the per-stage table of the first."""
    lines = [f"{report['gpu']} | copy {report['copy_bandwidth_bytes_per_s'] / 1e12:.2f} TB/s | {report['model']} "
             f"| ops {report['ops']}{' + PDL' if report.get('pdl') else ''}", f"type mix: {report['type_mix']}",
             f"{'context':>8} {'ms/tok':>8} {'tok/s':>8} {'replay':>8} {'MB/tok':>8} {'floor ms':>9} {'floor%':>7}"]
    for r in report["decode"]:
        lines.append(f"{r['context']:>8} {r['ms_per_token']:>8.3f} {r['tok_per_s']:>8.1f} "
                     f"{r['graph_replay_ms']:>8.3f} {r['bytes_per_token']['total'] / 1e6:>8.1f} "
                     f"{r['floor_ms']:>9.3f} {100 * r['fraction_of_floor']:>6.1f}%")
    lines.extend(f"{s['context']:>8} skipped: {s['error'][:90]}" for s in report.get("decode_skipped", []))
    if "prefill" in report:
        p = report["prefill"]
        lines.append(f"prefill: {p['tokens']} tokens in {p['seconds']:.2f} s = {p['tok_per_s']:.1f} tok/s "
                     f"(median of {len(p['runs_s'])}; first pass, with compilation: {p['first_pass_s']:.2f} s)")
        if "kernels" in p:
            k = p["kernels"]
            lines.append(f"prefill launches {k['launches']} kernels, {k['kernel_ms']:.1f} ms of kernel time; "
                         "largest:")
            lines.extend(f"  {t['ms']:>8.2f} ms {t['count']:>5}x {t['kernel']}" for t in k["top"][:15])
    first = report["decode"][0] if report["decode"] else {}
    if "kernels" in first:
        k = first["kernels"]
        lines.append(f"one step launches {k['launches']} kernels, {k['kernel_ms']:.3f} ms of kernel time; largest:")
        lines.extend(f"  {t['ms']:>8.3f} ms {t['count']:>5}x {t['kernel']}" for t in k["top"])
    if first.get("replay_kernels", {}).get("launches"):
        k = first["replay_kernels"]
        lines.append(f"one replay: {k['launches']} kernels over {k['span_ms']:.3f} ms; marginal time (how far each "
                     "moves the replay's end):")
        lines.extend(f"  {t['marginal_ms']:>8.3f} ms {t['count']:>5}x {t['kernel']}" for t in k["top"])
    for kind, lp in first.get("replay_kernels", {}).get("layers", {}).items():
        lines.append(f"{kind} layer ({lp['alike']} of {lp['layers']} alike): {lp['span_us']:.1f} us; per launch, "
                     "us after the layer's start when it ends, its share of the critical path, when it starts:")
        lines.extend(f"  {n[:40]:<40} {end:>8.1f} {share:>8.1f} {start:>8.1f}" for n, end, share, start in lp["steps"])
    if "stages_ms" in first:
        lines.append(f"per-stage ms (context {first['context']}; sum {first['stages_sum_ms']:.3f} ms of "
                     f"{first['ms_per_token']:.3f} ms):")
        lines.append(f"{'stage':<14}{'gdn':>9}{'qsa':>9}{'-':>9}")
        for stage, kinds in first["stages_ms"].items():
            lines.append(f"{stage:<14}" + "".join(f"{kinds.get(k, 0.0):>9.3f}" for k in ("gdn", "qsa", "-")))
    return "\n".join(lines)
