"""End to end: recurring schedules stored in Redis, delivered by several real ``celery beat``.

The worker and the beats run ``tests/apps/e2e_app.py`` (see ``tests/support/stack.py``);
the test process creates and manages the schedules through :class:`Schedules`.
Every execution point is published with the task id ``{<name>}@<UTC time ms>``, so
the worker's run records (``e2e:runs``) say exactly which points ran and how often.

Run with ``-s`` to see the counts (points expected, fired, duplicated, skipped) and
the lateness these tests print.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import time
from collections import defaultdict
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
import redis

from celery_delayq.schedules.api import Schedules
from celery_delayq.schedules.rules import IntervalRule, Rule
from celery_delayq.store.facade import get_store
from tests.support.polling import wait_for
from tests.support.processes import Procs, subprocess_env
from tests.support.stack import (
    CLOCK_TOL,
    STARTUP,
    Producer,
    lateness_line,
    leases_of,
    log_of,
    start_stack,
    starts,
    warm_up,
)

pytestmark = pytest.mark.e2e

#: A short lease, so that a point held by a killed beat is recovered inside the run.
RECLAIM_TTL = 3.0
CONF: dict[str, Any] = {"delayq_reclaim_ttl": RECLAIM_TTL}
#: A long lease for runs where no beat dies: a beat stalled by a loaded machine keeps its
#: point instead of having it re-claimed (and published twice) by another beat.
LONG_RECLAIM_TTL = 30.0

_POINT = re.compile(r"\{(?P<name>[^{}]+)\}@(?P<when>\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3})Z")


# -- helpers ---------------------------------------------------------------------------------


@pytest.fixture
def producer(redis_url: str) -> Iterator[Producer]:
    made = Producer(redis_url, redis_url)
    yield made
    made.close()


def env_with(redis_url: str, conf: dict[str, Any]) -> dict[str, str]:
    return subprocess_env(redis_url, redis_url, DELAYQ_TEST_CONF=json.dumps(conf))


def now_ms() -> int:
    return int(time.time() * 1000)


def parse_point(task_id: str) -> tuple[str, int] | None:
    """``(schedule name, point ms)`` of an execution point's task id, None for other ids."""
    m = _POINT.fullmatch(task_id)
    if m is None:
        return None
    when = datetime.strptime(m["when"], "%Y-%m-%dT%H:%M:%S.%f").replace(tzinfo=UTC)
    return m["name"], round(when.timestamp() * 1000)


def point_runs(r: redis.Redis) -> dict[str, dict[int, int]]:
    """schedule name -> {point ms: number of runs}, from the worker's records."""
    out: dict[str, dict[int, int]] = defaultdict(dict)
    for task_id, count in r.hgetall("e2e:runs").items():
        parsed = parse_point(task_id)
        assert parsed is not None, f"a run that is not a schedule point: {task_id}"
        out[parsed[0]][parsed[1]] = int(count)
    return out


def rule_points(rule: Rule, after_ms: int, until_ms: int) -> list[int]:
    """The rule's points in ``(after_ms, until_ms]``."""
    points: list[int] = []
    t = rule.next_after(after_ms)
    while t is not None and t <= until_ms:
        points.append(t)
        t = rule.next_after(t)
    return points


def mid_second() -> None:
    """Return at 0.2-0.6 s past a whole second: a schedule made now cannot straddle a cron point."""
    frac = time.time() % 1.0
    if not 0.2 <= frac < 0.6:
        time.sleep((1.25 - frac) % 1.0)


def beat_indexes(procs: Procs) -> list[int]:
    return [i for i, (proc, log) in enumerate(procs.procs) if log.name.startswith("beat-")]


def assert_running(procs: Procs, indexes: list[int]) -> None:
    for i in indexes:
        proc, log = procs.procs[i]
        assert proc.poll() is None, f"{log.name} exited with {proc.returncode}\n{procs.logs()}"


def check_point_records(r: redis.Redis, names: set[str]) -> list[float]:
    """Each run of a point of ``names`` carries its point time as due and did not start before it;
    returns the lateness (s)."""
    late: list[float] = []
    for rec in starts(r):
        parsed = parse_point(rec["id"])
        if parsed is None or parsed[0] not in names:
            continue
        assert rec["due"] is not None, rec
        assert abs(rec["due"] - parsed[1] / 1000.0) < 0.002, rec
        assert rec["start"] >= rec["due"] - CLOCK_TOL, f"ran before its point time: {rec}"
        late.append(rec["start"] - rec["due"])
    return late


