"""tools/gpu_check_model.py's table (the check itself runs on the device box): a column only some rows have, such
as the jitter spread of the tile-major row in a float run, gets its header and a blank cell in the other rows, so
the numbers stay under their headers."""

from __future__ import annotations

from tests.tool_module import load_tool

check = load_tool("gpu_check_model")


def test_optional_column_is_blank_where_a_row_lacks_it_and_absent_where_every_row_does() -> None:
    rows = [{"mode_rel_diff": None, "jitter_spread": None}, {"mode_rel_diff": None, "jitter_spread": 3.5e-5}]
    assert check._optional(rows, rows[0], "jitter_spread", 10) == " " * 10
    assert check._optional(rows, rows[1], "jitter_spread", 10) == "  3.50e-05"
    assert check._optional(rows, rows[1], "mode_rel_diff", 13) == ""
