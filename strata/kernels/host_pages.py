"""Host memory a GPU kernel reads directly: ranges page-locked and mapped into the GPUs' address space.

A kernel that takes a host tensor (the PLE row gather reading `--ple-table pinned` tables over PCIe) must know
that the GPU can address it; a plain host pointer would fault on the device. `cudaHostRegister` does not mark the
tensor, so the registered ranges are kept here, where both the code that registers them
(`strata.runtime.host_memory`) and the kernels that check them can see them.
"""

from __future__ import annotations

import weakref

import torch

from strata.errors import StrataError

_LOCKED: dict[int, int] = {}  # start -> bytes of the host ranges `page_lock` registered


def page_lock(t: torch.Tensor, name: str) -> None:
    """Page-lock a contiguous host tensor's memory and map it into the GPUs' address space (`cudaHostRegister`),
    so kernels read it directly (over PCIe); it is unregistered when the tensor is freed."""
    ptr, nbytes = t.data_ptr(), t.numel() * t.element_size()
    try:
        torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0))
    except Exception as e:  # noqa: BLE001 - any failure of the runtime call is reported the same way
        raise StrataError(f"{name}: cannot page-lock the table's {nbytes / 2**30:.1f} GiB of host memory for the GPU "
                          f"({e}); use --ple-table resident or mapped") from None
    _LOCKED[ptr] = nbytes
    weakref.finalize(t, _unlock, ptr)


def _unlock(ptr: int) -> None:
    _LOCKED.pop(ptr, None)
    try:
        torch.cuda.cudart().cudaHostUnregister(ptr)
    except Exception:  # noqa: BLE001, S110 - at exit the CUDA context may already be gone
        pass


def page_locked(t: torch.Tensor) -> bool:
    """Whether a host tensor's bytes lie in a range `page_lock` registered (so a GPU reads them directly)."""
    lo, hi = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    return t.device.type == "cpu" and any(p <= lo and hi <= p + n for p, n in _LOCKED.items())
