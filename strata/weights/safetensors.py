"""Zero-copy reader for safetensors files (single or sharded).

The file is memory-mapped and each tensor is a `torch.frombuffer` view into the map: nothing is read at load
beyond the JSON header, and pages come in from disk only when a tensor is used. The header is checked against
the file size so a truncated file fails at open, naming the first tensor that lies past the end.
"""

from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path

import torch

from strata.weights.tensor import DenseTensor, WeightError

_DTYPES = {
    "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
_MAX_HEADER = 100 * 1024 * 1024


class SafetensorsFile:
    """One memory-mapped .safetensors file."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            self._fh = open(self.path, "rb")
        except OSError as e:
            raise WeightError(f"cannot open {self.path}: {e.strerror}") from e
        size = self.path.stat().st_size
        if size < 8:
            raise WeightError(f"{self.path}: truncated safetensors file ({size} bytes, no header)")
        (header_len,) = struct.unpack("<Q", self._fh.read(8))
        if header_len > _MAX_HEADER or 8 + header_len > size:
            raise WeightError(f"{self.path}: truncated or corrupt safetensors file (header of {header_len} bytes, "
                              f"file of {size} bytes)")
        try:
            header = json.loads(self._fh.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise WeightError(f"{self.path}: corrupt safetensors header ({e})") from e
        if not isinstance(header, dict):
            raise WeightError(f"{self.path}: corrupt safetensors header (not an object)")
        self.metadata = header.pop("__metadata__", {}) or {}
        self._base = 8 + header_len
        self._entries: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
        for name, e in header.items():
            try:
                dtype, shape, (start, end) = e["dtype"], tuple(int(s) for s in e["shape"]), e["data_offsets"]
            except (KeyError, TypeError, ValueError) as err:
                raise WeightError(f"{self.path}: corrupt header entry for tensor {name!r}") from err
            if dtype not in _DTYPES:
                raise WeightError(f"{self.path}: tensor {name!r} has unsupported dtype {dtype}")
            numel = 1
            for s in shape:
                numel *= s
            if end - start != numel * torch.empty((), dtype=_DTYPES[dtype]).element_size():
                raise WeightError(f"{self.path}: tensor {name!r} spans {end - start} bytes but shape {list(shape)} "
                                  f"{dtype} needs {numel * torch.empty((), dtype=_DTYPES[dtype]).element_size()}")
            if self._base + end > size:
                raise WeightError(f"{self.path}: truncated file: tensor {name!r} ends at byte {self._base + end} "
                                  f"but the file has {size} bytes")
            self._entries[name] = (dtype, shape, start, end)
        self._map = mmap.mmap(self._fh.fileno(), 0, access=mmap.ACCESS_READ) if size else None

    def keys(self) -> list[str]:
        return list(self._entries)

    def tensor(self, name: str) -> DenseTensor:
        dtype, shape, start, end = self._entries[name]
        if end == start:
            t = torch.empty(shape, dtype=_DTYPES[dtype])
        else:
            # frombuffer warns that the mmap is read-only; we never write through these views.
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                t = torch.frombuffer(self._map, dtype=_DTYPES[dtype], count=(end - start) // _itemsize(dtype),
                                     offset=self._base + start).view(shape)
        return DenseTensor(name, t)


def _itemsize(dtype: str) -> int:
    return torch.empty((), dtype=_DTYPES[dtype]).element_size()


def open_checkpoint(folder: Path) -> dict[str, DenseTensor]:
    """All tensors of an HF checkpoint folder (model.safetensors or a sharded index), as lazy views."""
    index = folder / "model.safetensors.index.json"
    single = folder / "model.safetensors"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise WeightError(f"{index}: not a valid safetensors index ({e})") from e
        files: dict[str, SafetensorsFile] = {}
        out: dict[str, DenseTensor] = {}
        for name, fname in weight_map.items():
            if fname not in files:
                path = folder / fname
                if not path.is_file():
                    raise WeightError(f"{index} lists shard {fname} (for tensor {name!r}) but it does not exist")
                files[fname] = SafetensorsFile(path)
            f = files[fname]
            if name not in f._entries:
                raise WeightError(f"{index} puts tensor {name!r} in {fname}, which does not hold it")
            out[name] = f.tensor(name)
        return out
    if single.is_file():
        f = SafetensorsFile(single)
        return {k: f.tensor(k) for k in f.keys()}
    shards = sorted(folder.glob("*.safetensors"))
    if len(shards) == 1:
        f = SafetensorsFile(shards[0])
        return {k: f.tensor(k) for k in f.keys()}
    raise WeightError(f"{folder}: no model.safetensors or model.safetensors.index.json")
