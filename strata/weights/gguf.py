"""Zero-copy GGUF reader: header, metadata and tensor directory parsed from a memory map; tensor data handed
out as uint8 views into that map, so opening a 100 GB file reads a few MB.

Format (v2 and v3 share one layout; v1 used 32-bit counts and is refused): magic "GGUF", u32 version,
u64 tensor count, u64 metadata count, the metadata key/value pairs, the tensor infos (name, n_dims, ne[],
ggml type, data offset relative to the data section), padding to `general.alignment` (default 32), then the
data section.

Dimension order: GGUF (ggml) lists `ne[0]` first, and `ne[0]` is the contiguous row width. A torch tensor of
shape (out, in) is stored with ne = {in, out}, so `TensorInfo.shape` (torch order) is `reversed(dims)`.

Every inconsistency is a `GGUFError` naming the file and the problem, raised before anything large is allocated:
every count and length is bounded by the bytes left in the file before it is used, so a corrupt or hostile
file fails fast instead of allocating or looping for ever.

Split sets (`<prefix>-00001-of-00003.gguf`, llama.cpp's gguf-split and gguf-py's writer) are opened as one
`GGUFSet`: given any part, every part is found, numbered and checked (`split.no`, `split.count`,
`split.tensors.count`, no tensor in two parts, shared keys agree); the first part may hold metadata only.
"""

from __future__ import annotations

import mmap
import os
import re
import struct
import warnings
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import Any

import numpy as np
import torch

from strata.weights.tensor import WeightError

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS

KEY_ALIGNMENT = "general.alignment"
KEY_ARCH = "general.architecture"
KEY_SPLIT_NO = "split.no"
KEY_SPLIT_COUNT = "split.count"
KEY_SPLIT_TENSORS = "split.tensors.count"
SPLIT_KEYS = (KEY_SPLIT_NO, KEY_SPLIT_COUNT, KEY_SPLIT_TENSORS)

_SPLIT_RE = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


class GGUFError(WeightError):
    """A GGUF file (or split set) that cannot be read; the message names the file and what is wrong."""


class GGUFWarning(UserWarning):
    """A readable GGUF file with a known defect that strata works around (the message says how)."""


class ValueType(IntEnum):
    """GGUF metadata value types (gguf.h `enum gguf_type`)."""

    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


# scalar type -> (struct format, numpy dtype)
_SCALAR = {
    ValueType.UINT8: ("<B", np.uint8), ValueType.INT8: ("<b", np.int8), ValueType.UINT16: ("<H", np.uint16),
    ValueType.INT16: ("<h", np.int16), ValueType.UINT32: ("<I", np.uint32), ValueType.INT32: ("<i", np.int32),
    ValueType.FLOAT32: ("<f", np.float32), ValueType.BOOL: ("<B", np.uint8), ValueType.UINT64: ("<Q", np.uint64),
    ValueType.INT64: ("<q", np.int64), ValueType.FLOAT64: ("<d", np.float64),
}
_SCALAR_SIZE = {t: struct.calcsize(f) for t, (f, _) in _SCALAR.items()}

# The float storage types a plain torch view can hold (ggml type id -> torch dtype).
FLOAT_TYPES: dict[int, torch.dtype] = {0: torch.float32, 1: torch.float16, 30: torch.bfloat16}


@dataclass(frozen=True)
class TensorInfo:
    """One entry of the tensor directory. `dims` is in GGUF order (dims[0] = ne[0] = row width)."""

    name: str
    dims: tuple[int, ...]
    type_id: int
    type_name: str
    offset: int  # absolute byte offset in the file
    nbytes: int
    row_bytes: int  # bytes of one row of dims[0] elements

    @property
    def shape(self) -> tuple[int, ...]:
        """Torch (row-major) order: the GGUF dims reversed."""
        return tuple(reversed(self.dims))

    @property
    def n_rows(self) -> int:
        n = 1
        for d in self.dims[1:]:
            n *= d
        return n


class _Cursor:
    """Bounds-checked little-endian reads from a buffer; every overrun is a GGUFError."""

    def __init__(self, buf: Any, size: int, path: Path):
        self.buf, self.size, self.path, self.pos = buf, size, path, 0

    def fail(self, what: str) -> GGUFError:
        return GGUFError(f"{self.path}: {what}")

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise self.fail(f"truncated file: {what} needs {n} bytes at offset {self.pos}, but the file has "
                            f"{self.size} bytes")

    def scalar(self, vt: ValueType, what: str) -> Any:
        fmt, _ = _SCALAR[vt]
        n = _SCALAR_SIZE[vt]
        self.need(n, what)
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return v

    def u32(self, what: str) -> int:
        return self.scalar(ValueType.UINT32, what)

    def u64(self, what: str) -> int:
        return self.scalar(ValueType.UINT64, what)

    def string(self, what: str) -> str:
        n = self.u64(f"the length of {what}")
        if n > self.size - self.pos:
            raise self.fail(f"{what} claims {n} bytes but only {self.size - self.pos} remain (corrupt or truncated "
                            "file)")
        s = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s


