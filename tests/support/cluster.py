"""A local Redis Cluster for tests: :class:`LocalCluster`, the session-wide ``redis_cluster``
and the per-test ``cluster_url`` (emptied before and after), imported by the test modules that
use them (``from tests.support.cluster import cluster_url, redis_cluster``, named in ``__all__``)."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from celery_delayq.devtools.embedded import EmbeddedRedis
from tests.support.polling import wait_for


class LocalCluster:
    """``masters`` primaries (each with ``replicas`` replicas) of ``redis-server
    --cluster-enabled yes`` on free loopback ports <= 55535 (a node's bus port is port + 10000),
    joined with ``redis-cli --cluster create``; ``url`` names the first node."""

    #: With replicas: short, so that the failover tests see a primary replaced in seconds.
    #: Without: long, so that a node stalled by a loaded machine is never marked FAIL (with no
    #: replica to promote, its slots would stay down for the rest of the session).
    NODE_TIMEOUT_MS = 2000
    NODE_TIMEOUT_NO_REPLICAS_MS = 15000

    def __init__(self, masters: int = 3, replicas: int = 0, use_cli: bool = True) -> None:
        self.masters = masters
        self.replicas = replicas
        self.node_timeout_ms = self.NODE_TIMEOUT_MS if replicas else self.NODE_TIMEOUT_NO_REPLICAS_MS
        self.use_cli = use_cli  # False, or no redis-cli on PATH: joined with redis-py
        self.nodes: list[EmbeddedRedis] = []
        self._shared: Any = None

    @property
    def url(self) -> str:
        return self.nodes[0].url

    @staticmethod
    def _free_pair() -> int:
        """A port whose bus port (+10000) is free too."""
        import socket

        from celery_delayq.devtools.embedded import free_port

        for _ in range(100):
            port = free_port(max_port=55535)
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind(("127.0.0.1", port + 10000))
                except OSError:
                    continue
            return port
        raise RuntimeError("no free port pair for a cluster node")

    def start(self, timeout: float = 60.0) -> LocalCluster:
        count = self.masters * (1 + self.replicas)
        ports: list[int] = []
        while len(ports) < count:
            port = self._free_pair()
            if port not in ports:
                ports.append(port)
        try:
            for port in ports:
                node = EmbeddedRedis(
                    port=port,
                    extra_args=[
                        "--cluster-enabled",
                        "yes",
                        "--cluster-config-file",
                        f"nodes-{port}.conf",
                        "--cluster-node-timeout",
                        str(self.node_timeout_ms),
                    ],
                )
                self.nodes.append(node.start())
            if self.use_cli and shutil.which("redis-cli"):
                subprocess.run(
                    [
                        "redis-cli",
                        "--cluster",
                        "create",
                        *(f"127.0.0.1:{p}" for p in ports),
                        "--cluster-replicas",
                        str(self.replicas),
                        "--cluster-yes",
                    ],
                    check=True,
                    capture_output=True,
                    timeout=timeout,
                )
            else:
                self._create(timeout)
            self.wait_ok(timeout, replicas=self.masters * self.replicas)
        except BaseException:
            self.stop()
            raise
        return self

    def _create(self, timeout: float) -> None:
        """What ``redis-cli --cluster create`` does, with redis-py: slots in equal ranges to
        the first ``masters`` nodes, MEET, then each other node replicates a primary."""
        clients = [self.node_client(node) for node in self.nodes]
        try:
            per = 16384 // self.masters
            for i, client in enumerate(clients[: self.masters]):
                last = 16383 if i == self.masters - 1 else (i + 1) * per - 1
                client.execute_command("CLUSTER", "ADDSLOTS", *range(i * per, last + 1))
            for node in self.nodes[1:]:
                clients[0].execute_command("CLUSTER", "MEET", "127.0.0.1", node.port)
            known = wait_for(
                lambda: all(int(c.cluster("info")["cluster_known_nodes"]) == len(clients) for c in clients),
                timeout,
                0.1,
            )
            assert known, "the nodes did not meet"
            ids = [c.execute_command("CLUSTER", "MYID") for c in clients[: self.masters]]
            for j, client in enumerate(clients[self.masters :]):

                def replicate(client: redis.Redis = client, master: str = ids[j % self.masters]) -> bool:
                    try:
                        client.execute_command("CLUSTER", "REPLICATE", master)
                    except redis.ResponseError:
                        return False  # the master is not known to it yet
                    return True

                assert wait_for(replicate, timeout, 0.1), "a replica could not attach"
        finally:
            for client in clients:
                client.close()

    def node_client(self, node: EmbeddedRedis) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=node.port, decode_responses=True, socket_timeout=5)

    def alive(self) -> list[EmbeddedRedis]:
        return [n for n in self.nodes if n.process is not None and n.process.poll() is None]

    def state(self) -> dict[int, dict[str, Any]]:
        """Per live node: its ``CLUSTER INFO``, its role and (for a replica) its link status."""
        out: dict[int, dict[str, Any]] = {}
        for node in self.alive():
            client = self.node_client(node)
            try:
                info = client.cluster("info")
                replication = client.info("replication")
                out[node.port] = {
                    **info,
                    "role": replication["role"],
                    "link": replication.get("master_link_status"),
                }
            except redis.RedisError:
                out[node.port] = {"cluster_state": "unreachable"}
            finally:
                client.close()
        return out

    def wait_ok(self, timeout: float, replicas: int = 0) -> dict[int, dict[str, Any]]:
        """Until every live node says ``cluster_state:ok``, ``masters`` primaries serve slots
        and at least ``replicas`` replicas have their link up; the last state seen."""
        last: dict[int, dict[str, Any]] = {}

        def ok() -> bool:
            nonlocal last
            last = self.state()
            primaries = [s for s in last.values() if s.get("role") == "master"]
            linked = [s for s in last.values() if s.get("role") == "slave" and s.get("link") == "up"]
            return (
                all(s.get("cluster_state") == "ok" for s in last.values())
                and len(primaries) == self.masters
                and all(int(s.get("cluster_known_nodes", 0)) >= len(self.nodes) for s in last.values())
                and len(linked) >= replicas
            )

        if not wait_for(ok, timeout, 0.1):
            raise RuntimeError(f"the cluster did not become ok in {timeout} s: {last}")
        return last

    def client(self) -> Any:
        from redis.cluster import RedisCluster

        return RedisCluster.from_url(self.url, decode_responses=True)

    def shared_client(self) -> Any:
        """One :meth:`client` for the cluster's life, for the fixtures (a new RedisCluster
        asks every node for its slots and ``COMMAND``: some 20 ms each on a loaded machine).
        Not to be closed by its users: :meth:`stop` closes it."""
        if self._shared is None:
            self._shared = self.client()
        return self._shared

    def stop(self) -> None:
        if self._shared is not None:
            self._shared.close()
            self._shared = None
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


#: Where the session's cluster is kept: each test module that imports :func:`redis_cluster`
#: registers a fixture of its own, and all of them share the one cluster.
_SESSION_CLUSTER = pytest.StashKey[LocalCluster]()


@pytest.fixture(scope="session")
def redis_cluster(request: pytest.FixtureRequest) -> Iterator[LocalCluster]:
    """A cluster of three primaries (no replicas) for the whole session, started by the first
    test that asks for it (a test module imports this fixture, and ``cluster_url``, by name)."""
    stash = request.config.stash
    if _SESSION_CLUSTER in stash:
        yield stash[_SESSION_CLUSTER]
        return
    with LocalCluster(masters=3) as cluster:
        stash[_SESSION_CLUSTER] = cluster
        try:
            yield cluster
        finally:
            del stash[_SESSION_CLUSTER]


@pytest.fixture
def cluster_url(redis_cluster: LocalCluster) -> Iterator[str]:
    """URL of the session cluster's first node (any node will do), empty before and after."""
    client = redis_cluster.shared_client()
    client.flushall()
    yield redis_cluster.url
    client.flushall()
