#!/usr/bin/env python3
"""Train the small qwen4_exp model that strata bundles as its default model (strata/models/default).

Why this exists: a random-weight model can show that strata computes the reference math, but not that its
output is *useful* (perplexity, KL between dtypes or quantisations, sampling, chat). A tiny trained model with
every architectural feature switched on -- Gated DeltaNet layers, two QSA layers whose indexer budget is well
below the training context (so block selection is sparse), a 16-expert MoE with a shared expert, four
hyper-connection streams and a PLE layer -- gives those measurements meaning at CPU speed.

Why the model is written here rather than taken from transformers: transformers' qwen4_exp is a reference
implementation whose QSA indexer loops in Python over every (sequence, query) pair, far too slow to train with,
and the training box may carry an older transformers whose layer-type names differ. So this script holds its
own vectorised, differentiable implementation of the model math of /work/shared/spec/qwen4exp.md (same
parameter names and shapes as transformers' `Qwen4ExpForCausalLM`), trains it, and writes the checkpoint in
the layout `save_pretrained` of transformers 5.23 produces (bf16 safetensors, one tensor per expert
projection, the PLE table as `shard_0`, the hash buffers included). Afterwards it checks that strata loads the
result and reproduces this script's float32 logits, and -- where transformers with qwen4_exp imports -- that
transformers loads it with no missing or unexpected keys and gives the same logits. transformers is never
needed for training.

Two training-only additions, neither stored in the checkpoint: a switch-style load-balancing loss for the
router, and a KL loss that teaches each QSA indexer to pick the blocks its layer's attention would weight
most (block selection is a top-k, so the language-model loss sends the indexer no gradient; without this the
indexer would keep its random initialisation). The indexer sees a detached copy of its input, so the KL
loss trains the indexer alone.

Corpus: the .py files of the running interpreter's standard library (`sysconfig.get_paths()["stdlib"]`),
present on every machine with no download. Whole files chosen with a fixed seed are held out and written to
`heldout.txt`; none of their text is used for the tokenizer or for training. The tokenizer is a byte-level
BPE (Qwen's pre-tokenizer regex, ByteLevel decoder) trained here with `tokenizers`.

Outputs in --out: config.json, generation_config.json, tokenizer.json, tokenizer_config.json,
model.safetensors, heldout.txt, train_log.json, loss.png -- eight files, and model.safetensors stays below
16 MiB, because that is what one command on the device machine can hand back.

    python tools/train_small.py --out /tmp/small --minutes 8 --device cuda     # the real run (one H200)
    python tools/train_small.py --smoke --out /tmp/smoke                       # end-to-end check on a CPU

--minutes is the wall-clock budget of the whole script (corpus, tokenizer, training, export, checks); the
learning-rate schedule runs on elapsed training time, so a slower or faster machine trains for fewer or more
steps rather than overrunning.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

TOOLS = Path(__file__).resolve().parent
REPO = TOOLS.parent
# The repository's own strata (config validation, PLE geometry, the loader we check against) and plot_loss.
sys.path[:0] = [str(REPO), str(TOOLS)]

from strata.config import ModelConfig, PLEGeometry

SEED = 1234
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Qwen2/3's pre-tokenizer split (digits one by one, letters with marks, whitespace runs kept whole).
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")
MAX_CHECKPOINT_BYTES = 16 * 2**20  # one file handed back from the device machine
RESERVE_S = 50.0  # of the budget, kept for the final evaluation, export and checks

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- set content = message['content'] %}"
    "{%- if message['role'] == 'assistant' and '</think>' in content %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)


@dataclass(frozen=True)
class Recipe:
    """Everything that defines a run besides the corpus: model geometry and optimisation."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    attn_interval: int  # every attn_interval-th layer is QSA, the rest Gated DeltaNet
    num_heads: int
    num_kv_heads: int
    head_dim: int
    partial_rotary_factor: float
    mrope_section: tuple[int, ...]
    gdn_key_heads: int
    gdn_value_heads: int
    gdn_head_dim: int
    num_experts: int
    experts_per_tok: int
    expert_size: int
    shared_expert_size: int
    hc_count: int
    hc_lowrank: int
    ple_layer_ids: tuple[int, ...]
    ple_embed_dim: int
    heads_per_ngram: int
    ngram_vocab_size_base: int
    indexer_heads: int
    indexer_head_dim: int
    indexer_budget: int
    indexer_compress_ratio: int
    seq_len: int
    batch_size: int
    peak_lr: float
    min_lr_ratio: float
    warmup_frac: float
    weight_decay: float
    grad_clip: float
    router_aux_coef: float
    indexer_aux_coef: float
    log_every: int
    eval_every: int
    eval_windows: int
    max_steps: int | None  # None: until the time budget is spent
    heldout_bytes: int
    tokenizer_bytes: int  # training text the BPE is learned from
    corpus_bytes: int | None  # cap on training text (None: all of it)
    verify_tokens: int


FULL = Recipe(
    vocab_size=4096, hidden_size=256, num_layers=8, attn_interval=4, num_heads=4, num_kv_heads=2, head_dim=64,
    partial_rotary_factor=0.25, mrope_section=(3, 3, 2), gdn_key_heads=2, gdn_value_heads=4, gdn_head_dim=64,
    num_experts=16, experts_per_tok=2, expert_size=24, shared_expert_size=64, hc_count=4, hc_lowrank=16,
    ple_layer_ids=(2,), ple_embed_dim=128, heads_per_ngram=4, ngram_vocab_size_base=1024, indexer_heads=4,
    indexer_head_dim=32, indexer_budget=64, indexer_compress_ratio=4, seq_len=512, batch_size=32, peak_lr=2e-3,
    min_lr_ratio=0.1, warmup_frac=0.04, weight_decay=0.1, grad_clip=1.0, router_aux_coef=0.01,
    indexer_aux_coef=1.0, log_every=10, eval_every=200, eval_windows=32, max_steps=None, heldout_bytes=80_000,
    tokenizer_bytes=12_000_000, corpus_bytes=None, verify_tokens=320,
)

# Same features, every one active (sparse selection from query 19 on, PLE, MoE, 4 streams), tiny and short.
SMOKE = Recipe(
    vocab_size=512, hidden_size=64, num_layers=4, attn_interval=2, num_heads=4, num_kv_heads=2, head_dim=16,
    partial_rotary_factor=0.5, mrope_section=(2, 1, 1), gdn_key_heads=2, gdn_value_heads=4, gdn_head_dim=16,
    num_experts=8, experts_per_tok=2, expert_size=16, shared_expert_size=32, hc_count=4, hc_lowrank=8,
    ple_layer_ids=(1,), ple_embed_dim=32, heads_per_ngram=2, ngram_vocab_size_base=256, indexer_heads=2,
    indexer_head_dim=16, indexer_budget=16, indexer_compress_ratio=4, seq_len=96, batch_size=4, peak_lr=3e-3,
    min_lr_ratio=0.1, warmup_frac=0.1, weight_decay=0.1, grad_clip=1.0, router_aux_coef=0.01,
    indexer_aux_coef=1.0, log_every=5, eval_every=15, eval_windows=4, max_steps=30, heldout_bytes=6_000,
    tokenizer_bytes=300_000, corpus_bytes=300_000, verify_tokens=96,
)


