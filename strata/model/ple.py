"""PLE: the hashed n-gram embedding added to the hyper-connection state at some GDN layers (spec 7).

The hash is host work on int64 ids; only the gathered table rows are read (the real table is tens of GB and
lives in a memory-mapped file). The host gathers the rows as they are stored (bytes of quantized blocks) and
the device decodes them where they are used (`Ops.decode_rows`), so a decode step's host work is a hash and a
copy of ~1.5 KB."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from strata.config import ModelConfig, PLEGeometry
from strata.model.gdn import causal_conv
from strata.model.norms import grouped_rms_norm
from strata.runtime.state import PLEState
from strata.weights.schema import Weights
from strata.weights.tensor import StoredTensor

if TYPE_CHECKING:
    from strata.model.ops import Ops


def shifted_history(history: torch.Tensor, shift: int, eos: int) -> torch.Tensor:
    """history[p - shift], or EOS where that is before the start or an EOS lies in history[p-shift .. p-1]."""
    if shift == 0:
        return history
    n = history.shape[0]
    pos = torch.arange(n, device=history.device)
    eos_at = torch.where(history == eos, pos, -1)
    last_eos_before = torch.cat([torch.full_like(pos[:1], -1), torch.cummax(eos_at, 0).values[:-1]])
    src = pos - shift
    valid = (src >= 0) & (src > last_eos_before)
    return torch.where(valid, history[src.clamp_min(0)], eos)


def _i64(v: int) -> int:
    """v wrapped to a signed 64-bit integer (torch's int64 multiply)."""
    v &= (1 << 64) - 1
    return v - (1 << 64) if v >> 63 else v


def ngram_rows_one(token: int, context: list[int], geo: PLEGeometry, cfg: ModelConfig) -> list[int]:
    """`ngram_rows` of one id in plain integer arithmetic: a decode step's host work, on the path of every token
    (the step waits for it after its first layer), so each product is formed once, wrapped once, and the orders'
    hashes build on each other (h_m = h_(m-1) ^ p_(m-1))."""
    n, hpn, eos = cfg.ngram_size, cfg.heads_per_ngram, cfg.ple_eos
    hist = [*context[len(context) - (n - 1):], token]  # hist[n - 1 - k]: the id k back
    rows: list[int] = []
    h = 0
    live = True  # no EOS between the id k back and the current one (exclusive)
    for k in range(n):
        v = hist[n - 1 - k] if live else eos
        if k > 0 and hist[n - 1 - k] == eos:
            live = False  # ids further back are replaced by EOS (this one is EOS itself)
        h ^= _i64(v * geo.multipliers[k])
        if k == 0:
            continue
        lo = (k - 1) * hpn
        for prime, off in zip(geo.primes[lo:lo + hpn], geo.offsets[lo:lo + hpn], strict=True):
            rows.append(h % prime + off)
    return rows


def ngram_rows(ids: torch.Tensor, context: torch.Tensor, geo: PLEGeometry, cfg: ModelConfig) -> torch.Tensor:
    """Table rows (L, ngram_heads) for the ids, given the previous n-1 ids."""
    if ids.numel() == 1 and context.numel() == cfg.ngram_size - 1:
        return torch.tensor([ngram_rows_one(int(ids.reshape(-1)[0]), context.tolist(), geo, cfg)])
    hist = torch.cat([context, ids.to(torch.int64).cpu()])
    return ngram_hash_rows(hist, NgramTables.of(geo, cfg, "cpu"))


def ngram_hash_rows(hist: torch.Tensor, tables: NgramTables) -> torch.Tensor:
    """Table rows (len(hist) - n + 1, ngram_heads) of the n-grams ending at hist[n - 1:], in tensor ops on
    hist's device (no host synchronisation, so a captured step can run it): ids older than an EOS (the id itself
    excepted) hash as EOS; products wrap around int64; the remainder is taken non-negative."""
    n, hpn = tables.multipliers.numel(), tables.heads_per_ngram
    shifted = [shifted_history(hist, k, tables.eos) for k in range(n)]
    mult, primes, offsets = tables.multipliers, tables.primes, tables.offsets
    blocks = []
    for m in range(2, n + 1):
        h = shifted[0] * mult[0]
        for j in range(1, m):
            h = torch.bitwise_xor(h, shifted[j] * mult[j])
        sl = slice((m - 2) * hpn, (m - 1) * hpn)
        blocks.append(torch.remainder(h.unsqueeze(-1), primes[sl]) + offsets[sl])
    return torch.cat(blocks, dim=-1)[n - 1:]


def ple_rows(ids: torch.Tensor, w: Weights, layer: int, cfg: ModelConfig, state: PLEState) -> torch.Tensor:
    """Host work: hash the n-grams ending at each id, gather the table rows as stored, advance the n-gram
    context. Returns (L, ngram_heads, stored row width) on the table's device (the host)."""
    rows = ngram_rows(ids, state.context, cfg.ple[layer], cfg)
    state.context = torch.cat([state.context, ids.to(torch.int64).cpu()])[-(cfg.ngram_size - 1):]
    return w[f"L{layer}.ple.table"].stored_rows(rows)


def ple_rows_into(token: int, w: Weights, layer: int, cfg: ModelConfig, state: PLEState,
                  out: torch.Tensor | np.ndarray) -> None:
    """`ple_rows` of one id written into the host buffer `out` (ngram_heads, stored row width; or the uint8 numpy
    array of its bytes, `StoredTensor.stored_rows_into`): a decode step's host work in plain integers and one
    numpy gather, with no tensor op."""
    ctx = state.context.numpy()  # the context's memory: advanced in place, without building a tensor
    rows = ngram_rows_one(token, ctx.tolist(), cfg.ple[layer], cfg)
    _advance(ctx, token)
    w[f"L{layer}.ple.table"].stored_rows_into(rows, out)


def ple_advance(token: int, state: PLEState) -> None:
    """The n-gram context moved on by one id the device fed itself (a step run ahead), writing no buffer."""
    _advance(state.context.numpy(), token)


def _advance(ctx: np.ndarray, token: int) -> None:
    """The n-gram context (the memory of `PLEState.context`) moved on by one id, in place."""
    ctx[:-1] = ctx[1:]  # numpy copies overlapping ranges as if through a temporary
    ctx[-1] = token


@dataclass(frozen=True)
class NgramTables:
    """One PLE layer's hashing geometry as device tensors, for a step that hashes a token's n-grams and gathers
    their rows on the device (`Ops.ple_gather`): the multipliers (n,) wrapped to int64 (the products wrap
    alike), and each n-gram head's prime and row offset ((n-1) * heads_per_ngram,)."""

    multipliers: torch.Tensor
    primes: torch.Tensor
    offsets: torch.Tensor
    eos: int
    heads_per_ngram: int

    @classmethod
    def of(cls, geo: PLEGeometry, cfg: ModelConfig, device: torch.device | str) -> NgramTables:
        i64 = functools.partial(torch.tensor, dtype=torch.int64, device=device)
        return cls(i64([_i64(m) for m in geo.multipliers]), i64(list(geo.primes)), i64(list(geo.offsets)),
                   cfg.ple_eos, cfg.heads_per_ngram)


def ple_hist_into(token: int, state: PLEState, out: np.ndarray) -> None:
    """A decode step's host work where the device hashes (`Ops.ple_gather`): the n-gram history of one id
    (its context, then the id) written into `out` ((n,) int64), the context advanced as `ple_rows_into` does."""
    ctx = state.context.numpy()
    out[:-1] = ctx
    out[-1] = token
    _advance(ctx, token)


def ple_gather_ref(hist: torch.Tensor, table: torch.Tensor, tables: NgramTables, out: torch.Tensor) -> None:
    """The rows of the n-grams ending at hist's last id (`ngram_hash_rows`) gathered as stored, on the table's
    device (a page-locked host table: copied to out's): hist (n,) int64 the context and the id, table (rows, row
    bytes) uint8 the stored rows, out (heads, row bytes) uint8."""
    out.copy_(table.index_select(0, ngram_hash_rows(hist, tables)[-1].to(table.device)))


def decode_rows_ref(stored: torch.Tensor, table: StoredTensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows gathered by `StoredTensor.stored_rows`, decoded in `dtype` on their device."""
    return table.decode_rows(stored, dtype)


def ple_mix_ref(x: torch.Tensor, key: torch.Tensor, value: torch.Tensor, norm_key: torch.Tensor,
                norm_query: torch.Tensor, norm_conv: torch.Tensor, conv_w: torch.Tensor, window: torch.Tensor,
                cfg: ModelConfig) -> torch.Tensor:
    """Everything of a PLE layer after its two projections (spec 7.4 steps 2, 4-11): x (L, S*H) the HC state,
    key (L, S*H) and value (L, H) the projections, the three fp32 grouped-norm scales (S*H,), conv_w (S*H, Kp)
    in the model dtype, window (S*H, (Kp-1)*n) the conv state (updated in place). Returns (L, S*H)."""
    S, H, eps = cfg.hc_count, cfg.hidden_size, cfg.rms_norm_eps
    key = grouped_rms_norm(key, norm_key, H, eps).unflatten(-1, (S, H))
    query = grouped_rms_norm(x, norm_query, H, eps).unflatten(-1, (S, H))
    s = (key * query).sum(-1, keepdim=True) / math.sqrt(H)
    s = s.abs().clamp_min(1e-6).sqrt() * s.sign()
    gated = (torch.sigmoid(s) * value.unsqueeze(-2)).flatten(-2)  # (L, S*H)
    conv, new_window = causal_conv(grouped_rms_norm(gated, norm_conv, H, eps), window, conv_w,
                                   dilation=cfg.ngram_size)
    window.copy_(new_window)
    return gated + F.silu(conv)


def ple_layer(x: torch.Tensor, stored: torch.Tensor, w: Weights, layer: int, cfg: ModelConfig, state: PLEState,
              ops: Ops) -> torch.Tensor:
    """The PLE contribution (L, S*H) to add to the state x, from the table rows `ple_rows` gathered (on x's
    device); updates `state`."""
    p = f"L{layer}.ple."
    dev = x.device
    e = ops.decode_rows(stored, w[p + "table"], x.dtype).flatten(-2)
    scale = lambda name: w[p + name].dense(torch.float32, dev)
    return ops.ple_mix(x, ops.linear(e, w[p + "key"]), ops.linear(e, w[p + "value"]), scale("norm_key"),
                       scale("norm_query"), scale("norm_conv"), w[p + "conv"].dense(x.dtype, dev), state.conv, cfg)
