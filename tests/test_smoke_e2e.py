from __future__ import annotations

import time

import pytest
import redis

from tests.conftest import Procs, subprocess_env, wait_for


@pytest.mark.e2e
def test_smoke(redis_url: str, procs: Procs) -> None:
    env = subprocess_env(redis_url, redis_url)
    procs.start("worker", env)
    procs.start("beat", env)
    from tests.apps import e2e_app

    e2e_app.app.conf.delayq_url = redis_url
    e2e_app.app.conf.broker_url = redis_url
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    res = [e2e_app.record.apply_in(1 + i * 0.01) for i in range(50)]
    got = wait_for(lambda: r.hlen("e2e:runs") >= 50, 30)
    assert got, procs.logs()
    assert all(int(v) == 1 for v in r.hgetall("e2e:runs").values())
    assert {x.id for x in res} == set(r.hgetall("e2e:runs"))
    time.sleep(0.1)
