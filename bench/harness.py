"""What every row uses: Redis servers, worker/beat processes, producer apps, fills, sampling.

Every Redis server is a throwaway :class:`~celery_delayq.devtools.embedded.EmbeddedRedis` on a free
loopback port (never 6379). Every ``celery worker``/``celery beat`` runs ``bench.app`` in its
own process group and is registered here; :meth:`Context.cleanup` stops them all, and the
servers, whatever happened (it also runs at exit and on SIGTERM/SIGINT).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import redis
from celery import Celery
from celery.utils import uuid

from celery_delayq import DelayedTask
from celery_delayq.devtools.embedded import EmbeddedRedis

from .jobs import REAL, call_of, fields, job_call, markers

ROOT = Path(__file__).resolve().parent.parent
APP_MODULE = "bench.app"
TASK_NAME = "bench.job"
STARTS_KEY = "bench:starts"
#: The worker pool of every row but the steady-lateness one.
WORKER_POOL = ("-P", "threads", "-c", "8")
#: Time for a worker or beat to start on a loaded 2-core machine.
STARTUP_TIMEOUT = 60.0


class BenchError(RuntimeError):
    """A row could not be measured (a process died, a wait timed out)."""


# -- sizes -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sizes:
    """How big each row is. ``default`` fits 10 minutes on 2 cores; ``quick`` about three."""

    produce_seconds: float  # rows 1-2: seconds per timed loop
    many_jobs: int  # row 2: jobs scheduled with apply_at_many
    dispatch_jobs: int  # row 3: jobs due at once
    rabbit_jobs: int  # row 4
    steady_seconds: float  # row 5: seconds at 1,000 jobs/s
    steady_grace: float  # row 5: seconds Celery ETA's runs get past the last due time
    burst_jobs: int  # row 6: delayq jobs due in one second
    eta_jobs: int  # rows 6, 9, 10: Celery ETA tasks (the slow baseline)
    idle_seconds: float  # row 7
    wake_tries: int  # row 8
    rss_jobs: int  # row 9: jobs pending in delayq
    memory_jobs: int  # row 10: jobs stored in delayq
    scale_small: int  # row 11: pending (not due) in the small store
    scale_large: int  # row 11: pending (not due) in the large store
    scale_due: int  # row 11: jobs due
    spark_rows: int  # row 12: rows written by Spark (and by the plain writer)
    web_jobs: int  # row web: jobs pending while the dashboard's pages are timed
    web_requests: int  # row web: loads of each page
    web_refreshes: int  # row web: live refreshes of each open page in the window counted
    cluster_jobs: int  # row cluster_dispatch: jobs due at once on a 3-primary cluster


DEFAULT = Sizes(
    produce_seconds=3.0,
    many_jobs=50_000,
    dispatch_jobs=300_000,
    rabbit_jobs=50_000,
    steady_seconds=60.0,
    steady_grace=30.0,
    burst_jobs=100_000,
    eta_jobs=20_000,
    idle_seconds=60.0,
    wake_tries=200,
    rss_jobs=100_000,
    memory_jobs=100_000,
    scale_small=10_000,
    scale_large=1_000_000,
    scale_due=100_000,
    spark_rows=200_000,
    web_jobs=1_000_000,
    web_requests=50,
    web_refreshes=6,
    cluster_jobs=200_000,
)
QUICK = Sizes(
    produce_seconds=0.5,
    many_jobs=5_000,
    dispatch_jobs=20_000,
    rabbit_jobs=5_000,
    steady_seconds=5.0,
    steady_grace=30.0,
    burst_jobs=10_000,
    eta_jobs=1_000,
    idle_seconds=8.0,
    wake_tries=30,
    rss_jobs=10_000,
    memory_jobs=5_000,
    scale_small=1_000,
    scale_large=100_000,
    scale_due=5_000,
    spark_rows=5_000,
    web_jobs=20_000,
    web_requests=5,
    web_refreshes=1,
    cluster_jobs=20_000,
)
#: The smoke test's sizes (``--smoke``, tests/test_bench.py): every row runs to its end, in
#: about half the time of ``--quick``; its figures are too small to compare with anything.
SMOKE = Sizes(
    produce_seconds=0.3,
    many_jobs=1_000,
    dispatch_jobs=3_000,
    rabbit_jobs=1_000,
    steady_seconds=2.0,
    steady_grace=5.0,
    burst_jobs=2_000,
    eta_jobs=300,
    idle_seconds=5.0,
    wake_tries=10,
    rss_jobs=2_000,
    memory_jobs=1_000,
    scale_small=300,
    scale_large=10_000,
    scale_due=1_000,
    spark_rows=1_000,
    web_jobs=3_000,
    web_requests=3,
    web_refreshes=1,
    cluster_jobs=3_000,
)
#: The issue's sizes, where the default mode has to cut (takes about 20 minutes).
FULL = Sizes(
    produce_seconds=5.0,
    many_jobs=100_000,
    dispatch_jobs=1_000_000,
    rabbit_jobs=100_000,
    steady_seconds=60.0,
    steady_grace=30.0,
    burst_jobs=1_000_000,
    eta_jobs=100_000,
    idle_seconds=60.0,
    wake_tries=200,
    rss_jobs=100_000,
    memory_jobs=100_000,
    scale_small=10_000,
    scale_large=10_000_000,
    scale_due=100_000,
    spark_rows=1_000_000,
    web_jobs=1_000_000,
    web_requests=50,
    web_refreshes=12,
    cluster_jobs=1_000_000,
)


# -- processes -------------------------------------------------------------------------------


@dataclass
class Child:
    """One ``celery worker``/``celery beat`` process of ``bench.app``."""

    kind: str
    proc: subprocess.Popen[bytes]
    log: Path
    ready_file: Path | None = None
    publish_log: Path | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


@dataclass
class Context:
    """One benchmark run: its sizes, its folder, and everything it started."""

    sizes: Sizes
    mode: str
    selected: list[str] = field(default_factory=list)
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="delayq-bench-")))
    started: float = field(default_factory=time.monotonic)
    children: list[Child] = field(default_factory=list)
    servers: list[EmbeddedRedis] = field(default_factory=list)
    cache: dict[str, Any] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _count: int = 0

    # -- progress ----------------------------------------------------------------------------

    def say(self, message: str) -> None:
        print(f"[{time.monotonic() - self.started:7.1f}s] {message}", file=sys.stderr, flush=True)

    # -- Redis -------------------------------------------------------------------------------

    def redis(self) -> EmbeddedRedis:
        """A new empty Redis server on a free loopback port (stopped by :meth:`cleanup`)."""
        server = EmbeddedRedis()
        with self._lock:
            self.servers.append(server)
        return server.start()

    def stop_redis(self, server: EmbeddedRedis) -> None:
        with contextlib.suppress(Exception):
            server.stop()
        with self._lock:
            if server in self.servers:
                self.servers.remove(server)

    # -- celery processes --------------------------------------------------------------------

    def _next(self) -> int:
        with self._lock:
            self._count += 1
            return self._count

    def _spawn(
        self,
        kind: str,
        args: list[str],
        env: dict[str, str],
        log: Path,
        ready_file: Path | None = None,
        publish_log: Path | None = None,
    ) -> Child:
        cmd = [sys.executable, "-m", "celery", "-A", APP_MODULE, kind, *args]
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                cmd,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=str(ROOT),
                start_new_session=True,  # its own process group: stopped as a whole
            )
        child = Child(kind, proc, log, ready_file, publish_log)
        with self._lock:
            self.children.append(child)
        return child

    def _env(self, broker: str, store: str, conf: dict[str, Any] | None, **extra: str) -> dict[str, str]:
        import json

        env = dict(os.environ)
        env.update(
            BENCH_BROKER=broker,
            BENCH_STORE=store,
            BENCH_CONF=json.dumps(conf or {}),
            PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
            PYTHONUNBUFFERED="1",
        )
        env.pop("BENCH_READY_FILE", None)
        env.pop("BENCH_PUBLISH_LOG", None)
        env.update(extra)
        return env

    def start_worker(
        self,
        broker: str,
        store: str,
        conf: dict[str, Any] | None = None,
        queue: str | None = None,
        pool: Sequence[str] = WORKER_POOL,
    ) -> Child:
        """A ``celery worker``, by default ``-P threads -c 8`` (one process: its RSS is all of it)."""
        n = self._next()
        ready = self.workdir / f"worker-{n}.ready"
        env = self._env(broker, store, conf, BENCH_READY_FILE=str(ready))
        args = [
            "-l",
            "warning",
            *pool,
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
            "-n",
            f"bench{n}@%h",
        ]
        if queue:
            args += ["-Q", queue]
        return self._spawn("worker", args, env, self.workdir / f"worker-{n}.log", ready_file=ready)

    def start_beat(
        self, broker: str, store: str, conf: dict[str, Any] | None = None, publish_log: bool = False
    ) -> Child:
        """A ``celery beat -S celery_delayq.Scheduler``; with ``publish_log``, ``-S
        bench.app.RecordingScheduler``, the same with the dispatcher's lateness record kept
        (see :mod:`bench.app`)."""
        n = self._next()
        extra: dict[str, str] = {}
        log_path = None
        if publish_log:
            log_path = self.workdir / f"beat-{n}.published"
            log_path.write_text("")
            extra["BENCH_PUBLISH_LOG"] = str(log_path)
        env = self._env(broker, store, conf, **extra)
        scheduler = "bench.app.RecordingScheduler" if publish_log else "celery_delayq.Scheduler"
        args = ["-l", "info", "-S", scheduler, "--schedule", str(self.workdir / f"beat-{n}")]
        return self._spawn("beat", args, env, self.workdir / f"beat-{n}.log", publish_log=log_path)

    def start_web(self, store: str, port: int, *args: str) -> Child:
        """``celery -A bench.app delayq web --port <port> [args]``: the dashboard (waitress) on
        127.0.0.1."""
        n = self._next()
        env = self._env(store, store, None)
        return self._spawn("delayq", ["web", "--port", str(port), *args], env, self.workdir / f"web-{n}.log")

    def stop(self, child: Child, grace: float = 10.0) -> None:
        """SIGTERM the child's process group, SIGKILL it after ``grace`` seconds."""
        _stop_group(child.proc, grace)
        with self._lock:
            if child in self.children:
                self.children.remove(child)

    def stop_all(self, children: Sequence[Child], grace: float = 10.0) -> None:
        for child in children:
            if child.alive():
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(child.pid, signal.SIGTERM)
        for child in children:
            self.stop(child, grace)

    @staticmethod
    def freeze(children: Sequence[Child]) -> None:
        """SIGSTOP: the children stop where they are (a sleeping beat stays subscribed)."""
        for child in children:
            os.killpg(child.pid, signal.SIGSTOP)

    @staticmethod
    def thaw(children: Sequence[Child]) -> None:
        for child in children:
            os.killpg(child.pid, signal.SIGCONT)

    def wait_worker(self, child: Child, timeout: float = STARTUP_TIMEOUT) -> None:
        assert child.ready_file is not None
        path = child.ready_file
        wait_until(lambda: path.exists(), timeout, 0.05, [child], "worker did not become ready")

    def wait_beats(
        self, store_client: Any, channel: str, children: Sequence[Child], timeout: float = STARTUP_TIMEOUT
    ) -> None:
        """Until ``len(children)`` clients are subscribed to delayq's wake channel: each beat
        subscribes on its first pass, so it is in its claim loop."""
        want = len(children)

        def subscribed() -> bool:
            return int(dict(store_client.pubsub_numsub(channel)).get(channel, 0)) >= want

        wait_until(subscribed, timeout, 0.02, children, f"{want} beat(s) did not subscribe")

    # -- cleanup -----------------------------------------------------------------------------

    def owned(self) -> tuple[set[int], set[int]]:
        """Ids of the children and servers running now (see :meth:`stop_since`)."""
        with self._lock:
            return {id(c) for c in self.children}, {id(s) for s in self.servers}

    def stop_since(self, before: tuple[set[int], set[int]]) -> None:
        """Stop every child and server started after :meth:`owned` returned ``before``: what a
        row left running (after an error, say) does not load the rows after it."""
        with self._lock:
            children = [c for c in self.children if id(c) not in before[0]]
            servers = [s for s in self.servers if id(s) not in before[1]]
        self.stop_all(children, grace=5.0)
        for server in servers:
            self.stop_redis(server)

    def cleanup(self, keep_dir: bool = False) -> None:
        with self._lock:
            children, self.children = list(self.children), []
            servers, self.servers = list(self.servers), []
        for child in children:
            if child.alive():
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(child.pid, signal.SIGTERM)
        for child in children:
            _stop_group(child.proc, 5.0)
        for server in servers:
            with contextlib.suppress(Exception):
                server.stop()
        if not keep_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)


