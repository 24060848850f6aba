"""The import rules the layout rests on, checked on the source (every import statement, also the
ones inside functions) and, for the gateway, on a real interpreter.

Everything is one namespace, `detgate`, cut into layers that import only downwards:

    detgate (cli, up)  bench                   the top: commands, the stack, benchmarks
    gateway   audit   train                    no torch in gateway/ and audit/
    worker: server -> engine -> model, tools beside
    kernels
    contract   procs   stack                   the shared base, and starting processes

- each layer names the layers it may import (`ALLOWED`); a module outside every layer fails;
- gateway/, audit/ and contract/ never import torch (nor numpy or triton);
- the engine and the model never import the HTTP stack or Redis;
- benchmarks live in detgate/bench/ alone, and tests never import them.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "detgate"

# layer -> the other layers of detgate it may import
ALLOWED: dict[str, set[str]] = {
    "contract": set(),
    "kernels": {"contract"},
    "worker.errors": {"contract"},
    "worker.model": {"contract", "kernels"},
    "worker.engine": {"contract", "kernels", "worker.errors", "worker.model"},
    "worker.tools": {"contract", "kernels", "worker.model", "worker.data"},
    "worker.server": {"contract", "kernels", "worker.errors", "worker.engine", "worker.model",
                      "worker.tools"},
    "worker.data": set(),
    "worker": {"contract", "worker.server", "worker.tools"},
    "gateway": {"contract"},
    "audit": {"contract"},
    "train": {"contract", "kernels", "worker.model", "worker.tools"},
    "procs": set(),
    "stack": {"contract", "procs"},
    "rl": {"contract", "procs", "stack", "train", "worker.tools"},
    "top": {"contract", "procs", "stack", "gateway", "audit", "train", "rl", "worker", "bench"},
    "bench": {"contract", "kernels", "worker.errors", "worker.model", "worker.engine",
              "worker.tools", "worker.server", "worker", "gateway", "audit", "train", "procs",
              "stack"},
}
TOP = ("cli", "up", "__init__")

# layer -> third-party modules it may not import
FOREIGN = {
    "contract": ("torch", "numpy", "triton"),
    "gateway": ("torch", "numpy", "triton"),
    "audit": ("torch", "numpy", "triton"),
    "worker.model": ("fastapi", "starlette", "uvicorn", "httpx", "redis"),
    "worker.engine": ("fastapi", "starlette", "uvicorn", "httpx", "redis"),
    "kernels": ("fastapi", "starlette", "uvicorn", "httpx", "redis"),
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
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and getattr(node.func, "id", None) in ("__import__", "import_module")):
            names.append(node.args[0].value)
    return names


def layer_of(module: str) -> str | None:
    """The layer a module of detgate belongs to ("top" for the commands at the root), None
    for a module outside detgate."""
    parts = module.removesuffix(".__init__").split(".")
    if parts[0] != "detgate":
        return None
    if len(parts) == 1 or parts[1] in TOP or parts[1] == "__version__":
        return "top"
    if parts[1] == "worker":
        return "worker" if len(parts) == 2 or parts[2] == "cli" else ".".join(parts[1:3])
    return parts[1]


def violations(path: Path) -> list[str]:
    layer = layer_of(".".join(path.relative_to(ROOT).with_suffix("").parts))
    if layer not in ALLOWED:
        return [f"{path.relative_to(ROOT)} is in no layer ({layer!r}): add it to ALLOWED"]
    found = []
    for module in imported_modules(path):
        target = layer_of(module)
        if target is None:
            if any(module == f or module.startswith(f + ".") for f in FOREIGN.get(layer, ())):
                found.append(f"{path.relative_to(ROOT)} imports {module}")
        elif target != layer and target not in ALLOWED[layer]:
            found.append(f"{path.relative_to(ROOT)} ({layer}) imports {module} ({target})")
    return found


def sources(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*.py") if "__pycache__" not in p.parts)


def test_every_module_imports_only_downwards() -> None:
    found = [v for path in sources(PACKAGE) for v in violations(path)]
    assert not found, "\n".join(found)


def test_tests_never_import_the_benchmarks() -> None:
    this_file = Path(__file__).resolve()
    found = [f"{path.relative_to(ROOT)} imports {module}"
             for path in sources(ROOT / "tests") if path != this_file
             for module in imported_modules(path) if layer_of(module) == "bench"]
    assert not found, "\n".join(found)


def test_only_detgate_is_installed() -> None:
    """One import namespace: nothing else at the top of the repository is a package (the
    distribution installs `detgate` alone, so no `kernels` or `worker` lands in
    site-packages beside other projects' packages of that name)."""
    stray = [p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()
             and p.name not in ("detgate", "tests")]
    assert not stray, stray
    text = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'include = \["detgate\*"\]', text), "packages.find must include detgate only"