def consecutive(points: list[int], step_ms: int) -> bool:
    return all(b - a == step_ms for a, b in itertools.pairwise(points))


def kill_holding_a_point(
    r: redis.Redis, lease_keys: list[str], pid: int, timeout: float, prefer_published: float
) -> tuple[bool, set[str]]:
    """SIGKILL beat ``pid`` while it holds (has claimed, not yet fired) some schedule point.

    Watches the shards' lease hashes for a lease of that beat and freezes the beat
    (SIGSTOP). It is killed (SIGKILL) when a point it still holds has already run:
    it published the point and died before its ack, the worst moment. Until then it
    is thawed (SIGCONT) only for a moment between two looks, so it steps from its
    claim towards the publish. After ``prefer_published`` seconds any held point
    will do. Returns (caught, ids of held points that had run when it was killed).
    """
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if not leases_of(r, lease_keys, pid):
            time.sleep(0.001)
            continue
        os.kill(pid, signal.SIGSTOP)
        if leases_of(r, lease_keys, pid):
            time.sleep(0.1)  # a published point reaches the worker's record meanwhile
            held = leases_of(r, lease_keys, pid)  # (a fire sent just before the freeze is applied)
            ran = {job_id for job_id in held if r.hexists("e2e:runs", job_id)}
            if ran or (held and time.monotonic() - start > prefer_published):
                os.kill(pid, signal.SIGKILL)
                return True, ran
        os.kill(pid, signal.SIGCONT)
    os.kill(pid, signal.SIGKILL)
    return False, set()


# -- several beats, one schedule set ---------------------------------------------------------


