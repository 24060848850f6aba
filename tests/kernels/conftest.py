"""Shared by the CPU kernel tests: torch's intra-op thread count, set per test."""

from __future__ import annotations

import os

import pytest
import torch

# One thread, two, and every core: no reduction order may follow the thread count.
THREADS = sorted({1, 2, os.cpu_count() or 1})


@pytest.fixture(params=THREADS, ids=lambda t: f"threads{t}")
def threads(request):
    saved = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(saved)
