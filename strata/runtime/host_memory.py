"""Whether the PLE n-gram tables are held in memory before decode, or read from their mapped pages as tokens
hash to them.

A decode token gathers 16 rows of each PLE table on the host (`strata.model.ple.ple_rows_into`) while the step's
first layers run. The tables are tens of GB and live in the model file's memory mapping (or, for the synthetic
benchmark model, in untouched anonymous pages), so a row on a page no token touched before is a page fault, and
a disk read where the file is not in the page cache. 16 such rows took 38 us on the GPU box's host and 62 on the
development machine, against 2.4-2.6 us with the pages mapped (`tools/host_pages_lab.py`,
bench/results/2026-12-06-*-host-pages-*.json). Holding a table means mapping every one of its pages up front
(`madvise(MADV_POPULATE_READ)`, Linux 5.14+; else one read per page), which reads the file into the page cache:
the table's size in RAM, and seconds to minutes at load. For the synthetic model's zero pages it costs no memory.
The pages are not locked: under memory pressure the kernel may still drop some, and their rows fault again.

Modes (`strata generate --ple-table`, `Engine(ple_table=...)`): "resident" holds the tables, "mapped" leaves them
to the page faults, "auto" (the default) holds them where they fit in the memory the system reports available,
"device" copies them into the GPU's memory (`tables_to_device`; a GPU with room beside the model, e.g. an H200's
for the real model's 27 GB), where the decode step hashes each token's n-grams and gathers its rows itself
(`strata.runtime.graph.DecodeStep`): no host work but a few integers per token, and one graph per step, which can
run ahead of the host (`DecodeStep.ids_ahead`). "pinned" gives a GPU without that room the same step: the tables
copied into page-locked host memory that the GPU reads directly (`tables_to_pinned`), so the step's gather reads
a token's rows over PCIe (16 rows of a few hundred bytes per PLE layer) instead of the host staging them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import mmap
import os
import sys
from collections.abc import Iterator

import numpy as np
import torch

from strata.errors import StrataError
from strata.kernels.host_pages import page_lock
from strata.weights.quant_tensor import QuantTensor
from strata.weights.schema import Weights
from strata.weights.tensor import DenseTensor, StoredTensor, raw_rows

PLE_TABLE_MODES = ("auto", "resident", "mapped", "device", "pinned")
AUTO_FRACTION = 0.8  # "auto" holds the tables when they take at most this share of the available memory
CHUNK_BYTES = 256 << 20  # populated per call, so a progress bar moves and a failure names where
MADV_POPULATE_READ = 22  # <linux/mman.h>; Python's mmap module does not name it before 3.13


def host_arrays(t: StoredTensor) -> Iterator[np.ndarray]:
    """The host byte arrays a stored table's rows are gathered from (`StoredTensor.host_rows`), shard by shard;
    nothing for a table on a device or in a form that is not gathered from host bytes."""
    parts = getattr(t, "parts", None)
    if parts is not None:
        for p in parts:
            yield from host_arrays(p)
        return
    host = t.host_rows()
    if host is not None:
        yield host[0]


def ple_tables(w: Weights) -> list[StoredTensor]:
    return [t for name, t in w.tensors.items() if name.endswith("ple.table")]


def available_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (the kernel's estimate of what can be used without swapping, page cache
    included), or None where there is no such file."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _madvise():
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    fn = libc.madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def _touch(addr: int, length: int) -> None:
    """One read per page of [addr, addr + length): maps each page as a read fault would."""
    page = mmap.PAGESIZE
    view = np.ctypeslib.as_array((ctypes.c_uint8 * length).from_address(addr))
    int(view[::page].sum(dtype=np.uint64))


def span(a: np.ndarray) -> tuple[int, int]:
    """[start, end) of the pages a's bytes lie on (start page-aligned)."""
    page = mmap.PAGESIZE
    return a.ctypes.data // page * page, a.ctypes.data + a.nbytes


