"""Real Redis deployments for tests, each in its own temporary folder on free ports: a Redis
Cluster (masters with a replica each, made by `redis-cli --cluster create`) and a Sentinel
setup (a master, a replica, sentinels). Nothing here touches the shared Redis on 6379.

Every server runs with `appendonly no` and no snapshots: what a killed master held survives
only on its replica, which is exactly what a failover test must measure.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import redis

from tests.support.procs import free_port

MASTER_NAME = "detgate-test"


def missing_tools() -> str | None:
    """Why these deployments cannot run here (None: they can)."""
    absent = [tool for tool in ("redis-server", "redis-cli") if shutil.which(tool) is None]
    return f"{' and '.join(absent)} not installed" if absent else None


def _wait(condition, what: str, timeout: float = 30.0,
          state: Callable[[], str] | None = None) -> None:
    """Poll `condition` until true; past `timeout`, TimeoutError with `state()` (what the
    servers say now) in its message."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if condition():
                return
        except (redis.RedisError, OSError):
            pass
        if time.monotonic() > deadline:
            seen = ""
            if state is not None:
                try:
                    seen = f"; the servers say:\n{state()}"
                except (redis.RedisError, OSError) as exc:
                    seen = f"; the servers did not answer ({exc!r})"
            raise TimeoutError(f"{what} not within {timeout:g}s{seen}")
        time.sleep(0.05)


def _free_ports(n: int) -> list[int]:
    """n distinct free ports. Each free_port() is released as soon as it is found, so two
    calls may return the same one; a cluster node given another node's bus port cannot bind."""
    ports: list[int] = []
    while len(ports) < n:
        if (port := free_port()) not in ports:
            ports.append(port)
    return ports


@dataclass
class Server:
    """One redis-server (or redis-sentinel) process."""

    port: int
    folder: Path
    args: list[str]
    proc: subprocess.Popen | None = None

    def start(self) -> Server:
        self.folder.mkdir(parents=True, exist_ok=True)
        log = open(self.folder / "server.log", "ab")  # noqa: SIM115 - the process holds it
        self.proc = subprocess.Popen(["redis-server", *self.args], cwd=self.folder,
                                     stdout=log, stderr=subprocess.STDOUT)
        log.close()
        _wait(self._answers, f"redis-server on {self.port}")
        return self

    def _answers(self) -> bool:
        if self.proc.poll() is not None:  # no use waiting: say why it ended
            tail = (self.folder / "server.log").read_text(errors="replace")[-1500:]
            raise RuntimeError(f"redis-server on {self.port} exited "
                               f"({self.proc.returncode}):\n{tail}")
        return bool(self.client().ping())

    def client(self, **kwargs) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2, **kwargs)

    def info(self, section: str) -> dict:
        with self.client() as client:
            return client.info(section)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL: no shutdown, no save."""
        if self.alive:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.alive:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


def _base_args(port: int) -> list[str]:
    return ["--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--protected-mode", "no"]


@dataclass
class Cluster:
    """`masters` masters with one replica each; `url` is the gateway's form of it."""

    servers: list[Server]
    node_timeout_ms: int

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{s.port}" for s in self.servers[:3])

    def client(self) -> redis.RedisCluster:
        return redis.RedisCluster(host="127.0.0.1", port=self.alive()[0].port, socket_timeout=2)

    def alive(self) -> list[Server]:
        return [s for s in self.servers if s.alive]

    def master_of(self, key: str) -> Server:
        """The server that holds `key`'s slot now."""
        with self.client() as client:
            node = client.get_node_from_key(key)
        return next(s for s in self.servers if s.port == int(node.port))

    def replicas_of(self, master: Server) -> list[Server]:
        """The replicas `master` itself lists as connected (its view, the one WAIT counts)."""
        info = master.info("replication")
        ports = {int(info[f"slave{i}"]["port"]) for i in range(info["connected_slaves"])}
        return [s for s in self.servers if s.port in ports]

    def state(self) -> str:
        """CLUSTER NODES as the first live node sees it: for a failure's message."""
        with self.alive()[0].client() as client:
            nodes = client.execute_command("CLUSTER", "NODES")
        return nodes.decode() if isinstance(nodes, bytes) else str(nodes)

    def wait_ok(self, timeout: float = 30.0, *, pairs: bool = False) -> None:
        """Every live node sees the cluster ok, every slot served by a live master (after a
        master was killed: once its replica took over), and every live replica in sync.
        `pairs`: also every master with exactly one replica connected, as the cluster was
        made (a test that stops or kills a master's replica needs that shape: on a loaded
        machine a node can miss the node timeout, fail over and come back elsewhere)."""
        def ok() -> bool:
            for server in self.alive():
                with server.client() as client:
                    if client.cluster("info")["cluster_state"] != "ok":
                        return False
                    slots = client.cluster("slots")
                if any(int(r[2][1]) not in {s.port for s in self.alive()} for r in slots):
                    return False
                info = server.info("replication")
                if info["role"] == "slave" and info["master_link_status"] != "up":
                    return False
                if pairs and info["role"] == "master" and info["connected_slaves"] != 1:
                    return False
            return True
        _wait(ok, "cluster state ok" + (", a replica per master" if pairs else ""), timeout,
              self.state)

    def stop(self) -> None:
        for server in self.servers:
            server.stop()


