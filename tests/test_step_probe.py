"""The launch probe (`gemv_rr.Probe`, tools/step_probe.py): its regions, its refusal off CUDA, and the summary of
one launch's program rows (the recording itself runs on the device box)."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # as the kernel tests: no kernel runs here, but Triton may be imported first

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from strata.errors import StrataError  # noqa: E402
from strata.kernels import gemv_rr  # noqa: E402

from tests.tool_module import load_tool  # noqa: E402

sp = load_tool("step_probe")


def test_probe_refuses_a_cpu_device() -> None:
    with pytest.raises(StrataError, match="CUDA"):
        gemv_rr.Probe("cpu")


def test_probe_regions_follow_the_launches(monkeypatch) -> None:
    """Each launch takes the next rows in call order and the probe refuses to overflow, naming its size."""
    probe = object.__new__(gemv_rr.Probe)  # its buffer on the CPU: the region bookkeeping only
    probe.buf, probe.used, probe.launches = torch.zeros(10, 5, dtype=torch.int64), 0, []
    a = probe.region("A", "ids", (2, 3, 1))
    b = probe.region("B", "plain", (4, 1, 1))
    assert a.shape == (6, 5) and b.shape == (4, 5) and probe.used == 10
    assert b.data_ptr() - a.data_ptr() == 6 * 5 * 8
    assert probe.launches == [("A", "ids", 0, (2, 3, 1)), ("B", "plain", 6, (4, 1, 1))]
    with pytest.raises(StrataError, match="10 rows full"):
        probe.region("C", "plain", (1, 1, 1))


def test_launch_stats_in_microseconds() -> None:
    """Starts, waits, loops and ends relative to the launch's first start; programs per SM; where the launch
    sits after the replay's first probed program."""
    rows = np.array([  # sm, start, waited, looped, end (ns)
        [0, 10_000, 12_000, 15_000, 16_000],
        [0, 11_000, 12_500, 16_000, 17_000],
        [1, 10_500, 12_000, 18_000, 20_000],
    ], dtype=np.int64)
    st = sp.launch_stats(rows, t0=4_000)
    assert st["programs"] == 3 and st["sms"] == 2 and st["max_per_sm"] == 2
    assert st["at"] == pytest.approx(6.0)
    assert st["start_max"] == pytest.approx(1.0) and st["start_p50"] == pytest.approx(0.5)
    assert st["waited_p50"] == pytest.approx(2.0) and st["waited_max"] == pytest.approx(2.5)
    assert st["loop_p50"] == pytest.approx(3.5)  # looped - waited: 3.0, 3.5, 6.0
    assert st["after_loop_p50"] == pytest.approx(1.0)
    assert st["end_max"] == pytest.approx(10.0)
    rows[:, 2] = 0  # a launch that waits inside its K loop: loops from the start, no wait columns
    st = sp.launch_stats(rows, t0=4_000)
    assert "waited_p50" not in st and st["loop_p50"] == pytest.approx(5.0)


def test_timer_step_is_the_smallest_reading_step() -> None:
    rows = np.array([[0, 1000, 0, 1032, 1064], [3, 2000, 0, 2064, 2128]], dtype=np.int64)
    assert sp.timer_step(rows) == 32.0


def test_sm_stats_slope_of_span_over_programs() -> None:
    """Per-SM spans that grow by 2 us per program give a slope of 2 and a correlation of 1; equal spans give no
    slope (nothing to fit)."""
    rows, sm_of = [], {0: 1, 1: 2, 2: 3}
    for s, n in sm_of.items():
        for i in range(n):
            rows.append([s, 0, 0, 0, 1_000 + 2_000 * n])  # every program ends when its SM's n programs are done
    rows = np.array(rows, dtype=np.int64)
    st = sp.sm_stats(rows, rows[:, 1])
    assert st["min_per_sm"] == 1 and st["per_sm_p50"] == 2.0
    assert st["sm_span_p50"] == pytest.approx(5.0) and st["sm_span_max"] == pytest.approx(7.0)
    assert st["us_per_program"] == pytest.approx(2.0) and st["span_count_r"] == pytest.approx(1.0)
    rows[:, 4] = 4_000
    st = sp.sm_stats(rows, rows[:, 1])
    assert "us_per_program" not in st and st["sm_span_max"] == pytest.approx(4.0)
