"""PLE tables held in memory (`strata.runtime.host_memory`): pages mapped up front, so a row read is no fault."""

from __future__ import annotations

import ctypes
import errno
import mmap
import resource
import sys

import numpy as np
import pytest

from strata.errors import StrataError
from strata.kernels import host_pages
from strata.runtime import host_memory
from strata.runtime.engine import Engine, load_weights

PAGES = 256
linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="page-fault counts are Linux's")


def faults_reading(a: np.ndarray) -> int:
    """Minor page faults of one read per page of a."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    int(a.reshape(-1)[::mmap.PAGESIZE].sum(dtype=np.uint64))
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def fresh_pages() -> tuple[mmap.mmap, np.ndarray]:
    m = mmap.mmap(-1, PAGES * mmap.PAGESIZE)
    return m, np.frombuffer(m, dtype=np.uint8).reshape(PAGES, mmap.PAGESIZE)


@linux
def test_untouched_pages_fault_and_populated_ones_do_not():
    m, a = fresh_pages()
    assert faults_reading(a) >= PAGES // 2  # the lab's premise: each new page is a fault
    m2, b = fresh_pages()
    assert host_memory.populate(b, "t") == "madvise"
    assert faults_reading(b) < PAGES // 8
    del a, b
    m.close()
    m2.close()


def failing_madvise(err: int):
    """A stand-in for `host_memory._madvise` whose calls fail with errno err."""
    def make():
        def madvise(addr, length, advice):
            ctypes.set_errno(err)
            return -1
        return madvise
    return make


@linux
def test_touch_fallback_where_the_kernel_lacks_the_advice(monkeypatch):
    monkeypatch.setattr(host_memory, "_madvise", failing_madvise(errno.EINVAL))
    m, a = fresh_pages()
    assert host_memory.populate(a, "t") == "touch"
    assert faults_reading(a) < PAGES // 8
    del a
    m.close()


def test_a_read_error_names_the_table(monkeypatch):
    monkeypatch.setattr(host_memory, "_madvise", failing_madvise(errno.EIO))
    monkeypatch.setattr(host_memory.sys, "platform", "linux")
    with pytest.raises(StrataError, match="L1.ple.table: cannot read the table's pages"):
        host_memory.populate(np.zeros(4096, np.uint8), "L1.ple.table")


def test_progress_counts_every_byte_of_the_pages():
    a = np.zeros((3 * host_memory.CHUNK_BYTES // 2) // 4096 * 4096 + 100, np.uint8)
    done = []
    host_memory.populate(a, "t", done.append)
    start, end = host_memory.span(a)
    assert len(done) == 2 and sum(done) == end - start >= a.nbytes


def test_modes_on_the_bundled_model(monkeypatch, capsys):
    w = load_weights(Engine.load().path)
    tables = host_memory.ple_tables(w)
    assert tables and all(list(host_memory.host_arrays(t)) for t in tables)
    assert host_memory.hold_ple_tables(w, "mapped") == "mapped"
    assert host_memory.hold_ple_tables(w, "resident") == "resident"
    assert host_memory.hold_ple_tables(w, "auto") == "resident"
    monkeypatch.setattr(host_memory, "available_bytes", lambda: 1000)
    assert host_memory.hold_ple_tables(w, "auto") == "mapped"
    assert "not held in memory" in capsys.readouterr().err
    assert host_memory.hold_ple_tables(w, "resident") == "resident"  # asked for: held anyway
    with pytest.raises(StrataError, match="ple_table must be one of"):
        host_memory.hold_ple_tables(w, "lazy")


def test_engine_reports_and_validates_the_mode():
    assert Engine.load(ple_table="mapped").ple_table == "mapped"
    assert Engine.load().ple_table == "resident"
    with pytest.raises(StrataError, match="ple_table must be one of auto, resident, mapped, device, pinned, got 'x'"):
        Engine.load(ple_table="x")


def test_plan_decides_without_touching_memory(monkeypatch):
    w = load_weights(Engine.load().path)
    total = sum(a.nbytes for t in host_memory.ple_tables(w) for a in host_memory.host_arrays(t))
    monkeypatch.setattr(host_memory, "available_bytes", lambda: int(total / host_memory.AUTO_FRACTION))
    assert host_memory.plan(w, "auto") == ("resident", total, int(total / host_memory.AUTO_FRACTION))
    monkeypatch.setattr(host_memory, "available_bytes", lambda: int(total / host_memory.AUTO_FRACTION) - 2)
    assert host_memory.plan(w, "auto")[0] == "mapped"
    monkeypatch.setattr(host_memory, "available_bytes", lambda: None)
    assert host_memory.plan(w, "auto")[0] == "resident"
    assert host_memory.plan(w, "mapped")[0] == "mapped"
    no_ple = type(w)(w.cfg, {n: t for n, t in w.tensors.items() if not n.endswith("ple.table")}, w.gdn_value_order)
    assert host_memory.plan(no_ple, "resident") == ("none", 0, None)
    assert host_memory.hold_ple_tables(no_ple, "resident") == "none"


def test_inspect_shows_the_plan(capsys):
    from strata.cli.main import main

    assert main(["inspect", "--ple-table", "mapped"]) == 0
    assert "--ple-table mapped: mapped" in capsys.readouterr().out
    assert main(["inspect", "--ple-table", "device"]) == 0
    assert "--ple-table device: copied into the GPU's memory" in capsys.readouterr().out
    assert main(["inspect", "--ple-table", "pinned"]) == 0
    assert "--ple-table pinned: copied into page-locked host memory the GPU reads" in capsys.readouterr().out


def test_device_mode_refuses_a_cpu_or_a_full_gpu_before_copying(monkeypatch):
    """`--ple-table device` on a CPU model, or on a GPU with less free memory than the tables, is refused with
    the sizes, before any byte moves."""
    import torch

    w = load_weights(Engine.load().path)
    with pytest.raises(StrataError, match="keeps the PLE tables in a GPU's memory; the model runs on cpu"):
        Engine.load(ple_table="device")
    need = sum(t.nbytes for t in host_memory.ple_tables(w))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (need - 1, 10 * need))
    with pytest.raises(StrataError, match=r"the PLE tables need .* GiB on cuda, .* GiB is free .*resident or mapped"):
        host_memory.tables_to_device(w, "cuda")
    assert host_memory.plan(w, "device") == ("device", need, host_memory.available_bytes())


def test_one_tensor_joins_row_shards_and_refuses_mixed_storage():
    """A table's row shards become one tensor of the same rows (what the step's device gather reads); shards of
    two storage types are refused by name."""
    import torch

    from strata.weights.tensor import DenseTensor, RowConcatTensor

    parts = [DenseTensor(f"t.{i}", torch.randn(5 + i, 4).to(torch.bfloat16)) for i in range(3)]
    table = RowConcatTensor("t", parts)
    one = host_memory.one_tensor(table, torch.device("cpu"))
    assert isinstance(one, DenseTensor) and one.shape == table.shape
    assert torch.equal(one.tensor, torch.cat([p.tensor for p in parts]))
    mixed = RowConcatTensor("t", [parts[0], DenseTensor("t.f", torch.randn(2, 4))])
    with pytest.raises(StrataError, match="t: --ple-table device needs the table as 2-D row shards of one storage"):
        host_memory.one_tensor(mixed, torch.device("cpu"))


def test_pinned_mode_refuses_a_cpu_or_too_little_memory_then_locks_one_tensor_per_table(monkeypatch):
    """`--ple-table pinned` on a CPU model, or with less available memory than the tables, is refused with the
    sizes before any byte moves; else each table becomes one host tensor of the same rows, page-locked for the
    GPU (the CUDA runtime calls are stand-ins here), which a decode step then takes as readable by its GPU."""
    import gc

    import torch

    from strata.weights.tensor import raw_rows

    w = load_weights(Engine.load().path)
    need = sum(t.nbytes for t in host_memory.ple_tables(w))
    with pytest.raises(StrataError, match="keeps the PLE tables in host memory a GPU reads; the model runs on cpu"):
        Engine.load(ple_table="pinned")
    monkeypatch.setattr(host_memory, "available_bytes", lambda: need - 1)
    with pytest.raises(StrataError, match=r"need .* GiB of host memory, .* GiB is available; use --ple-table mapped"):
        host_memory.tables_to_pinned(w, "cuda")
    monkeypatch.setattr(host_memory, "available_bytes", lambda: 10 * need)
    calls = []

    class Runtime:
        def cudaHostRegister(self, ptr, n, flags):  # noqa: ANN001, ANN201, N802
            calls.append(("lock", ptr, n))
            return 0

        def cudaHostUnregister(self, ptr):  # noqa: ANN001, ANN201, N802
            calls.append(("unlock", ptr))
            return 0

    monkeypatch.setattr(torch.cuda, "cudart", Runtime)
    monkeypatch.setattr(torch.cuda, "check_error", lambda res: None)
    pinned = host_memory.tables_to_pinned(w, "cuda")
    names = [n for n in w.tensors if n.endswith("ple.table")]
    assert [c[0] for c in calls] == ["lock"] * len(names)
    for name in names:
        rows = raw_rows(pinned[name])
        assert rows.is_contiguous() and host_pages.page_locked(rows) and host_pages.page_locked(rows[3:7])
        assert torch.equal(rows, raw_rows(host_memory.one_tensor(w[name], torch.device("cpu"))))
        assert not host_pages.page_locked(rows.clone())
    assert host_memory.plan(pinned, "pinned") == ("pinned", need, 10 * need)
    del pinned, rows
    gc.collect()
    assert sorted(c[0] for c in calls) == ["lock"] * len(names) + ["unlock"] * len(names)
    assert not host_pages._LOCKED
