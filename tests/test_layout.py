"""The import rules the layout rests on, checked on the source (every import statement, also the
ones inside functions) and, for the gateway, on a real interpreter.

- gateway/ and detgate/contract/ never import torch (nor anything that does: worker/, kernels/);
- kernels/ knows nothing of the engine, the gateway or the benchmarks;
- the engine and the model never import the HTTP server, the model never the checkpoint tools;
- benchmarks live in detgate/bench/ alone, and tests never import them.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# package folder -> module prefixes that nothing in it may import
FORBIDDEN = {
    "gateway": ("torch", "triton", "numpy", "worker", "kernels", "detgate.bench"),
    "detgate/contract": ("torch", "numpy", "worker", "kernels", "gateway", "detgate.bench"),
    "kernels": ("worker", "gateway", "detgate.bench"),
    "worker/engine": ("worker.server", "worker.tools", "gateway", "detgate.bench"),
    "worker/model": ("worker.server", "worker.tools", "gateway", "detgate.bench"),
    "worker/server": ("gateway", "detgate.bench"),
    "tests": ("detgate.bench",),
}


def imported_modules(path: Path, package: str | None = None) -> list[str]:
    """Every module an import statement in `path` names, relative imports resolved against
    `package` (by default the one `path` sits in)."""
    if package is None:
        package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            names += [f"{base}.{alias.name}" for alias in node.names] or [base]
        elif (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "__import__"
              and node.args and isinstance(node.args[0], ast.Constant)):
            names.append(node.args[0].value)
    return names


def violates(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


@pytest.mark.parametrize("folder", sorted(FORBIDDEN))
def test_imports_follow_the_layout(folder: str) -> None:
    this_file = Path(__file__).resolve()
    found = [f"{path.relative_to(ROOT)} imports {module}"
             for path in sorted((ROOT / folder).rglob("*.py")) if path != this_file
             for module in imported_modules(path) if violates(module, FORBIDDEN[folder])]
    assert not found, "\n".join(found)


def test_benchmarks_live_in_detgate_bench_only() -> None:
    stray = [str(p.relative_to(ROOT)) for folder in ("gateway", "worker", "kernels", "bench")
             for p in (ROOT / folder).rglob("*.py") if "bench" in p.stem or folder == "bench"]
    assert not stray, stray


def test_the_gateway_loads_without_torch() -> None:
    code = ("import sys; import gateway.app, gateway.serve, detgate.contract.record; "
            "print(sorted(m for m in ('torch', 'numpy', 'triton') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_the_rules_catch_a_violation(tmp_path: Path) -> None:
    """Negative control: the scanner sees imports inside functions and relative imports."""
    source = tmp_path / "probe.py"
    source.write_text("def f():\n    from worker.engine import engine\n    from . import cpu\n"
                      "    __import__('gateway.bench')\n")
    found = imported_modules(source, package="kernels")
    assert found == ["worker.engine.engine", "kernels.cpu", "gateway.bench"]
    assert violates(found[0], FORBIDDEN["kernels"])
    assert not violates(found[1], FORBIDDEN["kernels"])
