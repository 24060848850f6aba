"""The gateway's one Redis client, whichever way Redis is deployed, chosen by DETGATE_REDIS_URL:

- `redis://[[user]:password@]host:port/db` (`rediss://` for TLS, `unix://path?db=N`): one
  Redis, through a blocking connection pool (under a burst a command waits for a connection
  instead of failing with "too many connections", which would read as Redis being down);
- `redis+cluster://[[user]:password@]host:port[,host:port...]` (`rediss+cluster://`): a Redis
  Cluster through redis-py's RedisCluster, the listed nodes being where it starts to learn
  the slots;
- `redis+sentinel://[[user]:password@]host:port[,host:port...]/MASTER[/db]`
  (`rediss+sentinel://`): the master that the listed sentinels name MASTER, through redis-py's
  Sentinel, which finds the new master after a failover. The URL's credentials are the
  master's; sentinels that need their own take `?sentinel_username=...&sentinel_password=...`.

Every key the gateway touches carries its tenant as a hash tag (gateway/keys.py), so each
script and each batch below runs on one slot, hence on one node of a cluster.

Durable writes (`run_durably`): with `wait_replicas` > 0, a record's script and a WAIT for
that many replicas go out together on one connection (one round trip): WAIT counts the
replicas that have every write this connection made, so an acknowledged record is on a
replica before the client is told success, and a failover (which promotes the most up-to-date
replica) keeps it. Fewer acknowledgements in `wait_timeout_ms` raise NotReplicated: the record
is then kept in the spool until a later write of it is replicated (gateway/recorder.py).

Availability: `up` is false from a failed command until a ping answers (the recorder's
watch); a command on a pooled connection that a restart of a single Redis closed is sent
once more on a new one. A cluster client retries nothing itself (a retried pipeline could
send its WAIT to another node and count another connection's writes): a failed command
marks Redis down, the spool and the per-process rate limits take over, and the next ping
re-reads the slots.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from urllib.parse import parse_qs, unquote, urlsplit

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisClusterException, RedisError

log = logging.getLogger("detgate.gateway")

STANDALONE, CLUSTER, SENTINEL = "standalone", "cluster", "sentinel"
_PORTS = {CLUSTER: 6379, SENTINEL: 26379}
_SENTINEL_AUTH = ("sentinel_username", "sentinel_password")
# Outside the blocking pool's or our own bound: a few connections for the cluster client's own
# topology reads.
_CLUSTER_SPARE = 8


class NotReplicated(RedisError):
    """The write is on the master (`reply`: its script's), but fewer replicas than asked
    acknowledged it in time."""

    def __init__(self, message: str, reply: object) -> None:
        super().__init__(message)
        self.reply = reply


@dataclass(frozen=True)
class RedisTarget:
    """DETGATE_REDIS_URL, parsed: how to reach Redis."""

    mode: str
    url: str
    nodes: tuple[tuple[str, int], ...] = ()
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    tls: bool = False
    master: str | None = None  # Sentinel's name of the master
    db: int = 0
    sentinel_auth: dict[str, str] = field(default_factory=dict, repr=False)

    @classmethod
    def parse(cls, url: str) -> RedisTarget:
        scheme, _, rest = url.partition("://")
        base, plus, mode = scheme.partition("+")
        if not plus:
            return cls(STANDALONE, url)  # redis-py reads it (redis, rediss, unix)
        if base not in ("redis", "rediss") or mode not in (CLUSTER, SENTINEL) or not rest:
            raise ValueError(f"DETGATE_REDIS_URL: unknown scheme {scheme!r} (redis://, "
                             "redis+cluster://, redis+sentinel://, and rediss for TLS)")
        parts = urlsplit(f"{base}://{rest}")
        userinfo, _, hosts = parts.netloc.rpartition("@")
        username, _, password = userinfo.partition(":")
        nodes = tuple(_host_port(h, _PORTS[mode]) for h in hosts.split(",") if h.strip())
        if not nodes:
            raise ValueError("DETGATE_REDIS_URL: no host")
        query = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
        allowed = _SENTINEL_AUTH if mode == SENTINEL else ()
        unknown = sorted(set(query) - set(allowed))
        if unknown:
            raise ValueError(f"DETGATE_REDIS_URL: unknown option(s) {', '.join(unknown)}")
        path = [unquote(p) for p in parts.path.split("/") if p]
        master, db = None, 0
        if mode == SENTINEL:
            if not path or len(path) > 2:
                raise ValueError("DETGATE_REDIS_URL: redis+sentinel://HOSTS/MASTER[/DB]")
            master = path[0]
            db = _db(path[1]) if len(path) == 2 else 0
        elif path and _db(path[0]) != 0 or len(path) > 1:
            raise ValueError("DETGATE_REDIS_URL: a Redis Cluster has database 0 only")
        return cls(mode, url, nodes, unquote(username) or None,
                   unquote(password) if userinfo else None, base == "rediss", master, db,
                   {k: v for k, v in query.items() if v})

    @property
    def replicated(self) -> bool:
        """Deployments whose masters have replicas to fail over to."""
        return self.mode != STANDALONE


def _host_port(entry: str, default: int) -> tuple[str, int]:
    entry = entry.strip()
    host, port = entry, default
    if entry.startswith("["):  # [v6 address]:port
        host, _, tail = entry[1:].partition("]")
        if tail:
            port = int(tail.removeprefix(":"))
    elif ":" in entry:
        host, _, raw = entry.rpartition(":")
        port = int(raw)
    if not host or not 0 < port < 65536:
        raise ValueError(f"DETGATE_REDIS_URL: bad host {entry!r}")
    return host, port


def _db(text: str) -> int:
    if not text.isdigit():
        raise ValueError(f"DETGATE_REDIS_URL: database {text!r} is not a number")
    return int(text)


class _BlockingSentinelPool(SentinelConnectionPool, aioredis.BlockingConnectionPool):
    """Sentinel's master discovery with the blocking pool's wait for a free connection."""


class ClientFailure(RedisError):
    """A failure of Redis that the client raises outside RedisError, made one as every other
    failure of Redis is: the cluster client's own exceptions (a slot that no node serves
    during a failover, ...), uvloop's RuntimeError on a connection whose peer has gone
    (uvloop issue 506: where asyncio's transport raises OSError, uvloop's raises
    RuntimeError; seen when a cluster master was killed under load), and the AttributeError
    or TypeError of a write on a connection that another task has just torn down (redis-py
    issues 3546 and 4287: `'NoneType' object has no attribute 'writelines'` when a cluster
    master was killed under 200 concurrent requests; redis-py 8.2 raises ConnectionError for a
    cleared writer, older versions and some Pythons still leak these), when raised inside the
    client."""


def _raised_in_client(tb) -> bool:
    """Whether a traceback runs through the redis package: the error came from inside the
    client, not from our own code around the call."""
    while tb is not None:
        if tb.tb_frame.f_globals.get("__name__", "").startswith("redis."):
            return True
        tb = tb.tb_next
    return False


class _Slot:
    """Around every command: a place under the bound (a cluster's; None: the pool's own), and
    the client's failures outside RedisError turned into one (ClientFailure)."""

    __slots__ = ("bound",)

    def __init__(self, bound: asyncio.Semaphore | None) -> None:
        self.bound = bound

    async def __aenter__(self) -> None:
        if self.bound is not None:
            await self.bound.acquire()

    async def __aexit__(self, kind, exc, tb) -> bool:
        if self.bound is not None:
            self.bound.release()
        if isinstance(exc, RedisClusterException | RuntimeError) or (
                isinstance(exc, AttributeError | TypeError) and _raised_in_client(tb)):
            raise ClientFailure(f"{type(exc).__name__}: {exc}") from exc
        return False