def test_benchmarks_live_in_detgate_bench_only() -> None:
    stray = [str(p.relative_to(ROOT)) for p in sources(PACKAGE)
             if "bench" in p.stem and layer_of(
                 ".".join(p.relative_to(ROOT).with_suffix("").parts)) != "bench"]
    stray += [str(p.relative_to(ROOT)) for p in (ROOT / "bench").rglob("*.py")]
    assert not stray, stray


def test_the_gateway_loads_without_torch() -> None:
    code = ("import sys; import detgate.gateway.app, detgate.gateway.serve, "
            "detgate.contract.record, detgate.contract.analysis; "
            "print(sorted(m for m in ('torch', 'numpy', 'triton') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_the_cli_parses_without_torch() -> None:
    """Every subcommand's arguments are registered without torch: the gateway's image has
    none, and `detgate gateway` builds the whole parser (a benchmark's register_args that
    imports its torch module breaks it)."""
    code = ("import sys; sys.modules.update(torch=None, triton=None, numpy=None); "
            "from detgate.cli import build_parser; build_parser(); print('ok')")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.stdout.strip() == "ok", out.stdout + out.stderr


def test_the_rules_catch_a_violation(tmp_path: Path) -> None:
    """Negative control: the scanner sees imports inside functions, relative imports and
    import_module, and the layers refuse an upward import."""
    source = tmp_path / "probe.py"
    source.write_text("def f():\n    from detgate.worker.engine import engine\n"
                      "    from . import cpu\n    import_module('detgate.gateway.app')\n")
    found = imported_modules(source, package="detgate.kernels")
    assert found == ["detgate.worker.engine.engine", "detgate.kernels.cpu", "detgate.gateway.app"]
    assert [layer_of(m) for m in found] == ["worker.engine", "kernels", "gateway"]
    assert "worker.engine" not in ALLOWED["kernels"] and "gateway" not in ALLOWED["kernels"]
    assert "worker.engine" not in ALLOWED["worker.model"]
    assert "worker.tools" not in ALLOWED["worker.engine"]
    assert layer_of("detgate.up") == "top" and layer_of("detgate.worker.cli") == "worker"


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_the_layers_form_no_cycle(layer: str) -> None:
    seen, todo = set(), [layer]
    while todo:
        for target in ALLOWED[todo.pop()]:
            assert target != layer, f"{layer} can reach itself through {target}"
            if target not in seen:
                seen.add(target)
                todo.append(target)


def readme_layout() -> str:
    text = (ROOT / "README.md").read_text()
    return text[text.index("## Code layout"):text.index("\n## ", text.index("## Code layout") + 1)]


def test_the_readme_layout_names_every_folder_and_only_real_ones() -> None:
    """The README's code layout matches the tree: every folder it names (`detgate/...`, or a
    `name/` inside a named folder's block) exists, and every folder of the package is named."""
    section = readme_layout()
    named = set(re.findall(r"\bdetgate/((?:[a-z_]+/)*[a-z_]+)/", section))
    missing = sorted(n for n in named if not (PACKAGE / n).is_dir())
    assert not missing, f"the README names folders that do not exist: {missing}"
    folders = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*") if p.is_dir()
                     and p.name != "__pycache__" and "__pycache__" not in p.parts)
    unnamed = [f for f in folders
               if f not in named and not re.search(rf"(?<![\w/]){re.escape(f.rsplit('/', 1)[-1])}/",
                                                   section)]
    assert not unnamed, f"folders the README's code layout does not name: {unnamed}"
