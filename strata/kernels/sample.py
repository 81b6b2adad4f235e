"""Token choice on the device: greedy argmax and temperature / top-k / top-p / min-p sampling with a device seed
and step offset, with no host synchronisation, so the choice can sit inside the captured decode graph and the
next step's input id never has to visit the host.

The filters follow transformers' definitions (as `strata.text.sampling` documents them): logits / temperature,
then top-k (keep logits >= the k-th largest, ties kept), top-p (drop the tokens whose ascending cumulative
probability is <= 1 - p, always keeping the most likely one), min-p (drop probabilities below min_p x the
largest). Each of these keeps exactly the logits at or above some value, so after one descending sort the three
reduce to one threshold per row; the draw is then a Gumbel-max over the kept logits: argmax(x_i + G_i) with
G_i = -log(-log u_i) is distributed as softmax(x) over the kept set, and needs no normalisation, cumulative sum
or search. u comes from Triton's Philox keyed by (seed, step offset), so a seed fixes the token sequence.

Every parameter is a device tensor (B,), so one captured graph serves any parameters; a temperature of 0
selects the argmax. Differences from the host sampler are confined to float rounding at a filter boundary and to
ties at the top-p boundary (kept here; the host's unstable sort keeps an arbitrary part of a tie).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from strata.kernels import pdl
from strata.kernels.gemv import tickets

GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64: spreads consecutive step offsets over Philox keys
BLOCK = 4096


@triton.jit
def _gumbel_argmax_kernel(x_ptr, thr_ptr, key_ptr, bv_ptr, bi_ptr, V, s_x, NBLK, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    blk = tl.program_id(1)
    i = blk * BLOCK + tl.arange(0, BLOCK)
    im = i < V
    x = tl.load(x_ptr + row * s_x + i, mask=im, other=float("-inf"))
    thr = tl.load(thr_ptr + row)
    u = tl.rand(tl.load(key_ptr + row), i)
    gumbel = -tl.log(-tl.log(u))
    score = tl.where(im & (x >= thr), x + gumbel, float("-inf"))
    best = tl.argmax(score, axis=0)
    tl.store(bv_ptr + row * NBLK + blk, tl.max(score, axis=0))
    tl.store(bi_ptr + row * NBLK + blk, (blk * BLOCK + best).to(tl.int64))


def thresholds(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """The lowest kept logit value per row (B,) of temperature-scaled fp32 logits x (B, V): tokens with
    x >= threshold survive top-k (0 = off), then top-p (>= 1 = off), then min-p (0 = off)."""
    V = x.shape[-1]
    vals = x.sort(dim=-1, descending=True).values
    k = torch.where(top_k > 0, top_k.clamp(max=V), V).to(torch.int64)
    kth = vals.gather(-1, (k - 1)[:, None])  # (B, 1)
    filt = vals.masked_fill(vals < kth, float("-inf"))
    probs = filt.softmax(-1)
    before = F.pad(probs.cumsum(-1)[:, :-1], (1, 0))  # mass strictly above each sorted position
    # ascending cumsum <= 1 - p  <=>  (mass strictly above) >= p ; the monotone kept set is a prefix
    n_keep = (before < top_p[:, None]).sum(-1).clamp(min=1)
    thr_p = vals.gather(-1, (n_keep - 1)[:, None])
    thr_p = torch.where(top_p[:, None] < 1, thr_p, float("-inf"))
    # min-p on the filtered distribution: p_i / p_max = exp(x_i - x_max), and x_max = vals[:, 0] always stays
    thr_m = torch.where(min_p[:, None] > 0, vals[:, :1] + torch.log(min_p.clamp(min=1e-30))[:, None],
                        float("-inf"))
    return torch.maximum(torch.maximum(kth, thr_p), thr_m)[:, 0]


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           min_p: torch.Tensor, seed: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """One token per row (B,) int64 from logits (B, V) (or (V,), giving (1,)). All parameters are device
    tensors of shape (B,): temperature (0 = greedy), top_k (int, 0 = off), top_p, min_p, seed and offset
    (int64; the draw is a function of (seed, offset, logits), so advance the offset every step)."""
    if logits.dim() == 1:
        logits = logits[None]
    B, V = logits.shape
    raw = logits.float()
    greedy = raw.argmax(-1)
    hot = temperature > 0
    x = (raw / torch.where(hot, temperature, 1.0)[:, None]).contiguous()
    thr = thresholds(x, top_k, top_p, min_p).contiguous()
    key = (seed.to(torch.int64) + offset.to(torch.int64) * GOLDEN).contiguous()
    block = min(BLOCK, triton.next_power_of_2(V))
    nblk = triton.cdiv(V, block)
    bv = torch.empty(B, nblk, dtype=torch.float32, device=x.device)
    bi = torch.empty(B, nblk, dtype=torch.int64, device=x.device)
    _gumbel_argmax_kernel[(B, nblk)](x, thr, key, bv, bi, V, x.stride(0), nblk, BLOCK=block)
    drawn = bi.gather(-1, bv.argmax(-1, keepdim=True))[:, 0]
    return torch.where(hot, drawn, greedy)


@triton.jit
def _argmax_kernel(x_ptr, part_ptr, cnt_ptr, out_ptr, V, NBLK: tl.constexpr, NBP: tl.constexpr,
                   BLOCK: tl.constexpr, GDC: tl.constexpr = False):
    """Program b: the largest key of x[b * BLOCK ...] into part[b]; the last program to draw a ticket reduces the
    NBLK partial keys and stores the index. A key orders by value, then by lower index: the fp32 bits mapped to
    an int32 order (-0.0 as +0.0, every NaN above +inf: torch's argmax) in the high word, 2^32 - 1 - index in the
    low word; so the result does not depend on which program finishes last, and is torch's first maximal index."""
    pdl.enter(GDC)
    blk = tl.program_id(0)
    i = blk * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < V, other=float("-inf")).to(tl.float32) + 0.0  # -0.0 + 0.0 = +0.0
    b = x.to(tl.int32, bitcast=True)
    o = tl.where(b >= 0, b, b ^ 0x7FFFFFFF)
    o = tl.where(x != x, 0x7FFFFFFF, o)
    key = o.to(tl.int64) * 4294967296 + (4294967295 - i.to(tl.int64))
    tl.store(part_ptr + blk, tl.max(key, axis=0))
    tl.debug_barrier()  # the partial is written before the ticket is drawn
    last = tl.where(tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu") == NBLK - 1, 1, 0)
    j = tl.arange(0, NBP)
    keys = tl.load(part_ptr + j, mask=j < NBLK * last, other=-9223372036854775807 - 1, cache_modifier=".cg")
    best = tl.max(keys, axis=0)
    tl.store(out_ptr, 4294967295 - (best & 4294967295), mask=last == 1)
    tl.atomic_add(cnt_ptr, -NBLK * last, sem="relaxed", scope="gpu")  # back to 0 for the next launch


ARGMAX_BLOCK = 4096


def argmax_supported(x: torch.Tensor) -> bool:
    """The tensors `argmax` takes: non-empty, contiguous, fp32 / bf16 / fp16."""
    return x.is_contiguous() and x.dtype in (torch.float32, torch.bfloat16, torch.float16) and x.numel() > 0


def argmax(x: torch.Tensor, block: int = ARGMAX_BLOCK, out: torch.Tensor | None = None) -> torch.Tensor:
    """`x.argmax()` (a 0-d int64 tensor: the first maximal element of the flattened x, NaN above everything) in
    one launch: per-block partial keys and a ticket (`gemv.tickets`), with no atomics on the result, so a
    graph replay gives the eager call's index. x contiguous float; the decode step's greedy choice. `out`: a
    one-element int64 tensor to write the index into (returned)."""
    if not argmax_supported(x):
        raise ValueError(f"argmax: expected a non-empty contiguous float tensor, got {x.dtype} {tuple(x.shape)}")
    if out is not None and (out.dtype != torch.int64 or out.numel() != 1 or out.device != x.device):
        raise ValueError(f"argmax: out must be one int64 element on {x.device}, got {out.dtype} {tuple(out.shape)}")
    cnt = tickets(x.device)
    if cnt is None:
        return x.argmax() if out is None else out.copy_(x.argmax().view(out.shape))
    V = x.numel()
    nblk = triton.cdiv(V, block)
    part = torch.empty(nblk, dtype=torch.int64, device=x.device)
    out = torch.empty((), dtype=torch.int64, device=x.device) if out is None else out
    _argmax_kernel[(nblk,)](x, part, cnt, out, V, NBLK=nblk, NBP=triton.next_power_of_2(nblk), BLOCK=block,
                            **pdl.launch(x.device))
    return out


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """The argmax token per row (B,) int64 of logits (B, V) or (V,) -> (1,); a device op, no host sync."""
    if logits.dim() == 1:
        logits = logits[None]
    return logits.argmax(-1)


class DeviceSampler:
    """One sequence's sampling parameters in device buffers, so a captured decode graph that ends in the draw
    serves any request: `configure` copies new parameters in, each call draws a token (1,) int64 and advances
    the step offset on the device."""

    def __init__(self, device: torch.device | str):
        dev = torch.device(device)
        self.temperature = torch.zeros(1, dtype=torch.float32, device=dev)
        self.top_k = torch.zeros(1, dtype=torch.int64, device=dev)
        self.top_p = torch.ones(1, dtype=torch.float32, device=dev)
        self.min_p = torch.zeros(1, dtype=torch.float32, device=dev)
        self.seed = torch.zeros(1, dtype=torch.int64, device=dev)
        self.offset = torch.zeros(1, dtype=torch.int64, device=dev)

    def configure(self, temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
                  seed: int = 0) -> None:
        """Load a request's parameters (temperature 0 = greedy) and restart its random stream."""
        self.temperature.fill_(float(temperature))
        self.top_k.fill_(int(top_k))
        self.top_p.fill_(float(top_p))
        self.min_p.fill_(float(min_p))
        self.seed.fill_(int(seed))
        self.offset.zero_()

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        token = sample(logits, self.temperature, self.top_k, self.top_p, self.min_p, self.seed, self.offset)
        self.offset.add_(1)
        return token
