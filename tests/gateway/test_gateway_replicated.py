"""The gateway on replicated Redis: a real Redis Cluster (3 masters, a replica each, made by
redis-cli) and a real Sentinel setup (a master, 2 replicas, 3 sentinels), in temporary folders
on free ports (tests/support/redis_servers.py), with real gateway and tiny worker processes.

What is measured: every answer that claimed success (a 2xx, a stream's `[DONE]`) against the
records Redis holds after a master was killed -9 under load, failed over, and the gateway's
spool drained. A record is acknowledged only once a replica has it (WAIT) or the spool does;
the negative controls show what that costs to leave out: with the master's replication
stream held back by a proxy (a replica behind), a gateway that does not wait loses the
records it acknowledged in that window, and with a cluster replica stopped it acknowledges
records that only the master holds.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest

from detgate.gateway.keys import Keys
from detgate.gateway.limits import TenantLimits
from detgate.gateway.rates import SharedRates
from detgate.gateway.recorder import Recorder, dumps, now
from detgate.gateway.store import RedisTarget, Store
from tests.gateway.test_gateway_faults import body, model_of, send, wait_drained
from tests.gateway.test_gateway_recorder import make_record
from tests.support.holding_proxy import HoldingProxy
from tests.support.redis_servers import missing_tools, start_cluster, start_sentinel

pytestmark = pytest.mark.skipif(
    missing_tools() is not None,
    reason=f"Redis Cluster and Sentinel tests start their own servers: {missing_tools()}")

KEYS = "alice:sk-alice-0123456789,bob:sk-bob-9876543210,carol:sk-carol-1111111111"
TENANTS = {"alice": "sk-alice-0123456789", "bob": "sk-bob-9876543210",
           "carol": "sk-carol-1111111111"}


@pytest.fixture(scope="module")
def workers(start_workers_module) -> list[str]:
    return [w.url for w in start_workers_module(["batch_invariant"])]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """One cluster for the module; a test that kills a master brings it back as a replica."""
    made = start_cluster(tmp_path_factory.mktemp("cluster"))
    yield made
    made.stop()


def _fire(gw_url: str, payloads: list[tuple[dict, str | None]], concurrency: int,
          during: Callable) -> list[dict]:
    """Send every payload (with its key), `concurrency` at a time; `during(wait)` runs
    meanwhile, `wait(k)` returning once k more requests were answered."""
    answered = threading.Semaphore(0)

    def wait(count: int) -> None:
        for _ in range(count):
            answered.acquire()

    def one(item: tuple[dict, str | None]) -> dict:
        try:
            return send(gw_url, *item)
        finally:
            answered.release()

    with ThreadPoolExecutor(concurrency) as pool:
        futures = [pool.submit(one, item) for item in payloads]
        during(wait)
        return [f.result() for f in futures]


async def test_each_tenant_is_one_slot_and_tenants_spread_over_masters(cluster):
    """The recorder and the shared rates straight on the cluster, through two clients as two
    gateways: every key of a tenant hashes to one slot (a script touching two would fail with
    CROSSSLOT), tenants land on several masters, and listing, replays, the storage total
    and the buckets read the same from either client."""
    prefix = f"detgate-test-{secrets.token_hex(4)}"
    target = RedisTarget.parse(cluster.url)
    stores = [Store(target, timeout_s=2.0, wait_replicas=1) for _ in range(2)]
    first, second = (Recorder(s, prefix=prefix, ttl_s=600, retry_after_s=1) for s in stores)
    tenants = [f"tenant-{i}" for i in range(12)]
    try:
        sizes: dict[str, int] = {}
        for tenant in tenants:
            for i in range(3):
                record = make_record(f"cmpl-{tenant}-{i}", [-0.5], created=now() - 10 + i)
                # 15 tokens at 1/s: the bucket's key lives until it is full again, 15 s on
                stored = await first.save(tenant, record, tokens=5, tokens_per_s=1)
                assert stored is not None and not stored.spooled
                sizes[tenant] = stored.total
            for i in range(2):  # a ring of one: the second deletes the first (DEL in-script)
                refusal = make_record(f"cmpl-{tenant}-refused-{i}", [-0.5], created=now() + i)
                assert (await first.save_refusal(tenant, refusal, dumps(refusal), cap=None,
                                                 ring=1)).written
        for tenant in tenants:
            page = await second.list(tenant, 2)
            rest = await second.list(tenant, 2, after=page.last_id)
            assert [r["id"] for r in page.data + rest.data] == [
                f"cmpl-{tenant}-refused-1", *(f"cmpl-{tenant}-{i}" for i in (2, 1, 0))]
            assert await second.get(tenant, f"cmpl-{tenant}-refused-0") is None
            record, pttl = await second.get(tenant, f"cmpl-{tenant}-0")
            await second.add_replay(tenant, record["id"], {"replay_id": "rpl-1", "match": True},
                                    pttl)
            replayed, _ = await first.get(tenant, record["id"])
            assert replayed["replays"] == [{"replay_id": "rpl-1", "match": True}]
            assert (await second.stored(tenant)).total > sizes[tenant]
        client = cluster.client()
        keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
        slots: dict[str, set[int]] = {}
        for key in keys:
            tenant = key.decode().split("{", 1)[1].split("}", 1)[0]
            slots.setdefault(tenant, set()).add(client.keyslot(key))
        client.close()
        assert sorted(slots) == sorted(tenants)
        assert all(len(s) == 1 for s in slots.values()), slots
        # record, replays, index, total, expiries, buckets, refusal ring (+ the refusal)
        assert all(sum(1 for k in keys if f"{{{t}}}".encode() in k) == 10 for t in tenants)
        masters = {cluster.master_of(Keys(prefix).index(t)).port for t in tenants}
        assert len(masters) >= 2, masters

        # The buckets are one per tenant whichever client asks: 20 requests/s admits the
        # burst of 20 (and what refills meanwhile) out of 100 sent at once through both.
        lim = TenantLimits(requests_per_s=20)
        rates = [SharedRates(s, Keys(prefix)) for s in stores]
        t0 = time.monotonic()
        verdicts = await asyncio.gather(*(rates[i % 2].admit("tenant-0", lim, stores=False)
                                          for i in range(100)))
        elapsed = time.monotonic() - t0
        admitted = sum(not v.refused for v in verdicts)
        assert 20 <= admitted <= 20 + 20 * elapsed + 1, (admitted, elapsed)
    finally:
        client = cluster.client()
        keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
        for key in keys:
            client.delete(key)
        client.close()
        for store in stores:
            await store.aclose()


def test_a_record_is_acknowledged_once_a_replica_has_it(cluster, start_gateway, workers):
    """With the replica of the tenant's master stopped (SIGSTOP), a gateway that waits for
    one replica keeps every record in its spool too (durable on its disk, not on the master
    alone) and drains them once the replica answers again; one that does not wait
    (DETGATE_REDIS_WAIT_REPLICAS=0, the negative control) acknowledges them from the master
    alone."""
    waits = start_gateway(workers, redis=cluster.url,
                          env={"DETGATE_REDIS_WAIT_TIMEOUT_MS": "100"})
    alone = start_gateway(workers, redis=cluster.url, env={"DETGATE_REDIS_WAIT_REPLICAS": "0"})
    model = model_of(workers[0])
    cluster.wait_ok(pairs=True)
    master = cluster.master_of(Keys(waits.prefix).index("default"))
    replicas = cluster.replicas_of(master)
    assert len(replicas) == 1, cluster.state()
    for replica in replicas:
        os.kill(replica.proc.pid, signal.SIGSTOP)
    try:
        outcomes = [send(gw.url, body(model, i, stream=i % 2 == 0))
                    for gw in (waits, alone) for i in range(4)]
    finally:
        for replica in replicas:
            os.kill(replica.proc.pid, signal.SIGCONT)
    assert all(o["ok"] for o in outcomes), outcomes
    spooled = [gw.metric("detgate_records_total", result="spooled") for gw in (waits, alone)]
    stored = [gw.metric("detgate_records_total", result="stored") for gw in (waits, alone)]
    print(f"replica stopped: waiting gateway spooled {spooled[0]:.0f} of 4, stored "
          f"{stored[0]:.0f}; not waiting spooled {spooled[1]:.0f}, stored {stored[1]:.0f}")
    assert spooled == [4, 0] and stored == [0, 4]
    wait_drained(waits.url)
    client = cluster.client()
    try:
        for gw, batch in ((waits, outcomes[:4]), (alone, outcomes[4:])):
            keys = Keys(gw.prefix)
            assert all(client.get(keys.record("default", o["id"])) for o in batch)
    finally:
        client.close()


def test_a_cluster_master_killed_under_200_concurrent_requests(cluster, start_gateway,
                                                               workers):
    """200 requests at once from 3 tenants (both rates checked in Redis), the master of the
    busiest tenant's slot killed -9 after 40 answers: every request is answered (the spool
    takes the records while no master serves the slot, the per-process buckets the rates),
    and after the failover and the spool's drain every acknowledged record is in the
    cluster, listed and replayable."""
    limits = json.dumps({"*": {"requests_per_s": 1000, "tokens_per_s": 1e6}})
    gw = start_gateway(workers, redis=cluster.url, api_keys=KEYS,
                       env={"DETGATE_QUEUE_FACTOR": "4", "DETGATE_TENANT_LIMITS": limits})
    keys = Keys(gw.prefix)
    cluster.wait_ok(pairs=True)  # the victim has its replica (the test before stopped it)
    victim = cluster.master_of(keys.index("alice"))
    model = model_of(workers[0])
    tenants = ["alice", "alice", "bob", "carol"]
    payloads = [(body(model, i, stream=i % 2 == 1), TENANTS[tenants[i % 4]])
                for i in range(200)]
    killed_at: list[float] = []

    def kill(wait) -> None:
        wait(40)
        victim.kill()
        killed_at.append(time.monotonic())

    outcomes = _fire(gw.url, payloads, 200, kill)
    answered_s = time.monotonic() - killed_at[0]
    cluster.wait_ok()  # the victim's replica serves its slots
    failover_s = time.monotonic() - killed_at[0]
    victim.start()  # back, as a replica of the promoted one (a restarted pod)
    cluster.wait_ok(pairs=True)
    wait_drained(gw.url, timeout=120)
    drained_s = time.monotonic() - killed_at[0]
    ok = [(tenants[i % 4], o) for i, o in enumerate(outcomes) if o["ok"]]
    spooled = gw.metric("detgate_records_total", result="spooled")
    client = cluster.client()
    try:
        missing = [o["id"] for tenant, o in ok
                   if client.get(keys.record(tenant, o["id"])) is None]
    finally:
        client.close()
    print(f"cluster master killed: {len(ok)} of 200 acknowledged, {spooled:.0f} spooled, "
          f"{len(missing)} acknowledged records missing; all answered {answered_s:.1f} s, "
          f"failed over {failover_s:.1f} s, drained {drained_s:.1f} s after the kill")
    assert len(ok) == 200, [_why(o) for o in outcomes if not o["ok"]][:3]
    assert missing == []
    assert spooled > 0  # the outage was felt
    for tenant in ("alice", "bob", "carol"):
        with gw.http(TENANTS[tenant]) as http:
            listed = {r["id"] for r in http.get("/v1/requests?limit=1000").json()["data"]}
            assert {o["id"] for t, o in ok if t == tenant} <= listed
    rid = next(o["id"] for t, o in ok if t == "alice" and not o.get("stream"))
    with gw.http(TENANTS["alice"]) as http:
        replay = http.post(f"/replay/{rid}")
    assert replay.status_code == 200 and replay.json()["match"] is True, replay.text


def _why(outcome: dict) -> dict:
    """What a failed request was told: its status, record id and error body."""
    told = outcome.get("raw") or outcome.get("json")
    return {"status": outcome["status"], "id": outcome["id"], "told": told}


def _failover_under_load(gw, setup, proxy, model: str) -> tuple[list[dict], list[str]]:
    """80 requests, 16 at a time: after 20 answers the replicas' stream is held back, after
    30 more the master is killed -9. The answers, and the ids of acknowledged records the new
    master lacks once the spool drained."""
    def fault(wait) -> None:
        wait(20)
        proxy.hold()
        wait(30)
        setup.master.kill()

    payloads = [(body(model, i, stream=i % 2 == 0), None) for i in range(80)]
    outcomes = _fire(gw.url, payloads, 16, fault)
    new = setup.wait_failover()
    wait_drained(gw.url, timeout=60)
    keys = Keys(gw.prefix)
    with new.client() as client:
        missing = [o["id"] for o in outcomes
                   if o["ok"] and client.get(keys.record("default", o["id"])) is None]
    return outcomes, missing


def test_sentinel_failover_loses_no_acknowledged_record_without_wait_it_does(
        tmp_path, start_gateway, workers):
    """The master killed -9 under load while its replicas were behind: a gateway that waits
    for a replica acknowledged every record on one (or in its spool) and the new master has
    them all; one that does not wait (the negative control, side by side) acknowledged records
    the new master never got."""
    proxies: dict[int, HoldingProxy] = {}

    def through(master_port: int) -> int:
        proxies[master_port] = HoldingProxy(master_port).start()
        return proxies[master_port].port

    with ThreadPoolExecutor(2) as pool:
        setups = list(pool.map(lambda name: start_sentinel(tmp_path / name, through=through),
                               ("waits", "alone")))
    try:
        with ThreadPoolExecutor(2) as pool:
            waits, alone = pool.map(lambda pair: start_gateway(workers, redis=pair[0].url,
                                                               env=pair[1]),
                                    ((setups[0], {}),
                                     (setups[1], {"DETGATE_REDIS_WAIT_REPLICAS": "0"})))
        model = model_of(workers[0])
        with ThreadPoolExecutor(2) as pool:
            results = list(pool.map(
                lambda pair: _failover_under_load(*pair, proxies[pair[1].master.port], model),
                ((waits, setups[0]), (alone, setups[1]))))
    finally:
        for setup in setups:
            setup.stop()
        for proxy in proxies.values():
            proxy.stop()
    (outcomes, missing), (control, lost) = results
    acknowledged = sum(o["ok"] for o in outcomes)
    print(f"sentinel failover: waiting for a replica, {acknowledged} of 80 acknowledged, "
          f"{len(missing)} missing; not waiting, {sum(o['ok'] for o in control)} "
          f"acknowledged, {len(lost)} missing")
    assert acknowledged == 80 and missing == []
    assert len(lost) > 0  # negative control: acknowledged from the master alone, then lost
