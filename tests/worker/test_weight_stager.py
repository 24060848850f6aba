"""Staging a weight update in process (worker/model/weight_update.py): the staged values are
what the loader would load from the same tensors, and the weights' hash names the tensors, not
the files: sharding, Hugging Face or packed names and the handoff file give the same hash as
a fresh load; the values only change at commit."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from detgate.worker.model.loader import load
from detgate.worker.model.weight_update import WeightsRejected, WeightStager
from tests.support.floats import bits


@pytest.fixture(scope="module")
def served(tiny_model):
    return load(tiny_model, dtype="float32", device="cpu", mode="batch_invariant")


def params_of(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        bits(a[n].flatten().tolist()) == bits(b[n].flatten().tolist()) for n in a)


def test_staged_weights_are_a_fresh_load_and_change_nothing_until_commit(
        served, tiny_model, tiny_model_b):
    before = params_of(served.model)
    b = load(tiny_model_b, dtype="float32", device="cpu", mode="batch_invariant")
    stager = WeightStager(served.model, served.config)
    staged = stager.stage(tiny_model_b)
    assert staged.weights_sha256 == b.fingerprint_parts["weights_sha256"]
    assert staged.weights_sha256 != served.fingerprint_parts["weights_sha256"]
    assert same(params_of(served.model), before)  # nothing live touched yet
    staged.commit()
    assert same(params_of(served.model), params_of(b.model))
    stager.stage(tiny_model).commit()  # the staging buffers are reused
    assert same(params_of(served.model), before)


def test_the_hash_names_the_tensors_not_the_files(served, tiny_model, tmp_path):
    tensors = load_file(tiny_model / "model.safetensors")
    names = sorted(tensors)
    # Two shards with an index, as save_pretrained writes big checkpoints.
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "config.json").write_bytes((tiny_model / "config.json").read_bytes())
    halves = {"a.safetensors": names[::2], "b.safetensors": names[1::2]}
    for file, part in halves.items():
        save_file({n: tensors[n] for n in part}, sharded / file)
    index = {"weight_map": {n: f for f, part in halves.items() for n in part}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    # The packed names the model uses, in one handoff file.
    packed = dict(tensors)
    for layer in range(4):
        pre = f"model.layers.{layer}.mlp"
        packed[f"{pre}.gate_up_proj.weight"] = torch.cat(
            [packed.pop(f"{pre}.gate_proj.weight"), packed.pop(f"{pre}.up_proj.weight")])
    save_file(packed, tmp_path / "handoff.safetensors")
    stager = WeightStager(served.model, served.config)
    expected = served.fingerprint_parts["weights_sha256"]
    assert stager.stage(sharded).weights_sha256 == expected
    assert stager.stage(tmp_path / "handoff.safetensors").weights_sha256 == expected
    # Other bytes, another hash (the control).
    tensors["model.norm.weight"] = tensors["model.norm.weight"].nextafter(torch.tensor(2.0))
    save_file(tensors, tmp_path / "other.safetensors")
    assert stager.stage(tmp_path / "other.safetensors").weights_sha256 != expected


def test_bfloat16_tensors_widen_exactly_into_float32_weights(served, tiny_model, tmp_path):
    folder = tmp_path / "bf16"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((tiny_model / name).read_bytes())
    tensors = {n: t.bfloat16() for n, t in load_file(tiny_model / "model.safetensors").items()}
    save_file(tensors, folder / "model.safetensors")
    fresh = load(folder, dtype="float32", device="cpu", mode="batch_invariant")
    staged = WeightStager(served.model, served.config).stage(folder)
    assert staged.weights_sha256 == fresh.fingerprint_parts["weights_sha256"]
    assert same(staged.buffers, params_of(fresh.model))


def test_a_lossy_cast_is_refused(tiny_model, tmp_path):
    bf16 = load(tiny_model, dtype="bfloat16", device="cpu", mode="batch_invariant")
    with pytest.raises(WeightsRejected, match="serves bfloat16 and accepts bfloat16") as exc:
        WeightStager(bf16.model, bf16.config).stage(tiny_model)  # float32 tensors
    assert exc.value.code == "dtype_mismatch" and exc.value.tensor
