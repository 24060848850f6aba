"""Worker processes shared by the tests of one module: each distinct flag set starts once."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.procs import Proc, detgate_cmd, free_port


@pytest.fixture(scope="module")
def module_worker(tiny_model, tmp_path_factory) -> Iterator:
    """`module_worker(mode="batch_invariant", *flags)` -> a running worker's Proc, started on
    first use and stopped when the module's tests are done."""
    procs: dict[tuple[str, ...], Proc] = {}
    logs = tmp_path_factory.mktemp("worker-logs")

    def get(mode: str = "batch_invariant", *flags: str) -> Proc:
        key = (mode, *flags)
        if key not in procs:
            port = free_port()
            args = detgate_cmd("worker", "--model", str(tiny_model), "--mode", mode,
                               "--port", str(port), *flags)
            proc = Proc(args, f"http://127.0.0.1:{port}", logs / f"worker-{port}.log")
            procs[key] = proc.start("/health")
        return procs[key]

    yield get
    for proc in procs.values():
        proc.stop()
