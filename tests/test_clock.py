"""Relative times count from the Redis server's clock, whatever the producer's or beat's clock.

A producer (or beat) whose clock is wrong by an hour must still store ``apply_in(5)`` due five
seconds after the Redis server's now, and a schedule's first run where the rule puts it by the
server's clock. The producer's clock is shifted by patching ``time.time`` in this process; the
beat's, with libfaketime (``apt-get install faketime``) when it is installed. An absolute
``apply_at`` far in the past of the server's clock is logged once (``delayq_past_warning``).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery, group
from celery.bin.base import CLIContext

from celery_delayq import Schedules
from celery_delayq import apply_in as canvas_apply_in
from celery_delayq.beat.upkeep import sync_config
from celery_delayq.store.envelope import decode_envelope
from celery_delayq.store.facade import get_store
from tests.support.apps import make_app
from tests.support.polling import wait_for
from tests.support.processes import Procs, subprocess_env
from tests.support.store import command_calls, server_ms

#: Shifts of the producer's clock, in seconds.
SKEWS = [3600.0, -3600.0]
#: Allowed difference between a due time and the server's now plus the delay (ms): the calls
#: take milliseconds, a loaded machine may take much longer.
TOLERANCE_MS = 3000
LIBFAKETIME = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1")


@pytest.fixture
def skew(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> float:
    """This process's ``time.time`` shifted by the parameter, in seconds (what delayq and Celery
    read as the wall clock; ``time.monotonic`` is left alone, as a clock step leaves it)."""
    shift = float(request.param)
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + shift)
    return shift


def stored_due(r: redis.Redis, app: Celery, job_id: str) -> int:
    keys = get_store(app).keys.for_job(job_id)
    score = r.zscore(keys.due, job_id)
    assert score is not None, job_id
    return int(score)


def assert_due_in(due_ms: int, before_ms: int, after_ms: int, delay_ms: int) -> None:
    """``due_ms`` is ``delay_ms`` after the server's now, read before and after the call."""
    assert before_ms + delay_ms - 50 <= due_ms <= after_ms + delay_ms + TOLERANCE_MS, (
        f"due {due_ms - before_ms - delay_ms:+d} ms off the server's now + delay"
    )


@pytest.mark.parametrize("skew", SKEWS, indirect=True, ids=["ahead-1h", "behind-1h"])
def test_apply_in_is_due_after_the_servers_now(
    skew: float, app_factory: Callable[..., Celery], r: redis.Redis
) -> None:
    app = app_factory()
    assert abs(time.time() - server_ms(r) / 1000 - skew) < 5  # the shift is in place
    before = server_ms(r)
    result = app.tasks["t.add"].apply_in(5, (1, 2), expires=60)
    after = server_ms(r)
    due = stored_due(r, app, result.id)
    assert_due_in(due, before, after, 5000)
    assert int(result.due.timestamp() * 1000) == due  # ScheduledResult.due is the stored due
    # The envelope's expiry (60 s from the due time) agrees with the stored due, not the
    # producer's clock: it is built from the server's now as last read (Store.server_now_ms).
    envelope = decode_envelope(get_store(app).get(result.id).envelope)  # type: ignore[union-attr]
    assert envelope.expires_ms is not None
    off = envelope.expires_ms - (due + 60_000)
    print(f"[clock] apply_in(5, expires=60), skew {skew:+.0f} s: expiry - (due + 60 s) = {off:+d} ms")
    assert abs(off) < TOLERANCE_MS


@pytest.mark.parametrize("skew", SKEWS, indirect=True, ids=["ahead-1h", "behind-1h"])
def test_intercepted_countdown_is_due_after_the_servers_now(
    skew: float, app_factory: Callable[..., Celery], r: redis.Redis
) -> None:
    """``apply_async(countdown=)`` (and ``self.retry(countdown=)``, which calls it) with
    ``delayq_intercept_eta``; ``expires`` in seconds counts from the call, by the server's clock."""
    app = app_factory(delayq_intercept_eta=True)
    before = server_ms(r)
    result = app.tasks["t.add"].apply_async((1, 2), countdown=5, expires=600)
    after = server_ms(r)
    due = stored_due(r, app, result.id)
    assert_due_in(due, before, after, 5000)
    envelope = decode_envelope(get_store(app).get(result.id).envelope)  # type: ignore[union-attr]
    assert envelope.expires_ms is not None
    assert_due_in(envelope.expires_ms, before, after, 600_000)