@pytest.mark.parametrize("kill", [False, True], ids=["three-beats", "three-beats-one-sigkilled"])
def test_three_beats_fire_every_point_once(
    kill: bool, redis_url: str, r: redis.Redis, procs: Procs, producer: Producer
) -> None:
    """Three beats share a per-second cron and two intervals for 20 s: every point runs once.

    With ``kill``, one beat is SIGKILLed at ~8 s while it holds a point, preferably one
    it has already published but not acked (and a new beat is started): another beat
    delivers that point again once its lease expires (the reclaim TTL), the points of
    that schedule due meanwhile are caught up (missed policy "once", within grace),
    none is skipped, and none runs twice: the worker drops the second copy of a point the
    dead beat had published (``delayq_start_check``: the copy whose claim started first runs).
    """
    # The kill run needs the short lease (the dead beat's point is recovered inside the run);
    # without a kill, a long one, so that no stalled beat's point is claimed twice.
    reclaim_ttl = RECLAIM_TTL if kill else LONG_RECLAIM_TTL
    env = env_with(redis_url, {**CONF, "delayq_reclaim_ttl": reclaim_ttl})
    start_stack(procs, env, beats=3)
    warm_up(producer, r, procs)
    schedules = Schedules(producer.app)
    store = get_store(producer.app)
    window = 20.0

    mid_second()
    t0 = time.time()
    made = [
        schedules.add("per-second", "e2e.record", "* * * * * *"),
        schedules.add("every-500ms", "e2e.record", 0.5, args=("half",)),
        schedules.add("every-700ms", "e2e.record", 0.7, kwargs={"k": 7}),
    ]
    t1 = time.time()
    names = {s.name for s in made}
    assert isinstance(made[1].rule, IntervalRule) and made[1].rule.every_ms == 500
    # The first cron point is the next whole second after it was added (the expected points
    # below count from it).
    assert made[0].next_run is not None
    assert int(t0) + 1 <= made[0].next_run.timestamp() <= int(t1) + 1, (t0, t1, made[0].next_run)

    killed: set[str] = set()
    t_kill = hunt = 0.0
    published: set[str] = set()
    expiry: dict[str, float] = {}
    dead: list[int] = []
    if kill:
        time.sleep(max(0.0, t0 + 8.0 - time.time()))
        victim_index = beat_indexes(procs)[0]
        dead.append(victim_index)
        victim = procs.procs[victim_index][0]
        lease_keys = sorted({store.keys.for_job("{" + n + "}").leases for n in names})
        hunt = time.time()
        caught, ran_before = kill_holding_a_point(
            r, lease_keys, victim.pid, timeout=8.0, prefer_published=5.0
        )
        t_kill = time.time()
        victim.wait(timeout=10)
        assert victim.returncode == -signal.SIGKILL
        # Its points stay leased to the dead beat until the lease expires.
        killed = leases_of(r, lease_keys, victim.pid)
        assert caught and killed, "the beat was never caught holding a point"
        # A leased point's score is its lease expiry: when another beat may claim it again.
        expiry = {k: float(r.zscore(store.keys.for_job(k).due, k) or 0) / 1000.0 for k in killed}
        published = ran_before & killed
        procs.start("beat", env)  # a replacement joins mid-run

    cutoff = round((t0 + window) * 1000)
    expected = {s.name: rule_points(s.rule, round(s.created.timestamp() * 1000), cutoff) for s in made}
    n_expected = sum(len(p) for p in expected.values())
    assert n_expected >= 20 + 40 + 28 - 3, expected

    def all_ran() -> bool:
        got = point_runs(r)
        return all(set(points) <= set(got.get(name, {})) for name, points in expected.items())

    time.sleep(max(0.0, t0 + window - time.time()))
    wait_for(all_ran, 20, 0.2)  # late points are reported as skipped below
    # A point re-delivered after an expired lease would show up within the TTL.
    time.sleep(RECLAIM_TTL + 1.5)

    got = point_runs(r)
    fired = duplicated = skipped = 0
    detail: list[str] = []
    dups: dict[str, list[int]] = {}
    missing: dict[str, list[int]] = {}
    extra: dict[str, list[int]] = {}
    for name, points in expected.items():
        ran = {p: c for p, c in got.get(name, {}).items() if p <= cutoff}
        missing[name] = sorted(set(points) - set(ran))
        extra[name] = sorted(set(ran) - set(points))
        dups[name] = sorted(p for p, c in ran.items() if c > 1)
        fired += len(ran)
        duplicated += len(dups[name])
        skipped += len(missing[name])
        detail.append(f"{name}: {len(points)}/{len(ran)}/{len(dups[name])}/{len(missing[name])}")
    label = "3 beats, one SIGKILLed" if kill else "3 beats"
    print(
        f"\nE2E schedules {label} ({window:.0f} s, reclaim TTL {reclaim_ttl:g} s): points expected "
        f"{n_expected}, fired (distinct) {fired}, duplicated {duplicated}, skipped {skipped} "
        f"[per schedule expected/fired/duplicated/skipped: {', '.join(detail)}]"
    )
    if kill:
        print(
            f"E2E schedules: beat SIGKILLed {t_kill - t0:.1f} s in ({t_kill - hunt:.2f} s to catch it "
            f"holding a point), holding {sorted(killed)}, {len(published)} of them already "
            f"published; runs of those: { {k: int(r.hget('e2e:runs', k) or 0) for k in sorted(killed)} }"
        )
    assert not any(extra.values()), f"points off the rule ran: {extra}"
    assert skipped == 0, f"points skipped: {missing}\n{procs.logs()}"
    late = check_point_records(r, names)
    print(lateness_line(f"schedule points, {label}", late))

    # Nothing ran twice, with a beat killed too: a point the dead beat had published is
    # published again by another beat after its lease, and the workers drop that copy.
    assert duplicated == 0, f"points ran twice: {dups}\n{procs.logs()}"
    if kill:
        held = {parse_point(k) for k in killed}
        assert len({h[0] for h in held if h}) == len(held), "a beat held two points of one schedule"
        by_id: dict[str, list[float]] = defaultdict(list)
        for rec in starts(r):
            by_id[rec["id"]].append(rec["start"])
        for job_id in killed:
            assert 0 < expiry[job_id] <= t_kill + reclaim_ttl, (job_id, expiry[job_id], t_kill)
            # Each held point started once: from the dead beat's message (it had published
            # it) or, once its lease expired, from another beat's.
            assert len(by_id[job_id]) == 1, (job_id, by_id[job_id], expiry[job_id])
            if job_id not in published:
                continue
            assert by_id[job_id][0] < expiry[job_id], (job_id, by_id[job_id], expiry[job_id])
        # ... and the copies of what it had published, sent again by another beat, were dropped.
        keys = store.keys
        dropped = sum(int(r.get(keys.shard(i).dropped) or 0) for i in range(store.config.shards))
        assert dropped >= len(published), (dropped, published)
    assert_running(procs, [i for i in range(len(procs.procs)) if i not in dead])
    # Every schedule still has exactly one point waiting, and its history counts the runs.
    for s in made:
        now = schedules.get(s.name)
        assert now is not None and now.next_run is not None and now.enabled
        assert now.run_count >= len(expected[s.name]), (now, len(expected[s.name]))
    assert list(producer.dq.dead()) == []