def _stop_group(proc: subprocess.Popen[bytes], grace: float) -> None:
    """Stop a child started with ``start_new_session`` and everything in its group."""
    pgid = proc.pid
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGTERM)
            os.killpg(pgid, signal.SIGCONT)  # a frozen (SIGSTOP) child must run to exit
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace)
    # Anything left in the group (the process itself, or a child it forked): SIGKILL.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


def wait_until(
    predicate: Callable[[], Any],
    timeout: float,
    interval: float,
    children: Sequence[Child] = (),
    what: str = "condition",
) -> Any:
    """Poll ``predicate`` until truthy; raise :class:`BenchError` on timeout or a dead child."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        for child in children:
            if not child.alive():
                raise BenchError(
                    f"{what}: {child.kind} exited with {child.proc.returncode}\n{child.log_tail()}"
                )
        if time.monotonic() > deadline:
            tails = "\n".join(f"--- {c.log.name}\n{c.log_tail()}" for c in children)
            raise BenchError(f"{what} within {timeout:.0f} s\n{tails}")
        time.sleep(interval)


# -- producer apps ---------------------------------------------------------------------------


@dataclass
class Producer:
    """An in-process app with ``bench.job`` (same name and signature as in ``bench.app``)."""

    app: Celery
    task: Any
    client: redis.Redis

    def close(self) -> None:
        from celery_delayq.store.facade import get_store

        with contextlib.suppress(Exception):
            get_store(self.app).close()
        self.client.close()
        self.app.close()


def make_producer(broker: str, store: str, **conf: Any) -> Producer:
    app = Celery("bench-producer", broker=broker, set_as_current=False)
    app.conf.update(
        delayq_url=store,
        broker_connection_retry_on_startup=True,
        task_ignore_result=True,
        **conf,
    )

    @app.task(base=DelayedTask, bind=True, name=TASK_NAME, shared=False)  # type: ignore[untyped-decorator]
    def job(
        self: Any, user_id: int | None = None, text: str = "", locale: str = "en-US", payload: str = ""
    ) -> None:
        return None

    return Producer(app, job, redis.Redis.from_url(store, decode_responses=True))


@contextlib.contextmanager
def producer(broker: str, store: str, **conf: Any) -> Iterator[Producer]:
    p = make_producer(broker, store, **conf)
    try:
        yield p
    finally:
        p.close()


def wake_channel(p: Producer) -> str:
    """The pub/sub channel a beat subscribes to when it enters its claim loop."""
    from celery_delayq.store.facade import get_store

    try:
        return str(get_store(p.app).keys.wake_channel)
    except AttributeError:  # as documented in docs/how-it-works.md
        return f"{p.app.conf.get('delayq_prefix') or 'delayq'}:wake"


# -- filling the store -----------------------------------------------------------------------

#: Stands for the task id in a templated envelope (as long as a uuid).
_PLACEHOLDER = "bench0placeholder0000000000000000000"
FILL_CHUNK = 10_000
#: Stands for the due time (ms) in a templated envelope: 2100-01-01, found nowhere else.
_DUE_MARK = 4_102_444_800_123


@dataclass
class Fill:
    jobs: int
    seconds: float
    via_many: int  # jobs stored by apply_at_many
    many_rate: float  # apply_at_many jobs/s on those
    fast: bool  # the rest went through Store.enqueue with templated envelopes
    shape: str = REAL

    @property
    def method(self) -> str:
        what = f"bench.job, {self.shape}"
        if not self.fast:
            return f"{what}: apply_at_many ({self.many_rate:,.0f} jobs/s)"
        return (
            f"{what}: apply_at_many for the first {self.via_many:,} ({self.many_rate:,.0f} jobs/s, too "
            f"slow for the budget), then Store.enqueue with one build_envelope() templated by the "
            f"task id and the job's arguments ({self.jobs / self.seconds:,.0f} jobs/s overall)"
        )


class Template:
    """``build_envelope()``'s output for job ``i`` of a shape, without building it: one envelope
    built with marker values (:func:`bench.jobs.markers`) and a placeholder id, the markers then
    replaced by job ``i``'s values and the placeholder by its id. Made only when that gives, for
    a sample job, exactly what ``build_envelope()`` gives."""

    def __init__(self, envelope: str, shape: str) -> None:
        self.envelope = envelope
        self.shape = shape
        self.marks = [(name, str(value)) for name, value in markers(shape).items()]
        self.due = str(_DUE_MARK) in envelope

    def __call__(self, job_id: str, i: int, due_ms: int) -> str:
        values = fields(i, self.shape)
        out = self.envelope
        for name, mark in self.marks:
            out = out.replace(mark, str(values[name]))
        if self.due:
            out = out.replace(str(_DUE_MARK), str(due_ms))
        return out.replace(_PLACEHOLDER, job_id)


def envelope_template(p: Producer, shape: str = REAL) -> Template | None:
    """A :class:`Template` of ``bench.job``'s stored envelope for ``shape``, or None if that
    cannot be had (the build's API or format changed)."""
    try:
        from celery_delayq.producer.build import build_envelope

        marked = call_of(markers(shape))
        sample_id, sample, due_ms = uuid(), 123_457, int(time.time() * 1000) + 3_600_123
        args, kwargs = job_call(sample, shape)
        # The envelope holds the time it was built (ms): the two builds can fall in two
        # milliseconds, hence a few tries.
        for _ in range(5):
            envelope = build_envelope(p.app, p.task, _PLACEHOLDER, _DUE_MARK, *marked, {})
            built = build_envelope(p.app, p.task, sample_id, due_ms, args, kwargs, {})
            if not isinstance(envelope, str) or _PLACEHOLDER not in envelope:
                return None
            template = Template(envelope, shape)
            if any(mark not in envelope for _, mark in template.marks):
                return None
            if template(sample_id, sample, due_ms) == built:
                return template
    except Exception:
        return None
    return None


def fill(p: Producer, n: int, due_at: Callable[[int], float], budget_s: float, shape: str = REAL) -> Fill:
    """Store ``n`` ``bench.job`` jobs of ``shape``, job ``i`` due at ``due_at(i)`` (seconds since the
    epoch), with :func:`bench.jobs.job_call`'s arguments for ``i``.

    ``apply_at_many`` in chunks of 10,000 while it looks like finishing within ``budget_s``;
    if it does not, the rest goes through the store's own ``enqueue`` (what ``apply_at_many``
    calls after building each message) with a :class:`Template` of ``build_envelope()``'s
    output: byte for byte what ``apply_at_many`` stores, minus the per-job build.
    """
    from celery_delayq.store.facade import get_store

    t0 = time.perf_counter()
    done = 0
    many_jobs, many_time = 0, 0.0
    template: Template | None = None
    fast = False
    while done < n:
        k = min(FILL_CHUNK, n - done)
        if template is None:
            items = [(due_at(i), *job_call(i, shape)) for i in range(done, done + k)]
            t = time.perf_counter()
            p.task.apply_at_many(items)
            many_time += time.perf_counter() - t
            many_jobs += k
            done += k
            left = budget_s - (time.perf_counter() - t0)
            if done < n and (n - done) * many_time / many_jobs > left:
                template = envelope_template(p, shape)
                fast = template is not None
                if not fast:
                    budget_s = float("inf")  # no faster path: keep going
        else:
            jobs = []
            for i in range(done, done + k):
                job_id = uuid()
                due_ms = round(due_at(i) * 1000)
                jobs.append((job_id, due_ms, template(job_id, i, due_ms)))
            try:
                get_store(p.app).enqueue(jobs)
            except (TypeError, AttributeError, ValueError):  # the store's API changed: the slow path
                template, fast, budget_s = None, False, float("inf")
                continue
            done += k
    many_rate = many_jobs / many_time if many_time else 0.0
    return Fill(n, time.perf_counter() - t0, many_jobs, many_rate, fast, shape)


# -- measuring -------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100)."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    rank = max(1, min(len(ordered), round(q / 100.0 * len(ordered) + 0.4999)))
    return ordered[rank - 1]


def watch(
    count: Callable[[], int],
    target: int,
    timeout: float,
    interval: float = 0.02,
    children: Sequence[Child] = (),
    what: str = "count",
) -> list[tuple[float, int]]:
    """Samples ``(time.time(), count())`` until ``count() >= target``."""
    samples: list[tuple[float, int]] = []
    deadline = time.time() + timeout
    while True:
        value = count()
        now = time.time()
        samples.append((now, value))
        if value >= target:
            return samples
        if now > deadline:
            raise BenchError(f"{what}: {value:,} of {target:,} after {timeout:.0f} s")
        for child in children:
            if not child.alive():
                raise BenchError(f"{what}: {child.kind} exited\n{child.log_tail()}")
        time.sleep(interval)


def rate_between(samples: list[tuple[float, int]], total: int, lo: float = 0.05, hi: float = 0.95) -> float:
    """Jobs/s between the first samples at or over ``lo`` and ``hi`` of ``total`` (steady state:
    process start-up and the last stragglers left out)."""
    first = next((t, c) for t, c in samples if c >= lo * total)
    last = next((t, c) for t, c in samples if c >= hi * total)
    if last[0] <= first[0]:
        return float("nan")
    return (last[1] - first[1]) / (last[0] - first[0])


def rss_mib(pid: int, samples: int = 5, interval: float = 0.2) -> float:
    """Median RSS of a process over a second, in MiB."""
    proc = psutil.Process(pid)
    values = []
    for _ in range(samples):
        values.append(proc.memory_info().rss / 2**20)
        time.sleep(interval)
    return float(statistics.median(values))


class CpuWatch:
    """CPU used by some processes between :meth:`start` and :meth:`stop`, in % of one core."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.procs = {name: psutil.Process(pid) for name, pid in pids.items()}
        self.before: dict[str, float] = {}
        self.t0 = 0.0

    @staticmethod
    def _cpu(proc: psutil.Process) -> float:
        try:
            times = proc.cpu_times()
        except psutil.Error:
            return float("nan")
        return float(times.user + times.system)

    def start(self) -> CpuWatch:
        self.t0 = time.monotonic()
        self.before = {name: self._cpu(proc) for name, proc in self.procs.items()}
        return self

    def used(self) -> dict[str, float]:
        """Each process's user+system time since :meth:`start`, in % of one core."""
        elapsed = time.monotonic() - self.t0
        return {
            name: 100.0 * (self._cpu(proc) - self.before[name]) / elapsed for name, proc in self.procs.items()
        }

    def stop(self) -> str:
        return ", ".join(f"{name} {pct:.0f}%" for name, pct in self.used().items())


def used_memory(client: Any) -> int:
    return int(client.info("memory")["used_memory"])


def read_floats(path: Path | None) -> list[float]:
    if path is None or not path.exists():
        return []
    return [float(line) for line in path.read_text().split() if line]


def starts(client: Any) -> list[tuple[float, float]]:
    """``(start, due)`` of every ``bench.job`` run recorded so far."""
    out = []
    for raw in client.lrange(STARTS_KEY, 0, -1):
        start, due = raw.split()
        out.append((float(start), float(due)))
    return out


def timed_loop(call: Callable[[], Any], seconds: float) -> float:
    """Calls/s of ``call`` repeated for ``seconds``."""
    n = 0
    t0 = time.perf_counter()
    deadline = t0 + seconds
    while True:
        call()
        n += 1
        if n % 16 == 0 and time.perf_counter() >= deadline:
            break
    return n / (time.perf_counter() - t0)
