"""The scripts under tools/ as modules, for the tests of their kernels and helpers (tools/ is not a package)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

TOOLS = Path(__file__).resolve().parent.parent / "tools"


def load_tool(name: str) -> ModuleType:
    """tools/<name>.py, imported under a private module name."""
    spec = importlib.util.spec_from_file_location(f"_strata_{name}", TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
