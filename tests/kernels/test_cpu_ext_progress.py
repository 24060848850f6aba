"""The first worker start compiles the CPU kernels (minutes on a loaded machine): it says so."""

from __future__ import annotations

import time

from detgate.kernels.cpu_ext import _progress


def test_a_slow_build_prints_progress_and_a_fast_load_prints_nothing(capsys):
    with _progress("compiling the kernels (once)", first_after_s=0.01, every_s=0.05):
        time.sleep(0.2)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "detgate: compiling the kernels (once) ..."
    assert any(line.startswith("detgate: still compiling the kernels: ") for line in lines)
    assert lines[-1].startswith("detgate: done in ")
    with _progress("compiling", first_after_s=5):
        pass
    assert capsys.readouterr().err == ""