def populate(a: np.ndarray, name: str, progress=None) -> str:  # noqa: ANN001 - progress: (bytes) -> None
    """Map every page of a's memory (C-contiguous) for reading, CHUNK_BYTES at a time; `progress(n)` is called
    with the bytes done after each chunk (of `span(a)`). Returns how: "madvise" or "touch" (where the kernel has
    no MADV_POPULATE_READ). A read error (the file behind the mapping) raises StrataError naming the table."""
    if not a.flags.c_contiguous:
        raise StrataError(f"{name}: cannot hold a table whose rows are not one contiguous array in memory")
    start, end = span(a)
    madvise = _madvise() if sys.platform.startswith("linux") else None
    how = "madvise" if madvise is not None else "touch"
    for lo in range(start, end, CHUNK_BYTES):
        n = min(CHUNK_BYTES, end - lo)
        if how == "madvise" and madvise(lo, n, MADV_POPULATE_READ) != 0:
            err = ctypes.get_errno()
            if err not in (errno.EINVAL, errno.ENOSYS, errno.EPERM):
                raise StrataError(f"{name}: cannot read the table's pages into memory at byte {lo - start}: "
                                  f"{os.strerror(err)}")
            how = "touch"  # a kernel without MADV_POPULATE_READ (before 5.14)
        if how == "touch":
            _touch(lo, n)
        if progress is not None:
            progress(n)
    return how


def check_mode(mode: str) -> None:
    """Refuse a PLE table mode that is not one of PLE_TABLE_MODES."""
    if mode not in PLE_TABLE_MODES:
        raise StrataError(f"ple_table must be one of {', '.join(PLE_TABLE_MODES)}, got {mode!r}")


