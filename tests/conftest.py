"""Shared test setup: one torch thread (two threads on a 2-core box stall), and the fixtures folder."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO.parent / "shared" / "fixtures" / "qwen4exp-tiny"


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    """../shared/fixtures/qwen4exp-tiny. Fails (never skips) when it is missing: these tests are how we know we
    read real-world files right."""
    if not (FIXTURES / "MANIFEST.md").is_file():
        pytest.fail(f"fixtures folder {FIXTURES} is missing: it must lie beside the repository")
    return FIXTURES
