"""A weight update on CUDA (skipped without CUDA): the engine's CUDA graphs, captured on the
old weights, replay the new ones: after staging and committing new weights into a running
engine, its traffic gives the token ids and logprob bits of a fresh engine loaded with them,
in float32 and bfloat16. Negative control: the same traffic before the update differs."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from detgate.worker.engine import offline as wl
from detgate.worker.engine.config import EngineConfig
from detgate.worker.engine.engine import Engine
from detgate.worker.model.loader import load
from detgate.worker.model.weight_update import WeightStager
from tests.worker.test_gpu_engine import results, traffic

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def engine_on(folder, dtype: str):
    loaded = load(folder, dtype=dtype, device="cuda", mode="batch_invariant")
    config = EngineConfig(model=str(folder), device="cuda", dtype=dtype, max_num_seqs=64,
                          max_num_batched_tokens=1024, kv_cache_mb=256)
    return loaded, Engine(config, loaded.model, loaded.config)


def in_dtype(folder, dtype: str, out):
    """`folder` with its tensors in `dtype` (what a worker serving that dtype accepts)."""
    out.mkdir()
    for f in folder.iterdir():
        if f.suffix != ".safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    tensors = load_file(folder / "model.safetensors")
    save_file({k: t.to(getattr(torch, dtype)) for k, t in tensors.items()},
              out / "model.safetensors")
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graphs_replay_the_new_weights(tiny_model, tiny_model_b, tmp_path, dtype):
    a = in_dtype(tiny_model, dtype, tmp_path / "a")
    b = in_dtype(tiny_model_b, dtype, tmp_path / "b")
    loaded, eng = engine_on(a, dtype)
    assert eng.runner.graphs is not None
    reqs = traffic(loaded.config.vocab_size)
    before, _ = wl.run(eng, reqs, arrival_seed=3)  # captures graphs on the old weights
    staged = WeightStager(loaded.model, loaded.config).stage(b)
    eng.update_weights(staged.commit)
    after, _ = wl.run(eng, reqs, arrival_seed=3)
    fresh_loaded, fresh = engine_on(b, dtype)
    expected, _ = wl.run(fresh, reqs, arrival_seed=5)
    assert staged.weights_sha256 == fresh_loaded.fingerprint_parts["weights_sha256"]
    assert results(after) == results(expected)
    assert results(before) != results(after)


@pytest.fixture(scope="module")
def cuda_worker(tiny_model, tmp_path_factory):
    from tests.support.weights import start_worker

    proc = start_worker(tiny_model, tmp_path_factory.mktemp("cuda-updatable"),
                        extra=("--device", "cuda", "--dtype", "bfloat16"))
    yield proc
    proc.stop()


def test_a_trainers_cuda_tensors_update_a_worker_process_over_ipc(
        cuda_worker, tiny_model, tiny_model_b, tmp_path):
    """The trainer side (this process) sends CUDA IPC handles of its tensors; the worker (its
    own process on the same GPU) copies them out: the same weights hash, fingerprint and
    answers, bit for bit, as the same weights sent as a file. Negative control: the answers
    before the update differ."""
    from detgate.worker.tools.push_weights import update_weights
    from tests.support.weights import TOKEN, fingerprint, probe, update_worker

    b = in_dtype(tiny_model_b, "bfloat16", tmp_path / "b")
    assert update_worker(cuda_worker.url, in_dtype(tiny_model, "bfloat16", tmp_path / "a")
                         ).status_code == 200
    before = probe(cuda_worker.url)
    r = update_worker(cuda_worker.url, b)
    assert r.status_code == 200, r.text
    by_file, fp_file = probe(cuda_worker.url), fingerprint(cuda_worker.url)
    assert by_file != before
    assert update_worker(cuda_worker.url, tmp_path / "a").status_code == 200
    tensors = {k: t.cuda() for k, t in load_file(b / "model.safetensors").items()}
    [answer] = update_weights([cuda_worker.url], TOKEN, tensors, via="ipc")
    assert answer["weights_sha256"] == r.json()["weights_sha256"]
    assert answer["system_fingerprint"] == fp_file == fingerprint(cuda_worker.url)
    assert probe(cuda_worker.url) == by_file