def start_cluster(folder: Path, masters: int = 3, node_timeout_ms: int = 2000) -> Cluster:
    """`masters` masters and as many replicas; a replica is promoted `node_timeout_ms` (and an
    election) after its master stops answering."""
    servers = []
    ports = _free_ports(4 * masters)
    for i in range(2 * masters):
        # The bus port apart (port + 10000 may not exist), and none shared with another node.
        port, bus = ports[2 * i], ports[2 * i + 1]
        servers.append(Server(port, folder / f"node-{i}", [
            *_base_args(port), "--cluster-enabled", "yes", "--cluster-port", str(bus),
            "--cluster-config-file", "nodes.conf",
            "--cluster-node-timeout", str(node_timeout_ms),
            # A replica takes over however far behind it is: the gateway's WAIT, not this,
            # decides what was acknowledged.
            "--cluster-replica-validity-factor", "0"]))
    cluster = Cluster(servers, node_timeout_ms)
    try:
        for server in servers:
            server.start()
        subprocess.run(["redis-cli", "--cluster", "create",
                        *(f"127.0.0.1:{s.port}" for s in servers),
                        "--cluster-replicas", "1", "--cluster-yes"],
                       check=True, capture_output=True, timeout=60)
        cluster.wait_ok(pairs=True)
    except BaseException:
        cluster.stop()
        raise
    return cluster


@dataclass
class SentinelSetup:
    """A master, its replicas, and sentinels watching it under MASTER_NAME."""

    master: Server
    replicas: list[Server]
    sentinels: list[Server] = field(default_factory=list)

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://{hosts}/{MASTER_NAME}"

    def servers(self) -> list[Server]:
        return [self.master, *self.replicas]

    def _named_master(self) -> Server | None:
        """The replica every live sentinel names the master, if it answers as one."""
        ports = set()
        for sentinel in self.sentinels:
            if sentinel.alive:
                with sentinel.client() as client:
                    ports.add(int(client.sentinel_get_master_addr_by_name(MASTER_NAME)[1]))
        server = next((s for s in self.replicas if s.port in ports), None)
        if len(ports) != 1 or server is None:
            return None
        if server.alive and server.info("replication")["role"] == "master":
            return server
        return None

    def wait_failover(self, timeout: float = 30.0) -> Server:
        """The new master, once the sentinels promoted one and every other live server
        replicates from it."""
        new: list[Server] = []

        def done() -> bool:
            master = self._named_master()
            if master is None:
                return False
            new[:] = [master]
            for server in self.servers():
                if server is not master and server.alive:
                    info = server.info("replication")
                    if info.get("master_port") != master.port \
                            or info.get("master_link_status") != "up":
                        return False
            return True
        _wait(done, "a failover", timeout)
        return new[0]

    def stop(self) -> None:
        for server in (*self.sentinels, *self.replicas, self.master):
            server.stop()


def start_sentinel(folder: Path, *, replicas: int = 2, sentinels: int = 3,
                   down_after_ms: int = 500,
                   through: Callable[[int], int] | None = None) -> SentinelSetup:
    """`through(master_port)`: the port at which the master is reached, by its replicas, the
    sentinels and so the clients (a proxy in front of it, to hold its replication stream
    back); its own by default. Once the master fails, the sentinels name a replica at its own
    address."""
    master_port, *replica_ports = _free_ports(1 + replicas)
    source = through(master_port) if through else master_port
    master = Server(master_port, folder / "master", _base_args(master_port))
    setup = SentinelSetup(master, [Server(port, folder / f"replica-{i}", [
        *_base_args(port), "--replicaof", "127.0.0.1", str(source),
        # A replica tells the master (and so the sentinels) where it really listens.
        "--replica-announce-ip", "127.0.0.1", "--replica-announce-port", str(port)])
        for i, port in enumerate(replica_ports)])
    try:
        master.start()
        for replica in setup.replicas:
            replica.start()
        _wait(lambda: all(r.info("replication")["master_link_status"] == "up"
                          for r in setup.replicas), "replicas in sync")
        quorum = sentinels // 2 + 1
        for i in range(sentinels):
            port = free_port()
            conf = folder / f"sentinel-{i}" / "sentinel.conf"
            conf.parent.mkdir(parents=True)
            conf.write_text(
                f"port {port}\nbind 127.0.0.1\nprotected-mode no\n"
                f"sentinel monitor {MASTER_NAME} 127.0.0.1 {source} {quorum}\n"
                f"sentinel down-after-milliseconds {MASTER_NAME} {down_after_ms}\n"
                f"sentinel failover-timeout {MASTER_NAME} 5000\n"
                f"sentinel parallel-syncs {MASTER_NAME} {replicas}\n")
            setup.sentinels.append(
                Server(port, conf.parent, [str(conf), "--sentinel"]).start())

        # Each sentinel knows the replicas and the other sentinels before a test kills anything.
        def known() -> bool:
            for sentinel in setup.sentinels:
                with sentinel.client() as client:
                    state = client.sentinel_master(MASTER_NAME)
                if state["num-slaves"] < replicas \
                        or state["num-other-sentinels"] < sentinels - 1:
                    return False
            return True
        _wait(known, "sentinels that know the replicas and each other")
    except BaseException:
        setup.stop()
        raise
    return setup