# -- managing schedules while beats run ------------------------------------------------------


def test_pause_resume_update_delete_while_beats_run(
    redis_url: str, r: redis.Redis, procs: Procs, producer: Producer
) -> None:
    start_stack(procs, env_with(redis_url, CONF), beats=2)
    warm_up(producer, r, procs)
    schedules = Schedules(producer.app)
    store = get_store(producer.app)

    mid_second()
    steady = schedules.add("steady", "e2e.record", "* * * * * *")
    crud = schedules.add("crud", "e2e.record", "* * * * * *")
    doomed = schedules.add("doomed", "e2e.record", 0.5)
    t_start = now_ms()

    def crud_points() -> list[int]:
        return sorted(point_runs(r).get("crud", {}))

    assert wait_for(lambda: len(crud_points()) >= 2, 15, 0.1), procs.logs()

    # Pause: the waiting point is removed; a point a beat already holds may still run, but
    # nothing after the moment pause() returned.
    schedules.pause("crud")
    t_paused = now_ms()
    paused = schedules.get("crud")
    assert paused is not None and not paused.enabled and paused.next_run is None
    time.sleep(3.0)
    before_resume = crud_points()
    assert before_resume and max(before_resume) <= t_paused, (before_resume, t_paused)
    waiting = r.zrange(store.keys.for_job("{crud}").due, 0, -1)
    assert not any(j.startswith("{crud}@") for j in waiting), waiting

    # Resume: fires again, every second from the next point on.
    t_resume = now_ms()
    resumed = schedules.resume("crud")
    t_resumed = now_ms()
    assert resumed.enabled and resumed.next_run is not None
    assert wait_for(lambda: len([p for p in crud_points() if p > t_resume]) >= 3, 15, 0.1), procs.logs()
    after_resume = [p for p in crud_points() if p > t_resume]
    assert after_resume[0] <= t_resumed + 1000, (after_resume, t_resumed)
    assert consecutive(after_resume, 1000), after_resume

    # Update: per-second -> every 2 s; the new rule applies from the next point.
    t_update = now_ms()
    updated = schedules.update("crud", rule=2.0)
    t_updated = now_ms()
    assert isinstance(updated.rule, IntervalRule) and updated.rule.every_ms == 2000
    anchor = updated.rule.anchor_ms
    assert anchor == round(crud.created.timestamp() * 1000)  # anchored at creation, not now
    assert wait_for(lambda: len([p for p in crud_points() if p > t_updated]) >= 3, 15, 0.1), procs.logs()
    new_rule = [p for p in crud_points() if p > t_updated]
    assert consecutive(new_rule, 2000), new_rule
    assert all((p - anchor) % 2000 == 0 for p in new_rule), (new_rule, anchor)
    old_rule = [p for p in crud_points() if t_resume < p <= t_update]
    assert consecutive(old_rule, 1000) and old_rule, old_rule
    assert new_rule[0] - max(p for p in crud_points() if p <= t_updated) <= 3000

    # Delete: never fires again.
    assert schedules.delete("doomed") is True
    t_deleted = now_ms()
    assert schedules.get("doomed") is None
    assert schedules.delete("doomed") is False
    assert point_runs(r).get("doomed"), "the interval schedule never fired"
    time.sleep(4.0)
    doomed_points = sorted(point_runs(r)["doomed"])
    assert max(doomed_points) <= t_deleted, (doomed_points[-3:], t_deleted)
    waiting = r.zrange(store.keys.for_job("{doomed}").due, 0, -1)
    assert not any(j.startswith("{doomed}@") for j in waiting), waiting
    assert doomed_points == rule_points(
        doomed.rule, round(doomed.created.timestamp() * 1000), doomed_points[-1]
    ), "the interval schedule skipped points before it was deleted"

    # The schedule nobody touched fired every second, once each, through all of it.
    got = point_runs(r)
    steady_points = sorted(got["steady"])
    assert steady_points[0] == steady.rule.next_after(round(steady.created.timestamp() * 1000))
    assert consecutive(steady_points, 1000), steady_points
    assert wait_for(lambda: len(point_runs(r)["steady"]) >= (now_ms() - t_start) // 1000 - 2, 15, 0.2), (
        sorted(point_runs(r)["steady"])[-3:],
        t_start,
        now_ms(),
    )
    dups = {name: [p for p, c in points.items() if c != 1] for name, points in got.items()}
    assert not any(dups.values()), dups
    check_point_records(r, {"steady", "crud", "doomed"})
    assert {s.name for s in schedules.list()} >= {"steady", "crud"}
    assert_running(procs, list(range(len(procs.procs))))


