"""Where weights live and which op table runs them.

The plan today is simple and printed by `strata inspect`: on a GPU every tensor goes to device memory except
the PLE n-gram table, which stays in host RAM or in its mapped file (only the rows a token hashes to are read,
on the host, before the step). Experts in host RAM with a CPU pool and an adaptive VRAM expert cache are the
next placements to add.
"""

from __future__ import annotations

import torch

from strata.errors import StrataError
from strata.model.ops import Ops
from strata.weights.schema import Weights
from strata.weights.tensor import DenseTensor, StackedTensor, StoredTensor

HOST_RESIDENT = ("ple.table",)


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
    return Weights(w.cfg, moved, w.gdn_value_order, w.source, w.unknown)


def fast_ops(base: Ops | None = None) -> Ops:
    """The op table with every available Triton kernel installed (each falls back to the reference for
    inputs it does not cover)."""
    ops = base or Ops()
    try:
        from strata.kernels.fused import fused_ops
        from strata.kernels.ops import triton_ops
    except ImportError as e:
        raise StrataError(f"the GPU path needs Triton ({e}); install it with: pip install -e '.[gpu]'") from e
    return fused_ops(triton_ops(ops))