def one_tensor(t: StoredTensor, device: torch.device, progress=None) -> StoredTensor:  # noqa: ANN001
    """A 2-D table (row shards or one tensor) as one contiguous tensor on `device`, copied in pieces of at most
    CHUNK_BYTES (`progress(bytes)` after each): the form a device-side row gather reads (`raw_rows`)."""
    parts = list(getattr(t, "parts", None) or [t])
    raws = [raw_rows(p) for p in parts]
    kinds = {(type(p), p.kind, getattr(p, "type_id", None), r.dtype if r is not None else None)
             for p, r in zip(parts, raws, strict=True)}
    if any(r is None or r.dim() != 2 for r in raws) or len(kinds) != 1:
        raise StrataError(f"{t.name}: --ple-table device needs the table as 2-D row shards of one storage type; "
                          f"it is {', '.join(sorted({p.kind for p in parts}))} in {len(parts)} part(s)")
    out = torch.empty(t.shape[0], raws[0].shape[1], dtype=raws[0].dtype, device=device)
    row = 0
    for r in raws:
        step = max(1, CHUNK_BYTES // max(1, r.shape[1] * r.element_size()))
        for a in range(0, r.shape[0], step):
            piece = r[a:a + step]
            out[row + a:row + a + piece.shape[0]].copy_(piece)
            if progress is not None:
                progress(piece.numel() * piece.element_size())
        row += r.shape[0]
    if isinstance(parts[0], DenseTensor):
        return DenseTensor(t.name, out)
    return QuantTensor(t.name, out, parts[0].type_id, tuple(t.shape))


def tables_to_device(w: Weights, device: torch.device | str, progress: bool = False) -> Weights:
    """w with every PLE table as one tensor in `device`'s memory (`one_tensor`), refusing, before any copy, a
    device that is not a GPU or has too little free memory for them."""
    device = torch.device(device)
    need = sum(t.nbytes for t in ple_tables(w))
    if not need:
        return w
    if device.type != "cuda":
        raise StrataError(f"--ple-table device keeps the PLE tables in a GPU's memory; the model runs on {device}")
    free, _ = torch.cuda.mem_get_info(device)
    if need > free:
        raise StrataError(f"--ple-table device: the PLE tables need {need / 2**30:.1f} GiB on {device}, "
                          f"{free / 2**30:.1f} GiB is free beside the model; use --ple-table resident or mapped")
    return _tables_replaced(w, "PLE tables to the GPU", progress, lambda t, done: one_tensor(t, device, done))


def _tables_replaced(w: Weights, desc: str, progress: bool, make) -> Weights:  # noqa: ANN001 - (table, done) -> table
    """w with each PLE table replaced by `make(table, done)`, which calls `done(bytes)` as it copies (a progress
    bar over all the tables' bytes, `desc`)."""
    from tqdm import tqdm

    tensors = dict(w.tensors)
    with tqdm(total=sum(t.nbytes for t in ple_tables(w)), desc=desc, unit="B", unit_scale=True,
              disable=not progress, leave=False) as bar:
        for name, t in w.tensors.items():
            if name.endswith("ple.table"):
                tensors[name] = make(t, bar.update)
    return Weights(w.cfg, tensors, w.gdn_value_order, w.source, w.unknown)


def tables_to_pinned(w: Weights, device: torch.device | str, progress: bool = False) -> Weights:
    """w with every PLE table as one tensor in page-locked host memory that `device` (a GPU) reads directly
    (`one_tensor` on the host, then `page_lock`): a decode step on that GPU gathers its rows itself. Refused,
    before any copy, off a GPU or where the tables exceed the memory the system reports available."""
    device = torch.device(device)
    need = sum(t.nbytes for t in ple_tables(w))
    if not need:
        return w
    if device.type != "cuda":
        raise StrataError(f"--ple-table pinned keeps the PLE tables in host memory a GPU reads; the model runs on "
                          f"{device}")
    avail = available_bytes()
    if avail is not None and need > avail:
        raise StrataError(f"--ple-table pinned: the PLE tables need {need / 2**30:.1f} GiB of host memory, "
                          f"{avail / 2**30:.1f} GiB is available; use --ple-table mapped")

    def locked(t: StoredTensor, done) -> StoredTensor:  # noqa: ANN001 - done: (bytes) -> None
        one = one_tensor(t, torch.device("cpu"), done)
        page_lock(raw_rows(one), t.name)
        return one

    return _tables_replaced(w, "PLE tables into page-locked memory", progress, locked)


def plan(w: Weights, mode: str = "auto") -> tuple[str, int, int | None]:
    """What `hold_ple_tables(w, mode)` would do, without doing it: ("resident" | "mapped" | "none", the host
    tables' bytes, `available_bytes()`). "auto" holds them when their bytes are at most AUTO_FRACTION of the
    available memory (unknown: held). "device" and "pinned" (`tables_to_device`, `tables_to_pinned`, done by the
    caller) give (that mode, all the tables' bytes, ...)."""
    check_mode(mode)
    if mode in ("device", "pinned"):
        total = sum(t.nbytes for t in ple_tables(w))
        return (mode if total else "none"), total, available_bytes()
    total = sum(a.nbytes for t in ple_tables(w) for a in host_arrays(t))
    avail = available_bytes()
    if total == 0:
        return "none", 0, avail
    if mode == "auto":
        mode = "mapped" if avail is not None and total > AUTO_FRACTION * avail else "resident"
    return mode, total, avail


def place_ple_tables(w: Weights, mode: str, device: torch.device | str, progress: bool = False,
                     ) -> tuple[Weights, str]:
    """Apply a PLE table mode for a model on `device`: "device" and "pinned" move the tables (`tables_to_device`,
    `tables_to_pinned`), the others hold them in memory or not (`hold_ple_tables`). Returns the weights and what
    was done."""
    check_mode(mode)
    if w.cfg.ple and mode == "device":
        w = tables_to_device(w, device, progress)
    elif w.cfg.ple and mode == "pinned":
        w = tables_to_pinned(w, device, progress)
    return w, hold_ple_tables(w, mode, progress)


def hold_ple_tables(w: Weights, mode: str = "auto", progress: bool = False) -> str:
    """Apply a PLE table mode (`PLE_TABLE_MODES`, decided by `plan`) to w's tables in host memory. Returns what was
    done: "resident" (every page mapped), "mapped" (left to the page faults), "device" or "pinned" (the caller
    moved them) or "none" (no PLE table)."""
    decided, total, avail = plan(w, mode)
    if decided != "resident":
        if mode == "auto" and decided == "mapped":
            print(f"strata: the PLE tables ({total / 2**30:.1f} GiB) are not held in memory: "
                  f"{(avail or 0) / 2**30:.1f} GiB available; decode tokens will wait on page faults "
                  "(--ple-table resident holds them anyway)", file=sys.stderr)
        return decided
    arrays = [(t.name, a) for t in ple_tables(w) for a in host_arrays(t)]
    spans = sum(end - start for start, end in (span(a) for _, a in arrays))
    from tqdm import tqdm

    with tqdm(total=spans, desc="PLE table into memory", unit="B", unit_scale=True, disable=not progress,
              leave=False) as bar:
        for name, a in arrays:
            populate(a, name, bar.update)
    return "resident"