# -- beat_schedule on several beats ----------------------------------------------------------

_SYNC_LINE = re.compile(r"beat_schedule in Redis: (\d+) added, (\d+) updated, (\d+) removed")


def sync_counts(procs: Procs, indexes: list[int]) -> tuple[int, int, int]:
    totals = [0, 0, 0]
    for i in indexes:
        (m,) = _SYNC_LINE.findall(log_of(procs, i))
        for k in range(3):
            totals[k] += int(m[k])
    return totals[0], totals[1], totals[2]


def test_beat_schedule_shared_by_several_beats(
    redis_url: str, r: redis.Redis, procs: Procs, producer: Producer
) -> None:
    conf = {**CONF, "beat_schedule": {"p": {"task": "e2e.record", "schedule": 1.0}}}
    start_stack(procs, env_with(redis_url, conf), beats=3)
    warm_up(producer, r, procs)
    schedules = Schedules(producer.app)
    first_beats = beat_indexes(procs)

    # Three beats stored it once (the others found it unchanged), anchored at the epoch.
    p = schedules.get("p")
    assert p is not None and p.origin == "config" and p.task == "e2e.record"
    assert p.rule == IntervalRule(1000, 0)
    # Each config entry (p, and Celery's own celery.backend_cleanup) was added by one beat;
    # the others found it unchanged.
    config_names = {s.name for s in schedules.list() if s.origin == "config"}
    assert "p" in config_names
    added, updated, _ = sync_counts(procs, first_beats)
    assert (added, updated) == (len(config_names), 0), procs.logs()
    keep = schedules.add("keep", "e2e.record", "* * * * * *")  # made through the API

    assert wait_for(lambda: len(point_runs(r).get("p", {})) >= 4, 30, 0.2), procs.logs()
    p_points = sorted(point_runs(r)["p"])
    assert len(p_points) >= 4, f"p ran {len(p_points)} times\n{procs.logs()}"
    assert all(t % 1000 == 0 for t in p_points), p_points
    assert consecutive(p_points, 1000), p_points
    counts = point_runs(r)["p"]
    assert all(c == 1 for c in counts.values()), counts

    # The same beats restarted with another beat_schedule: "p" leaves the store, the API
    # schedule stays (it is not the config's to remove), "q" arrives.
    for i in first_beats:
        procs.procs[i][0].terminate()
    for i in first_beats:
        procs.procs[i][0].wait(timeout=15)
    t_stopped = now_ms()
    conf2 = {**CONF, "beat_schedule": {"q": {"task": "e2e.record", "schedule": 1.0}}}
    env2 = env_with(redis_url, conf2)
    for _ in range(2):
        procs.start("beat", env2)
    second_beats = [i for i in beat_indexes(procs) if i not in first_beats]
    ready = wait_for(lambda: all("delayq: beat" in log_of(procs, i) for i in second_beats), STARTUP, 0.1)
    assert ready, procs.logs()

    assert schedules.get("p") is None
    q = schedules.get("q")
    assert q is not None and q.origin == "config"
    kept = schedules.get("keep")
    assert kept is not None and kept.origin == "api" and kept.enabled
    assert (kept.rule, kept.created, kept.updated) == (keep.rule, keep.created, keep.updated)
    added, updated, removed = sync_counts(procs, second_beats)
    assert (added, updated) == (1, 0) and removed >= 1, procs.logs()

    assert wait_for(lambda: len(point_runs(r).get("q", {})) >= 3, 15, 0.1), procs.logs()
    time.sleep(2.0)
    got = point_runs(r)
    # Nothing of "p" after the old beats stopped, not even the point that was waiting.
    assert max(got["p"]) <= t_stopped, (sorted(got["p"])[-3:], t_stopped)
    q_points = sorted(got["q"])
    assert consecutive(q_points, 1000) and all(t % 1000 == 0 for t in q_points), q_points
    # The API schedule went on through the restart: the points due while no beat ran were
    # caught up (missed policy "once", within grace), each once.
    keep_points = sorted(got["keep"])
    assert keep_points[0] == keep.rule.next_after(round(keep.created.timestamp() * 1000))
    assert consecutive(keep_points, 1000), keep_points
    assert max(keep_points) > t_stopped
    dups = {name: [t for t, c in points.items() if c != 1] for name, points in got.items()}
    assert not any(dups.values()), dups
    check_point_records(r, {"p", "q", "keep"})
    assert_running(procs, [0, *second_beats])


