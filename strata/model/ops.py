"""The op table: the few operations a fast backend may replace.

The model calls these through an `Ops` object, never a kernel directly, so a backend (Triton on the GPU)
swaps implementations without forking the model. `Ops()` is the reference: plain PyTorch on any device,
dequantizing stored weights on use.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from strata.model.act_quant import q8_input
from strata.model.attention import attend_ref
from strata.model.experts import experts_ref
from strata.model.gdn import gdn_core_ref
from strata.model.hyper import hc_read_ref, hc_write_read_ref, hc_write_ref
from strata.model.moe import moe_combine_ref, route_ref
from strata.model.ple import decode_rows_ref, ple_gather_ref, ple_mix_ref
from strata.model.qsa import Rope, norm_rope_ref, norm_ropes_ref, qsa_store_ref, select_tokens
from strata.weights.tensor import StoredTensor


def linear_ref(x: torch.Tensor, w: StoredTensor, bias: StoredTensor | None = None) -> torch.Tensor:
    """y = x W^T (+ b), in x's dtype."""
    b = bias.dense(x.dtype, x.device) if bias is not None else None
    return F.linear(x, w.dense(x.dtype, x.device), b)


def linear_q8_ref(x: torch.Tensor, w: StoredTensor, bias: StoredTensor | None = None) -> torch.Tensor:
    """`linear_ref` with Q8 activations: x rounded by `act_quant.round_q8` (then to x's dtype) when W is
    block-quantized, as llama.cpp's GPU matmuls round theirs; dense weights keep x as it is."""
    return linear_ref(q8_input(x, w.kind), w, bias)


def jittered_linear(linear: Callable, rel: float, seed: int) -> Callable:
    """`linear` with rel * u * max |row| added to each output value, u uniform in [-1, 1] (a seeded stream): the
    reference perturbed by the size of the differences between two correct implementations (fp32 accumulation
    order: ~1e-7 of a row's largest product). Where the model is continuous in its products (float activations)
    the logits move by about as much; the Q8-activation mode is not (an input at a rounding boundary lands on
    either integer, a step of 1/127 of its run's largest value), and how far it moves bounds what another correct
    implementation of the mode may differ by (`tools/gpu_check_model.py`)."""
    gen = torch.Generator().manual_seed(seed)

    def jittered(x: torch.Tensor, w: StoredTensor, bias: StoredTensor | None = None) -> torch.Tensor:
        y = linear(x, w, bias)
        u = torch.rand(y.shape, generator=gen, dtype=torch.float64).to(y.device)
        scale = y.double().abs().amax(-1, keepdim=True)
        return (y.double() + rel * scale * (2 * u - 1)).to(y.dtype)

    return jittered


def linears_ref(x: torch.Tensor, ws: Sequence[StoredTensor], biases: Sequence[StoredTensor | None],
                linear: Callable) -> list[torch.Tensor]:
    """x through several weights that read the same x: [linear(x, w, b) for each]. A fast backend runs weights
    stored side by side (see `strata.runtime.placement.fuse_rows`) as one matrix."""
    return [linear(x, w, b) for w, b in zip(ws, biases, strict=True)]


def mlp_ref(x: torch.Tensor, gate: StoredTensor, up: StoredTensor, down: StoredTensor,
            linear: Callable) -> torch.Tensor:
    """SiLU-gated MLP, each product rounded to x's dtype: down(silu(gate x) * up x)."""
    return linear(F.silu(linear(x, gate)) * linear(x, up), down)


def branches_ref(x: torch.Tensor, fns: Sequence[Callable[[], object]]) -> list[object]:
    """Independent computations of one layer, one after the other (a backend may run them side by side)."""
    return [f() for f in fns]


def embed_ref(ids: torch.Tensor, table: StoredTensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows of an embedding table."""
    return table.rows(ids, dtype)


@dataclass
class Ops:
    """Replaceable operations. Each field has the signature of its `*_ref` twin."""

    linear: Callable = linear_ref
    linears: Callable = linears_ref  # (x, [w...], [bias|None...], linear) -> [y...]
    mlp: Callable = mlp_ref  # (x, gate, up, down, linear) -> (L, H)
    embed: Callable = embed_ref
    decode_rows: Callable = decode_rows_ref  # (stored rows (..., width), table, dtype) -> (..., cols)
    attend: Callable = attend_ref  # (q, qsa_state, idx, ok, cfg, gate|None) -> (L, Hq*hd)
    experts: Callable = experts_ref  # (a, top_i, top_w, gate, up, down, linear) -> (L, H)
    gdn_core: Callable = gdn_core_ref  # (x, z, b, alpha, GDNParams, GDNState, cfg) -> (L, nv*dv)
    select_tokens: Callable = select_tokens  # (q_idx, blocks, positions, cfg) -> (idx, ok)
    # (qsa_state, positions, ki, k, v, rope, idx_norm, k_norm, cfg, static, norm_rope) -> None: the cache writes
    qsa_store: Callable = qsa_store_ref
    hc_read: Callable = hc_read_ref  # (x, norm, down, up, inject|None, S, eps, linear) -> (a, inject weights)
    norm_rope: Callable = norm_rope_ref  # (x (L, heads, d), scale (d,) fp32, cos, sin (L, r), eps) -> (L, heads, d)
    norm_ropes: Callable = norm_ropes_ref  # ([x...], [scale...], cos, sin, eps, norm_rope) -> [norm_rope of each]
    rope: Callable = Rope.at  # (positions (L,), cfg, dtype) -> Rope: the call's RoPE tables
    route: Callable = route_ref  # (logits (L, E), k, norm_topk_prob) -> (top_i (L, k) int64, top_w (L, k))
    moe_combine: Callable = moe_combine_ref  # (routed, gate_logit (L, 1), shared) -> (L, H)
    hc_write: Callable = hc_write_ref  # (x (L, S*H), inject (L, S), y (L, H)) -> (L, S*H)
    ple_mix: Callable = ple_mix_ref  # (x, key, value, 3 norm scales, conv_w, window, cfg) -> (L, S*H)
    # (hist (n,) int64, table (rows, row bytes) uint8, NgramTables, out (heads, row bytes) uint8) -> None: a token's
    # n-gram rows gathered where the table lives (a step whose PLE tables are in device memory)
    ple_gather: Callable = ple_gather_ref
    # hc_write then hc_read: (x, inject_prev (L, S), y (L, H), norm, down, up, inject|None, S, eps, linear)
    # -> (x' (L, S*H), a, inject weights|None)
    hc_write_read: Callable = hc_write_read_ref
    # independent computations of one layer: (x, [fn, ...]) -> [fn() for each]; a backend may run them side by
    # side (x gives the device)
    branches: Callable = branches_ref


ACTIVATIONS = ("float", "q8")
"""How GEMV inputs meet block-quantized weights: "float" (exact products of the stored weights, the default) or
"q8" (rounded to Q8 activations first, `act_quant`: integer dot products on the GPU)."""


def with_activations(ops: Ops, activations: str) -> Ops:
    """`ops` whose `linear` rounds activations as `activations` says (`ACTIVATIONS`); every product with a stored
    weight goes through `linear` (the experts, MLP and grouped projections take it as an argument), so swapping
    it defines the mode for the reference. Fast entries of the mode are installed by the backend
    (`strata.runtime.placement.fast_ops`)."""
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations must be one of {', '.join(ACTIVATIONS)}, got {activations!r}")
    return dataclasses.replace(ops, linear=linear_q8_ref) if activations == "q8" else ops
