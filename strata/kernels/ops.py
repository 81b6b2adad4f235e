"""Op-table entries backed by the Triton GEMV: `linear`, `linears`, `mlp` and `experts` read weights as stored.

`triton_ops(base)` returns `base` (default: the reference `Ops()`) with these entries swapped:

* `linear_triton(x, w, bias)`: y = x W^T (+ b) straight from W's stored rows (ggml blocks of a QuantTensor, or
  the F32/F16/BF16 tensor of a DenseTensor) when x is on a CUDA device, W's bytes already live there and W's
  type has a kernel. For more rows than `GEMV_MAX_ROWS` (prefill) a quantized W is dequantized on the device in
  one launch and multiplied by one cuBLAS matmul, which beats reading the weights once per 8 rows. Anything else
  goes to `linear_ref`, as do dense weights past what one launch takes.
* `linears_triton(x, ws, biases, linear)`: weights stored back to back (`placement.fuse_rows`) as one GEMV.
* `mlp_triton(x, gate, up, down, linear)`: gate/up/SiLU as one GEMV launch, then down.
* `decode_rows_triton(stored, table, dtype)`: table rows the host gathered as stored, decoded on the device.
* `embed_triton(ids, table, dtype)`: embedding rows gathered as stored and decoded in one launch (the reference's
  decoders are a few dozen small PyTorch kernels per call, ~80 us of a captured decode step).
* `experts_triton(a, top_i, top_w, gate, up, down, linear)`: the routed experts of a MoE layer in three launches
  (gate/up/SiLU over all L*k selected slots; down over the slots; the weighted sum over each token's slots; for
  one token the last two are one launch, `gemv_experts_sum`) with
  the expert ids never leaving the device, so a decode step can be captured in a CUDA graph. From GEMM_MIN_TOKENS
  tokens (prefill) the first two are grouped matrix products over tiles of one expert's slots
  (`experts_gemm`). Other inputs go to the reference (`experts_gather`, the capturable twin, while a graph is
  being captured).

All return x's dtype, computed in fp32 and rounded where the reference rounds. A stored tensor exposes its raw
rows as `DenseTensor.tensor` or as a uint8 `data` tensor of shape (*shape[:-1], row_bytes) with `kind` = the ggml type name (QuantTensor).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from strata.kernels.experts_gemm import expert_tiles, experts_gemm, experts_gemm_glu, tile_rows
from strata.kernels.gemv import (GEMV_TYPE_NAMES, MAX_TOKENS, OUT_DTYPES, dequantize_rows, gemv, gemv_experts,
                                 gemv_experts_glu, gemv_experts_sum, gemv_glu)
from strata.kernels import gemv_q8x, gemv_rr
from strata.kernels.moe import slot_sum
from strata.model.act_quant import DENSE_KINDS, RUN
from strata.model.act_quant import q8_input as q8_input_ref
from strata.model.experts import experts_gather, experts_ref
from strata.model.ops import Ops, embed_ref, linear_q8_ref, linear_ref, linears_ref, mlp_ref
from strata.model.ple import decode_rows_ref
from strata.weights.tensor import DenseTensor, StoredTensor, raw_rows

GEMV_MAX_ROWS = 32
"""Rows of x up to which `linear_triton` runs the GEMV on quantized weights (8 rows per launch, each reading all
of W); dense weights take it only for what one launch covers (MAX_TOKENS rows)."""

MAX_EXPERT_SLOTS = 8192
"""Selected (token, expert) slots up to which `experts_triton` runs the GEMV (one program row per slot); the
grouped GEMM (from GEMM_MIN_TOKENS tokens) takes any number. The alternative, the reference's host loop over
distinct experts, costs a few hundred dependent launches and host syncs per layer."""

GEMM_MIN_TOKENS = 16
"""Tokens from which `experts_blocks` runs the routed experts as grouped matrix products on the tensor cores
(`experts_gemm`: each expert's weights decoded once per tile of its slots) instead of one GEMV pass per slot."""

SETTLED_IDS = True
"""One token's routed down projections read the expert ids, and load their weights' first K-loop steps
(`gemv_rr.PRELOAD`), before their PDL wait (the GLU launch between them and the routing waited for it:
`gemv_experts_sum`'s `ids_settled`); False for A/B runs (`tools/step_variants.py`)."""

Q8_UNITS_FROM_GLU = True
"""In the Q8-activation mode, one token's routed GLU writes the down projections' Q8 units itself
(`gemv_q8x.gemv_experts_glu`'s units_for) instead of a quantize launch between the two; False for A/B runs
(`tools/step_variants.py q8-units:off`)."""

_FLOAT_X = (torch.float32, torch.float16, torch.bfloat16)


def stored_rows(w: StoredTensor) -> tuple[torch.Tensor, str] | None:
    """(raw rows, type name) of a stored tensor the GEMV can read directly (`raw_rows` of a type it knows; for a
    tile-major type its `tiled_rows`, which only the kernels given its type name read as tiles), or None."""
    if w.kind not in GEMV_TYPE_NAMES:
        return None
    raw = w.tiled_rows() if getattr(w, "tiled", False) else raw_rows(w)
    return (raw, w.kind) if raw is not None else None

def _as_x(x: torch.Tensor, k: int) -> torch.Tensor:
    """x as (rows, k) with contiguous rows in a dtype the kernel loads."""
    x2 = x.reshape(-1, k)
    if x2.dtype not in _FLOAT_X:
        x2 = x2.float()
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _q8_kernel(x: torch.Tensor, kind: str, *mats: torch.Tensor) -> bool:
    """Whether one row of x meets the raw weights `mats` (matrices or expert stacks) of `kind` in a Q8-activation
    GEMV (`gemv_q8x`)."""
    return x.numel() == x.shape[-1] and x.dtype in OUT_DTYPES and _q8_types(kind, x.shape[-1], *mats)


def _q8_types(kind: str, k: int, *mats: torch.Tensor) -> bool:
    """Whether `gemv_q8x` multiplies rows of k weights of `kind` stored as `mats`: a row-register type, k a
    multiple of 128, rows 16-byte aligned."""
    return (kind in gemv_q8x.ORDER and k % 128 == 0
            and all(gemv_rr.covers(kind, 1, m, None, (m.stride(0),) if m.dim() == 3 else ()) for m in mats))


def q8_input(x: torch.Tensor, kind: str, q8: bool = True) -> torch.Tensor:
    """`act_quant.q8_input` (x rounded to Q8 activations where `kind` is block-quantized), in one launch
    (`gemv_q8x.round_rows`) where x lives on the GPU: the input of a product whose weights have no Q8 GEMV."""
    if q8 and kind not in DENSE_KINDS and _on_gpu(x) and x.shape[-1] % RUN == 0 and x.dtype in _FLOAT_X:
        return gemv_q8x.round_rows(x)
    return q8_input_ref(x, kind, q8)


def linear_blocks(x: torch.Tensor, data: torch.Tensor, kind: str, bias: StoredTensor | None = None,
                  q8: bool = False) -> torch.Tensor:
    """y = x W^T (+ b) by the GEMV from W's raw rows `data` of type `kind`; x (..., K) -> (..., N) in x's dtype.
    q8: Q8 activations (`strata.model.ops.with_activations`): one row by `gemv_q8x` where the type has its
    kernel, else x rounded first. No device check: the caller decides (the tests run it on the CPU under the
    Triton interpreter)."""
    k = x.shape[-1]
    if q8 and bias is None and _q8_kernel(x, kind, data):
        y = gemv_q8x.gemv(gemv_q8x.quantize(_as_x(x, k), kind), data, kind, k, out_dtype=x.dtype)
        return y.reshape(*x.shape[:-1], y.shape[-1])
    x = q8_input(x, kind, q8)
    if bias is None and x.dtype in OUT_DTYPES:  # rounded to x's dtype at the store: no cast launch
        y = gemv(_as_x(x, k), data, kind, k, out_dtype=x.dtype)
        return y.reshape(*x.shape[:-1], y.shape[-1])
    y = gemv(_as_x(x, k), data, kind, k)
    if bias is not None:
        y += bias.dense(torch.float32, y.device)
    return y.to(x.dtype).reshape(*x.shape[:-1], y.shape[-1])


def linear_triton(x: torch.Tensor, w: StoredTensor, bias: StoredTensor | None = None, q8: bool = False,
                  ) -> torch.Tensor:
    """`Ops.linear`: the GEMV from W's stored rows when it applies (see the module docstring); for more rows of
    x, W dequantized on the device in one launch (`dense_on_device`) and one matmul; else `linear_ref`. q8: with
    Q8 activations (`linear_blocks`; else x rounded, or `linear_q8_ref`)."""
    raw = _gemv_ok(x, w, GEMV_MAX_ROWS)
    if raw is not None:
        return linear_blocks(x, raw[0], raw[1], bias, q8)
    dense = dense_on_device(x, w)
    if dense is not None:
        x = q8_input(x, w.kind, q8)
        return F.linear(x, dense, bias.dense(x.dtype, x.device) if bias is not None else None)
    return linear_q8_ref(x, w, bias) if q8 else linear_ref(x, w, bias)


def dense_on_device(x: torch.Tensor, w: StoredTensor) -> torch.Tensor | None:
    """W (2-D, quantized, its bytes on x's CUDA device, of a type the GEMV decodes) as a dense (N, K) tensor of x's
    dtype, decoded by `dequantize_rows` in one launch (the reference's decoders are a few dozen PyTorch kernels
    per matrix, and more for strata's word-ordered types); None for anything else. The values are the
    reference's: each weight decoded in fp32 and rounded once to x's dtype."""
    if not (_on_gpu(x) and len(w.shape) == 2 and x.dtype in OUT_DTYPES) or isinstance(w, DenseTensor):
        return None
    raw = stored_rows(w)
    if raw is None or raw[0].device != x.device or raw[0].dtype != torch.uint8:
        return None
    return dequantize_rows(raw[0], raw[1], w.shape[1], x.dtype, block_n=8)


def _on_gpu(x: torch.Tensor) -> bool:
    """Whether x's device runs the kernels (compiled Triton needs CUDA; the tests patch this to run the entries
    under the interpreter on the CPU)."""
    return x.is_cuda


def _gemv_ok(x: torch.Tensor, w: StoredTensor, rows_limit: int) -> tuple[torch.Tensor, str] | None:
    """W's raw rows when x (on CUDA) can go through the GEMV with them, else None."""
    if not (_on_gpu(x) and len(w.shape) == 2 and x.shape[-1] == w.shape[1] and x.shape[-1] > 0):
        return None
    raw = stored_rows(w)
    rows = x.numel() // x.shape[-1]
    limit = min(rows_limit, MAX_TOKENS) if isinstance(w, DenseTensor) else rows_limit
    if raw is None or raw[0].device != x.device or rows > limit:
        return None
    return raw


def adjacent_span(raws: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """One (sum of rows, width) view over 2-D row blocks that lie back to back in one storage (as
    `strata.runtime.placement.fuse_rows` leaves them), else None."""
    first = raws[0]
    rows = 0
    for r in raws:
        if (r.dim() != 2 or r.dtype != first.dtype or r.shape[1] != first.shape[1] or r.stride() != first.stride()
                or r.stride(1) != 1 or r.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
                or r.data_ptr() != first.data_ptr() + rows * first.stride(0) * first.element_size()):
            return None
        rows += r.shape[0]
    return first.as_strided((rows, first.shape[1]), first.stride())


def linears_triton(x: torch.Tensor, ws: Sequence[StoredTensor], biases: Sequence[StoredTensor | None],
                   linear: Callable, q8: bool = False) -> list[torch.Tensor]:
    """`Ops.linears`: weights of one type stored back to back run as one GEMV (one launch, x read once), the
    outputs returned as column slices; otherwise one `linear` each. q8: see `linear_blocks`."""
    raws = [_gemv_ok(x, w, GEMV_MAX_ROWS) for w in ws]
    if len(ws) > 1 and all(r is not None and r[1] == raws[0][1] for r in raws):
        span = adjacent_span([r[0] for r in raws])
        if span is not None:
            y = linear_blocks(x, span, raws[0][1], q8=q8)
            outs, col = [], 0
            for w, b in zip(ws, biases, strict=True):
                part = y[..., col:col + w.shape[0]]
                col += w.shape[0]
                if x.numel() != x.shape[-1]:
                    part = part.contiguous()
                outs.append(part if b is None else part + b.dense(part.dtype, part.device))
            return outs
    return linears_ref(x, ws, biases, linear)


def mlp_triton(x: torch.Tensor, gate: StoredTensor, up: StoredTensor, down: StoredTensor,
               linear: Callable, q8: bool = False) -> torch.Tensor:
    """`Ops.mlp`: gate, up and SiLU in one GEMV launch (`gemv_glu`) when both are GEMV-readable and of one type,
    then `linear` for down; else the reference composition. q8: see `linear_blocks`."""
    g, u = _gemv_ok(x, gate, MAX_TOKENS), _gemv_ok(x, up, MAX_TOKENS)
    if g is not None and u is not None and g[1] == u[1] and x.dtype in OUT_DTYPES:
        k = x.shape[-1]
        if q8 and _q8_kernel(x, g[1], g[0], u[0]):
            h = gemv_q8x.gemv_glu(gemv_q8x.quantize(_as_x(x, k), g[1]), g[0], u[0], g[1], k, out_dtype=x.dtype)
        else:
            h = gemv_glu(_as_x(q8_input(x, g[1], q8), k), g[0], u[0], g[1], k, out_dtype=x.dtype)
        return linear(h.reshape(*x.shape[:-1], h.shape[-1]), down)
    return mlp_ref(x, gate, up, down, linear)


def experts_blocks(a: torch.Tensor, top_i: torch.Tensor, top_w: torch.Tensor,
                   gate: tuple[torch.Tensor, str], up: tuple[torch.Tensor, str], down: tuple[torch.Tensor, str],
                   q8: bool = False) -> torch.Tensor:
    """Σ_j top_w[:, j] · down_e(silu(gate_e a) ⊙ up_e a), e = top_i[:, j], from raw expert stacks (data, kind):
    gate/up (E, I, ·) over H, down (E, H, ·) over I. Slot s = l*k + j runs expert top_i[l, j] on token l; the
    three GEMVs cover all slots in one launch each; from GEMM_MIN_TOKENS tokens the slots are sorted by expert
    and the gate/up and down products run as grouped matrix products (`experts_gemm`). q8: Q8 activations for
    both products (`linear_blocks`): one token by `gemv_q8x` where the types have its kernels, the GLU writing
    the down projections' Q8 units itself where it can, else a quantize launch before each. No device check (see
    `linear_blocks`)."""
    n_tok, k = top_i.shape
    h_dim = a.shape[-1]
    i_dim = gate[0].shape[1]
    ids = top_i.reshape(-1)
    if ids.dtype not in (torch.int32, torch.int64):
        ids = ids.to(torch.int64)
    ids = ids.contiguous()
    x = _as_x(a, h_dim)
    if (q8 and n_tok == 1 and gate[1] == up[1] and _q8_kernel(x, gate[1], gate[0], up[0])
            and _q8_types(down[1], i_dim, down[0])):
        h = gemv_q8x.gemv_experts_glu(gemv_q8x.quantize(x, gate[1]), gate[0], up[0], ids, gate[1], h_dim,
                                      out_dtype=a.dtype, units_for=down[1] if Q8_UNITS_FROM_GLU else None)
        return gemv_q8x.gemv_experts_sum(gemv_q8x.quantize(h, down[1]), down[0], ids, top_w.reshape(-1).contiguous(),
                                         down[1], i_dim, out_dtype=a.dtype, ids_settled=SETTLED_IDS)
    xg = q8_input(x, gate[1], q8)
    xu = xg if (gate[1] in DENSE_KINDS) == (up[1] in DENSE_KINDS) else q8_input(x, up[1], q8)
    # slots sorted by expert: the GEMM's tiles are runs of one expert's slots; the GEMV's programs of one expert
    # run back to back and find its weights in L2
    order = ids.argsort(stable=True) if n_tok > 1 else None
    if n_tok >= GEMM_MIN_TOKENS and a.dtype in OUT_DTYPES:
        return _experts_grouped(xg, ids[order], order, top_w.reshape(n_tok, k), gate, up, down, a.dtype,
                                None if xu is xg else xu, q8)
    if order is not None:
        ids = ids[order].contiguous()
        xg, xu = (xg[order // k],) * 2 if xu is xg else (xg[order // k], xu[order // k])
    if gate[1] == up[1] and a.dtype in OUT_DTYPES:
        # gate/up/SiLU in one launch; down over every slot in parallel (fp32), then the weighted sum over each
        # token's slots (a program looping over the slots itself serialises k dependent GEMVs: 8x slower)
        h = q8_input(gemv_experts_glu(xg, gate[0], up[0], ids, gate[1], h_dim, out_dtype=a.dtype), down[1], q8)
        if n_tok == 1:  # one token (decode): the down projections and their weighted sum in one launch
            return gemv_experts_sum(h, down[0], ids, top_w.reshape(-1).contiguous(), down[1], i_dim,
                                    out_dtype=a.dtype, ids_settled=SETTLED_IDS)
        y = gemv_experts(h, down[0], ids, down[1], i_dim)
    else:
        g = gemv_experts(xg, gate[0], ids, gate[1], h_dim)
        u = gemv_experts(xu, up[0], ids, up[1], h_dim)
        y = gemv_experts(q8_input(F.silu(g) * u, down[1], q8), down[0], ids, down[1], i_dim)
    if order is not None:
        y = torch.empty_like(y).index_copy_(0, order, y)
    return slot_sum(y, top_w.reshape(n_tok, k), a.dtype)


def _experts_grouped(x: torch.Tensor, ids_sorted: torch.Tensor, order: torch.Tensor, top_w: torch.Tensor,
                     gate: tuple[torch.Tensor, str], up: tuple[torch.Tensor, str], down: tuple[torch.Tensor, str],
                     dtype: torch.dtype, x_up: torch.Tensor | None = None, q8: bool = False) -> torch.Tensor:
    """`experts_blocks` by the grouped GEMM: x (tokens, H) (x_up: the up products' x, where it differs), the
    slots' expert ids sorted and the sorting order; q8: the down products' input rounded (`q8_input`)."""
    n_tok, k = top_w.shape
    n_exp = gate[0].shape[0]
    bm = tile_rows(ids_sorted.numel(), n_exp)
    tiles = expert_tiles(ids_sorted, n_exp, bm)
    if gate[1] == up[1]:
        h = experts_gemm_glu(x, gate[0], up[0], tiles, order // k, gate[1], x.shape[1], bm, dtype)
    else:
        h = _glu_apart(x, gate, up, tiles, order // k, x.shape[1], bm, dtype, x_up)
    h = q8_input(h, down[1], q8)
    y = experts_gemm(h, down[0], tiles, order, down[1], h.shape[1], bm)
    return slot_sum(y, top_w, dtype)


def _glu_apart(x: torch.Tensor, gate: tuple[torch.Tensor, str], up: tuple[torch.Tensor, str], tiles: torch.Tensor,
               x_rows: torch.Tensor, h_dim: int, bm: int, dtype: torch.dtype, x_up: torch.Tensor | None = None,
               ) -> torch.Tensor:
    """silu(gate) * up of gate and up stacks of different types: each product by `experts_gemm` (sorted slot
    order; x_up: the up products' x where it differs from x), rounded as the model rounds them."""
    rows = torch.arange(x_rows.shape[0], device=x.device)
    xs = x.index_select(0, x_rows)
    xus = xs if x_up is None else x_up.index_select(0, x_rows)
    g = experts_gemm(xs, gate[0], tiles, rows, gate[1], h_dim, bm).to(dtype)
    u = experts_gemm(xus, up[0], tiles, rows, up[1], h_dim, bm).to(dtype)
    return F.silu(g) * u


def experts_triton(a: torch.Tensor, top_i: torch.Tensor, top_w: torch.Tensor, gate: StoredTensor,
                   up: StoredTensor, down: StoredTensor, linear, q8: bool = False) -> torch.Tensor:
    """`Ops.experts`: the kernels of `experts_blocks` when a is on a CUDA device, the three stacks' raw bytes live
    there, their types have kernels and the GEMM takes the call or there are at most MAX_EXPERT_SLOTS slots; else
    the reference (which rounds through `linear` in the q8 mode, `experts_gather` by its own `q8`)."""
    if (_on_gpu(a) and top_i.dim() == 2 and top_i.numel() > 0
            and (top_i.shape[0] >= GEMM_MIN_TOKENS or top_i.numel() <= MAX_EXPERT_SLOTS)):
        raws = [stored_rows(t) if len(t.shape) == 3 else None for t in (gate, up, down)]
        if all(r is not None and r[0].device == a.device for r in raws):
            return experts_blocks(a, top_i, top_w, raws[0], raws[1], raws[2], q8)
    if a.is_cuda and torch.cuda.is_current_stream_capturing():
        return experts_gather(a, top_i, top_w, gate, up, down, linear, q8=q8)
    return experts_ref(a, top_i, top_w, gate, up, down, linear)


def decode_rows_triton(stored: torch.Tensor, table: StoredTensor, dtype: torch.dtype) -> torch.Tensor:
    """`Ops.decode_rows`: stored quantized rows on a CUDA device decoded in one launch by the GEMV's decoders
    (`dequantize_rows`); anything else (dense rows, other devices) by the reference."""
    if (_on_gpu(stored) and stored.dtype == torch.uint8 and table.kind in GEMV_TYPE_NAMES
            and dtype in OUT_DTYPES and stored.shape[-1] > 0):
        cols = table.shape[-1]
        y = dequantize_rows(stored.reshape(-1, stored.shape[-1]), table.kind, cols, dtype)
        return y.reshape(*stored.shape[:-1], cols)
    return decode_rows_ref(stored, table, dtype)


def embed_triton(ids: torch.Tensor, table: StoredTensor, dtype: torch.dtype) -> torch.Tensor:
    """`Ops.embed`: rows of a quantized 2-D table in device memory gathered as stored (no range check, so no host
    synchronisation: ids are checked when they are staged) and decoded in one launch (`decode_rows_triton`);
    anything else by the reference."""
    raw = raw_rows(table) if len(table.shape) == 2 else None
    if raw is not None and raw.dtype == torch.uint8 and _on_gpu(ids) and raw.device == ids.device and ids.numel():
        stored = raw.index_select(0, ids.reshape(-1).to(torch.int64)).reshape(*ids.shape, raw.shape[1])
        return decode_rows_triton(stored, table, dtype)
    return embed_ref(ids, table, dtype)


def triton_ops(base: Ops | None = None, q8: bool = False) -> Ops:
    """`base` (default `Ops()`) with `linear`, `linears`, `mlp`, `experts`, `decode_rows` and `embed` run by the
    Triton GEMV kernels; other entries unchanged. q8: the entries of the Q8-activation mode
    (`strata.model.ops.with_activations`)."""
    if q8:
        return dataclasses.replace(
            base or Ops(), linear=functools.partial(linear_triton, q8=True),
            linears=functools.partial(linears_triton, q8=True), mlp=functools.partial(mlp_triton, q8=True),
            experts=functools.partial(experts_triton, q8=True), decode_rows=decode_rows_triton, embed=embed_triton)
    return dataclasses.replace(base or Ops(), linear=linear_triton, linears=linears_triton, mlp=mlp_triton,
                               experts=experts_triton, decode_rows=decode_rows_triton, embed=embed_triton)