class Store:
    """The client and the few operations whose form differs by deployment. Every call may
    raise RedisError or OSError; `up` follows them."""

    def __init__(self, target: RedisTarget, *, timeout_s: float, max_connections: int = 64,
                 wait_replicas: int = 0, wait_timeout_ms: int = 200) -> None:
        self.target = target
        self.wait_replicas = wait_replicas
        self.wait_timeout_ms = wait_timeout_ms
        self.timeout_s = timeout_s
        self.up = True
        conn = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s}
        # One more try on a new connection when a pooled one was closed (a restart).
        retry = Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,))
        self._slot = _Slot(None)
        self.sentinel: Sentinel | None = None
        if target.mode == STANDALONE:
            pool = aioredis.BlockingConnectionPool.from_url(
                target.url, max_connections=max_connections, timeout=timeout_s, retry=retry,
                **conn)
            self.client = aioredis.Redis.from_pool(pool)
        elif target.mode == SENTINEL:
            auth = {"username": target.username, "password": target.password}
            sentinel_auth = {k.removeprefix("sentinel_"): v
                             for k, v in target.sentinel_auth.items()}
            self.sentinel = Sentinel(list(target.nodes), min_other_sentinels=0,
                                     sentinel_kwargs={**conn, "ssl": target.tls,
                                                      **sentinel_auth},
                                     ssl=target.tls, **conn, **auth)
            self.client = self.sentinel.master_for(
                target.master, connection_pool_class=_BlockingSentinelPool,
                max_connections=max_connections, timeout=timeout_s, retry=retry, db=target.db)
        else:
            # The async cluster client raises at its per-node connection bound instead of
            # waiting: commands wait here instead, at most one connection each per node.
            self._slot = _Slot(asyncio.Semaphore(max_connections))
            self.client = RedisCluster(
                startup_nodes=[ClusterNode(h, p) for h, p in target.nodes],
                username=target.username, password=target.password, ssl=target.tls,
                require_full_coverage=False, retry=Retry(NoBackoff(), 0),
                max_connections=max_connections + _CLUSTER_SPARE, **conn)

    def mark_down(self, exc: BaseException) -> None:
        if self.up:
            log.warning("redis unavailable: %s", exc)
        self.up = False

    async def ping(self) -> bool:
        try:
            async with self._slot:
                if isinstance(self.client, RedisCluster):
                    await self.client.ping(target_nodes=RedisCluster.PRIMARIES)
                else:
                    await self.client.ping()
        except (RedisError, OSError, TimeoutError) as exc:
            self.mark_down(exc)
            return False
        if not self.up:
            log.warning("redis reachable again")
        self.up = True
        return True

    def script(self, lua: str) -> aioredis.client.AsyncScript:  # type: ignore[name-defined]
        return self.client.register_script(lua)

    async def run(self, script, keys: list[str], args: list) -> object:
        """One script on the slot of its keys (NOSCRIPT: loaded and sent again)."""
        async with self._slot:
            try:
                return await self.client.execute_command(
                    "EVALSHA", script.sha, len(keys), *keys, *args)
            except NoScriptError:  # a new master (a failover) or a flushed script cache
                await self.client.script_load(script.script)
                return await self.client.execute_command(
                    "EVALSHA", script.sha, len(keys), *keys, *args)

    async def run_durably(self, script, keys: list[str], args: list) -> object:
        """`run`, then WAIT for `wait_replicas` on the same connection, in one round trip;
        NotReplicated when fewer acknowledged."""
        if self.wait_replicas <= 0:
            return await self.run(script, keys, args)
        async with self._slot:
            try:
                reply, acked = await self._with_wait(script, keys, args)
            except NoScriptError:
                await self.client.script_load(script.script)
                reply, acked = await self._with_wait(script, keys, args)
        if acked < self.wait_replicas:
            raise NotReplicated(f"{acked} of {self.wait_replicas} replica(s) acknowledged "
                                f"within {self.wait_timeout_ms} ms", reply)
        return reply

    async def _with_wait(self, script, keys: list[str], args: list) -> tuple[object, int]:
        # Both commands on one connection: in a cluster pinned to the node of the keys' slot
        # (a slot that moved meanwhile answers MOVED, raised, not followed elsewhere).
        pin = {}
        if isinstance(self.client, RedisCluster):
            await self.client.initialize()  # the slots, read on first use or after a failure
            pin = {"target_nodes": self.client.get_node_from_key(keys[0])}
        async with self.client.pipeline(transaction=False) as pipe:
            pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *args, **pin)
            pipe.execute_command("WAIT", self.wait_replicas, self.wait_timeout_ms, **pin)
            if isinstance(self.client, RedisCluster):
                reply, acked = await pipe.execute(allow_redirections=False)
            else:
                reply, acked = await pipe.execute()
        return reply, int(acked)

    async def batch(self, commands: list[tuple]) -> list:
        """Commands on one slot, pipelined (not a transaction): one round trip."""
        async with self._slot, self.client.pipeline(transaction=False) as pipe:
            for command in commands:
                pipe.execute_command(*command)
            return await pipe.execute()

    async def call(self, *command) -> object:
        async with self._slot:
            return await self.client.execute_command(*command)

    async def aclose(self) -> None:
        await self.client.aclose()
        if self.sentinel is not None:
            for sentinel in self.sentinel.sentinels:
                await sentinel.aclose()
