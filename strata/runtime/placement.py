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
from strata.model.ops import Ops, with_activations
from strata.weights.quant_tensor import QuantTensor
from strata.weights.repack import (Q4_K_ID, Q4_K_R_ID, Q4_K_RT_ID, Q5_1_ID, Q5_1_R_ID, Q6_K_ID, Q6_K_R_ID, Q6_K_RT_ID,
                                   Q8_0_ID, Q8_0_R_ID, TILE_LAYOUTS, tile_major_,
                                   reorder_q4_k, reorder_q5_1, reorder_q6_k, reorder_q8_0, repack_rows)
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
Q4_K_R) when it has at least this many rows per input column (2-D Q8_0 matrices are word-ordered whatever their
shape, `word_ordered`). The row-register GEMV (`kernels/gemv_rr.py`) measured faster for tall matrices (Q4_K
10240 x 2560: 11.3 us against 15.5; Q8_0 16432 x 2560: 15.4 against 24.8) and even with the generic kernel for
short wide Q8_0 ones once it splits K (2560 x 6144: 8.7 against 10.3); short wide Q4_K groups were not measured
(bench/results/2026-12-04-h200-gemv-rr-lab-*.json)."""

WORD_ORDERED_STACKS = ("moe.gate_exps", "moe.up_exps", "moe.down_exps")
"""Expert stacks a GPU stores word-ordered (Q4_K -> Q4_K_R, Q5_1 -> Q5_1_R) for the row-register GEMV: at the real
shape the routed gate/up GLU 19.5 -> 13.7 us and the down projections with their slot sum (Q5_1) 12.6 -> 9.9 us
per layer (H200, bench/results/2026-12-04-h200-gemv-rr-lab-*.json)."""


TILE_MAJOR_STACKS = ("moe.gate_exps", "moe.up_exps")
"""Q4_K expert stacks a GPU stores tile-major (Q4_K_RT, `repack.TILE_LAYOUTS`: each 4 rows' two super-blocks of
one K-loop step together, as the routed GLU's programs read them) where their rows are whole tiles and steps.
With the head as Q6_K_RT, the 4K step on an H100 4.562-4.563 -> 4.493-4.494 ms per replay against both row-major
(bench/results/2026-12-06-h100-step-variants-tiled-1ed74c8.json)."""

TILE_MAJOR_HEAD_MIN_ROWS = 16 * 4096
"""Rows from which the 2-D Q6_K head is stored tile-major (Q6_K_RT: 16 rows' super-blocks of one step together):
the launches of at least `gemv_rr.BIG_LAUNCH_TILES` tiles of 16 rows, whose programs read it so."""

MODEL_DTYPE_MATRICES = ("moe.router", "moe.sh_gate_inp")
"""Float32-stored matrices (GGUF keeps the router in F32) that a GPU stores in the model's dtype when that is a
16-bit one (`in_model_dtype`): `linear_ref` rounds them to it at every call (`w.dense(x.dtype)`), so the stored
copy holds the very values the reference multiplies with, in half the bytes."""


def in_model_dtype(w: Weights, dtype: torch.dtype | None) -> Weights:
    """The weight set with its float32 MODEL_DTYPE_MATRICES in `dtype` (rounded as `DenseTensor.dense` rounds)
    when that is float16 or bfloat16, else w itself. Converted tensors are new buffers: `gpu_layout`, which calls
    this, stores their groups back to back afterwards (`fuse_groups`)."""
    if dtype not in (torch.float16, torch.bfloat16):
        return w
    tensors = {name: DenseTensor(t.name, t.dense(dtype))
               if (name.endswith(MODEL_DTYPE_MATRICES) and isinstance(t, DenseTensor) and len(t.shape) == 2
                   and t.tensor.dtype == torch.float32) else t
               for name, t in w.tensors.items()}
    return Weights(w.cfg, tensors, w.gdn_value_order, w.source, w.unknown)


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


def place(w: Weights, device: torch.device | str, dtype: torch.dtype | None = None) -> Weights:
    """The weight set with every tensor but the host-resident ones moved to `device` (expert stacks kept as
    per-expert parts become one stack there), in the layouts of `gpu_layout` for a model run in `dtype`."""
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
    return gpu_layout(Weights(w.cfg, moved, w.gdn_value_order, w.source, w.unknown), inplace=True, dtype=dtype)


def gpu_layout(w: Weights, inplace: bool = False, dtype: torch.dtype | None = None) -> Weights:
    """The weight set in the layouts GPU placement stores (the tensors where they are): expert stacks and 2-D Q8_0
    and Q6_K matrices word-ordered but the host-resident ones (`word_ordered`), the FUSED_GROUPS back to back
    and repacked (`fuse_groups`). `place` ends with it, and the
    benchmark's synthetic model goes through it, so both run the same kernels on the same layouts. With
    `inplace`, w's tensors are replaced one by one, so each old layout is freed as its new one is made (a model
    of more than half the device's memory fits); w is then spent. For a model run in `dtype` (None: as stored)
    the MODEL_DTYPE_MATRICES are stored in it (`in_model_dtype`)."""
    tensors = w.tensors if inplace else dict(w.tensors)
    for name in list(tensors):
        if not name.endswith(HOST_RESIDENT):
            tensors[name] = word_ordered(name, tensors[name])
    w = Weights(w.cfg, tensors, w.gdn_value_order, w.source, w.unknown)
    return fuse_groups(in_model_dtype(w, dtype), repack=True)


def word_ordered(name: str, t: StoredTensor) -> StoredTensor:
    """A Q4_K or Q5_1 expert stack of WORD_ORDERED_STACKS in its word-ordered layout (Q4_K_R, Q5_1_R), a 2-D Q8_0
    matrix as Q8_0_R (the shared expert; the out projections) and a 2-D Q6_K matrix as Q6_K_R (the head: 248320 x
    2560 in 224 us against 333 as Q6_K_P, the former layout; H200); anything else unchanged. Same values. The
    gate/up stacks (TILE_MAJOR_STACKS) and a large head (TILE_MAJOR_HEAD_MIN_ROWS) go on to their tile-major
    types (Q4_K_RT, Q6_K_RT) where their rows are whole tiles and steps (`tiled`)."""
    if not isinstance(t, QuantTensor):
        return t
    k = t.shape[-1]
    if name.endswith(WORD_ORDERED_STACKS) and len(t.shape) == 3:
        if t.type_id == Q4_K_ID:
            r = QuantTensor(t.name, reorder_q4_k(t.data, k), Q4_K_R_ID, t.shape)
            return tiled(r, Q4_K_RT_ID) if name.endswith(TILE_MAJOR_STACKS) else r
        if t.type_id == Q5_1_ID and k % 128 == 0:
            return QuantTensor(t.name, reorder_q5_1(t.data, k), Q5_1_R_ID, t.shape)
    if t.type_id == Q8_0_ID and len(t.shape) == 2 and k % 256 == 0:
        return QuantTensor(t.name, reorder_q8_0(t.data, k), Q8_0_R_ID, t.shape)
    if t.type_id == Q6_K_ID and len(t.shape) == 2:
        r = QuantTensor(t.name, reorder_q6_k(t.data, k), Q6_K_R_ID, t.shape)
        return tiled(r, Q6_K_RT_ID) if name == "head" and t.shape[0] >= TILE_MAJOR_HEAD_MIN_ROWS else r
    return t


def tiled(t: QuantTensor, type_id: int) -> QuantTensor:
    """Row-major t (of the base type of tile-major `type_id`) as that type, its bytes re-laid in place
    (`repack.tile_major_`); t unchanged where its rows are not whole tiles and steps."""
    layout = TILE_LAYOUTS[type_id]
    if t.type_id != layout.base or t.shape[-2] % layout.tile or t.data.shape[-1] % layout.step:
        return t
    data = tile_major_(t.data.contiguous(), layout.tile, layout.step)
    return QuantTensor(t.name, data.view(*t.shape[:-2], t.shape[-2] // layout.tile, layout.tile, data.shape[-1]),
                       type_id, t.shape)


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


def fast_ops(base: Ops | None = None, streams: bool = True, activations: str = "float") -> Ops:
    """The op table with every available Triton kernel installed (each falls back to the reference for
    inputs it does not cover) and, with `streams`, a layer's independent branches on CUDA streams of their own
    (`strata.runtime.streams`); `activations`: the mode of products with quantized weights
    (`strata.model.ops.with_activations`: the reference fallbacks and the kernels both follow it)."""
    ops = with_activations(base or Ops(), activations)
    try:
        from strata.kernels.fused import fused_ops
        from strata.kernels.ops import triton_ops
    except ImportError as e:
        raise StrataError(f"the GPU path needs Triton ({e}); install it with: pip install -e '.[gpu]'") from e
    from strata.runtime.streams import SideStreams

    q8 = activations == "q8"
    fast = fused_ops(triton_ops(ops, q8=q8), q8=q8)
    return dataclasses.replace(fast, branches=SideStreams()) if streams else fast
