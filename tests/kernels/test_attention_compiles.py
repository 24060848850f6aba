"""Every launch variant of the Triton paged attention compiles for Hopper (sm_90) on a machine
without a GPU: Triton's own compiler and its bundled ptxas, as on the card. The interpreter
tests (test_attention_triton.py) check the arithmetic; this checks that each variant the
launcher can pick (fused or split, by split or by group, decode tiles or general ones, all
sequences or one subset of a mixed step, and the combine of each) is a kernel the GPU build
accepts, so that a worker does not first learn of a variant's compile error on the card.
The compiles run in a process of their own (tests/kernels/sm90_compile.py says why)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.kernels import sm90_compile

ROOT = Path(__file__).resolve().parents[2]
# Found, not imported: triton imported here, before the interpreter tests set TRITON_INTERPRET,
# would leave its own jit'd library functions (tl.zeros) compiled-mode in their kernels.
TRITON = importlib.util.find_spec("triton")
PTXAS = Path(TRITON.origin).parent / "backends" / "nvidia" / "bin" / "ptxas" if TRITON else None
pytestmark = pytest.mark.skipif(PTXAS is None or not PTXAS.exists(),
                                reason="no Triton with its ptxas")


@pytest.fixture(scope="module")
def errors() -> dict[str, str | None]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "kernels" / "sm90_compile.py")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.mark.parametrize("variant", sm90_compile.variants())
def test_attention_variant_compiles_for_sm90(errors, variant):
    assert errors[variant] is None, errors[variant]
