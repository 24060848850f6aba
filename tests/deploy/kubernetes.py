"""The Kubernetes manifests as the cluster would get them: rendered by kustomize (the one built
into kubectl, client-side, offline) and checked against the Kubernetes API's schemas
(kubernetes-validate, strict: unknown fields are errors) and, for the operators' custom
resources, against their CRDs' OpenAPI schemas vendored under tests/deploy/crds/."""

from __future__ import annotations

import json
import shutil
import subprocess
from functools import cache
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.deploy.conftest import DEPLOY

K8S = DEPLOY / "kubernetes"
OVERLAYS = ("cpu", "gpu", "vllm", "gpu-vllm")
CRDS = Path(__file__).parent / "crds"
# The oldest Kubernetes the manifests are for, and the newest schemas the package carries.
K8S_VERSIONS = ("1.30", kubernetes_validate.latest_version())


def kubectl() -> str:
    path = shutil.which("kubectl")
    if path is None:
        pytest.fail("kubectl (its built-in kustomize renders the manifests) is not installed")
    return path


def render(directory: Path) -> list[dict]:
    out = subprocess.run([kubectl(), "kustomize", str(directory)], capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


@cache
def rendered(overlay: str) -> tuple[dict, ...]:
    return tuple(render(K8S / "overlays" / overlay))


def one(objects, kind: str, name: str) -> dict:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, (kind, name, len(found))
    return found[0]


def _closed(schema):
    """The schema with unknown fields refused wherever it lists the known ones (a CRD's
    server prunes them silently; a typo must fail here)."""
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _closed(v) for k, v in schema.items()}
    if ("properties" in out and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


@cache
def crd_schemas() -> dict[tuple[str, str], dict]:
    """(apiVersion, kind) -> the closed schema of each vendored CRD."""
    out = {}
    for path in CRDS.glob("*.json"):
        crd = json.loads(path.read_text())
        schema = _closed(crd["openAPIV3Schema"])
        # Metadata is the API server's, not the CRD's: checked as any object's below.
        schema["properties"]["metadata"] = {"type": "object"}
        out[(f"{crd['group']}/{crd['version']}", crd["kind"])] = schema
    return out


def validate(obj: dict) -> None:
    """Raises when `obj` does not fit its kind's schema (jsonschema or kubernetes_validate
    errors)."""
    schema = crd_schemas().get((obj["apiVersion"], obj["kind"]))
    if schema is not None:
        jsonschema.Draft7Validator(schema).validate(obj)
        kubernetes_validate.validate(
            {"apiVersion": "v1", "kind": "ConfigMap", "metadata": obj["metadata"]},
            K8S_VERSIONS[0], strict=True)
        return
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(obj, version, strict=True)


def pod_specs(objects) -> list[tuple[str, dict]]:
    return [(o["metadata"]["name"], o["spec"]["template"]) for o in objects
            if o["kind"] in ("Deployment", "StatefulSet")]


def containers(objects) -> list[tuple[str, dict]]:
    return [(name, c) for name, template in pod_specs(objects)
            for c in template["spec"]["containers"]]


def selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())