def _read_value(cur: _Cursor, vt_raw: int, key: str) -> tuple[Any, ValueType, ValueType | None]:
    """One metadata value: (python value, type, element type for arrays)."""
    try:
        vt = ValueType(vt_raw)
    except ValueError:
        raise cur.fail(f"metadata key {key!r} has unknown value type {vt_raw}") from None
    if vt == ValueType.STRING:
        return cur.string(f"the value of {key!r}"), vt, None
    if vt != ValueType.ARRAY:
        v = cur.scalar(vt, f"the value of {key!r}")
        return (bool(v) if vt == ValueType.BOOL else v), vt, None
    et_raw = cur.u32(f"the element type of array {key!r}")
    try:
        et = ValueType(et_raw)
    except ValueError:
        raise cur.fail(f"metadata array {key!r} has unknown element type {et_raw}") from None
    n = cur.u64(f"the length of array {key!r}")
    left = cur.size - cur.pos
    if et == ValueType.ARRAY:
        raise cur.fail(f"metadata array {key!r} holds arrays; nested arrays are not supported (nor by llama.cpp)")
    if et == ValueType.STRING:
        if n > left // 8:  # every string costs at least its 8-byte length
            raise cur.fail(f"metadata array {key!r} claims {n} strings but only {left} bytes remain (corrupt or "
                           "truncated file)")
        buf, pos, size = cur.buf, cur.pos, cur.size
        out: list[str] = []
        append = out.append
        unpack = struct.unpack_from
        for i in range(n):
            if pos + 8 > size:
                cur.pos = pos
                raise cur.fail(f"truncated file: string {i} of array {key!r} runs past the end")
            (ln,) = unpack("<Q", buf, pos)
            pos += 8
            if ln > size - pos:
                cur.pos = pos
                raise cur.fail(f"string {i} of array {key!r} claims {ln} bytes but only {size - pos} remain "
                               "(corrupt or truncated file)")
            append(bytes(buf[pos:pos + ln]).decode("utf-8", errors="replace"))
            pos += ln
        cur.pos = pos
        return out, vt, et
    esize = _SCALAR_SIZE[et]
    if n > left // esize:
        raise cur.fail(f"metadata array {key!r} claims {n} elements of {esize} bytes but only {left} bytes remain "
                       "(corrupt or truncated file)")
    arr = np.frombuffer(cur.buf, dtype=np.dtype(_SCALAR[et][1]).newbyteorder("<"), count=n, offset=cur.pos)
    cur.pos += n * esize
    values = (arr != 0).tolist() if et == ValueType.BOOL else arr.tolist()
    return values, vt, et


def _ggml_type(type_id: int, name: str, path: Path) -> tuple[str, int, int]:
    """(type name, block size, bytes per block) of a tensor's ggml type, via the quant table."""
    from strata.weights import quants

    try:
        t = quants.file_type(type_id)
    except ValueError as e:  # UnsupportedTypeError names the type
        raise GGUFError(f"{path}: tensor {name!r}: {e}") from None
    return t.name, t.block_size, t.type_size


