"""strata: an inference engine for qwen4_exp models (Qwen3.8-Flash-Next).

`from strata import LLM, SamplingParams` is the Python API (see strata.api). Both names are imported on first
use, so `import strata` stays cheap (no torch) for tools that only need a submodule or the version.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from strata.api import LLM
    from strata.text.sampling import SamplingParams

__all__ = ["LLM", "SamplingParams"]

_LAZY = {"LLM": "strata.api", "SamplingParams": "strata.text.sampling"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'strata' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
