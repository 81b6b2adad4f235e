"""What a command prints when it fails: one line naming the problem and what to try, exit status 2, no traceback."""

from __future__ import annotations

import pytest
import torch

from strata.cli import bench, generate
from strata.cli.main import main
from strata.errors import StrataError


def _raise(exc: BaseException):
    def run(args) -> int:
        raise exc
    return run


@pytest.mark.parametrize("module,argv,hint", [
    (bench, ["bench"], "shorter --contexts or fewer --layers"),
    (generate, ["generate", "hi"], "try a shorter --context"),
])
def test_out_of_device_memory_is_an_error_with_a_hint(module, argv, hint, monkeypatch, capsys) -> None:
    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (79.1 GiB in use)\nsecond line")
    monkeypatch.setattr(module, "run", _raise(oom))
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"strata {argv[0]}: error: out of device memory: CUDA out of memory. Tried to allocate 2.00 GiB" in err
    assert hint in err and "second line" not in err and "Traceback" not in err


def test_other_runtime_errors_are_not_hidden(monkeypatch) -> None:
    monkeypatch.setattr(bench, "run", _raise(RuntimeError("a bug")))
    with pytest.raises(RuntimeError, match="a bug"):
        main(["bench"])


def test_strata_errors_print_one_line(monkeypatch, capsys) -> None:
    monkeypatch.setattr(bench, "run", _raise(StrataError("strata bench needs a CUDA device")))
    assert main(["bench"]) == 2
    assert capsys.readouterr().err == "strata bench: error: strata bench needs a CUDA device\n"