@pytest.mark.parametrize("skew", SKEWS, indirect=True, ids=["ahead-1h", "behind-1h"])
def test_canvas_apply_in_is_due_after_the_servers_now(
    skew: float, app_factory: Callable[..., Celery], r: redis.Redis
) -> None:
    app = app_factory()
    add = app.tasks["t.add"]
    before = server_ms(r)
    one = canvas_apply_in(add.s(1, 2), 5)
    members = canvas_apply_in(group(add.s(i, i) for i in range(5)), 5)
    after = server_ms(r)
    assert_due_in(stored_due(r, app, one.id), before, after, 5000)
    assert int(one.due.timestamp() * 1000) == stored_due(r, app, one.id)
    for member in members.results:
        assert_due_in(stored_due(r, app, member.id), before, after, 5000)


@pytest.mark.parametrize("skew", SKEWS, indirect=True, ids=["ahead-1h", "behind-1h"])
def test_schedule_first_runs_follow_the_servers_clock(
    skew: float, app_factory: Callable[..., Celery], r: redis.Redis
) -> None:
    """An API interval counts from its creation (the server's now); a ``beat_schedule`` interval
    is anchored at the epoch: its first run is the next multiple after the server's now. With
    the interval equal to the skew, the producer's clock would put it exactly one interval late
    (ahead) or in the past (behind)."""
    app = app_factory()
    schedules = Schedules(app)
    before = server_ms(r)
    schedules.add("every-minute", "t.add", 60, (1, 2))
    report = sync_config(schedules, {"hourly": {"task": "t.add", "schedule": 3600.0, "args": (1, 2)}})
    after = server_ms(r)
    assert report["added"] == ["hourly"]
    minute = schedules.get("every-minute")
    assert minute is not None and minute.next_run is not None
    assert_due_in(int(minute.next_run.timestamp() * 1000), before, after, 60_000)
    assert abs(minute.created.timestamp() * 1000 - before) < TOLERANCE_MS
    hourly = schedules.get("hourly")
    assert hourly is not None and hourly.next_run is not None
    next_ms = int(hourly.next_run.timestamp() * 1000)
    assert next_ms % 3_600_000 == 0
    assert before < next_ms <= after + 3_600_000


@pytest.mark.e2e  # a real celery beat process: over a second a case
@pytest.mark.slow
@pytest.mark.skipif(not LIBFAKETIME.exists(), reason="libfaketime is missing (apt-get install faketime)")
@pytest.mark.parametrize("shift", ["+600", "-600"], ids=["ahead-10min", "behind-10min"])
def test_a_beat_with_a_skewed_clock_stores_beat_schedule_first_runs_by_the_servers_clock(
    shift: str, procs: Procs, redis_url: str, r: redis.Redis
) -> None:
    """A real ``celery beat`` whose clock libfaketime shifts by 10 minutes stores a 10-minute
    ``beat_schedule`` interval (anchored at the epoch) with its first run the next multiple of
    600 s after the server's now (its own clock would put it 10 min late, or now)."""
    conf = {"beat_schedule": {"skewed": {"task": "e2e.plain", "schedule": 600.0}}}
    env = subprocess_env(
        redis_url,
        redis_url,
        DELAYQ_TEST_CONF=json.dumps(conf),
        LD_PRELOAD=str(LIBFAKETIME),
        FAKETIME=shift,
        FAKETIME_DONT_RESET="1",
    )
    before = server_ms(r)
    procs.start("beat", env)
    app = make_app(redis_url)
    try:
        stored = wait_for(lambda: Schedules(app).get("skewed"), timeout=60)
        after = server_ms(r)
        assert stored.next_run is not None
        next_ms = int(stored.next_run.timestamp() * 1000)
        assert next_ms % 600_000 == 0
        assert before < next_ms <= after + 600_000, (next_ms - before) / 1000
        # The beat's clock really was shifted: its heartbeat's start time is its time.time().
        beats = wait_for(lambda: get_store(app).beats(), timeout=60)
        (heartbeat,) = beats.values()
        started_off = heartbeat["started_ms"] / 1000 - before / 1000
        assert abs(started_off - float(shift)) < 30, started_off
    finally:
        app.close()


