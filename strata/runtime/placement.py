"""Where weights live and which op table runs them.

The plan today is simple and printed by `strata inspect`: on a GPU every tensor goes to device memory except
the PLE n-gram table, which stays in host RAM or in its mapped file (only the rows a token hashes to are read,
on the host, before the step). Experts in host RAM with a CPU pool and an adaptive VRAM expert cache are the
next placements to add.
"""

from __future__ import annotations

import dataclasses

import torch

from strata.errors import StrataError
from strata.model.ops import Ops
from strata.weights.quant_tensor import QuantTensor
from strata.weights.repack import Q4_K_ID, Q4_K_R_ID, Q6_K_ID, Q6_K_P_ID, pad_q6_k, reorder_q4_k, repack_rows
from strata.weights.schema import Weights
from strata.weights.tensor import DenseTensor, StackedTensor, StoredTensor, raw_rows

HOST_RESIDENT = ("ple.table",)

FUSED_GROUPS = (("gdn.qkv", "gdn.z", "gdn.b", "gdn.a"),
                ("idx.q", "idx.k", "attn.q", "attn.k", "attn.v"),
                ("moe.router", "moe.sh_gate_inp"))
"""Per-layer weights that read the same input; `place` stores each group's rows back to back so `Ops.linears`
runs the group as one GEMV (one launch instead of up to five)."""


REPACK_MIN_ROWS_PER_K = 4
"""A fused group on a GPU is stored in its repacked layout (`strata.weights.repack`: Q8_0 -> Q8_0_R, Q4_K ->
Q4_K_R) when it has at least this many rows per input column. The row-register GEMV of the repacked rows
(`kernels/gemv_rr.py`) measured faster for tall matrices (Q8_0 16432 x 2560: 15.3 us against 18.8) and slower
for short wide ones, where its K loop is long and its programs few (2560 x 6144: 12.4 us at best against 10.3;
bench/results/2026-12-04-h200-gemv-rr-lab.json)."""

WORD_ORDERED_STACKS = ("moe.gate_exps", "moe.up_exps")
"""Expert stacks a GPU stores as Q4_K_R when they are Q4_K: the routed experts' gate/up GLU of one token is the
row-register GEMV's (19.6 -> 13.4 us per layer at the real shape, H200). The down stacks stay as they are: their
one-token launch also sums the slots, which only the generic kernel does."""


def fuse_rows(parts: list[StoredTensor], repack: bool = False) -> list[StoredTensor]:
    """The parts re-made as row views of one new buffer, in order, when they share storage type, row width and
    device (else unchanged). Same values: only their placement in memory changes, and with `repack` (the GPU
    placement) a tall group of a type with a repacked layout (`REPACK_MIN_ROWS_PER_K`) is stored in it."""
    raws = [raw_rows(t) if len(t.shape) == 2 else None for t in parts]
    if any(r is None for r in raws) or len({(t.kind, r.shape[1], r.dtype, r.device)
                                            for t, r in zip(parts, raws, strict=True)}) != 1:
        return parts
    buf = torch.cat(raws)
    type_id = getattr(parts[0], "type_id", None)
    k = parts[0].shape[1]
    if repack and type_id is not None and buf.shape[0] >= REPACK_MIN_ROWS_PER_K * k:
        buf, type_id = repack_rows(buf, type_id, k)
    out: list[StoredTensor] = []
    row = 0
    for t, r in zip(parts, raws, strict=True):
        view = buf[row:row + r.shape[0]]
        row += r.shape[0]
        out.append(DenseTensor(t.name, view) if isinstance(t, DenseTensor)
                   else QuantTensor(t.name, view, type_id, t.shape))
    return out


def place(w: Weights, device: torch.device | str) -> Weights:
    """The weight set with every tensor but the host-resident ones moved to `device` (expert stacks kept as
    per-expert parts become one stack there)."""
    device = torch.device(device)
    if device.type == "cpu":
        return w
    moved: dict[str, StoredTensor] = {}
    for name, t in w.tensors.items():
        if name.endswith(HOST_RESIDENT):
            moved[name] = t
        elif isinstance(t, StackedTensor) and all(isinstance(p, DenseTensor) for p in t.parts):
            # Per-expert parts (HF layout) become one device stack, so the expert kernel reads it by id.
            moved[name] = DenseTensor(name, torch.stack([p.tensor.to(device) for p in t.parts]))
        else:
            moved[name] = t.to(device)
    return gpu_layout(Weights(w.cfg, moved, w.gdn_value_order, w.source, w.unknown))


def gpu_layout(w: Weights) -> Weights:
    """The weight set in the layouts GPU placement stores (the tensors where they are): every 2-D Q6_K matrix
    but the host-resident ones as Q6_K_P (`padded_matrix`), Q4_K gate/up expert stacks as Q4_K_R
    (`word_ordered`), the FUSED_GROUPS back to back and repacked
    (`fuse_groups`). `place` ends with it, and the benchmark's synthetic model goes through it, so both run the
    same kernels on the same layouts."""
    tensors = {name: t if name.endswith(HOST_RESIDENT) else word_ordered(name, padded_matrix(t))
               for name, t in w.tensors.items()}
    return fuse_groups(Weights(w.cfg, tensors, w.gdn_value_order, w.source, w.unknown), repack=True)


def padded_matrix(t: StoredTensor) -> StoredTensor:
    """A 2-D Q6_K matrix in the Q6_K_P layout (`strata.weights.repack`: blocks padded to 16-byte multiples, so the
    GEMV loads words instead of bytes), anything else unchanged. Same values."""
    if isinstance(t, QuantTensor) and t.type_id == Q6_K_ID and len(t.shape) == 2:
        return QuantTensor(t.name, pad_q6_k(t.data, t.shape[1]), Q6_K_P_ID, t.shape)
    return t


def word_ordered(name: str, t: StoredTensor) -> StoredTensor:
    """A Q4_K expert stack of WORD_ORDERED_STACKS in the Q4_K_R layout, anything else unchanged. Same values."""
    if (name.endswith(WORD_ORDERED_STACKS) and isinstance(t, QuantTensor) and t.type_id == Q4_K_ID
            and len(t.shape) == 3):
        return QuantTensor(t.name, reorder_q4_k(t.data, t.shape[-1]), Q4_K_R_ID, t.shape)
    return t


def fuse_groups(w: Weights, repack: bool = False) -> Weights:
    """The weight set with every FUSED_GROUPS group of every layer stored back to back (`fuse_rows`, `repack`
    passed on)."""
    tensors = dict(w.tensors)
    for i in range(w.cfg.num_hidden_layers):
        for group in FUSED_GROUPS:
            names = [f"L{i}.{n}" for n in group]
            if all(n in tensors for n in names):
                tensors.update(zip(names, fuse_rows([tensors[n] for n in names], repack), strict=True))
    return Weights(w.cfg, tensors, w.gdn_value_order, w.source, w.unknown)


def fast_ops(base: Ops | None = None, streams: bool = True) -> Ops:
    """The op table with every available Triton kernel installed (each falls back to the reference for
    inputs it does not cover) and, with `streams`, a layer's independent branches on CUDA streams of their own
    (`strata.runtime.streams`)."""
    ops = base or Ops()
    try:
        from strata.kernels.fused import fused_ops
        from strata.kernels.ops import triton_ops
    except ImportError as e:
        raise StrataError(f"the GPU path needs Triton ({e}); install it with: pip install -e '.[gpu]'") from e
    from strata.runtime.streams import SideStreams

    fast = fused_ops(triton_ops(ops))
    return dataclasses.replace(fast, branches=SideStreams()) if streams else fast
