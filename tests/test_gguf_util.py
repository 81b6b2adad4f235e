"""Helpers shared by the GGUF tests (no tests here): KL, logits, and byte-level edits of GGUF files."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import torch

from strata.model.model import Model
from strata.weights.gguf import GGUFFile
from strata.weights.schema import Weights


def kl(p_logits: np.ndarray | torch.Tensor, q_logits: np.ndarray | torch.Tensor) -> float:
    """Mean over positions of KL(softmax(p) || softmax(q)), in float64."""
    p = torch.log_softmax(torch.as_tensor(np.asarray(p_logits), dtype=torch.float64), -1)
    q = torch.log_softmax(torch.as_tensor(np.asarray(q_logits), dtype=torch.float64), -1)
    return float((p.exp() * (p - q)).sum(-1).mean())


def prompt_ids(fixtures_dir: Path) -> torch.Tensor:
    return torch.tensor(json.loads((fixtures_dir / "prompt.json").read_text())["ids"])


def logits(w: Weights, ids: torch.Tensor, decode: bool = False) -> torch.Tensor:
    """float32 logits (L, V): one prefill call, or one call per token."""
    m = Model(w)
    state = m.new_state()
    if not decode:
        return m.forward(ids, state).float()
    return torch.cat([m.forward(ids[i:i + 1], state).float() for i in range(ids.shape[0])])


def tensor_info_offset(path: Path, name: str) -> int:
    """Byte offset of tensor `name`'s info record (its name-length field) in the header."""
    raw = path.read_bytes()
    needle = struct.pack("<Q", len(name.encode())) + name.encode()
    at = raw.find(needle, 0, GGUFFile(path).data_offset)
    assert at >= 0, name
    return at


def patch_tensor_type(path: Path, name: str, type_id: int) -> None:
    """Overwrite the ggml type field of one tensor info in place."""
    at = tensor_info_offset(path, name) + 8 + len(name.encode())
    with open(path, "r+b") as f:
        f.seek(at)
        (n_dims,) = struct.unpack("<I", f.read(4))
        f.seek(at + 4 + 8 * n_dims)
        f.write(struct.pack("<I", type_id))


def patch_bytes(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)
