"""`QuantTensor`: a ggml block-quantized tensor (Q8_0, Q4_K, IQ2_XS, ...) behind the `StoredTensor` interface.

The bytes stay where they are (a uint8 view into the memory-mapped GGUF file) and are decoded on use:
* `dense()` dequantizes the whole tensor, for matmuls; the result is not cached, so a model never holds a
  dequantized copy of its weights between calls;
* `rows(index)` decodes only the rows asked for: a GGUF row is one `ne[0]`-wide run of whole blocks, so any
  subset of rows can be decoded alone. The PLE table (hundreds of GB in the real model) and the token embedding
  are only ever read this way;
* `[e]` is expert `e` of a 3-D stack: a view of that expert's rows, no copy.

A tile-major type (`repack.TILE_LAYOUTS`: Q4_K_RT, Q6_K_RT, made on a GPU for the decode GEMV) stores whole tiles
of rows, not rows: its bytes are kept as (*shape[:-2], N / tile, tile, row_bytes), so nothing that takes a
tensor's rows as (*shape[:-1], row_bytes) (`raw_rows`) reads them as rows, `rows` and the other row-wise readers
refuse, and `tiled_rows` gives the kernels that read the layout their (*shape[:-1], row_bytes) view.

Shapes are torch order (GGUF's dims reversed): ne = {in, out, E} is shape (E, out, in), and one row of the
byte matrix is one `in`-wide row of the logical tensor.
"""

from __future__ import annotations

import numpy as np
import torch

from strata.weights import repack
from strata.weights.tensor import StoredTensor, WeightError


class QuantTensor(StoredTensor):
    """ggml-typed data `data` (uint8, shape (*shape[:-1], row_bytes)) of logical torch-order shape `shape`;
    `kind` is the ggml type name."""

    def __init__(self, name: str, data: torch.Tensor, type_id: int, shape: tuple[int, ...]):
        from strata.weights import quants

        qtype = quants.ggml_type(type_id)
        shape = tuple(int(s) for s in shape)
        if not shape or shape[-1] % qtype.block_size:
            raise WeightError(f"{name}: shape {list(shape)} is not whole {qtype.name} blocks of "
                              f"{qtype.block_size} along its rows")
        row_bytes = shape[-1] // qtype.block_size * qtype.type_size
        want = [*shape[:-1], row_bytes]
        layout = repack.TILE_LAYOUTS.get(type_id)
        if layout is not None:
            if len(shape) < 2 or shape[-2] % layout.tile or row_bytes % layout.step:
                raise WeightError(f"{name}: shape {list(shape)} is not whole {qtype.name} tiles of {layout.tile} "
                                  f"rows and {layout.step}-byte steps")
            want = [*shape[:-2], shape[-2] // layout.tile, layout.tile, row_bytes]
        if data.dtype != torch.uint8 or list(data.shape) != want:
            raise WeightError(f"{name}: {qtype.name} data of shape {list(data.shape)} ({data.dtype}) does not hold "
                              f"shape {list(shape)} (expected uint8 {want})")
        self.name = name
        self.data = data
        self._host_rows: tuple[np.ndarray, torch.dtype] | None = None
        self.type_id = type_id
        self.kind = qtype.name
        self.shape = shape

    @property
    def tiled(self) -> bool:
        """Whether the bytes are tile-major (`repack.TILE_LAYOUTS`): no row is stored by itself."""
        return self.type_id in repack.TILE_LAYOUTS

    def tiled_rows(self) -> torch.Tensor:
        """A tile-major tensor's bytes as (*shape[:-1], row_bytes), for the kernels that read the layout (row r of
        this view is not row r of the matrix)."""
        if not self.tiled:
            raise WeightError(f"{self.name}: {self.kind} is not a tile-major type")
        return self.data.reshape(*self.shape[:-1], self.data.shape[-1])

    def _rowwise(self, what: str) -> None:
        if self.tiled:
            raise WeightError(f"{self.name}: {what} reads rows one by one, and {self.kind} stores whole tiles of "
                              f"{repack.TILE_LAYOUTS[self.type_id].tile} rows (tile-major, for the decode GEMV)")

    @classmethod
    def from_bytes(cls, name: str, flat: torch.Tensor, type_id: int, shape: tuple[int, ...], row_bytes: int,
                   ) -> QuantTensor:
        """Wrap a flat uint8 buffer holding prod(shape[:-1]) rows of `row_bytes` bytes (a view, no copy)."""
        return cls(name, flat.view(*shape[:-1], row_bytes), type_id, shape)

    @property
    def cols(self) -> int:
        return self.shape[-1]

    def _decode(self, rows2d: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        from strata.weights import quants

        return quants.dequantize(rows2d, self.type_id, self.cols, dtype)

    def dense(self, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> torch.Tensor:
        rb = self.data.shape[-1]
        out = self._decode(self.data.reshape(-1, rb), dtype).reshape(self.shape)
        return out if device is None else out.to(device)

    def rows(self, index: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        self._rowwise("rows()")
        if len(self.shape) != 2:
            raise WeightError(f"{self.name}: rows() needs a 2-D tensor, this one is {self.shape}")
        flat = index.reshape(-1).to(torch.int64)
        if flat.is_cuda and self.data.is_cuda:
            # No host synchronisation, so a captured decode step can gather its token's row; the ids were
            # checked against the vocabulary when they were staged.
            return self._decode(self.data.index_select(0, flat), dtype).reshape(*index.shape, self.cols)
        uniq, inverse = torch.unique(flat, return_inverse=True)
        decoded = self.decode_rows(self.stored_rows(uniq), dtype)  # each distinct row decoded once
        return decoded[inverse.to(decoded.device)].reshape(*index.shape, self.cols)

    def host_rows(self) -> tuple[np.ndarray, torch.dtype] | None:
        if self.tiled:
            return None
        if len(self.shape) != 2 or self.data.device.type != "cpu" or not self.data.is_contiguous():
            return None
        if self._host_rows is None:
            self._host_rows = (self.data.numpy(), torch.uint8)
        return self._host_rows

    def stored_rows(self, index: torch.Tensor) -> torch.Tensor:
        self._rowwise("stored_rows()")
        if len(self.shape) != 2:
            raise WeightError(f"{self.name}: stored_rows() needs a 2-D tensor, this one is {self.shape}")
        flat = index.reshape(-1)
        if flat.dtype != torch.int64:
            flat = flat.to(torch.int64)
        if flat.numel():
            lo, hi = torch.aminmax(flat)
            if int(lo) < 0 or int(hi) >= self.shape[0]:
                raise WeightError(f"{self.name}: row index out of range [0, {self.shape[0]})")
        return self.data.index_select(0, flat.to(self.data.device)).reshape(*index.shape, self.data.shape[-1])

    def decode_rows(self, stored: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        self._rowwise("decode_rows()")
        rb = self.data.shape[-1]
        if stored.dtype != torch.uint8 or stored.shape[-1] != rb:
            raise WeightError(f"{self.name}: stored rows of shape {list(stored.shape)} ({stored.dtype}) are not "
                              f"uint8 rows of {rb} bytes")
        return self._decode(stored.reshape(-1, rb), dtype).reshape(*stored.shape[:-1], self.cols)

    def __getitem__(self, i: int) -> StoredTensor:
        if len(self.shape) != 3:
            return super().__getitem__(i)
        return QuantTensor(f"{self.name}[{i}]", self.data[i], self.type_id, self.shape[1:])

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def to(self, device: torch.device | str) -> StoredTensor:
        return QuantTensor(self.name, self.data.to(device), self.type_id, self.shape)
