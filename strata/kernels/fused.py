"""The fused-kernel op table: `fused_ops(base)` installs the Triton twins of the decode-critical ops.

Each installed entry keeps the reference's signature and decides per call: the kernel when the inputs live on a
CUDA device (or when `force` is set, which is how the CPU tests run the kernels under TRITON_INTERPRET=1) and
the shape case is one the kernel handles (one token for GDN and the hyper-connection read, a few queries for
attention, a few tokens for the MoE routing and combine), else the entry it replaces in `base`. So prefill,
quantized weights and CPU runs keep the reference math, and a captured decode step gets the kernels without the
model knowing.

The indexer selection entry (`select_tokens`) is replaced when it holds the reference function.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from strata.kernels import attention, gdn, gemv_q8x, hyper, moe, qsa_store
from strata.kernels import hc_write as hc_write_kernel
from strata.kernels import norm_rope as norm_rope_kernel
from strata.kernels import ple as ple_kernel
from strata.model.ops import Ops
from strata.model.qsa import select_tokens as select_tokens_ref


def _entry(kernel: Callable, supported: Callable, fallback: Callable, force: bool) -> Callable:
    """An op entry with the reference's signature: `kernel(*args)` when the first tensor argument lives on CUDA
    (or `force`) and `supported(*args)`, else `fallback(*args)`."""

    def entry(*args):  # noqa: ANN002, ANN202 - the signature of the entry it replaces
        if (force or next(a for a in args if isinstance(a, torch.Tensor)).is_cuda) and supported(*args):
            return kernel(*args)
        return fallback(*args)

    entry.__name__ = getattr(kernel, "__name__", "entry")
    return entry


def fused_ops(base: Ops, force: bool = False, q8: bool = False) -> Ops:
    """`base` with the fused entries installed (each falling back to what `base` had). `force` runs the
    kernels on any device (CPU tensors need TRITON_INTERPRET=1); without it they run only on CUDA tensors.
    q8: the Q8-activation mode (`base` from `triton_ops(q8=True)`): the HC reads, the GDN step and the attention
    merge also write their output as the Q8 units of the GEMVs that read it (`gemv_q8x.UNITS_SPAN`), which then launch
    no quantize of their own."""
    span = gemv_q8x.UNITS_SPAN if q8 else None
    # name -> (kernel, supported); both take the entry's arguments (the cases each kernel covers: one token for
    # GDN, the HC read with dense weights and the PLE mix, a few queries/tokens for the rest)
    table: dict[str, tuple[Callable, Callable]] = {
        "gdn_core": (lambda *a: gdn.gdn_step(*a, q8_span=span),
                     lambda x, z, b, a, prm, state, cfg: gdn.supported(x, state, cfg)),
        "attend": (lambda *a: attention.attend(*a, q8_span=span),
                   lambda q, state, *_: attention.attend_supported(q, state)),
        "hc_read": (lambda *a: hyper.hc_read(*a[:7], q8_span=span),  # the kernel needs no `linear`
                    lambda x, n, down, up, inj, *_: hyper.supported(x, down, up, inj)),
        "norm_rope": (norm_rope_kernel.norm_rope, lambda x, scale, cos, *_: norm_rope_kernel.supported(x, scale, cos)),
        "norm_ropes": (norm_rope_kernel.norm_ropes, norm_rope_kernel.pair_supported),
        "rope": (norm_rope_kernel.rope_at, norm_rope_kernel.rope_supported),
        "route": (moe.route, lambda logits, k, _: moe.route_supported(logits, k)),
        "moe_combine": (moe.moe_combine, moe.combine_supported),
        "hc_write": (hc_write_kernel.hc_write, hc_write_kernel.supported),
        "ple_mix": (ple_kernel.ple_mix, lambda x, key, value, nk, nq, nc, conv_w, window, cfg:
                    ple_kernel.supported(x, key, value, conv_w, window, cfg)),
        "ple_gather": (ple_kernel.ple_gather, ple_kernel.gather_supported),
        "qsa_store": (lambda state, pos, ki, k, v, rope, inorm, knorm, cfg, *_:
                      qsa_store.qsa_store(state, pos, ki, k, v, rope, inorm, knorm, cfg.rms_norm_eps),
                      lambda state, pos, ki, k, v, rope, inorm, knorm, *_:
                      qsa_store.supported(state, pos, ki, k, v, inorm, knorm)),
    }
    entries = {name: _entry(kernel, supported, getattr(base, name), force)
               for name, (kernel, supported) in table.items()}
    # the write folded into the next read's two launches where both kernels apply (one token, dense weights,
    # matching dtypes); else the write and the read through the entries above (which fall back to `base`)
    write, read = entries["hc_write"], entries["hc_read"]

    def write_then_read(x, inj_prev, y, *read_args):
        x = write(x, inj_prev, y)
        return (x, *read(x, *read_args))

    entries["hc_write_read"] = _entry(
        lambda *a: hyper.hc_write_read(*a[:9], q8_span=span),  # the kernel needs no `linear`
        lambda x, inj_prev, y, n, down, up, inj, *_: (hyper.supported(x, down, up, inj)
                                                      and hc_write_kernel.supported(x, inj_prev, y)),
        write_then_read, force)
    if base.select_tokens is select_tokens_ref:
        entries["select_tokens"] = _entry(attention.select_tokens,
                                          lambda q_idx, *_: q_idx.shape[0] <= attention.MAX_L,
                                          select_tokens_ref, force)
    return dataclasses.replace(base, **entries)
