"""Poison data never stops delivery: a table of corrupt entries seeded straight into Redis.

Each entry of :data:`POISON` is written over a stored job (its envelope, its lease) or a
stored schedule (its definition, its run state) with the store's own key layout, as an
operator with write access to the prefix, a buggy migration or a half-applied restore could.
Meanwhile 300 normal jobs are due. Two real ``celery beat`` processes and a real worker run
(``tests/apps/e2e_app.py``). Every normal job must run exactly once, each poison must end as
the table says (dead-lettered with its reason, its lease replaced, its run state reset), and
both beats must still be alive, with no traceback and no "Redis unavailable" in their logs.

The ``control`` run is the same without the poison: compare the printed delivery times
(``-s``). Before issue 13, the first beat to claim a deeply nested envelope died with
``RecursionError`` and the claim of a shard holding a malformed lease failed for ever.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import pytest
import redis

from celery_delayq import Schedules
from celery_delayq.store.facade import get_store
from tests.support.polling import wait_for
from tests.support.processes import Procs, subprocess_env
from tests.support.stack import Producer, assert_alive, log_of, producers, start_stack, warm_up

__all__ = ["producers"]  # a fixture, used by name

pytestmark = pytest.mark.e2e

#: Normal jobs due while the poison is in the store.
NORMAL = 300
#: Seconds from the seeding to the first due time: the beats run, so everything must be written
#: before any of it is due.
LEAD = 6.0
#: Seconds over which the normal jobs are spread.
SPREAD = 2.0
#: How long the 300 may take after the last is due (a loaded 2-core machine; the bound of the
#: other end-to-end tests).
DELIVERY_BOUND = 60.0
#: Nesting far beyond what Python's json or Redis's cjson can take (both stop near 1000).
DEEP = 20_000
CONF: dict[str, Any] = {"delayq_reclaim_ttl": 30.0}


@dataclass(frozen=True)
class Poison:
    """One corrupt entry: which job (``envelope``/``lease``) or schedule (``definition``/
    ``history``) it replaces, the text written, and the start of the dead letter's reason
    (None: nothing is dead-lettered; the entry is repaired and the job or schedule goes on)."""

    name: str
    part: str
    text: Callable[[str], str]
    reason: str | None


def _deep_headers(envelope: str) -> str:
    data = json.loads(envelope)
    data["h"] = "@@"
    return json.dumps(data).replace('"@@"', '{"a":' * DEEP + "1" + "}" * DEEP)


def _huge(envelope: str) -> str:
    data = json.loads(envelope)
    data["h"] = {"pad": "x" * 1_100_000}
    return json.dumps(data)


POISON = [
    Poison(
        "deep-envelope",
        "envelope",
        lambda _: "[" * DEEP + "]" * DEEP,
        "corrupt envelope: envelope is nested more than 100 levels deep",
    ),
    Poison(
        "deep-headers",
        "envelope",
        _deep_headers,
        "corrupt envelope: envelope is nested more than 100 levels deep",
    ),
    Poison(
        "not-json",
        "envelope",
        lambda _: '{"v": 2, "t": "e2e.record", "b": ',
        "corrupt envelope: envelope is not JSON",
    ),
    Poison(
        "json-array",
        "envelope",
        lambda _: "[1, 2, 3]",
        "corrupt envelope: envelope is a JSON array, not a JSON object",
    ),
    Poison(
        "json-string",
        "envelope",
        lambda _: '"e2e.record"',
        "corrupt envelope: envelope is a JSON string, not a JSON object",
    ),
    Poison(
        "no-fields", "envelope", lambda _: '{"v": 2}', "corrupt envelope: envelope field missing or malformed"
    ),
    Poison(
        "huge", "envelope", _huge, "corrupt envelope: envelope is 11"
    ),  # 1,100,0xx bytes, over delayq_max_payload
    Poison("lease-garbage", "lease", lambda _: "garbage", None),
    Poison("lease-half", "lease", lambda _: "17|", None),
    Poison(
        "def-not-json",
        "definition",
        lambda _: "not json{",
        "schedule stopped: definition of schedule 'def-not-json' is not JSON",
    ),
    Poison(
        "def-list",
        "definition",
        lambda _: "[1, 2]",
        "schedule stopped: definition of schedule 'def-list' is a JSON array, not a JSON object",
    ),
    Poison(
        "def-deep",
        "definition",
        lambda _: "[" * DEEP + "]" * DEEP,
        "schedule stopped: definition of schedule 'def-deep' is nested more than 100 levels deep",
    ),
    Poison("history-garbage", "history", lambda _: "garbage", None),
    Poison("history-deep", "history", lambda _: "[" * DEEP + "]" * DEEP, None),
]


def _seed(producer: Producer, r: redis.Redis, due: float) -> dict[str, str]:
    """Store the jobs and schedules of :data:`POISON`, then write the poison over them; returns
    ``{poison name: job id}`` for the jobs (schedules are named after their poison)."""
    store = get_store(producer.app)
    schedules = Schedules(producer.app)
    ids: dict[str, str] = {}
    for n, poison in enumerate(POISON):
        at = due + 0.3 + 0.05 * n
        if poison.part in ("envelope", "lease"):
            job = producer.record.apply_at(at, args=(poison.name,), task_id=f"poison-{poison.name}")
            keys = store.keys.for_job(job.id)
            ids[poison.name] = job.id
            if poison.part == "envelope":
                record = store.get(job.id)
                assert record is not None
                r.hset(keys.jobs, job.id, poison.text(record.envelope))
            else:
                r.hset(keys.leases, job.id, poison.text(""))
        else:
            # Definitions: a one-shot point at ``at``; run states: every second, to see it go on.
            rule: Any = datetime.fromtimestamp(at, UTC) if poison.part == "definition" else 1.0
            schedules.add(poison.name, "e2e.record", rule, args=(poison.name,))
            keys = store.keys.for_job("{" + poison.name + "}")
            target = keys.schedules if poison.part == "definition" else keys.history
            r.hset(target, poison.name, poison.text(""))
    return ids


@pytest.mark.parametrize("poisoned", [True, False], ids=["poison", "control"])
def test_poison_never_stops_delivery(
    redis_url: str, r: redis.Redis, procs: Procs, producers: Callable[..., Producer], poisoned: bool
) -> None:
    producer = producers(redis_url, redis_url)
    start_stack(procs, subprocess_env(redis_url, redis_url, DELAYQ_TEST_CONF=json.dumps(CONF)), beats=2)
    warm_up(producer, r, procs)

    due = time.time() + LEAD
    normal = producer.record.apply_at_many([(due + SPREAD * i / NORMAL, (i,), None) for i in range(NORMAL)])
    ids = _seed(producer, r, due) if poisoned else {}
    assert time.time() < due, "seeding took longer than LEAD: the test would prove nothing"
    expected = {res.id for res in normal} | {ids[p.name] for p in POISON if p.part == "lease" and poisoned}

    def ran() -> set[str]:
        return expected & set(r.hkeys("e2e:runs"))

    done = wait_for(lambda: len(ran()) == len(expected), LEAD + SPREAD + DELIVERY_BOUND, 0.1)
    finished = time.time()
    assert done, f"{len(ran())} of {len(expected)} delivered\n{procs.logs()}"
    late = sorted(
        s["start"] - s["due"] for s in map(json.loads, r.lrange("e2e:starts", 0, -1)) if s["id"] in expected
    )
    print(
        f"\nPOISON {len(POISON) if poisoned else 0} poison entries: {len(expected)} of "
        f"{len(expected)} delivered; start - due p50 {late[len(late) // 2] * 1000:.0f} ms, max "
        f"{late[-1] * 1000:.0f} ms; all seen run {finished - (due + SPREAD):.2f} s after the last due"
    )
    time.sleep(1.0)  # a duplicate would show now
    counts = {k: int(v) for k, v in r.hgetall("e2e:runs").items()}
    assert {job_id: counts[job_id] for job_id in expected} == dict.fromkeys(expected, 1)

    dead = dict(producer.dq.dead())
    if poisoned:
        _check_poison(producer, r, procs, ids, dead)
    else:
        assert dead == {}
    beat_logs = [log_of(procs, i) for i in (1, 2)]
    for text in beat_logs:
        assert "Traceback" not in text and "Redis unavailable" not in text, procs.logs()
    assert_alive(procs)


def _check_poison(
    producer: Producer, r: redis.Redis, procs: Procs, ids: dict[str, str], dead: dict[str, Any]
) -> None:
    """Each poison ended as :data:`POISON` says."""
    logs = log_of(procs, 1) + log_of(procs, 2)
    runs = {k: int(v) for k, v in r.hgetall("e2e:runs").items()}
    buried = {name for name, p in ((p.name, p) for p in POISON) if p.reason is not None}
    dead_of: dict[str, dict[str, Any]] = {}
    for job_id, record in dead.items():
        name = job_id[1 : job_id.index("}")] if job_id.startswith("{") else job_id[len("poison-") :]
        dead_of[name] = record
    assert set(dead_of) == buried, sorted(dead)
    for poison in POISON:
        if poison.reason is not None:
            record = dead_of[poison.name]
            assert record["reason"].startswith(poison.reason), (poison.name, record["reason"][:200])
            assert f"moved to dead letters: {poison.reason}" in logs
            if poison.part == "envelope":
                assert producer.dq.get(ids[poison.name]) is not None  # readable, as a dead letter
        elif poison.part == "lease":
            assert runs[ids[poison.name]] == 1
        else:
            # The run state was reset and the schedule goes on: more points run after it.
            prefix = "{" + poison.name + "}@"
            before = len([k for k in runs if k.startswith(prefix)])

            def points(prefix: str = prefix) -> int:
                return len([k for k in r.hkeys("e2e:runs") if k.startswith(prefix)])

            assert wait_for(lambda before=before, points=points: points() >= before + 2, 20, 0.2), (
                f"schedule {poison.name} stopped\n{procs.logs()}"
            )
            schedule = Schedules(producer.app).get(poison.name)
            assert schedule is not None and schedule.enabled and schedule.run_count >= 1
            assert f"schedule {poison.name!r} had a run state (history) that does not read" in logs
    assert "lease entr(ies) that do not read; the claim replaced them" in logs
