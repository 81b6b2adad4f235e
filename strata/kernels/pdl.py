"""Programmatic dependent launch (PDL, Hopper and later): a decode kernel starts while the one before it ends.

A decode step is ~900 short kernels in a row. Launched plainly, each waits for the previous one to finish
before its programs are even scheduled, then pays its ramp-up and a first DRAM round trip before any useful
work. With PDL a kernel's programs are scheduled as soon as every program of the previous kernel has signalled
(`started`), they issue the loads of bytes no kernel writes (stored weights), and `wait` for the previous
kernel to complete and flush its memory before touching anything a kernel writes. The previous kernel in turn
waited for its own predecessor, so after `wait` every earlier kernel of the stream is complete.

The rule every kernel here follows:

    started(GDC)                 # first: lets the next kernel be scheduled
    ... loads of stored weights only (no kernel launched with PDL writes them) ...
    wait(GDC)                    # before any other load and before every store
    ... the rest ...

`started` may come later where letting the next kernel in early costs more than it saves: the row-register
GEMVs call it right after their wait (`gemv_rr.RELEASE`, measured per launch class), the QSA cache-write kernel
too (`LATE_RELEASE`). Only where it sits relative to `wait` can matter for correctness: a kernel
whose loads depend on what the previous kernel may still be waiting for (expert ids written by the routing) waits
first and calls `started` only after its wait; so the kernel after it may read those ids before its own wait
(`gemv.gemv_experts_sum`'s `ids_settled`).

With GDC False (the CPU, the Triton interpreter, GPUs before Hopper, or PDL switched off) both calls compile to
nothing and the launch is a plain one; a kernel launched plainly may still run them (they are then no-ops).
Capturing a step into a CUDA graph keeps the programmatic edges, so the replay overlaps kernels the same way.

`launch(device)` gives the keyword arguments that switch it on for one launch; `set_enabled(False)` switches it
off for the process and `enabled(on)` inside a block (`strata bench --no-pdl` measures the difference).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import triton
import triton.language as tl

try:  # Triton >= 3.3
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older Triton: PDL stays off
    gdc_launch_dependents = gdc_wait = None

_switch = {"on": True}
_capable: dict[int, bool] = {}


@triton.jit
def started(GDC: tl.constexpr):
    """Let the next kernel in the stream be scheduled once every program of this one has got here."""
    if GDC:
        gdc_launch_dependents()


@triton.jit
def wait(GDC: tl.constexpr):
    """Block until the previous kernel in the stream has completed and its writes are visible."""
    if GDC:
        gdc_wait()


@triton.jit
def enter(GDC: tl.constexpr, LATE: tl.constexpr = False):
    """`started` then `wait`, for a kernel with nothing to load before its wait; with LATE `wait` then `started`
    (`LATE_RELEASE`)."""
    if not LATE:
        started(GDC)
    wait(GDC)
    if LATE:
        started(GDC)


@triton.jit
def prefetch_l2(ptrs, mask):
    """Ask L2 for the 128-byte lines of `ptrs` (where `mask`) without waiting or using registers: bytes a kernel
    will load after its wait, fetched from DRAM while the kernel before still runs. No effect on any value. GPU
    only (inline PTX): a caller compiles it out under the interpreter."""
    tl.inline_asm_elementwise("{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
                              "=r,l,r", [ptrs.to(tl.int64, bitcast=True), mask.to(tl.int32)], dtype=tl.int32,
                              is_pure=False, pack=1)


LATE_RELEASE = {"qsa_store": True, "gdn_step": False, "route": False, "combine": False, "hc_down": False,
                "hc_up": False, "quantize": False}
"""Kernels (by launch name) that let the next kernel in only after their wait instead of first. True where the
4K decode step on an H200 measured it faster (`tools/step_variants.py`, bench/results/2026-12-04-h200-step-
variants-release-*.json): the QSA cache-write kernel, whose successors (norm and RoPE, block scores, selection,
attention) were otherwise launched while the projection group before it still streamed (a QSA layer's path
96.9 -> 94.2-94.6 us). The row-register GEMVs choose theirs by launch class (`gemv_rr.RELEASE`)."""


def _device_capable(device: torch.device) -> bool:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _capable:
        _capable[index] = gdc_wait is not None and torch.cuda.get_device_capability(index)[0] >= 9
    return _capable[index]


def active(device: torch.device) -> bool:
    """Whether launches on `device` use PDL: a CUDA device of compute capability >= 9 running compiled Triton,
    unless switched off."""
    return _switch["on"] and device.type == "cuda" and _device_capable(device)


def launch(device: torch.device, late: str | None = None) -> dict:
    """Keyword arguments for a kernel launch on `device`: the kernel's `GDC` flag and Triton's `launch_pdl`
    option when PDL is active, else none (the kernel's `GDC` defaults to False); with `late`, a `LATE_RELEASE`
    key, also the kernel's `LATE` flag."""
    if not active(device):
        return {}
    return {"GDC": True, "launch_pdl": True, **({"LATE": LATE_RELEASE[late]} if late else {})}


def set_enabled(on: bool) -> None:
    """Switch PDL on (the default where the device supports it) or off for this process."""
    _switch["on"] = bool(on)


@contextlib.contextmanager
def enabled(on: bool) -> Iterator[None]:
    """PDL switched on or off inside the block (kernels compiled either way stay cached)."""
    before = _switch["on"]
    set_enabled(on)
    try:
        yield
    finally:
        set_enabled(before)