# ====================================================================================== corpus and tokenizer

@dataclass
class Corpus:
    root: str
    train: list[tuple[str, str]]  # (path relative to the stdlib, text), in training order
    heldout: list[tuple[str, str]]


def load_corpus(recipe: Recipe) -> Corpus:
    """The stdlib .py files, sorted by path, split into whole held-out files and training files.

    Held-out files are drawn with a fixed seed from mid-sized files of ordinary library code (not tests, not
    IDLE, not the codec tables of encodings/) until `heldout_bytes` is reached. Files over 200 KB (generated
    tables) and files that are not UTF-8 are skipped."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files: list[tuple[str, str]] = []
    for p in sorted(root.rglob("*.py"), key=lambda q: q.relative_to(root).as_posix()):
        rel = p.relative_to(root).as_posix()
        if "site-packages" in rel.split("/") or not p.is_file():
            continue
        try:
            raw = p.read_bytes()
            text = raw.decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if 0 < len(raw) <= 200_000 and text.strip():
            files.append((rel, text))
    if not files:
        raise SystemExit(f"no usable .py files under {root}")
    rng = random.Random(SEED)
    def ordinary(rel: str) -> bool:
        parts = rel.split("/")
        return not ({"test", "tests", "idlelib", "encodings"} & set(parts)) and not parts[-1].startswith("test_")

    candidates = [f for f in files if 2_000 <= len(f[1]) <= 16_000 and ordinary(f[0])]
    rng.shuffle(candidates)
    heldout, size = [], 0
    for f in candidates:
        if size >= recipe.heldout_bytes:
            break
        heldout.append(f)
        size += len(f[1])
    held = {f[0] for f in heldout}
    train = [f for f in files if f[0] not in held]
    rng.shuffle(train)
    if recipe.corpus_bytes is not None:
        kept, size = [], 0
        for f in train:
            if size >= recipe.corpus_bytes:
                break
            kept.append(f)
            size += len(f[1])
        train = kept
    heldout.sort()
    return Corpus(str(root), train, heldout)


def heldout_text(corpus: Corpus) -> str:
    """The held-out files joined by blank lines: plain text any perplexity tool can read."""
    return "\n\n".join(text.rstrip("\n") for _, text in corpus.heldout) + "\n"


def train_tokenizer(corpus: Corpus, recipe: Recipe):
    """Byte-level BPE with Qwen's pre-tokenizer; the special tokens take the last three ids."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    texts, size = [], 0
    for _, text in corpus.train:
        if size >= recipe.tokenizer_bytes:
            break
        texts.append(text)
        size += len(text)
    trainer = trainers.BpeTrainer(vocab_size=recipe.vocab_size - len(SPECIAL_TOKENS), min_frequency=2,
                                  show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[])
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIAL_TOKENS])
    if tok.get_vocab_size() > recipe.vocab_size:
        raise SystemExit(f"tokenizer has {tok.get_vocab_size()} entries, more than vocab_size {recipe.vocab_size}")
    return tok


def encode_corpus(tok, texts: list[str], eot: int) -> torch.Tensor:
    """One int64 stream: each file's tokens followed by <|endoftext|> (the PLE n-gram reset token)."""
    out: list[int] = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        out.extend(enc.ids)
        out.append(eot)
    return torch.tensor(out, dtype=torch.int64)


def tokenizer_config(tok) -> dict:
    added = {str(tok.token_to_id(s)): {"content": s, "lstrip": False, "normalized": False, "rstrip": False,
                                       "single_word": False, "special": True} for s in SPECIAL_TOKENS}
    return {
        "tokenizer_class": "Qwen2Tokenizer", "add_prefix_space": False, "added_tokens_decoder": added,
        "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None,
        "errors": "replace", "clean_up_tokenization_spaces": False, "model_max_length": 4096,
        "split_special_tokens": False, "chat_template": CHAT_TEMPLATE,
    }


def model_config(recipe: Recipe, eot: int) -> dict:
    """config.json of the model, `qwen4_exp_text`, QSA layers written as "full_attention" like the real
    checkpoint. eos_token_id is <|endoftext|>: it separates documents, so it is the token the PLE n-gram
    context must reset on; generation_config.json lists <|im_end|> as a stop token too."""
    r = recipe
    types = ["full_attention" if (i + 1) % r.attn_interval == 0 else "linear_attention"
             for i in range(r.num_layers)]
    return {
        "architectures": ["Qwen4ExpForCausalLM"], "model_type": "qwen4_exp_text", "dtype": "bfloat16",
        "vocab_size": r.vocab_size, "hidden_size": r.hidden_size, "num_hidden_layers": r.num_layers,
        "layer_types": types, "num_attention_heads": r.num_heads, "num_key_value_heads": r.num_kv_heads,
        "head_dim": r.head_dim, "hidden_act": "silu", "output_gate_type": None, "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                            "partial_rotary_factor": r.partial_rotary_factor,
                            "mrope_section": list(r.mrope_section), "mrope_interleaved": True},
        "attention_bias": False, "attention_dropout": 0.0,
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": r.gdn_head_dim, "linear_value_head_dim": r.gdn_head_dim,
        "linear_num_key_heads": r.gdn_key_heads, "linear_num_value_heads": r.gdn_value_heads,
        "num_experts": r.num_experts, "num_experts_per_tok": r.experts_per_tok,
        "moe_intermediate_size": r.expert_size, "shared_expert_intermediate_size": r.shared_expert_size,
        "norm_topk_prob": True, "router_aux_loss_coef": r.router_aux_coef, "output_router_logits": False,
        "hc_count": r.hc_count, "hc_lowrank": r.hc_lowrank,
        "ple_layer_ids": list(r.ple_layer_ids), "ple_embed_dim": r.ple_embed_dim, "ple_conv_kernel_size": 4,
        "ngram_size": 3, "heads_per_ngram": r.heads_per_ngram, "ngram_vocab_size_base": r.ngram_vocab_size_base,
        "make_ngram_vocab_size_divisible_by": 128, "split_ngram_parts": 1, "seed": 1234,
        "indexer_n_heads": r.indexer_heads, "indexer_kv_heads": 1, "indexer_head_dim": r.indexer_head_dim,
        "indexer_budget": r.indexer_budget, "indexer_compress_ratio": r.indexer_compress_ratio,
        "max_position_embeddings": 4096, "initializer_range": 0.02, "tie_word_embeddings": False,
        "use_cache": True, "bos_token_id": None, "eos_token_id": eot, "pad_token_id": eot,
    }


# ====================================================================================== the model (training form)

