"""A record replays on another machine of its fingerprint (worker/model/numerics.py), through
real gateways, Redis and workers.

Machine A: a batch_invariant worker on 1 thread, the portable CPU kernel build and torch's AVX2
kernels; machine B: the same model on 2 threads, the native build, torch's kernels as
installed. Both report one fingerprint and their own machine; a gateway that knows only A
records requests, another on the same Redis that knows only B replays them: `match: true`,
the comparison naming both machines.

Negative control: default-mode workers on those two machines (1 thread, torch's kernels as
installed; 2 threads, its AVX2 kernels) answer with other bits, and report other fingerprints,
so the record of one is refused a replay on the other (409) rather than reported diverged.
"""

from __future__ import annotations

import httpx
import torch

from detgate.kernels.bits import same_bits


def _other_capability() -> str:
    """torch's CPU kernels another CPU family would run (AVX2 here, default on an AVX2 CPU)."""
    return "default" if torch.backends.cpu.get_cpu_capability() == "AVX2" else "avx2"


MACHINE_A = {"OMP_NUM_THREADS": "1", "DETGATE_CPU_KERNELS": "baseline"}
MACHINE_B = {"OMP_NUM_THREADS": "2"}


def _card(worker) -> dict:
    return httpx.get(worker.url + "/v1/models", timeout=30).json()["data"][0]


def _requests(client) -> list[str]:
    """Record ids of a greedy chat, a seeded sampled completion and a stream."""
    ids = [client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hello machines"}], max_tokens=12,
        temperature=0).id]
    ids.append(client.completions.create(model="tiny", prompt="one two three", max_tokens=12,
                                         temperature=0.9, top_p=0.9, seed=7).id)
    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "a stream"}], max_tokens=12,
        temperature=0.8, seed=3, stream=True)
    ids.append(next(iter(stream)).id)
    for _ in stream:
        pass
    return ids


def test_a_record_replays_on_another_machine_of_its_fingerprint(start_worker, start_gateway):
    a = start_worker(env={**MACHINE_A, "ATEN_CPU_CAPABILITY": _other_capability()})
    b = start_worker(env=MACHINE_B)
    card_a, card_b = _card(a), _card(b)
    assert card_a["system_fingerprint"] == card_b["system_fingerprint"]
    assert card_a["numerics"] == card_b["numerics"]
    assert (card_a["machine"]["torch_threads"], card_b["machine"]["torch_threads"]) == (1, 2)
    assert card_a["machine"]["torch_cpu_capability"] != card_b["machine"]["torch_cpu_capability"]
    assert card_a["machine"]["cpu_kernels"] == "x86-64 baseline" or \
        card_a["machine"]["isa_class"] != "x86-64 avx2+fma"

    gw_a = start_gateway([a.url])
    ids = _requests(gw_a.client())
    gw_b = start_gateway([b.url], prefix=gw_a.prefix)
    models = gw_b.http().get("/v1/models").json()["data"][0]
    assert models["system_fingerprints"] == [
        {"system_fingerprint": card_b["system_fingerprint"], "machine": card_b["machine"]}]
    with gw_b.http() as http:
        for rid in ids:
            record = http.get(f"/v1/requests/{rid}").json()
            assert record["status"] == "complete"
            assert record["machine"] == card_a["machine"]
            cmp = http.post(f"/replay/{rid}", json={"load": 2}).json()
            assert cmp["match"] is True, cmp
            assert cmp["tokens_compared"] > 0 and cmp["logprob_mse"] == 0.0
            assert cmp["original_fingerprint"] == cmp["replay_fingerprint"]
            assert cmp["worker"] == b.url
            assert (cmp["original_machine"], cmp["replay_machine"]) == (
                card_a["machine"], card_b["machine"])


def test_default_mode_machines_differ_in_bits_and_fingerprint(start_worker, start_gateway):
    """The negative control: default mode's bits depend on the machine, and so does its
    fingerprint, so its records do not replay across machines."""
    c = start_worker("default", env={"OMP_NUM_THREADS": "1"})
    d = start_worker("default", env={"OMP_NUM_THREADS": "2",
                                     "ATEN_CPU_CAPABILITY": _other_capability()})
    assert _card(c)["system_fingerprint"] != _card(d)["system_fingerprint"]

    body = {"model": "tiny", "prompt": "the same request", "max_tokens": 12, "temperature": 0,
            "logprobs": 0}
    answers = [httpx.post(w.url + "/v1/completions", json=body, timeout=60).json()
               for w in (c, d)]
    lps = [torch.tensor(a["choices"][0]["logprobs"]["token_logprobs"]) for a in answers]
    assert not same_bits(*lps), "default mode gave the same bits on both machines: the " \
                                "control shows nothing here"

    gw_c = start_gateway([c.url])
    rid = gw_c.client().completions.create(model="tiny", prompt="the same request",
                                           max_tokens=12, temperature=0).id
    gw_d = start_gateway([d.url], prefix=gw_c.prefix)
    reply = gw_d.http().post(f"/replay/{rid}", json={})
    assert reply.status_code == 409
    assert reply.json()["error"]["code"] == "no_matching_worker"

