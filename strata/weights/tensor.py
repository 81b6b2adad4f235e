"""Stored tensors: handles to weights as they lie in a file, decoded only when used.

The model never sees a file format. It sees `StoredTensor`s: something with a name, a logical shape and a
storage type that can give a dense torch tensor (`dense`), a subset of rows (`rows`, for embeddings and the PLE
table), or one slice of a 3-D stack (`[e]`, for experts). A memory-mapped bf16 matrix, a list of per-expert
matrices, the PLE table split into shards and a GGUF block-quantized tensor all fit behind this one interface,
so the model code has no format branches and the real model's tens of GB are never read at load.
"""

from __future__ import annotations

import bisect
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from strata.errors import StrataError


class WeightError(StrataError, ValueError):
    """A missing, mis-shaped, mis-typed or unreadable tensor; the message names the tensor."""


class StoredTensor(ABC):
    """A weight as stored. `shape` is the logical (torch, row-major) shape, e.g. (out, in) for a matrix."""

    name: str
    shape: tuple[int, ...]
    kind: str  # storage type: "F32", "BF16", "F16", or a ggml quant type name such as "Q4_K"

    @abstractmethod
    def dense(self, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> torch.Tensor:
        """The whole tensor, decoded, in `dtype` on `device`."""

    def rows(self, index: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows `index` (any shape of int64) of a 2-D tensor; result shape index.shape + (cols,)."""
        return self.dense(dtype)[index]

    def __getitem__(self, i: int) -> StoredTensor:
        """Slice `i` of the first dimension of a 3-D stack, as a 2-D stored tensor."""
        raise TypeError(f"{self.name}: a {len(self.shape)}-D {self.kind} tensor is not an expert stack")

    def stored_rows(self, index: torch.Tensor) -> torch.Tensor:
        """Rows `index` (any shape of int64) of a 2-D tensor as they are stored, not decoded: shape
        index.shape + (row width,), on the tensor's device. With `decode_rows` this splits `rows` in two, so the
        cheap half (a gather of bytes, where the table lives) and the decode (where the rows are used) can run
        on different devices."""
        raise TypeError(f"{self.name}: a {type(self).__name__} has no stored rows")

    def decode_rows(self, stored: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows from `stored_rows` (on any device), decoded: shape stored.shape[:-1] + (cols,) in `dtype`."""
        raise TypeError(f"{self.name}: a {type(self).__name__} has no stored rows")

    def host_rows(self) -> tuple[np.ndarray, torch.dtype] | None:
        """The stored rows as one 2-D uint8 numpy array (rows, row bytes) on the host (no copy) and the dtype
        `stored_rows` returns them in, where they are one host array, else None: what `stored_rows_into` gathers
        from without building index tensors."""
        return None

    def stored_rows_into(self, rows: Sequence[int], out: torch.Tensor | np.ndarray) -> None:
        """`stored_rows(rows)` written into `out`, a host tensor of shape (len(rows), row width), or the uint8 numpy
        array of its bytes (len(rows), row bytes), which a caller that fills the same buffer every token keeps: a
        decode step's gather of a token's table rows (a dozen ints) into its page-locked input buffer. Host rows
        are gathered with numpy (no tensor built, ~1 us); anything else goes through `stored_rows`."""
        n = self.shape[0]
        if rows and (min(rows) < 0 or max(rows) >= n):
            raise WeightError(f"{self.name}: row index out of range [0, {n})")
        host = self.host_rows()
        dst = _byte_rows(out, len(rows), host)
        if dst is None:
            _copy_rows(out, self.stored_rows(torch.tensor(list(rows), dtype=torch.int64)))
            return
        np.take(host[0], rows, axis=0, out=dst)

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Stored bytes."""

    def to(self, device: torch.device | str) -> StoredTensor:
        """The same stored tensor, its bytes moved to `device` (storage type unchanged)."""
        raise TypeError(f"{self.name}: {type(self).__name__} cannot be moved")

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, {self.shape}, {self.kind})"


_KIND_OF = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


class DenseTensor(StoredTensor):
    """A plain torch tensor (possibly a zero-copy view of a memory-mapped file)."""

    SMALL = 1 << 16
    """Elements up to which a converted copy (another dtype or device) is kept for the next call: the norms,
    conv kernels and gate vectors a decode step converts once per layer would otherwise be converted on every
    step (a kernel launch each)."""

    def __init__(self, name: str, tensor: torch.Tensor):
        self.name = name
        self.tensor = tensor
        self.shape = tuple(tensor.shape)
        self.kind = _KIND_OF.get(tensor.dtype, str(tensor.dtype).removeprefix("torch."))
        self._converted: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
        self._host_rows: tuple[np.ndarray, torch.dtype] | None = None

    def dense(self, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> torch.Tensor:
        t = self.tensor
        dev = t.device if device is None else torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        if t.dtype == dtype and t.device == dev:
            return t
        key = (dtype, dev)
        if key in self._converted:
            return self._converted[key]
        out = t.to(dev).to(dtype)
        if t.numel() <= self.SMALL and not (dev.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            self._converted[key] = out
        return out

    def rows(self, index: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.tensor[index.to(self.tensor.device)].to(dtype)

    def stored_rows(self, index: torch.Tensor) -> torch.Tensor:
        return self.tensor[index.to(self.tensor.device)]

    def decode_rows(self, stored: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return stored.to(dtype)

    def host_rows(self) -> tuple[np.ndarray, torch.dtype] | None:
        t = self.tensor
        if t.dim() != 2 or t.device.type != "cpu" or not t.is_contiguous():
            return None
        if self._host_rows is None:
            self._host_rows = (t.view(torch.uint8).numpy(), t.dtype)
        return self._host_rows

    def __getitem__(self, i: int) -> StoredTensor:
        if self.tensor.dim() != 3:
            return super().__getitem__(i)
        return DenseTensor(f"{self.name}[{i}]", self.tensor[i])

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def to(self, device: torch.device | str) -> StoredTensor:
        return DenseTensor(self.name, self.tensor.to(device))


class StackedTensor(StoredTensor):
    """A 3-D stack kept as its parts (one stored 2-D tensor per expert): never concatenated."""

    def __init__(self, name: str, parts: Sequence[StoredTensor]):
        if not parts:
            raise WeightError(f"{name}: an expert stack needs at least one part")
        first = parts[0].shape
        for p in parts:
            if p.shape != first:
                raise WeightError(f"{p.name}: shape {p.shape} differs from {parts[0].name} {first} in stack {name}")
        self.name = name
        self.parts = list(parts)
        self.shape = (len(parts), *first)
        kinds = {p.kind for p in parts}
        self.kind = kinds.pop() if len(kinds) == 1 else "mixed"

    def dense(self, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> torch.Tensor:
        return torch.stack([p.dense(dtype, device) for p in self.parts])

    def __getitem__(self, i: int) -> StoredTensor:
        return self.parts[i]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def to(self, device: torch.device | str) -> StoredTensor:
        return StackedTensor(self.name, [p.to(device) for p in self.parts])


class RowConcatTensor(StoredTensor):
    """A 2-D table stored as consecutive row shards (the PLE n-gram table): gathers read only the rows asked for."""

    def __init__(self, name: str, parts: Sequence[StoredTensor]):
        if not parts:
            raise WeightError(f"{name}: a sharded table needs at least one shard")
        cols = parts[0].shape[1]
        for p in parts:
            if len(p.shape) != 2 or p.shape[1] != cols:
                raise WeightError(f"{p.name}: shard shape {p.shape} does not match {parts[0].shape} in {name}")
        self.name = name
        self.parts = list(parts)
        starts = [0]
        for p in parts:
            starts.append(starts[-1] + p.shape[0])
        self.starts = torch.tensor(starts, dtype=torch.int64)
        self._starts = starts
        self.shape = (starts[-1], cols)
        kinds = {p.kind for p in parts}
        self.kind = kinds.pop() if len(kinds) == 1 else "mixed"

    def dense(self, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> torch.Tensor:
        return torch.cat([p.dense(dtype, device) for p in self.parts])

    def _by_shard(self, index: torch.Tensor, fetch) -> torch.Tensor:  # noqa: ANN001 - (part, rows) -> tensor
        """fetch(shard, its local row indices) for the rows `index` (range-checked), put together in index order
        on the host: index.shape + (row width,)."""
        flat = index.reshape(-1).to(torch.int64).cpu()
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.shape[0]):
            raise WeightError(f"{self.name}: row index out of range [0, {self.shape[0]})")
        shard = torch.searchsorted(self.starts, flat, right=True) - 1
        out = None
        for s in torch.unique(shard).tolist():
            sel = (shard == s).nonzero().flatten()
            got = fetch(self.parts[s], flat[sel] - self.starts[s]).cpu()
            if out is None:
                out = torch.empty(flat.numel(), got.shape[-1], dtype=got.dtype)
            out[sel] = got
        if out is None:  # no rows: the width and dtype of an empty fetch
            out = fetch(self.parts[0], flat).cpu()
        return out.reshape(*index.shape, out.shape[-1])

    def stored_rows_into(self, rows: Sequence[int], out: torch.Tensor | np.ndarray) -> None:
        hosts = [p.host_rows() for p in self.parts]
        dst = None if self.kind == "mixed" or any(h is None for h in hosts) else _byte_rows(out, len(rows), hosts[0])
        if dst is None:
            _copy_rows(out, self.stored_rows(torch.tensor(list(rows), dtype=torch.int64)))
            return
        if rows and (min(rows) < 0 or max(rows) >= self.shape[0]):
            raise WeightError(f"{self.name}: row index out of range [0, {self.shape[0]})")
        if len(hosts) == 1:
            np.take(hosts[0][0], rows, axis=0, out=dst)
            return
        starts = self._starts
        shards = [h[0] for h in hosts]
        for j, r in enumerate(rows):
            s = bisect.bisect_right(starts, r) - 1
            dst[j] = shards[s][r - starts[s]]

    def rows(self, index: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self._by_shard(index, lambda part, i: part.rows(i, dtype))

    def stored_rows(self, index: torch.Tensor) -> torch.Tensor:
        if self.kind == "mixed":
            raise WeightError(f"{self.name}: shards of several storage types have no common stored row form")
        return self._by_shard(index, lambda part, i: part.stored_rows(i))

    def decode_rows(self, stored: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.parts[0].decode_rows(stored, dtype)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def to(self, device: torch.device | str) -> StoredTensor:
        return RowConcatTensor(self.name, [p.to(device) for p in self.parts])


def _copy_rows(out: torch.Tensor | np.ndarray, stored: torch.Tensor) -> None:
    """Stored rows (`stored_rows`) copied into `out`: a tensor of their shape, or the numpy array of its bytes."""
    if isinstance(out, np.ndarray):
        src = stored.cpu().contiguous().view(torch.uint8)
        if src.numel() != out.size or out.dtype != np.uint8:
            raise WeightError(f"rows of {src.numel()} bytes do not fit a buffer of {out.size} x {out.dtype}")
        torch.from_numpy(out).copy_(src.reshape(out.shape))
    else:
        out.copy_(stored.reshape(out.shape))


def _byte_rows(out: torch.Tensor | np.ndarray, n: int, host: tuple[np.ndarray, torch.dtype] | None,
               ) -> np.ndarray | None:
    """`out` (a host tensor for n stored rows, or already the numpy array of its bytes) as the (n, row bytes) uint8
    numpy array `np.take` writes into, when it holds rows of the host array's dtype and width; else None (the
    caller takes the tensor path)."""
    if isinstance(out, np.ndarray):
        ok = host is not None and out.dtype == np.uint8 and out.shape == (n, host[0].shape[1])
        return out if ok else None
    if host is None or out.device.type != "cpu" or out.dtype != host[1] or not out.is_contiguous():
        return None
    if out.numel() * out.element_size() != n * host[0].shape[1]:
        return None
    return out.view(torch.uint8).numpy().reshape(n, host[0].shape[1])


def raw_rows(t: StoredTensor) -> torch.Tensor | None:
    """The stored rows of a tensor as one torch tensor, if it has one: a dense tensor's values, a quantized
    tensor's uint8 blocks (*shape[:-1], row_bytes). Stacks kept as parts and row-sharded tables have none."""
    if isinstance(t, DenseTensor):
        return t.tensor
    data = getattr(t, "data", None)
    if isinstance(data, torch.Tensor) and data.dtype == torch.uint8 and data.dim() == len(t.shape):
        return data
    return None


def iter_leaves(t: StoredTensor) -> Iterator[StoredTensor]:
    """The stored pieces behind a tensor (itself, or the parts of a stack/shard set)."""
    if isinstance(t, StackedTensor | RowConcatTensor):
        for p in t.parts:
            yield from iter_leaves(p)
    else:
        yield t