class OffsetRMSNorm(nn.Module):
    """y = x * rsqrt(mean(x^2) + eps) * (1 + w) in fp32, per group of `group` elements when grouped."""

    def __init__(self, dim: int, group: int | None = None, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.group, self.eps = group, eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        if self.group:
            xf = xf.unflatten(-1, (-1, self.group))
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.group:
            y = y.flatten(-2)
        return (y * (1.0 + self.weight.float())).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """GDN output norm: plain w (init 1), normalise, downcast, scale, then gate with act(z) in fp32."""

    def __init__(self, dim: int, act: str, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.act = F.silu if act == "silu" else torch.sigmoid
        self.eps = eps

    def forward(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        of = o.float()
        n = (of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + self.eps)).to(o.dtype)
        p = self.weight.to(o.dtype) * n
        return (p.float() * self.act(z.float())).to(o.dtype)


class GatedResidual(nn.Module):
    """Hyper-connection read: returns the block input (mean of gated normalised streams) and the inject gains."""

    def __init__(self, hidden: int, streams: int, rank: int, eps: float, inject: bool = True):
        super().__init__()
        self.S, self.H = streams, hidden
        self.hc_norm = OffsetRMSNorm(streams * hidden, hidden, eps)
        self.input_mix_weight_down = nn.Linear(streams * hidden, rank, bias=False)
        self.input_mix_weight_up = nn.Linear(rank, streams * hidden, bias=False)
        self.block_inject_weight = nn.Linear(streams * hidden, streams, bias=False) if inject else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        xn = self.hc_norm(x)
        m = F.silu(self.input_mix_weight_down(xn) / self.S)
        u = torch.sigmoid(self.input_mix_weight_up(m))
        a = (u.unflatten(-1, (self.S, self.H)) * xn.unflatten(-1, (self.S, self.H))).mean(-2)
        if self.block_inject_weight is None:
            return a, None
        return a, 2 * torch.sigmoid(self.block_inject_weight(xn) / self.S)


def hc_write(x: torch.Tensor, gains: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return x + (gains.unsqueeze(-1) * y.unsqueeze(-2)).flatten(-2)


def l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
                           g: torch.Tensor, chunk: int = 64) -> torch.Tensor:
    """Gated delta rule over a whole sequence from a zero state, chunked (spec section 4), in fp32.

    q, k: (B, H, L, dk), already l2-normalised (q also scaled); v: (B, H, L, dv); beta, g: (B, H, L).
    Within a chunk the (I + A)^-1 products are triangular solves; only the state is carried chunk to chunk,
    so the sequential part is L / chunk small matrix products."""
    B, H, L, dk = k.shape
    dv = v.shape[-1]
    pad = (-L) % chunk
    if pad:  # zero beta, k and g: padded steps neither decay nor write the state
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        beta, g = F.pad(beta, (0, pad)), F.pad(g, (0, pad))
    n = (L + pad) // chunk
    q, k, v = (t.reshape(B, H, n, chunk, -1) for t in (q, k, v))
    beta, g = beta.reshape(B, H, n, chunk), g.reshape(B, H, n, chunk)
    G = g.cumsum(-1)
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    strict = lower.tril(-1)
    D = torch.exp((G.unsqueeze(-1) - G.unsqueeze(-2)).masked_fill(~lower, float("-inf")))
    kb = k * beta.unsqueeze(-1)
    A = ((kb @ k.transpose(-1, -2)) * D).masked_fill(~strict, 0.0)
    T = A + torch.eye(chunk, dtype=A.dtype, device=A.device)
    U = torch.linalg.solve_triangular(T, v * beta.unsqueeze(-1), upper=False, unitriangular=True)
    W = torch.linalg.solve_triangular(T, kb * G.exp().unsqueeze(-1), upper=False, unitriangular=True)
    qe = q * G.exp().unsqueeze(-1)
    attn = (q @ k.transpose(-1, -2)) * D
    k_tail = k * (G[..., -1:] - G).exp().unsqueeze(-1)
    decay = G[..., -1].exp()
    S = q.new_zeros(B, H, dk, dv)
    outs = []
    for c in range(n):
        vp = U[:, :, c] - W[:, :, c] @ S
        outs.append(qe[:, :, c] @ S + attn[:, :, c] @ vp)
        S = decay[:, :, c, None, None] * S + k_tail[:, :, c].transpose(-1, -2) @ vp
    return torch.stack(outs, 2).reshape(B, H, n * chunk, dv)[:, :, :L]


class GatedDeltaNet(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        H = c["hidden_size"]
        self.nk, self.nv = c["linear_num_key_heads"], c["linear_num_value_heads"]
        self.dk, self.dv = c["linear_key_head_dim"], c["linear_value_head_dim"]
        self.K = c["linear_conv_kernel_dim"]
        conv_dim = 2 * self.nk * self.dk + self.nv * self.dv
        self.in_proj_qkv = nn.Linear(H, conv_dim, bias=False)
        self.in_proj_z = nn.Linear(H, self.nv * self.dv, bias=False)
        self.in_proj_b = nn.Linear(H, self.nv, bias=False)
        self.in_proj_a = nn.Linear(H, self.nv, bias=False)
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, self.K, groups=conv_dim, bias=False, padding=self.K - 1)
        self.dt_bias = nn.Parameter(torch.ones(self.nv))
        self.A_log = nn.Parameter(torch.empty(self.nv).uniform_(0.01, 16).log())
        self.norm = GatedRMSNorm(self.dv, c["output_gate_type"] or c["hidden_act"], c["rms_norm_eps"])
        self.out_proj = nn.Linear(self.nv * self.dv, H, bias=False)

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        L = a.shape[1]
        x = self.in_proj_qkv(a)
        x = F.silu(self.conv1d(x.transpose(1, 2))[..., :L]).transpose(1, 2)
        q, k, v = x.split([self.nk * self.dk, self.nk * self.dk, self.nv * self.dv], -1)
        z = self.in_proj_z(a).unflatten(-1, (self.nv, self.dv))
        beta = torch.sigmoid(self.in_proj_b(a))
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(a).float() + self.dt_bias.float())
        rep = self.nv // self.nk
        q = q.unflatten(-1, (self.nk, self.dk)).repeat_interleave(rep, 2)
        k = k.unflatten(-1, (self.nk, self.dk)).repeat_interleave(rep, 2)
        v = v.unflatten(-1, (self.nv, self.dv))
        with torch.autocast(a.device.type, enabled=False):
            qf = l2norm(q.float()) * self.dk ** -0.5
            o = chunk_gated_delta_rule(qf.transpose(1, 2), l2norm(k.float()).transpose(1, 2),
                                       v.float().transpose(1, 2), beta.float().transpose(1, 2), g.transpose(1, 2))
        o = o.transpose(1, 2).to(z.dtype)
        return self.out_proj(self.norm(o, z).flatten(-2))


class Rope:
    """Partial NeoX RoPE tables (text positions: mRoPE reduces to 1-D RoPE)."""

    def __init__(self, head_dim: int, factor: float, theta: float, length: int, device: torch.device):
        self.r = int(head_dim * factor)
        inv = 1.0 / theta ** (torch.arange(0, self.r, 2, device=device, dtype=torch.float32) / self.r)
        ang = torch.arange(length, device=device, dtype=torch.float32)[:, None] * inv[None]
        emb = torch.cat([ang, ang], -1)
        self.cos, self.sin = emb.cos(), emb.sin()

    def apply(self, x: torch.Tensor, positions: torch.Tensor | slice) -> torch.Tensor:
        """Rotate the first r dims of x (..., L, heads, d) or (..., L, d) at `positions` (one per L row)."""
        cos, sin = self.cos[positions].to(x.dtype), self.sin[positions].to(x.dtype)
        if x.dim() == 4:
            cos, sin = cos[:, None], sin[:, None]
        r, h = self.r, self.r // 2
        xr = x[..., :r]
        rot = torch.cat([-xr[..., h:], xr[..., :h]], -1)
        return torch.cat([xr * cos + rot * sin, x[..., r:]], -1)


class Indexer(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        self.h, self.d = c["indexer_n_heads"], c["indexer_head_dim"]
        self.c = c["indexer_compress_ratio"]
        self.index_qk_proj = nn.Linear(c["hidden_size"], (self.h + 1) * self.d, bias=False)
        self.q_layernorm = OffsetRMSNorm(self.d, eps=c["rms_norm_eps"])
        self.k_layernorm = OffsetRMSNorm(self.d, eps=c["rms_norm_eps"])

    def scores(self, a: torch.Tensor, rope: Rope) -> tuple[torch.Tensor, torch.Tensor]:
        """(block scores (B, L, L // c): sum over heads of ReLU(q . pooled key) / sqrt(Di) for every block,
        the per-head dot products before the ReLU (B, L, heads, L // c), also / sqrt(Di)).

        With gradients on, the ReLU passes a tenth of the gradient through negative inputs (the forward value
        is the exact ReLU): a block scored 0 by every head would otherwise be out of reach of the KL loss."""
        L = a.shape[1]
        q, kraw = self.index_qk_proj(a).split([self.h * self.d, self.d], -1)
        q = rope.apply(self.q_layernorm(q.unflatten(-1, (self.h, self.d))), slice(0, L))
        nb = L // self.c
        pooled = kraw[:, :nb * self.c].unflatten(1, (nb, self.c)).float().mean(2).to(kraw.dtype)
        starts = torch.arange(nb, device=a.device) * self.c
        kb = rope.apply(self.k_layernorm(pooled), starts)
        with torch.autocast(a.device.type, enabled=False):  # scores in fp32, as the reference computes them
            dots = torch.einsum("blhd,bmd->blhm", q.float(), kb.float()) / math.sqrt(self.d)
        act = dots.relu()
        if dots.requires_grad:
            act = act + 0.1 * torch.where(dots < 0, dots - dots.detach(), torch.zeros_like(dots))
        return act.sum(2), dots


def selection_mask(scores: torch.Tensor, c: int, block_topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(allowed (B, L, L) bool, valid (L, nb) bool) for QSA: each query sees its top-k complete blocks (by
    score, among blocks complete at its position) and the tail of its incomplete block (spec 5.4)."""
    B, L, nb = scores.shape
    dev = scores.device
    t = torch.arange(L, device=dev)
    nbt = (t + 1) // c  # complete blocks visible to query t
    valid = torch.arange(nb, device=dev)[None, :] < nbt[:, None]
    causal = t[None, :] <= t[:, None]
    if nb == 0:
        return causal.expand(B, L, L), valid
    k = min(block_topk, nb)
    idx = scores.masked_fill(~valid, float("-inf")).topk(k, -1).indices
    chosen = torch.zeros(B, L, nb, dtype=torch.bool, device=dev).scatter(-1, idx, True) & valid
    blk = (t // c).clamp(max=nb - 1)
    in_blocks = t[None, :] < (nbt * c)[:, None]  # key tau lies in a complete block of query t
    picked = chosen.gather(-1, blk[None, None, :].expand(B, L, L))
    return (in_blocks & picked) | (~in_blocks & causal), valid


class IndexedAttention(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        H = c["hidden_size"]
        self.hq, self.hkv, self.hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        self.c = c["indexer_compress_ratio"]
        self.block_topk = c["indexer_budget"] // self.c
        self.q_proj = nn.Linear(H, self.hq * 2 * self.hd, bias=False)
        self.k_proj = nn.Linear(H, self.hkv * self.hd, bias=False)
        self.v_proj = nn.Linear(H, self.hkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.hq * self.hd, H, bias=False)
        self.q_norm = OffsetRMSNorm(self.hd, eps=c["rms_norm_eps"])
        self.k_norm = OffsetRMSNorm(self.hd, eps=c["rms_norm_eps"])
        self.indexer = Indexer(c)
        self.record = False  # keep the last block scores (for the tie statistics of check_outputs)
        self.last_scores: torch.Tensor | None = None

    def forward(self, a: torch.Tensor, rope: Rope) -> tuple[torch.Tensor, torch.Tensor | None]:
        L = a.shape[1]
        q, gate = self.q_proj(a).unflatten(-1, (self.hq, 2 * self.hd)).split(self.hd, -1)
        q = rope.apply(self.q_norm(q), slice(0, L)).transpose(1, 2)
        k = rope.apply(self.k_norm(self.k_proj(a).unflatten(-1, (self.hkv, self.hd))), slice(0, L)).transpose(1, 2)
        v = self.v_proj(a).unflatten(-1, (self.hkv, self.hd)).transpose(1, 2)
        rep = self.hq // self.hkv
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        training = torch.is_grad_enabled()
        scores, dots = self.indexer.scores(a.detach() if training else a, rope)
        allowed, valid = selection_mask(scores.detach(), self.c, self.block_topk)
        if self.record:
            self.last_scores = scores.detach()
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None])
        y = self.o_proj(o.transpose(1, 2).flatten(-2) * torch.sigmoid(gate.flatten(-2)))
        aux = self.indexer_loss(q, k, scores, dots, valid) if training else None
        return y, aux

    def indexer_loss(self, q: torch.Tensor, k: torch.Tensor, scores: torch.Tensor, dots: torch.Tensor,
                     valid: torch.Tensor) -> torch.Tensor:
        """KL(attention mass per complete block || softmax of the indexer's block scores), averaged over the
        queries where selection is sparse; the target is the layer's dense causal attention, detached.

        Plus a hinge that asks every candidate block for a positive dot product in at least one head
        (margin 0.05). Without it many blocks score exactly 0 (all heads negative), and the top-k among equal
        scores is implementation-defined (spec 5.3): strata, transformers and llama.cpp would each pick a
        different set, and their logits could not be compared."""
        L, nb = scores.shape[1:]
        rows = (torch.arange(L, device=q.device) + 1) // self.c > self.block_topk
        if nb == 0 or not bool(rows.any()):
            return scores.new_zeros(())
        best = dots.amax(2)  # (B, L, nb): the most positive head per block
        hinge = (0.05 - best).relu().masked_fill(~valid, 0.0)[:, rows].sum(-1) / valid[rows].sum(-1)
        with torch.no_grad(), torch.autocast(q.device.type, enabled=False):
            logits = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(self.hd)
            causal = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
            p = logits.masked_fill(~causal, float("-inf")).softmax(-1).sum(1)  # (B, L, L), heads summed
            mass = p[..., :nb * self.c].unflatten(-1, (nb, self.c)).sum(-1).masked_fill(~valid, 0.0)
            target = mass / mass.sum(-1, keepdim=True).clamp_min(1e-12)
        logp = scores.masked_fill(~valid, float("-inf")).log_softmax(-1).masked_fill(~valid, 0.0)
        kl = (target * (target.clamp_min(1e-12).log() - logp)).sum(-1)
        return kl[:, rows].mean() + hinge.mean()


class Router(nn.Module):
    def __init__(self, experts: int, hidden: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(experts, hidden))


class Experts(nn.Module):
    def __init__(self, experts: int, hidden: int, size: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * size, hidden))
        self.down_proj = nn.Parameter(torch.empty(experts, hidden, size))


class MLP(nn.Module):
    def __init__(self, hidden: int, size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, size, bias=False)
        self.up_proj = nn.Linear(hidden, size, bias=False)
        self.down_proj = nn.Linear(size, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SparseMoe(nn.Module):
    """Top-k MoE plus a sigmoid-gated shared expert.

    The experts are tiny, so all of them run on every token as two dense matrix products with the routing
    weights (zero for unselected experts) applied in between: the same function and gradients as running only
    the selected ones, with far fewer kernel launches."""

    def __init__(self, c: dict):
        super().__init__()
        H, self.E, self.I = c["hidden_size"], c["num_experts"], c["moe_intermediate_size"]
        self.k = c["num_experts_per_tok"]
        self.gate = Router(self.E, H)
        self.experts = Experts(self.E, H, self.I)
        self.shared_expert = MLP(H, c["shared_expert_intermediate_size"])
        self.shared_expert_gate = nn.Linear(H, 1, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        logits = F.linear(x, self.gate.weight)
        probs = logits.float().softmax(-1)
        top_p, top_i = probs.topk(self.k, -1)
        top_p = top_p / top_p.sum(-1, keepdim=True)
        w = torch.zeros_like(probs).scatter(-1, top_i, top_p).to(logits.dtype)
        gu = F.linear(x, self.experts.gate_up_proj.reshape(self.E * 2 * self.I, -1)).unflatten(-1, (self.E, 2 * self.I))
        g, u = gu.split(self.I, -1)
        h = F.silu(g) * u * w.unsqueeze(-1)
        down = self.experts.down_proj.permute(1, 0, 2).reshape(shape[-1], self.E * self.I)
        y = F.linear(h.flatten(-2), down)
        y = y + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        counts = torch.zeros_like(probs).scatter(-1, top_i, 1.0).mean(0) / self.k
        balance = self.E * (counts * probs.mean(0)).sum()
        return y.reshape(shape), balance


class NGramEmbedding(nn.Module):
    def __init__(self, c: dict, geom: PLEGeometry, eos: int):
        super().__init__()
        self.n, self.hpn, self.eos = c["ngram_size"], c["heads_per_ngram"], eos
        heads = (self.n - 1) * self.hpn
        self.ngram_embedding = nn.Embedding(geom.rows, c["ple_embed_dim"] // heads)
        self.register_buffer("multipliers", torch.tensor(geom.multipliers, dtype=torch.int64), persistent=False)
        self.register_buffer("primes", torch.tensor(geom.primes, dtype=torch.int64), persistent=False)
        self.register_buffer("offsets", torch.tensor(geom.offsets, dtype=torch.int64), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Concatenated n-gram head embeddings (B, L, ple_embed_dim); context before a sequence's start is EOS,
        and context at or before the latest EOS strictly before a position is replaced by EOS (spec 7.2)."""
        B = ids.shape[0]
        hist = torch.cat([ids.new_full((B, self.n - 1), self.eos), ids], 1)

        def back(j: int) -> torch.Tensor:  # hist[p - j], EOS before the start
            return F.pad(hist, (j, 0), value=self.eos)[:, :hist.shape[1]]

        shifted = [hist]
        blocked = torch.zeros_like(hist, dtype=torch.bool)
        for j in range(1, self.n):
            blocked = blocked | (back(j) == self.eos)
            shifted.append(torch.where(blocked, torch.full_like(hist, self.eos), back(j)))
        rows = []
        h = shifted[0] * self.multipliers[0]
        for m in range(2, self.n + 1):
            h = torch.bitwise_xor(h, shifted[m - 1] * self.multipliers[m - 1])
            sl = slice((m - 2) * self.hpn, (m - 1) * self.hpn)
            rows.append(torch.remainder(h.unsqueeze(-1), self.primes[sl]) + self.offsets[sl])
        rows_t = torch.cat(rows, -1)[:, self.n - 1:]
        return self.ngram_embedding(rows_t).flatten(-2)


class PLELayer(nn.Module):
    def __init__(self, c: dict, geom: PLEGeometry, eos: int):
        super().__init__()
        H, S, E = c["hidden_size"], c["hc_count"], c["ple_embed_dim"]
        self.H, self.S, self.n = H, S, c["ngram_size"]
        self.Kp = c["ple_conv_kernel_size"]
        eps = c["rms_norm_eps"]
        self.ple_embedding = NGramEmbedding(c, geom, eos)
        self.key_proj = nn.Linear(E, S * H, bias=False)
        self.value_proj = nn.Linear(E, H, bias=False)
        self.norm_key = OffsetRMSNorm(S * H, H, eps)
        self.norm_query = OffsetRMSNorm(S * H, H, eps)
        self.norm_conv = OffsetRMSNorm(S * H, H, eps)
        self.conv1d = nn.Conv1d(S * H, S * H, self.Kp, groups=S * H, dilation=self.n, bias=False)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        e = self.ple_embedding(ids)
        key = self.norm_key(self.key_proj(e)).unflatten(-1, (self.S, self.H))
        value = self.value_proj(e)
        query = self.norm_query(x).unflatten(-1, (self.S, self.H))
        s = (key * query).sum(-1) / math.sqrt(self.H)
        s = s.sign() * s.abs().clamp_min(1e-6).sqrt()
        gated = (torch.sigmoid(s).unsqueeze(-1) * value.unsqueeze(-2)).flatten(-2)
        normed = self.norm_conv(gated)
        conv = self.conv1d(F.pad(normed.transpose(1, 2), ((self.Kp - 1) * self.n, 0)))
        return gated + F.silu(conv.transpose(1, 2))


class DecoderLayer(nn.Module):
    def __init__(self, c: dict, i: int, geom: PLEGeometry | None, eos: int):
        super().__init__()
        self.linear = c["layer_types"][i] == "linear_attention"
        if self.linear:
            self.linear_attn = GatedDeltaNet(c)
        else:
            self.self_attn = IndexedAttention(c)
        self.mlp = SparseMoe(c)
        self.ple = PLELayer(c, geom, eos) if geom is not None else None
        args = (c["hidden_size"], c["hc_count"], c["hc_lowrank"], c["rms_norm_eps"])
        self.attn_hyper_connection = GatedResidual(*args)
        self.mlp_hyper_connection = GatedResidual(*args)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, rope: Rope) -> tuple[torch.Tensor, list[torch.Tensor]]:
        aux = []
        if self.ple is not None:
            x = x + self.ple(x, ids)
        a, gains = self.attn_hyper_connection(x)
        if self.linear:
            y = self.linear_attn(a)
        else:
            y, idx_loss = self.self_attn(a, rope)
            if idx_loss is not None:
                aux.append(idx_loss)
        x = hc_write(x, gains, y)
        a, gains = self.mlp_hyper_connection(x)
        y, balance = self.mlp(a)
        return hc_write(x, gains, y), aux + [balance]


class TextModel(nn.Module):
    def __init__(self, c: dict, mc: ModelConfig):
        super().__init__()
        eos = mc.ple_eos
        self.embed_tokens = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.layers = nn.ModuleList(DecoderLayer(c, i, mc.ple.get(i), eos) for i in range(c["num_hidden_layers"]))
        self.hyper_connection_mixer = GatedResidual(c["hidden_size"], c["hc_count"], c["hc_lowrank"],
                                                    c["rms_norm_eps"], inject=False)


class TrainModel(nn.Module):
    """Qwen4ExpForCausalLM's parameters under the same names, with a training forward pass."""

    def __init__(self, c: dict, mc: ModelConfig):
        super().__init__()
        self.c = c
        self.S = c["hc_count"]
        self.model = TextModel(c, mc)
        self.lm_head = nn.Linear(c["hidden_size"], c["vocab_size"], bias=False)
        self._rope: Rope | None = None
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Normal(0, 0.02) matrices, output projections scaled by 1/sqrt(2 * layers), zero-centred norms at 0,
        the GDN norm at 1, dt_bias 1, A = U(0.01, 16), the PLE conv at 0 (as transformers initialises)."""
        out_scale = 1.0 / math.sqrt(2 * self.c["num_hidden_layers"])
        for name, p in self.named_parameters():
            if name.endswith(("dt_bias", "linear_attn.norm.weight")):
                p.fill_(1.0)
            elif name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(0.01, 16).log())
            elif p.dim() == 1 or name.endswith("ple.conv1d.weight"):
                p.zero_()
            elif name.endswith("linear_attn.conv1d.weight"):
                nn.init.uniform_(p, -0.5, 0.5)  # PyTorch's default for a depthwise kernel of 4: 1/sqrt(4)
            elif name.endswith("ngram_embedding.weight"):
                nn.init.normal_(p, std=1.0)
            else:
                std = 0.02 * (out_scale if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight",
                                                          "experts.down_proj")) else 1.0)
                nn.init.normal_(p, std=std)

    def rope(self, length: int, device: torch.device) -> Rope:
        if self._rope is None or self._rope.cos.shape[0] < length or self._rope.cos.device != device:
            rp = self.c["rope_parameters"]
            self._rope = Rope(self.c["head_dim"], rp["partial_rotary_factor"], rp["rope_theta"],
                              max(length, 1024), device)
        return self._rope

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(logits (B, L, V), mean router balance loss, mean indexer KL loss)."""
        rope = self.rope(ids.shape[1], ids.device)
        e = self.model.embed_tokens(ids)
        x = e.repeat(1, 1, self.S)
        balance, idx = [], []
        for layer in self.model.layers:
            x, aux = layer(x, ids, rope)
            balance.append(aux[-1])
            idx.extend(aux[:-1])
        h, _ = self.model.hyper_connection_mixer(x)
        zero = h.new_zeros((), dtype=torch.float32)
        return (self.lm_head(h), torch.stack(balance).mean() if balance else zero,
                torch.stack(idx).mean() if idx else zero)


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices (ndim >= 2); leave norms, dt_bias and A_log alone."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


# ====================================================================================== export

def export_state(model: TrainModel, mc: ModelConfig) -> dict[str, torch.Tensor]:
    """The checkpoint tensors in transformers 5.23's `save_pretrained` layout: bf16 parameters, experts split
    per expert (`experts.{e}.{gate,up,down}_proj.weight`), the n-gram table as `ngram_embedding.shard_0`
    (split_ngram_parts 1), and the three int64 hash buffers of each PLE layer."""
    out: dict[str, torch.Tensor] = {}
    I = model.c["moe_intermediate_size"]
    for name, p in model.state_dict().items():
        t = p.detach().to("cpu", torch.bfloat16)
        if name.endswith("mlp.experts.gate_up_proj"):
            base = name[: -len("gate_up_proj")]
            for e in range(t.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = t[e, :I].contiguous()
                out[f"{base}{e}.up_proj.weight"] = t[e, I:].contiguous()
        elif name.endswith("mlp.experts.down_proj"):
            base = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = t[e].contiguous()
        elif name.endswith("ple.ple_embedding.ngram_embedding.weight"):
            out[name.replace("ngram_embedding.weight", "ngram_embedding.shard_0.weight")] = t.contiguous()
        else:
            out[name] = t.contiguous()
    for layer, g in mc.ple.items():
        base = f"model.layers.{layer}.ple.ple_embedding."
        out[base + "layer_multipliers"] = torch.tensor(g.multipliers, dtype=torch.int64)
        out[base + "ngram_heads_vocab_sizes"] = torch.tensor(g.primes, dtype=torch.int64)
        out[base + "ngram_heads_offsets"] = torch.tensor(g.offsets, dtype=torch.int64)
    return out


def import_state(model: TrainModel, tensors: dict[str, torch.Tensor]) -> None:
    """Inverse of export_state (used to run exactly the stored bf16 weights in float32)."""
    sd = model.state_dict()
    new = {}
    for name in sd:
        if name.endswith("mlp.experts.gate_up_proj"):
            base = name[: -len("gate_up_proj")]
            parts = [(tensors[f"{base}{e}.gate_proj.weight"], tensors[f"{base}{e}.up_proj.weight"])
                     for e in range(sd[name].shape[0])]
            new[name] = torch.stack([torch.cat(p) for p in parts])
        elif name.endswith("mlp.experts.down_proj"):
            base = name[: -len("down_proj")]
            new[name] = torch.stack([tensors[f"{base}{e}.down_proj.weight"] for e in range(sd[name].shape[0])])
        elif name.endswith("ngram_embedding.weight"):
            new[name] = tensors[name.replace("ngram_embedding.weight", "ngram_embedding.shard_0.weight")]
        else:
            new[name] = tensors[name]
    model.load_state_dict({k: v.to(sd[k].dtype) for k, v in new.items()})


def write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


# ====================================================================================== training

def windows_of(stream: torch.Tensor, length: int) -> torch.Tensor:
    """Non-overlapping windows of `length` tokens (the tail that does not fill one is dropped)."""
    n = stream.numel() // length
    return stream[: n * length].view(n, length)


@torch.no_grad()
def heldout_loss(model: TrainModel, windows: torch.Tensor, device: torch.device, batch: int,
                 autocast: bool) -> float:
    """Mean next-token cross-entropy over every position of the given windows."""
    model.eval()
    total, count = 0.0, 0
    for i in range(0, windows.shape[0], batch):
        w = windows[i:i + batch].to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            logits, _, _ = model(w[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), w[:, 1:].flatten(), reduction="sum")
        total += float(loss)
        count += w[:, 1:].numel()
    model.train()
    return total / max(count, 1)


def lr_at(progress: float, recipe: Recipe) -> float:
    """Linear warm-up, then cosine decay to min_lr_ratio * peak, over progress in [0, 1]."""
    if progress < recipe.warmup_frac:
        return recipe.peak_lr * max(progress, 1e-3) / recipe.warmup_frac
    t = min(1.0, (progress - recipe.warmup_frac) / (1 - recipe.warmup_frac))
    return recipe.peak_lr * (recipe.min_lr_ratio + (1 - recipe.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def train(model: TrainModel, stream: torch.Tensor, held: torch.Tensor, recipe: Recipe, device: torch.device,
          deadline: float, log: dict, log_path: Path) -> None:
    """AdamW with bf16 autocast on CUDA; random windows drawn with a fixed-seed generator; logs to `log`."""
    autocast = device.type == "cuda"
    opt = torch.optim.AdamW(parameter_groups(model, recipe.weight_decay), lr=recipe.peak_lr, betas=(0.9, 0.95),
                            eps=1e-8, fused=device.type == "cuda")
    gen = torch.Generator().manual_seed(SEED)
    span = recipe.seq_len + 1
    held_eval = held[: recipe.eval_windows]
    start = time.time()
    budget = max(deadline - start, 1.0)
    model.train()
    # Running sums stay on the device: reading them every step would stall the GPU queue.
    zero = torch.zeros(3, device=device)
    step, acc, n_acc = 0, zero.clone(), 0
    while True:
        elapsed = time.time() - start
        progress = elapsed / budget
        if recipe.max_steps is not None:
            progress = max(progress, step / recipe.max_steps)
        if progress >= 1.0:
            break
        lr = lr_at(progress, recipe)
        for grp in opt.param_groups:
            grp["lr"] = lr
        starts = torch.randint(0, stream.numel() - span, (recipe.batch_size,), generator=gen)
        batch = torch.stack([stream[s:s + span] for s in starts.tolist()]).to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            logits, balance, idx_loss = model(batch[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
        total = loss + recipe.router_aux_coef * balance + recipe.indexer_aux_coef * idx_loss
        opt.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.grad_clip)
        opt.step()
        step += 1
        acc += torch.stack([loss.detach(), balance.detach().float(), idx_loss.detach().float()])
        n_acc += 1
        if step % recipe.log_every == 0:
            means = (acc / n_acc).tolist()
            row = {"step": step, "seconds": round(time.time() - start, 2), "lr": lr, "loss": means[0],
                   "router_balance": means[1], "indexer_loss": means[2],
                   "tokens": step * recipe.batch_size * recipe.seq_len}
            log["train"].append(row)
            acc, n_acc = zero.clone(), 0
            print(f"step {step:5d}  {row['seconds']:7.1f}s  lr {lr:.2e}  loss {row['loss']:.4f}  "
                  f"balance {row['router_balance']:.3f}  indexer {row['indexer_loss']:.4f}", flush=True)
        if step % recipe.eval_every == 0:
            ev = heldout_loss(model, held_eval, device, recipe.batch_size, autocast)
            log["eval"].append({"step": step, "seconds": round(time.time() - start, 2), "loss": ev})
            print(f"step {step:5d}  held-out loss {ev:.4f} (ppl {math.exp(ev):.2f})", flush=True)
            write_json(log_path, log)
    log["steps"] = step
    log["train_seconds"] = round(time.time() - start, 2)
    log["tokens_seen"] = step * recipe.batch_size * recipe.seq_len


# ====================================================================================== checks

def selection_ties(model: TrainModel, margin: float = 1e-5) -> dict:
    """Where the last forward's QSA selections were (near-)ties: queries whose k-th and (k+1)-th best block
    scores differ by less than `margin`. Which of the tied blocks is chosen is implementation-defined, so logits
    from that position on may legitimately differ between engines; positions before the first tie may not."""
    first, per_layer = None, {}
    for i, layer in enumerate(model.model.layers):
        if layer.linear or layer.self_attn.last_scores is None:
            continue
        att = layer.self_attn
        s = att.last_scores[0]
        tied = []
        for t in range(s.shape[0]):
            nb = (t + 1) // att.c
            if nb <= att.block_topk:
                continue
            top = s[t, :nb].topk(att.block_topk + 1).values
            if float(top[-2] - top[-1]) < margin:
                tied.append(t)
        per_layer[str(i)] = len(tied)
        if tied:
            first = tied[0] if first is None else min(first, tied[0])
    return {"tied_queries_per_layer": per_layer, "first_tied_position": first}


def check_outputs(out: Path, tensors: dict[str, torch.Tensor], held_ids: torch.Tensor, recipe: Recipe) -> dict:
    """Load the written checkpoint with strata (and transformers where it has qwen4_exp) and compare float32
    logits on the start of the held-out text with this script's model run on the stored bf16 weights.

    Differences are reported over all positions and over the positions before the first tied QSA selection
    (`*_before_tie`), the part every correct engine must reproduce to float32 rounding."""
    res: dict = {}
    torch.manual_seed(SEED)
    cfg = json.loads((out / "config.json").read_text())
    ref = TrainModel(cfg, ModelConfig.from_file(out))
    import_state(ref, {k: v.float() for k, v in tensors.items()})
    ref.eval()
    ids = held_ids[: recipe.verify_tokens]
    res["tokens"] = int(ids.numel())
    for layer in ref.model.layers:
        if not layer.linear:
            layer.self_attn.record = True
    with torch.no_grad():
        ours = ref(ids[None])[0][0].float()
    res["logit_absmax"] = float(ours.abs().max())
    res |= selection_ties(ref)
    cut = res["first_tied_position"] if res["first_tied_position"] is not None else ids.numel()

    def diff(a: torch.Tensor, b: torch.Tensor, name: str) -> None:
        res[f"{name}_max_abs"] = float((a - b).abs().max())
        res[f"{name}_max_abs_before_tie"] = float((a[:cut] - b[:cut]).abs().max()) if cut else 0.0
    try:
        from strata.runtime.engine import Engine

        t0 = time.time()
        eng = Engine.load(out, "float32", "cpu")
        st = eng.new_state()
        got = eng.prefill(ids.tolist(), st, all_logits=True)
        res["strata_prefill_s"] = round(time.time() - t0, 3)
        diff(got, ours, "strata_vs_trainer")
        t0 = time.time()
        tok = int(got[-1].argmax())
        n = 32
        for _ in range(n):
            tok = int(eng.decode(tok, st).argmax())
        res["strata_cpu_decode_tok_s"] = round(n / (time.time() - t0), 1)
        res["strata_cpu_threads"] = torch.get_num_threads()
    except Exception as e:  # noqa: BLE001 -- a failed check is logged; the trained files are already written
        res["strata_error"] = f"{type(e).__name__}: {e}"
        got = None
    try:
        import transformers

        res["transformers_version"] = transformers.__version__
        from transformers import Qwen4ExpForCausalLM

        hf, info = Qwen4ExpForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager",
                                                       output_loading_info=True)
        res["transformers_load"] = {k: sorted(v) if isinstance(v, (set, list)) else str(v)
                                    for k, v in info.items() if v}
        fresh = dict(Qwen4ExpForCausalLM(hf.config).named_buffers())  # hash constants computed by transformers
        res["hash_buffers_match_transformers"] = all(
            torch.equal(fresh[k], tensors[k]) for k in tensors if tensors[k].dtype == torch.int64)
        hf.eval()
        with torch.no_grad():
            hl = hf(ids[None]).logits[0].float()
        diff(hl, ours, "transformers_vs_trainer")
        if got is not None:
            diff(got, hl, "strata_vs_transformers")
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            hf.to(torch.bfloat16).save_pretrained(tmp)
            from safetensors import safe_open

            with safe_open(str(Path(tmp) / "model.safetensors"), "pt") as f:
                names = list(f.keys())  # safe_open is not iterable
                theirs = {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in names}
        mine = {k: (tuple(v.shape), {torch.bfloat16: "BF16", torch.int64: "I64"}[v.dtype]) for k, v in tensors.items()}
        res["layout_matches_save_pretrained"] = mine == theirs
        if mine != theirs:
            res["layout_diff"] = sorted(set(mine.items()) ^ set(theirs.items()))[:20]
    except Exception as e:  # noqa: BLE001 -- transformers may be absent or of another version: log it
        res["transformers_error"] = f"{type(e).__name__}: {e}"
    return res


# ====================================================================================== main

def check_only(out: Path, recipe: Recipe) -> int:
    """The checks of a finished run, on the files in `out` (nothing is written)."""
    from safetensors.torch import load_file
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    held_ids = torch.tensor(tok.encode((out / "heldout.txt").read_text(), add_special_tokens=False).ids)
    res = check_outputs(out, load_file(str(out / "model.safetensors")), held_ids, recipe)
    print(json.dumps(res, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="output folder (created; files in it are replaced)")
    ap.add_argument("--minutes", type=float, default=8.0,
                    help="wall-clock budget of the whole run, preparation and checks included (default 8)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="torch device to train on (default: cuda when available, else cpu)")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny model, small corpus slice, 30 steps: an end-to-end check that runs on a CPU in "
                         "well under a minute")
    ap.add_argument("--check", action="store_true",
                    help="train nothing: re-run the checks on the model already in --out and print them (to repeat "
                         "them where transformers 5.23 is installed, after a run on a machine without it)")
    args = ap.parse_args(argv)
    if args.check:
        return check_only(args.out, SMOKE if args.smoke else FULL)
    t0 = time.time()
    deadline = t0 + args.minutes * 60 - RESERVE_S * (0.2 if args.smoke else 1.0)
    recipe = SMOKE if args.smoke else FULL
    device = torch.device(args.device)
    random.seed(SEED)
    torch.manual_seed(SEED)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / "train_log.json"

    corpus = load_corpus(recipe)
    held_text = heldout_text(corpus)
    (out / "heldout.txt").write_text(held_text)
    tok = train_tokenizer(corpus, recipe)
    eot, im_end = tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")
    stream = encode_corpus(tok, [t for _, t in corpus.train], eot)
    held_ids = torch.tensor(tok.encode(held_text, add_special_tokens=False).ids, dtype=torch.int64)
    t_prep = time.time() - t0
    print(f"corpus: {len(corpus.train)} training files ({sum(len(t) for _, t in corpus.train) / 1e6:.1f} MB, "
          f"{stream.numel()} tokens), {len(corpus.heldout)} held-out files ({len(held_text)} chars, "
          f"{held_ids.numel()} tokens); tokenizer {tok.get_vocab_size()} entries; prep {t_prep:.1f}s", flush=True)

    cfg = model_config(recipe, eot)
    mc = ModelConfig.from_hf_dict(cfg)  # strata's validation of spec 1.3, and the PLE geometry
    torch.manual_seed(SEED)
    model = TrainModel(cfg, mc).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    ckpt_bytes = 2 * n_params + 8 * sum(3 * len(g.primes) for g in mc.ple.values())
    if ckpt_bytes > MAX_CHECKPOINT_BYTES * 0.98:
        raise SystemExit(f"{n_params} parameters make a {ckpt_bytes / 2**20:.1f} MiB checkpoint, over the 16 MiB "
                         "that one device-machine command can hand back")
    print(f"model: {n_params} parameters ({ckpt_bytes / 2**20:.2f} MiB in bf16), layers "
          f"{['QSA' if t == 'full_attention' else 'GDN' for t in cfg['layer_types']]}, PLE at {cfg['ple_layer_ids']}, "
          f"selection {recipe.indexer_budget}/{recipe.seq_len} tokens; device {device}", flush=True)

    log: dict = {
        "title": f"qwen4_exp small: {n_params / 1e6:.2f}M params, stdlib of Python {platform.python_version()}",
        "recipe": asdict(recipe), "seed": SEED, "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
        "torch": torch.__version__, "python": platform.python_version(), "parameters": n_params,
        "corpus": {"stdlib": corpus.root, "train_files": len(corpus.train),
                   "train_chars": sum(len(t) for _, t in corpus.train), "train_tokens": int(stream.numel()),
                   "heldout_files": [p for p, _ in corpus.heldout], "heldout_chars": len(held_text),
                   "heldout_tokens": int(held_ids.numel())},
        "tokenizer_entries": tok.get_vocab_size(), "prep_seconds": round(t_prep, 2), "train": [], "eval": [],
    }
    held_windows = windows_of(held_ids, recipe.seq_len + 1)
    train(model, stream, held_windows, recipe, device, deadline, log, log_path)
    final = heldout_loss(model, held_windows, device, recipe.batch_size, device.type == "cuda")
    log["eval"].append({"step": log["steps"], "seconds": log["train_seconds"], "loss": final})
    log["final_heldout"] = {"loss": final, "ppl": math.exp(final), "windows": int(held_windows.shape[0]),
                            "ctx": recipe.seq_len, "note": "bf16 autocast on CUDA, every position of each window"}
    print(f"final held-out loss {final:.4f} (ppl {math.exp(final):.2f}) after {log['steps']} steps", flush=True)

    from safetensors.torch import save_file

    tensors = export_state(model, mc)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)  # save_file creates it private
    write_json(out / "config.json", cfg | {"transformers_version": "5.23.0"})
    write_json(out / "generation_config.json", {
        "bos_token_id": None, "eos_token_id": [eot, im_end], "pad_token_id": eot, "do_sample": True,
        "temperature": 0.7, "top_k": 20, "top_p": 0.95, "transformers_version": "5.23.0"})
    tok.save(str(out / "tokenizer.json"))
    write_json(out / "tokenizer_config.json", tokenizer_config(tok))
    log["checkpoint_bytes"] = (out / "model.safetensors").stat().st_size
    write_json(log_path, log)

    model.cpu()
    log["checks"] = check_outputs(out, tensors, held_ids, recipe)
    print("checks: " + json.dumps(log["checks"]), flush=True)
    log["total_seconds"] = round(time.time() - t0, 2)
    write_json(log_path, log)
    from plot_loss import plot

    log["plot"] = plot(log, out / "loss.png")
    write_json(log_path, log)
    print(f"done in {log['total_seconds']:.1f}s: {sorted(p.name for p in out.iterdir())}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