# -- a schedule whose task retries, under load (issue 13) ------------------------------------


def test_a_schedule_with_a_retrying_task_under_load_runs_every_point(
    redis_url: str, r: redis.Redis, procs: Procs, producer: Producer
) -> None:
    """A per-second cron of ``e2e.flaky``, which fails once and retries with
    ``self.retry(countdown=1)`` (``delayq_intercept_eta`` on), while 1,000 other jobs are due
    each second: every point of 30 s runs twice (first attempt and retry, under the point's
    task id) and the schedule never stalls (the beats' sweep never had to repair it).

    Before, the retry was stored under the point's id: when it came while the beat still held
    the point, it took the point's place, the point's fire found its lease gone, and the
    schedule stopped for good after a run or two (with the fix undone, this test fails: the
    beat's log has the sweep's "was stalled" line, or points are missing). The other jobs go
    to a queue no worker reads
    (``sink``): they load the beat (big claims, long passes), not the worker.
    """
    seconds, per_second = 30, 1000
    env = env_with(redis_url, {"delayq_intercept_eta": True, "delayq_reclaim_ttl": LONG_RECLAIM_TTL})
    producer.app.conf.delayq_intercept_eta = True
    start_stack(procs, env)
    warm_up(producer, r, procs)
    beat_log = procs.procs[1][1]
    # The load, stored before the run: `per_second` jobs due on each whole second, with the
    # schedule's point (cron-aligned load, the worst case: the point shares its claim with them).
    begin = (now_ms() // 1000 + 8) * 1000
    for s in range(seconds + 3):
        producer.record.apply_at_many([((begin + s * 1000) / 1000.0, (), {})] * per_second, queue="sink")
    mid_second()
    schedules = Schedules(producer.app)
    added = schedules.add("retrier", "e2e.flaky", "* * * * * *", kwargs={"fail_times": 1, "countdown": 1.0})
    created = round(added.created.timestamp() * 1000)
    end = max(begin, created) + seconds * 1000
    time.sleep(max(0.0, (end - now_ms()) / 1000.0))
    expected = rule_points(added.rule, created, end)
    assert len(expected) >= seconds
    # The last points' retries come a second or so later; a loaded machine: allow several seconds.
    ran = wait_for(lambda: all(point_runs(r).get("retrier", {}).get(p, 0) >= 2 for p in expected), 30.0, 0.2)
    runs = point_runs(r).get("retrier", {})
    missing = [p for p in expected if runs.get(p, 0) < 2]
    assert ran, (
        f"{len(missing)} of {len(expected)} points did not run twice (first attempt + retry): "
        f"{[schedules_point(p) for p in missing[:5]]}...; runs {sorted(runs.items())[:5]}...; "
        f"schedule {schedules.get('retrier')}\n{procs.logs()}"
    )
    assert all(runs[p] == 2 for p in expected), {p: n for p, n in runs.items() if n != 2}
    retries = sorted(rec["retries"] for rec in starts(r) if parse_point(rec["id"]))
    assert retries.count(0) >= len(expected) and retries.count(1) >= len(expected)
    log = beat_log.read_text(errors="replace")
    assert "was stalled" not in log, log
    assert "ReservedTaskId" not in log and "ReservedTaskId" not in procs.logs()
    sink = int(r.llen("sink"))
    assert sink >= seconds * per_second  # the load did go through the beat
    after = schedules.get("retrier")
    assert after is not None and after.next_run is not None
    assert after.next_run.timestamp() > time.time() - 5, after
    assert_running(procs, [0, 1])
    print(
        f"\n[retrying schedule] {len(expected)} points, each run twice; {sink} other jobs "
        "published to 'sink' meanwhile; no stall repaired"
    )


def schedules_point(point_ms: int) -> str:
    return datetime.fromtimestamp(point_ms / 1000, UTC).isoformat()