def test_an_apply_at_far_in_the_servers_past_is_logged_once(
    app_factory: Callable[..., Celery], r: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    app = app_factory()
    add = app.tasks["t.add"]
    caplog.set_level(logging.WARNING, logger="celery_delayq.store.jobs")
    now = server_ms(r) / 1000
    add.apply_at(now - 600, (1, 2))  # 10 min late: under the default hour, not logged
    assert not caplog.records
    first = add.apply_at(now - 7200, (1, 2))
    add.apply_at(now - 7200, (1, 2))
    add.apply_at_many([(now - 9000, (1, 2), None), (now + 60, (1, 2), None)])
    warnings = [rec for rec in caplog.records if rec.name == "celery_delayq.store.jobs"]
    assert len(warnings) == 1, [rec.getMessage() for rec in warnings]
    message = warnings[0].getMessage()
    assert first.id in message and "7200 s before the Redis server's now" in message
    assert "delayq_past_warning" in message


@pytest.mark.parametrize("skew", [-7200.0], indirect=True, ids=["behind-2h"])
def test_a_producer_whose_clock_is_late_is_caught_by_the_past_warning(
    skew: float, app_factory: Callable[..., Celery], r: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """``apply_at(time.time() + 60)`` on a machine 2 h late is due 2 h in the server's past."""
    app = app_factory()
    caplog.set_level(logging.WARNING, logger="celery_delayq.store.jobs")
    app.tasks["t.add"].apply_at(time.time() + 60, (1, 2))
    (record,) = [rec for rec in caplog.records if rec.name == "celery_delayq.store.jobs"]
    assert "differs from the server's by -7200" in record.getMessage()


@pytest.mark.parametrize("setting", [None, 86400])
def test_past_warning_off_or_higher(
    setting: Any, app_factory: Callable[..., Celery], r: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    app = app_factory(delayq_past_warning=setting)
    caplog.set_level(logging.WARNING, logger="celery_delayq.store.jobs")
    app.tasks["t.add"].apply_at(server_ms(r) / 1000 - 7200, (1, 2))
    assert not [rec for rec in caplog.records if rec.name == "celery_delayq.store.jobs"]


def test_apply_in_reads_the_servers_clock_with_its_own_enqueue(
    app_factory: Callable[..., Celery], r: redis.Redis
) -> None:
    """The first relative call of a process asks ``TIME`` once; later ones reuse the ``TIME`` the
    enqueue script returned: one ``EVALSHA`` a call, as before (``TIME`` in a script counts in
    ``INFO commandstats`` too: one a call)."""
    app = app_factory()
    add = app.tasks["t.add"]
    add.apply_in(5, (1, 2))
    time_calls, evalsha_calls = command_calls(r, "time")[0], command_calls(r, "evalsha")[0]
    for _ in range(10):
        add.apply_in(5, (1, 2))
    assert command_calls(r, "evalsha")[0] - evalsha_calls == 10
    assert command_calls(r, "time")[0] - time_calls == 10  # the scripts' own TIME only


@pytest.mark.parametrize("skew", SKEWS, indirect=True, ids=["ahead-1h", "behind-1h"])
def test_now_on_the_command_line_and_in_requeue_is_the_servers(
    skew: float, app_factory: Callable[..., Celery], r: redis.Redis
) -> None:
    """``delayq run-now``, ``delayq reschedule ID +10m``, ``delayq dead requeue`` and
    ``DelayQ.requeue_dead()`` with no time count from the Redis server's now, as the beat does:
    with this machine an hour ahead, the local clock would hold the job an hour; behind, it
    would be due an hour early."""
    from click.testing import CliRunner

    from celery_delayq import DelayQ
    from celery_delayq.cli import delayq
    from tests.support.store import bury

    app = app_factory()
    runner = CliRunner()

    def cli(*args: str) -> None:
        result = runner.invoke(delayq, list(args), obj=CLIContext(app=app, no_color=True, workdir=None))
        assert result.exit_code == 0, result.output

    add = app.tasks["t.add"]
    moved = str(add.apply_at(server_ms(r) / 1000 + 3600, (1, 2)).id)
    before = server_ms(r)
    cli("run-now", moved)
    assert_due_in(stored_due(r, app, moved), before, server_ms(r), 0)
    before = server_ms(r)
    cli("reschedule", moved, "+10m")
    assert_due_in(stored_due(r, app, moved), before, server_ms(r), 600_000)

    for requeue in ("cli", "api"):
        dead = str(add.apply_at(server_ms(r) / 1000 - 1, (1, 2)).id)
        bury(app, dead)
        before = server_ms(r)
        if requeue == "cli":
            cli("dead", "requeue", dead)
        else:
            assert DelayQ(app).requeue_dead(dead) == "requeued"
        assert_due_in(stored_due(r, app, dead), before, server_ms(r), 0)
