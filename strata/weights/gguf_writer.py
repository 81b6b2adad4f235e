"""GGUF writer, and HF checkpoint -> GGUF conversion in llama.cpp's `qwen4exp` layout.

`GGUFWriter` is format-only: ordered typed metadata and tensors whose bytes come from a callable yielding chunks
(or `None` for all-zero data, written as a hole in a sparse file). It streams: the header is computed from
sizes alone, then each tensor's chunks are written in turn, so converting a checkpoint holds one chunk at a time,
never the model. Output goes to `<out>.tmp` and is renamed into place only when complete, so a failed or
interrupted conversion never leaves a truncated file under the real name. With `split_max_tensors` the writer
produces a split set in gguf-split's conventions (all metadata in part 1, `split.*` keys in every part).

`convert_hf_to_gguf` maps an HF checkpoint through the canonical weight set (`load_hf`) and writes it as
llama.cpp's converter does (`conversion/qwen4exp.py`): the same tensor names, metadata keys and transforms
(norms stored as 1+w, ssm_a = -exp(A_log), GDN value heads in tiled order, indexer q/k split, squeezed convs,
one `per_layer_token_embd`, hash constants as UINT64 arrays, `tokenizer.ggml.*` from tokenizer.json) and the
same type rules (1-D tensors, norms, routers, convs and the SSM vectors stay F32; Q8_0 falls back to F16 for rows
that are not whole 32-blocks). Two deliberate differences: `ple.eos_token_id` is the id transformers' hash uses
(the FIRST of a list; the converter writes the last), and `indexer.{q,k}_proj` follow the requested type like
every other matrix (as the converter does; llama-quantize keeps them F32).
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from strata.config import INDEXED, ModelConfig
from strata.weights.gguf import (
    DEFAULT_ALIGNMENT,
    GGUF_MAGIC,
    KEY_SPLIT_COUNT,
    KEY_SPLIT_NO,
    KEY_SPLIT_TENSORS,
    GGUFError,
    GGUFSet,
    ValueType,
    split_path,
)
from strata.weights.gguf_map import ARCH, gguf_name
from strata.weights.schema import Weights, expected_shapes
from strata.weights.tensor import StoredTensor

Chunks = Callable[[], Iterable[bytes | bytearray | memoryview | np.ndarray | torch.Tensor]]

# ggml type ids the writer produces, and llama.cpp's `general.file_type` for each output type.
TYPE_IDS = {"F32": 0, "F16": 1, "Q8_0": 8, "BF16": 30}
FILE_TYPES = {"F32": 0, "F16": 1, "Q8_0": 7, "BF16": 32}
OUTTYPES = {"f32": "F32", "f16": "F16", "bf16": "BF16", "q8_0": "Q8_0"}
_CHUNK_BYTES = 32 << 20  # float32 bytes converted per chunk

_NUMPY = {ValueType.UINT8: "<u1", ValueType.INT8: "<i1", ValueType.UINT16: "<u2", ValueType.INT16: "<i2",
          ValueType.UINT32: "<u4", ValueType.INT32: "<i4", ValueType.FLOAT32: "<f4", ValueType.BOOL: "<u1",
          ValueType.UINT64: "<u8", ValueType.INT64: "<i8", ValueType.FLOAT64: "<f8"}


def _encode_string(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def _encode_value(vt: ValueType, value: Any, elem: ValueType | None) -> bytes:
    if vt == ValueType.STRING:
        return _encode_string(value)
    if vt == ValueType.ARRAY:
        assert elem is not None and elem != ValueType.ARRAY
        head = struct.pack("<IQ", int(elem), len(value))
        if elem == ValueType.STRING:
            return head + b"".join(_encode_string(s) for s in value)
        return head + np.asarray(value).astype(_NUMPY[elem]).tobytes()
    return np.asarray(value).astype(_NUMPY[vt]).tobytes()


@dataclass
class _Tensor:
    name: str
    dims: tuple[int, ...]  # GGUF order
    type_id: int
    nbytes: int
    chunks: Chunks | None


class GGUFWriter:
    """Collects metadata and tensors, then writes them in one streaming pass (see the module docstring)."""

    def __init__(self, alignment: int = DEFAULT_ALIGNMENT):
        self.alignment = alignment
        self.kv: dict[str, tuple[ValueType, Any, ValueType | None]] = {}
        self.tensors: list[_Tensor] = []
        if alignment != DEFAULT_ALIGNMENT:
            self.add("general.alignment", ValueType.UINT32, alignment)

    def add(self, key: str, vt: ValueType, value: Any, elem: ValueType | None = None) -> None:
        """One metadata entry; arrays give their element type as `elem`."""
        self.kv[key] = (vt, value, elem)

    def add_tensor(self, name: str, shape: tuple[int, ...], type_id: int, chunks: Chunks | None) -> None:
        """A tensor of torch-order `shape` (stored as GGUF dims reversed) and ggml type `type_id`; `chunks()`
        yields its bytes in order (`None`: all zeros, left as a hole)."""
        from strata.weights import quants

        cols = shape[-1] if shape else 1
        rows = 1
        for s in shape[:-1]:
            rows *= s
        nbytes = quants.row_bytes(type_id, cols) * rows
        self.tensors.append(_Tensor(name, tuple(reversed(shape)), type_id, nbytes, chunks))

    def _header(self, kv: dict[str, tuple[ValueType, Any, ValueType | None]], tensors: list[_Tensor]) -> bytes:
        out = [GGUF_MAGIC, struct.pack("<IQQ", 3, len(tensors), len(kv))]
        for key, (vt, value, elem) in kv.items():
            out += [_encode_string(key), struct.pack("<I", int(vt)), _encode_value(vt, value, elem)]
        offset = 0
        for t in tensors:
            out += [_encode_string(t.name), struct.pack("<I", len(t.dims)),
                    struct.pack(f"<{len(t.dims)}Q", *t.dims), struct.pack("<IQ", t.type_id, offset)]
            offset += -(-t.nbytes // self.alignment) * self.alignment
        return b"".join(out)

    def _write_one(self, path: Path, kv: dict[str, tuple[ValueType, Any, ValueType | None]],
                   tensors: list[_Tensor]) -> None:
        tmp = path.with_name(path.name + ".tmp")
        try:
            with open(tmp, "wb") as f:
                header = self._header(kv, tensors)
                f.write(header)
                pos = -(-len(header) // self.alignment) * self.alignment
                for t in tensors:
                    f.seek(pos)
                    if t.chunks is not None:
                        written = 0
                        for chunk in t.chunks():
                            b = _as_bytes(chunk)
                            f.write(b)
                            written += len(b)
                        if written != t.nbytes:
                            raise GGUFError(f"{path}: tensor {t.name!r} produced {written} bytes, expected "
                                            f"{t.nbytes}")
                    pos = -(-(pos + t.nbytes) // self.alignment) * self.alignment
                f.truncate(pos)  # padding and all-zero tensors are holes: zeros that take no disk
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def write(self, path: str | Path, split_max_tensors: int = 0, first_part_metadata_only: bool = False,
              ) -> list[Path]:
        """Write one file, or a split set `<stem>-0000N-of-0000M.gguf` of at most `split_max_tensors` tensors per
        part (the first part holding only metadata when asked). Returns the paths written."""
        path = Path(path)
        if not split_max_tensors:
            self._write_one(path, self.kv, self.tensors)
            return [path]
        groups = [self.tensors[i:i + split_max_tensors] for i in range(0, len(self.tensors), split_max_tensors)]
        if first_part_metadata_only:
            groups.insert(0, [])
        n = len(groups)
        stem = path.name.removesuffix(".gguf")
        paths = []
        for i, group in enumerate(groups):
            split_kv = {KEY_SPLIT_NO: (ValueType.UINT16, i, None), KEY_SPLIT_COUNT: (ValueType.UINT16, n, None),
                        KEY_SPLIT_TENSORS: (ValueType.INT32, len(self.tensors), None)}
            kv = (self.kv | split_kv) if i == 0 else split_kv
            p = split_path(path.parent, stem, i + 1, n)
            self._write_one(p, kv, group)
            paths.append(p)
        return paths


def _as_bytes(chunk: Any) -> bytes | memoryview:
    """A chunk as a flat byte buffer, without copying what is already contiguous."""
    if isinstance(chunk, torch.Tensor):
        c = chunk.detach().cpu().contiguous()
        if not c.numel():
            return b""
        chunk = c.view(torch.uint8).numpy()
    if isinstance(chunk, np.ndarray):
        return memoryview(np.ascontiguousarray(chunk)).cast("B")
    return memoryview(chunk).cast("B")


# ----------------------------------------------------------------------------------------- Q8_0

def quantize_q8_0(x: torch.Tensor) -> torch.Tensor:
    """ggml's reference Q8_0 (`quantize_row_q8_0_ref`): per 32 weights, d = max|x| / 127 stored as fp16 and
    q = roundf(x / d) (half away from zero, computed as x * (1/d) in float32). x (rows, cols), cols % 32 == 0;
    returns uint8 (rows, cols / 32 * 34)."""
    rows, cols = x.shape
    b = x.to(torch.float32).reshape(-1, 32)
    d = b.abs().amax(dim=1, keepdim=True) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    v = b * inv
    a = v.abs()
    fl = a.floor()
    q = (torch.sign(v) * (fl + torch.floor(2 * (a - fl)))).to(torch.int8)
    out = torch.cat([d.to(torch.float16).view(torch.uint8), q.view(torch.uint8)], dim=1)
    return out.reshape(rows, cols // 32 * 34)


def _encode(block: torch.Tensor, type_name: str) -> torch.Tensor:
    """Float32 rows -> the bytes of `type_name`."""
    if type_name == "F32":
        return block.to(torch.float32).contiguous()
    if type_name == "F16":
        return block.to(torch.float16).contiguous()
    if type_name == "BF16":
        return block.to(torch.bfloat16).contiguous()
    if type_name == "Q8_0":
        return quantize_q8_0(block)
    raise GGUFError(f"the writer cannot produce {type_name}")


# ----------------------------------------------------------------------------------------- canonical -> GGUF

def _row_blocks(t: StoredTensor | torch.Tensor) -> Iterator[torch.Tensor]:
    """The tensor as float32 2-D blocks of whole rows, in storage order, a few MB at a time."""
    if isinstance(t, torch.Tensor):
        x = t.reshape(-1, t.shape[-1]) if t.dim() > 1 else t.reshape(1, -1)
        step = max(1, _CHUNK_BYTES // (4 * x.shape[1]))
        for s in range(0, x.shape[0], step):
            yield x[s:s + step].to(torch.float32)
        return
    if len(t.shape) == 3:
        for e in range(t.shape[0]):
            yield from _row_blocks(t[e])
        return
    if len(t.shape) != 2:
        yield t.dense(torch.float32).reshape(1, -1)
        return
    rows, cols = t.shape
    step = max(1, _CHUNK_BYTES // (4 * cols))
    for s in range(0, rows, step):
        yield t.rows(torch.arange(s, min(rows, s + step)), torch.float32)


def _tiled_perm(nk: int, nv: int) -> torch.Tensor:
    """perm[t] = grouped index of the value head at tiled position t (key head t % nk, its (t // nk)-th)."""
    rep = nv // nk
    t = torch.arange(nv)
    return (t % nk) * rep + t // nk


def _to_tiled(name: str, x: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Grouped -> tiled value-head order for one canonical GDN tensor (llama.cpp's V-head reorder)."""
    nk, nv, dv = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_value_head_dim
    if nk == nv:
        return x
    perm = _tiled_perm(nk, nv)
    part = name.split(".", 1)[1]
    if part in ("gdn.qkv", "gdn.conv"):
        kd = 2 * cfg.gdn_key_dim
        v = x[kd:].reshape(nv, dv, *x.shape[1:])[perm].reshape(nv * dv, *x.shape[1:])
        return torch.cat([x[:kd], v])
    if part == "gdn.z":
        return x.reshape(nv, dv, -1)[perm].reshape(nv * dv, -1)
    if part in ("gdn.a", "gdn.b", "gdn.A", "gdn.dt_bias"):
        return x[perm]
    if part == "gdn.out":
        return x.reshape(x.shape[0], nv, dv)[:, perm].reshape(x.shape[0], nv * dv)
    return x


_GDN_VALUE_TENSORS = ("gdn.qkv", "gdn.conv", "gdn.z", "gdn.a", "gdn.b", "gdn.A", "gdn.dt_bias", "gdn.out")
_ALWAYS_F32 = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight", "ssm_conv1d.weight", "ssm_a", "ssm_dt.bias")


def tensor_type(name: str, shape: tuple[int, ...], outtype: str) -> str:
    """The converter's type rule for GGUF tensor `name` of torch shape `shape` when writing `outtype`."""
    if len(shape) <= 1 or name.endswith("_norm.weight") or name.endswith(_ALWAYS_F32) or \
            not name.endswith(".weight"):
        return "F32"
    if outtype == "Q8_0" and shape[-1] % 32:
        return "F16"
    return outtype


# llama.cpp's tensor order inside a block (as its converter emits it).
_LAYER_ORDER = ("hc_attn.inject", "hc_attn.norm", "hc_attn.down", "hc_attn.up", "gdn.A", "gdn.conv", "gdn.dt_bias",
                "gdn.a", "gdn.b", "gdn.qkv", "gdn.z", "gdn.norm", "gdn.out", "moe.down_exps", "moe.gate_exps",
                "moe.up_exps", "moe.router", "moe.sh_down", "moe.sh_gate", "moe.sh_up", "moe.sh_gate_inp",
                "hc_ffn.inject", "hc_ffn.norm", "hc_ffn.down", "hc_ffn.up", "ple.conv", "ple.key", "ple.norm_conv",
                "ple.norm_key", "ple.norm_query", "ple.table", "ple.value", "idx.q", "idx.k", "idx.k_norm",
                "idx.q_norm", "attn.k_norm", "attn.k", "attn.o", "attn.q_norm", "attn.q", "attn.v", "attn.q_bias",
                "attn.k_bias", "attn.v_bias", "attn.o_bias")


def _canonical_order(cfg: ModelConfig) -> list[str]:
    names = expected_shapes(cfg)
    order = [n for n in ("head", "embed", "final.norm", "final.down", "final.up") if n in names]
    for i in range(cfg.num_hidden_layers):
        order += [f"L{i}.{s}" for s in _LAYER_ORDER if f"L{i}.{s}" in names]
    return order


def model_metadata(cfg: ModelConfig, file_type: int, name: str = "", mrope_section: list[int] | None = None,
                   full_attention_interval: int = 4) -> GGUFWriter:
    """A writer holding the general.* and qwen4exp.* metadata of `cfg` (keys, types and order as the converter's)."""
    if cfg.gdn_gate_act != "sigmoid" or cfg.hidden_act != "silu":
        raise GGUFError(f"llama.cpp's qwen4exp computes SiLU experts and a sigmoid GDN output gate; this model has "
                        f"hidden_act={cfg.hidden_act!r}, output_gate_type={cfg.gdn_gate_act!r}, which a qwen4exp "
                        "GGUF cannot express")
    if len(cfg.ple_layer_ids) > 1:
        raise GGUFError(f"the model has {len(cfg.ple_layer_ids)} PLE layers {list(cfg.ple_layer_ids)}; a qwen4exp "
                        "GGUF holds one PLE table and one set of hash constants")
    U32, I32, U64, F32, S, A, B = (ValueType.UINT32, ValueType.INT32, ValueType.UINT64, ValueType.FLOAT32,
                                   ValueType.STRING, ValueType.ARRAY, ValueType.BOOL)
    w = GGUFWriter()
    k = lambda key: f"{ARCH}.{key}"
    sections = list(mrope_section if mrope_section is not None else [11, 11, 10])
    sections = (sections + [0, 0, 0, 0])[:4]
    w.add("general.architecture", S, ARCH)
    w.add("general.type", S, "model")
    if name:
        w.add("general.name", S, name)
    w.add(k("block_count"), U32, cfg.num_hidden_layers)
    w.add(k("context_length"), U32, cfg.max_position_embeddings)
    w.add(k("embedding_length"), U32, cfg.hidden_size)
    w.add(k("attention.head_count"), U32, cfg.num_attention_heads)
    w.add(k("attention.head_count_kv"), U32, cfg.num_key_value_heads)
    w.add(k("rope.dimension_sections"), A, sections, I32)
    w.add(k("rope.freq_base"), F32, cfg.rope_theta)
    w.add(k("attention.layer_norm_rms_epsilon"), F32, cfg.rms_norm_eps)
    w.add(k("expert_count"), U32, cfg.num_experts)
    w.add(k("expert_used_count"), U32, cfg.num_experts_per_tok)
    w.add(k("attention.key_length"), U32, cfg.head_dim)
    w.add(k("attention.value_length"), U32, cfg.head_dim)
    w.add("general.file_type", U32, file_type)
    w.add(k("expert_feed_forward_length"), U32, cfg.moe_intermediate_size)
    w.add(k("expert_shared_feed_forward_length"), U32, cfg.shared_expert_intermediate_size)
    w.add(k("ssm.conv_kernel"), U32, cfg.linear_conv_kernel_dim)
    w.add(k("ssm.state_size"), U32, cfg.linear_key_head_dim)
    w.add(k("ssm.group_count"), U32, cfg.linear_num_key_heads)
    w.add(k("ssm.time_step_rank"), U32, cfg.linear_num_value_heads)
    w.add(k("ssm.inner_size"), U32, cfg.gdn_value_dim)
    w.add(k("attention.recurrent_layers"), A, [cfg.is_linear(i) for i in range(cfg.num_hidden_layers)], B)
    w.add(k("full_attention_interval"), U32, full_attention_interval)
    w.add(k("rope.dimension_count"), U32, cfg.rotary_dim)
    w.add(k("hyper_connection.count"), U32, cfg.hc_count)
    w.add(k("hyper_connection.low_rank"), U32, cfg.hc_lowrank)
    if INDEXED in cfg.layer_types:
        w.add(k("attention.indexer.head_count"), U32, cfg.indexer_n_heads)
        w.add(k("attention.indexer.key_length"), U32, cfg.indexer_head_dim)
        w.add(k("attention.indexer.top_k"), U32, cfg.indexer_budget)
        w.add(k("attention.compress_ratios"), A,
              [0 if cfg.is_linear(i) else cfg.indexer_compress_ratio for i in range(cfg.num_hidden_layers)], I32)
    if cfg.ple_layer_ids:
        geo = cfg.ple[cfg.ple_layer_ids[0] - 1]
        w.add(k("ple.layers"), A, [cfg.ple_layer_ids[0] - 1], I32)
        w.add(k("ple.ngram_size"), U32, cfg.ngram_size)
        w.add(k("ple.heads_per_ngram"), U32, cfg.heads_per_ngram)
        w.add(k("ple.conv_kernel"), U32, cfg.ple_conv_kernel_size)
        w.add(k("ple.eos_token_id"), U32, cfg.ple_eos)
        w.add(k("embedding_length_per_layer_input"), U32, cfg.ple_head_dim)
        w.add(k("ple.layer_multipliers"), A, list(geo.multipliers), U64)
        w.add(k("ple.head_offsets"), A, list(geo.offsets), U64)
        w.add(k("ple.head_vocab_sizes"), A, list(geo.primes), U64)
    w.add("general.quantization_version", U32, 2)
    return w


def add_weights(writer: GGUFWriter, w: Weights, outtype: str) -> None:
    """Every canonical tensor of `w` as its GGUF tensor, in llama.cpp's order, converted chunk by chunk."""
    cfg = w.cfg
    shapes = expected_shapes(cfg)
    for canon in _canonical_order(cfg):
        t = w[canon]
        name = gguf_name(canon)
        shape = tuple(shapes[canon])
        ttype = tensor_type(name, shape, outtype)
        reorder = w.gdn_value_order == "grouped" and canon.split(".", 1)[-1] in _GDN_VALUE_TENSORS

        def chunks(t: StoredTensor = t, canon: str = canon, ttype: str = ttype, reorder: bool = reorder,
                   ) -> Iterator[torch.Tensor]:
            source: StoredTensor | torch.Tensor = _to_tiled(canon, t.dense(torch.float32), cfg) if reorder else t
            for block in _row_blocks(source):
                yield _encode(block, ttype)

        writer.add_tensor(name, shape, TYPE_IDS[ttype], chunks)


def tokenizer_metadata(writer: GGUFWriter, folder: Path, cfg: ModelConfig) -> None:
    """`tokenizer.ggml.*` from an HF tokenizer.json (byte-level BPE), as llama.cpp's `get_vocab_base` builds them:
    every id below vocab_size, missing ids as `[PAD{i}]` (UNUSED), added special tokens CONTROL, other added
    tokens USER_DEFINED, the rest NORMAL."""
    tj = folder / "tokenizer.json"
    if not tj.is_file():
        return
    try:
        tok = json.loads(tj.read_text(encoding="utf-8"))
        model = tok["model"]
        vocab: dict[str, int] = dict(model["vocab"])
        merges_raw = model.get("merges", [])
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise GGUFError(f"{tj}: not a readable tokenizer.json ({e})") from None
    if model.get("type") != "BPE":
        raise GGUFError(f"{tj}: tokenizer model {model.get('type')!r} is not BPE; only byte-level BPE tokenizers "
                        "are converted")
    added = {a["id"]: a for a in tok.get("added_tokens", [])}
    reverse = {i: s for s, i in vocab.items()}
    reverse.update({i: a["content"] for i, a in added.items()})
    tokens, types = [], []
    for i in range(cfg.vocab_size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(5)
        else:
            tokens.append(reverse[i])
            types.append((3 if added[i].get("special") else 4) if i in added else 1)
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges_raw]
    ids = {s: i for i, s in enumerate(tokens)}
    special: dict[str, int | None] = {"eos": cfg.eos_ids[0] if cfg.eos_ids else None, "pad": cfg.pad_token_id,
                                      "bos": cfg.bos_token_id}
    tc = folder / "tokenizer_config.json"
    if tc.is_file():
        try:
            conf = json.loads(tc.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            conf = {}
        for kind in ("eos", "pad", "bos"):
            v = conf.get(f"{kind}_token")
            v = v.get("content") if isinstance(v, dict) else v
            if isinstance(v, str) and v in ids:
                special[kind] = ids[v]
    A, S, U32, I32 = ValueType.ARRAY, ValueType.STRING, ValueType.UINT32, ValueType.INT32
    writer.add("tokenizer.ggml.model", S, "gpt2")
    writer.add("tokenizer.ggml.pre", S, "qwen35")
    writer.add("tokenizer.ggml.tokens", A, tokens, S)
    writer.add("tokenizer.ggml.token_type", A, types, I32)
    writer.add("tokenizer.ggml.merges", A, merges, S)
    for kind, key in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("pad", "padding_token_id")):
        if special[kind] is not None:
            writer.add(f"tokenizer.ggml.{key}", U32, special[kind])


def write_gguf(w: Weights, out_path: str | Path, outtype: str = "f32", name: str = "",
               raw_config: dict[str, Any] | None = None, tokenizer_dir: Path | None = None) -> Path:
    """Write canonical weights as a qwen4exp GGUF. `raw_config` (the HF config.json) supplies what the canonical
    config does not keep (mrope sections, full_attention_interval)."""
    out_type = OUTTYPES.get(outtype.lower())
    if out_type is None:
        raise GGUFError(f"unknown output type {outtype!r}; choose one of {', '.join(OUTTYPES)}")
    raw = raw_config or {}
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    mrope = rope.get("mrope_section") if isinstance(rope, dict) else None
    writer = model_metadata(w.cfg, FILE_TYPES[out_type], name, mrope,
                            int(text.get("full_attention_interval", 4) or 4))
    if tokenizer_dir is not None:
        tokenizer_metadata(writer, tokenizer_dir, w.cfg)
    add_weights(writer, w, out_type)
    return writer.write(out_path)[0]


def convert_hf_to_gguf(src_folder: str | Path, out_path: str | Path, outtype: str = "f32") -> Path:
    """Convert an HF qwen4_exp checkpoint folder to one GGUF file (`outtype`: f32, bf16, f16 or q8_0)."""
    from strata.weights.hf import load_hf

    src = Path(src_folder)
    w = load_hf(src)
    try:
        raw = json.loads((src / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        raw = {}
    return write_gguf(w, out_path, outtype, name=src.resolve().name, raw_config=raw, tokenizer_dir=src)


def copy_gguf(gset: GGUFSet, out_path: str | Path, metadata: dict[str, Any] | None = None,
              drop_keys: Iterable[str] = (), drop_tensors: Iterable[str] = (),
              retype: dict[str, tuple[tuple[int, ...], int]] | None = None, split_max_tensors: int = 0,
              first_part_metadata_only: bool = False) -> list[Path]:
    """Re-write an opened GGUF (file or split set) byte for byte, with metadata entries replaced/added
    (`metadata`: key -> (ValueType, value[, elem])), keys or tensors dropped, tensor headers changed (`retype`:
    name -> (torch shape, type id), data zero-filled) or split into parts. Used to repair a file's metadata (e.g.
    a zeroed compress_ratios) and to build test files."""
    writer = GGUFWriter(alignment=gset.parts[0].alignment)
    drop = set(drop_keys) | {KEY_SPLIT_NO, KEY_SPLIT_COUNT, KEY_SPLIT_TENSORS, "general.alignment"}
    for key, value in gset.metadata.items():
        if key in drop:
            continue
        vt, et = gset.value_types[key]
        writer.add(key, vt, value, et)
    for key, spec in (metadata or {}).items():
        writer.add(key, *spec)
    dropped = set(drop_tensors)
    for tname, (part, info) in gset.tensors.items():
        if tname in dropped:
            continue
        if retype and tname in retype:
            shape, type_id = retype[tname]
            writer.add_tensor(tname, shape, type_id, None)
            continue
        writer.add_tensor(tname, info.shape, info.type_id,
                          lambda part=part, info=info: [part.data(info).numpy()])
    return writer.write(out_path, split_max_tensors, first_part_metadata_only)