class GGUFFile:
    """One memory-mapped GGUF file: `metadata`, `value_types`, `tensors` (name -> TensorInfo), and `data(info)`
    for a zero-copy uint8 view of a tensor's bytes."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as fh:  # the map keeps its own reference to the file
                self.size = os.fstat(fh.fileno()).st_size
                if self.size < 24:
                    head = fh.read(4)
                    if len(head) == 4 and head != GGUF_MAGIC:
                        raise GGUFError(f"{self.path}: not a GGUF file (starts with {head!r}, expected "
                                        f"{GGUF_MAGIC!r})")
                    raise GGUFError(f"{self.path}: truncated file ({self.size} bytes; a GGUF header alone is 24)")
                self._map = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as e:
            raise GGUFError(f"cannot open {self.path}: {e.strerror or e}") from None
        cur = _Cursor(self._map, self.size, self.path)
        magic = bytes(self._map[:4])
        if magic != GGUF_MAGIC:
            raise GGUFError(f"{self.path}: not a GGUF file (starts with {magic!r}, expected {GGUF_MAGIC!r})")
        cur.pos = 4
        version = cur.u32("the version")
        if version not in SUPPORTED_VERSIONS:
            if version == 1:
                raise GGUFError(f"{self.path}: GGUF version 1 is not supported (re-convert it with a current "
                                "llama.cpp)")
            if struct.unpack("<I", struct.pack(">I", version))[0] in SUPPORTED_VERSIONS:
                raise GGUFError(f"{self.path}: big-endian GGUF files are not supported")
            raise GGUFError(f"{self.path}: unsupported GGUF version {version} (strata reads versions 2 and 3)")
        self.version = version
        n_tensors = cur.u64("the tensor count")
        n_kv = cur.u64("the metadata count")
        left = self.size - cur.pos
        if n_kv > left // 13:  # key length (8) + value type (4) + at least one value byte
            raise GGUFError(f"{self.path}: metadata count {n_kv} is impossible for a file of {self.size} bytes "
                            "(truncated or corrupt file)")
        if n_tensors > left // 24:  # name length (8) + n_dims (4) + type (4) + offset (8)
            raise GGUFError(f"{self.path}: tensor count {n_tensors} is impossible for a file of {self.size} bytes "
                            "(truncated or corrupt file)")

        self.metadata: dict[str, Any] = {}
        self.value_types: dict[str, tuple[ValueType, ValueType | None]] = {}
        for i in range(n_kv):
            key = cur.string(f"metadata key {i}")
            vt_raw = cur.u32(f"the value type of {key!r}")
            value, vt, et = _read_value(cur, vt_raw, key)
            if key in self.metadata:
                raise GGUFError(f"{self.path}: duplicate metadata key {key!r}")
            self.metadata[key] = value
            self.value_types[key] = (vt, et)

        alignment = self.metadata.get(KEY_ALIGNMENT, DEFAULT_ALIGNMENT)
        if KEY_ALIGNMENT in self.metadata and self.value_types[KEY_ALIGNMENT][0] != ValueType.UINT32:
            raise GGUFError(f"{self.path}: {KEY_ALIGNMENT} must be a UINT32, got "
                            f"{self.value_types[KEY_ALIGNMENT][0].name}")
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise GGUFError(f"{self.path}: {KEY_ALIGNMENT} = {alignment!r} is not a power of two")
        self.alignment = alignment

        raw: list[tuple[str, tuple[int, ...], int, int]] = []
        for i in range(n_tensors):
            name = cur.string(f"the name of tensor {i}")
            n_dims = cur.u32(f"the dimension count of {name!r}")
            if n_dims > MAX_DIMS:
                raise GGUFError(f"{self.path}: tensor {name!r} has {n_dims} dimensions (at most {MAX_DIMS})")
            dims = tuple(cur.u64(f"dimension {d} of {name!r}") for d in range(n_dims))
            if any(d >= 1 << 63 for d in dims):
                raise GGUFError(f"{self.path}: tensor {name!r} has an impossible dimension {list(dims)}")
            type_id = cur.u32(f"the type of {name!r}")
            offset = cur.u64(f"the data offset of {name!r}")
            raw.append((name, dims, type_id, offset))
        self.data_offset = -(-cur.pos // alignment) * alignment

        self.tensors: dict[str, TensorInfo] = {}
        for name, dims, type_id, offset in raw:
            if name in self.tensors:
                raise GGUFError(f"{self.path}: duplicate tensor name {name!r}")
            type_name, block, type_size = _ggml_type(type_id, name, self.path)
            width = dims[0] if dims else 1
            if width % block:
                raise GGUFError(f"{self.path}: tensor {name!r} has row width {width}, not a multiple of the "
                                f"{type_name} block size {block}")
            if offset % alignment:
                raise GGUFError(f"{self.path}: tensor {name!r} has data offset {offset}, not a multiple of the "
                                f"alignment {alignment}")
            row_bytes = width // block * type_size
            n_rows = 1
            for d in dims[1:]:
                n_rows *= d
            nbytes = row_bytes * n_rows
            start = self.data_offset + offset
            if start + nbytes > self.size:
                raise GGUFError(f"{self.path}: truncated file: tensor {name!r} ({type_name}, dims {list(dims)}) "
                                f"spans bytes {start}..{start + nbytes} but the file has {self.size} bytes")
            self.tensors[name] = TensorInfo(name, dims, type_id, type_name, start, nbytes, row_bytes)

    def data(self, info: TensorInfo) -> torch.Tensor:
        """The tensor's bytes as a 1-D uint8 view into the map (nothing is read until it is used)."""
        if info.nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        with warnings.catch_warnings():  # the map is read-only; strata never writes through these views
            warnings.simplefilter("ignore", UserWarning)
            return torch.frombuffer(self._map, dtype=torch.uint8, count=info.nbytes, offset=info.offset)

    def __repr__(self) -> str:
        return f"GGUFFile({str(self.path)!r}, v{self.version}, {len(self.tensors)} tensors)"


def split_name(path: Path) -> tuple[str, int, int] | None:
    """(prefix, part number (1-based), part count) of a `<prefix>-0000N-of-0000M.gguf` name, else None."""
    m = _SPLIT_RE.match(path.name)
    if not m:
        return None
    return m.group("prefix"), int(m.group("no")), int(m.group("count"))


def split_path(directory: Path, prefix: str, no: int, count: int) -> Path:
    """llama.cpp's `llama_split_path`: `<prefix>-%05d-of-%05d.gguf`, part numbers from 1."""
    return directory / f"{prefix}-{no:05d}-of-{count:05d}.gguf"


class GGUFSet:
    """A model held in one GGUF file or a split set: merged metadata and a tensor directory over all parts."""

    def __init__(self, parts: list[GGUFFile]):
        self.parts = parts
        self.path = parts[0].path
        self.metadata: dict[str, Any] = {}
        self.value_types: dict[str, tuple[ValueType, ValueType | None]] = {}
        self.tensors: dict[str, tuple[GGUFFile, TensorInfo]] = {}
        for i, p in enumerate(parts):
            for k, v in p.metadata.items():
                if k in SPLIT_KEYS:
                    continue
                if k in self.metadata and self.metadata[k] != v:
                    raise GGUFError(f"inconsistent split set {self.describe()}: metadata {k!r} is {_short(v)} in "
                                    f"part {i + 1} ({p.path.name}) but {_short(self.metadata[k])} in an earlier "
                                    "part: these parts come from different models")
                self.metadata.setdefault(k, v)
                self.value_types.setdefault(k, p.value_types[k])
            for name, info in p.tensors.items():
                if name in self.tensors:
                    other = self.tensors[name][0]
                    raise GGUFError(f"inconsistent split set {self.describe()}: tensor {name!r} is in both "
                                    f"{other.path.name} and {p.path.name}: these parts come from different models "
                                    "or different splits")
                self.tensors[name] = (p, info)

    def describe(self) -> str:
        return str(self.path) if len(self.parts) == 1 else f"{self.path} (+{len(self.parts) - 1} parts)"

    def data(self, name: str) -> torch.Tensor:
        part, info = self.tensors[name]
        return part.data(info)

    @property
    def nbytes(self) -> int:
        return sum(p.size for p in self.parts)


def _short(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 60 else s[:57] + "..."


def open_gguf(path: str | Path) -> GGUFSet:
    """Open a GGUF file, or the whole split set when `path` is (any) part of one."""
    path = Path(path)
    first = GGUFFile(path)
    count = first.metadata.get(KEY_SPLIT_COUNT)
    if count is None or count == 1:
        return GGUFSet([first])
    if not isinstance(count, int) or count < 1:
        raise GGUFError(f"{path}: {KEY_SPLIT_COUNT} = {count!r} is not a positive integer")
    parsed = split_name(path)
    if parsed is None:
        raise GGUFError(f"{path}: this file is one part of a {count}-part split set, but its name does not follow "
                        "'<name>-0000N-of-0000M.gguf', so the other parts cannot be found")
    prefix, _, name_count = parsed
    if name_count != count:
        raise GGUFError(f"{path}: the file name says {name_count} parts but {KEY_SPLIT_COUNT} = {count}")
    paths = [split_path(path.parent, prefix, i, count) for i in range(1, count + 1)]
    missing = [p for p in paths if not p.is_file()]
    if missing:
        idx = paths.index(missing[0]) + 1
        raise GGUFError(f"incomplete split set {split_path(path.parent, prefix, 1, count)}: part {idx} of {count} "
                        f"({missing[0].name}) is missing" + (f" (and {len(missing) - 1} more)" if len(missing) > 1
                                                              else ""))
    parts = [first if p == path else GGUFFile(p) for p in paths]
    total = None
    for i, p in enumerate(parts):
        md = p.metadata
        if md.get(KEY_SPLIT_COUNT) != count:
            raise GGUFError(f"inconsistent split set {paths[0]}: {p.path.name} has {KEY_SPLIT_COUNT} = "
                            f"{md.get(KEY_SPLIT_COUNT)!r}, expected {count}: parts of different models")
        if md.get(KEY_SPLIT_NO) != i:
            raise GGUFError(f"inconsistent split set {paths[0]}: {p.path.name} has {KEY_SPLIT_NO} = "
                            f"{md.get(KEY_SPLIT_NO)!r}, expected {i} (0-based)")
        t = md.get(KEY_SPLIT_TENSORS)
        if t is not None:
            if total is not None and t != total:
                raise GGUFError(f"inconsistent split set {paths[0]}: {p.path.name} has {KEY_SPLIT_TENSORS} = {t} "
                                f"but an earlier part has {total}: parts of different models")
            total = t
    gset = GGUFSet(parts)
    if total is not None and total != len(gset.tensors):
        raise GGUFError(f"inconsistent split set {paths[0]}: {KEY_SPLIT_TENSORS} = {total} but the {count} parts "
                        f"hold {len(gset.tensors)} tensors: parts of different models or a damaged part")
    return gset
