"""The gate's slots against a model: a hypothesis state machine drives the flow-control
scripts (through :class:`Store`: claim, gate, hold, release, set_limit, pause, resume, cancel)
and a small pure-Python model side by side, and checks after every step that they agree.

Covered: jobs of three keys (own limits 2, 1 and none) added, claimed and gated by two beats
(released, parked, redelivered into the slot they have), held, released by their workers
(succeeded, failed, a retry that stored the job again, and releases repeated), the limit
changed (raised, lowered, "none", cleared), keys paused and resumed, jobs cancelled in any
state (a cancelled running job keeps its slot until it expires and the next gate purges it),
a worker or a beat dying (its job's slot or lease expires and another claim takes it again).

Time: the scripts read the server's ``TIME``, which cannot be faked; expiry is modelled by
editing scores: a dead worker's job gets due score and slot score "server now - 1" (what they
would be once its slot expired), a dead beat's job its due score, a cancelled job's slot its
slot score. Every other time is far from now: jobs are added due in the past, leases last
30 s and slots 60 s, so which jobs a claim takes is never ambiguous. Their order is the
store's (score, then id): the model takes the order of each claim as given and predicts every
gate decision in it.

Invariants: at every step a key's running slots are at most its limit in force (or, after the
limit was lowered, at most what ran then: running jobs finish); no job is lost or invented
(every job of the model is in Redis with its score, envelope, lease entry, slot and place in
its key's waiting list, and nothing else is); no job is both parked and running.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, cast

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from celery_delayq.flow.gate import PARK_MS, Gate
from celery_delayq.store.facade import Store
from celery_delayq.store.flow import GateDecision, ReleaseResult
from celery_delayq.store.jobs import CancelOutcome, EnqueueOutcome
from celery_delayq.store.lua_formats import lease_entry, wait_score
from tests.support.store import make_store, server_ms

SHARDS = 2
#: The keys and the limit each of their jobs carries.
OWN = {"k1": 2, "k2": 1, "k3": None}
KEYS = sorted(OWN)
TOKENS = ["beat-a:1:0123456789ab", "beat-b:2:ba9876543210"]
SLOT_MS = 60_000
PRIORITIES = [0, 3, 9]
#: Most jobs one example adds (so that a gate's purge, 10 expired slots at most, sees them all).
MAX_JOBS = 9

#: derandomize: the same examples every run, so that the coverage check below (each path reached)
#: cannot fail by chance (a CI run once drew 345 examples without a "release:promoted")
SETTINGS = settings(
    derandomize=True,
    max_examples=300,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


@dataclass
class Job:
    """One stored job as the model sees it.

    state: "waiting" (no lease, due at ``due``), "released" (a beat's lease and a slot),
    "running" (lease "run" and a slot), "parked" (lease "gate", PARK_MS, in the waiting list),
    "promoted" (lease "gate", due now), "expired" (its lease, "run" or a beat's, has passed:
    due again at ``score``; it has a slot)."""

    key: str
    priority: int
    due: int
    state: str = "waiting"
    tries: int = 0
    token: str | None = None  # the lease's token; None: no lease entry
    score: int | None = None  # known exactly: "waiting" (due), "parked", "expired"

    def lease(self) -> str | None:
        return None if self.token is None else lease_entry(self.due, self.tries, self.token)


class GateMachine(RuleBasedStateMachine):
    def __init__(self, store: Store, stats: Counter[str]) -> None:
        super().__init__()
        self.store = store
        self.client = store.client
        self.client.flushdb()
        self.stats = stats
        stats["examples"] += 1
        self.jobs: dict[str, Job] = {}
        self.released_once: set[str] = set()  # ids that ever had a slot (double releases)
        #: key -> {id: expired score or None (a live slot)}: the slots of gate:run:<key>
        self.run: dict[str, dict[str, int | None]] = {k: {} for k in KEYS}
        #: key -> {id: order score}: gate:wait:<key> (a cancelled parked job's entry stays)
        self.wait: dict[str, dict[str, int]] = {k: {} for k in KEYS}
        self.seen: dict[str, str] = {}  # gate:keys
        self.override: dict[str, str] = {}  # the run-time limit of each gate:keys entry
        self.paused: set[str] = set()
        #: key -> most slots it may hold now: its limit, or what ran when the limit was lowered
        self.allowed: dict[str, float] = {k: float("inf") for k in KEYS}
        self.counter = 0

    # -- the model's rules -------------------------------------------------------------------

    def in_force(self, key: str) -> int | None:
        override = self.override.get(key)
        if override == "none":
            return None
        if override is not None:
            return int(override)
        own = self.seen.get(key, "")
        return int(own) if own else None

    def purge(self, key: str) -> int:
        """Up to 10 expired slots (by score, then id) whose job is gone are removed."""
        slots = self.run[key]
        purged = 0
        for _, old in sorted((s, i) for i, s in slots.items() if s is not None)[:10]:
            if old not in self.jobs:
                del slots[old]
                purged += 1
                self._count("purged")
        return purged

    def promote(self, key: str) -> int:
        """As lua/includes/gate.lua's: nothing for a paused key or one with no parked job; the
        expired slots whose job is gone are purged only when the key has no free slot."""
        if key in self.paused or not self.wait[key]:
            return 0
        limit = self.in_force(key)
        free = len(self.wait[key]) if limit is None else limit - len(self.run[key])
        if limit is not None and free <= 0 and self.purge(key) > 0:
            free = limit - len(self.run[key])
        moved = 0
        while moved < free and self.wait[key]:
            job_id = min(self.wait[key], key=lambda i: (self.wait[key][i], i))
            del self.wait[key][job_id]
            job = self.jobs.get(job_id)
            if job is not None and job.state == "parked":
                job.state, job.score = "promoted", None
                moved += 1
        return moved

    def _limit_changed(self, key: str) -> None:
        limit = self.in_force(key)
        self.allowed[key] = float("inf") if limit is None else max(limit, len(self.run[key]))

    def _count(self, name: str) -> None:
        self.stats[name] += 1

    def _with(self, *states: str) -> list[str]:
        return sorted(i for i, j in self.jobs.items() if j.state in states)

    # -- producers and beats -----------------------------------------------------------------

    @initialize(jobs=st.lists(st.tuples(st.sampled_from(KEYS), st.sampled_from(PRIORITIES)), max_size=4))
    def start_with_jobs(self, jobs: list[tuple[str, int]]) -> None:
        for key, priority in jobs:
            self.add(key, priority, 1)

    @precondition(lambda self: self.counter < MAX_JOBS)
    @rule(key=st.sampled_from(KEYS), priority=st.sampled_from(PRIORITIES), n=st.integers(1, 3))
    def add(self, key: str, priority: int, n: int) -> None:
        now = server_ms(self.client)
        jobs = []
        for _ in range(min(n, MAX_JOBS - self.counter)):
            self.counter += 1
            job_id = "{" + key + "}" + f"j{self.counter}"
            due = now - 1000 + self.counter
            self.jobs[job_id] = Job(key, priority, due, score=due)
            jobs.append((job_id, due, f"env-{job_id}-{priority}"))
        assert self.store.enqueue(jobs) == [(EnqueueOutcome.NEW, due) for _, due, _ in jobs]

    @rule(token=st.sampled_from(TOKENS))
    def claim_and_gate(self, token: str) -> None:
        """A beat's pass: claim every due job, gate them all (one call a shard)."""
        due = set(self._with("waiting", "promoted", "expired"))
        by_shard: dict[int, list[tuple[str, Gate]]] = {}
        claimed: list[str] = []
        for result in self.store.claim(range(SHARDS), token):
            for got in result.jobs:
                job = self.jobs[got.id]
                assert (got.due_ms, got.tries) == (job.due, job.tries + 1), got
                job.tries += 1
                job.token = token
                claimed.append(got.id)
            if result.jobs:
                by_shard[result.shard] = [(j.id, self._gate(j.id)) for j in result.jobs]
        assert sorted(claimed) == sorted(due)
        if not by_shard:
            return
        decisions = self.store.gate(token, by_shard, SLOT_MS)
        for shard_jobs in by_shard.values():
            for job_id, _ in shard_jobs:
                expected = self._decide(job_id)
                assert decisions[job_id].decision == expected, (job_id, decisions[job_id], expected)
                self._count(f"gate:{expected}")

    def _gate(self, job_id: str) -> Gate:
        job = self.jobs[job_id]
        return Gate(job.key, OWN[job.key], priority=job.priority)

    def _decide(self, job_id: str) -> GateDecision:
        """The model of lua/gate.lua for one held job (in the order the store gates them)."""
        job = self.jobs[job_id]
        key = job.key
        own = OWN[key]
        self.seen[key] = "" if own is None else str(own)
        slots = self.run[key]
        purged = self.purge(key)
        if purged:
            self._count("gate:purged")
        if job_id in slots:
            slots[job_id] = None
            job.state, job.score = "released", None
            decision = GateDecision.RELEASED
            self._count("gate:redelivered")
        else:
            limit = self.in_force(key)
            if key in self.paused or (limit is not None and limit <= len(slots)):
                job.state, job.score, job.token = "parked", PARK_MS, "gate"
                job.tries -= 1
                self.wait[key][job_id] = wait_score(job.priority, job.due)
                decision = GateDecision.PARKED
            else:
                slots[job_id] = None
                self.released_once.add(job_id)
                job.state, job.score = "released", None
                decision = GateDecision.RELEASED
        if purged:
            self.promote(key)
        return decision

    @rule(data=st.data(), token=st.sampled_from(TOKENS))
    def hold(self, data: st.DataObject, token: str) -> None:
        """A beat holds what it published (mostly jobs it released; also any other id: one
        another beat took, one released already, one never released)."""
        mine = [i for i in self._with("released", "expired") if self.jobs[i].token == token]
        others = sorted(self.jobs) + sorted(self.released_once - set(self.jobs))
        if not mine and not others:
            return
        ids = data.draw(st.lists(st.sampled_from(mine or others), min_size=1, max_size=3, unique=True))
        if others and data.draw(st.booleans()):
            extra = data.draw(st.sampled_from(others))
            if extra not in ids:
                ids.append(extra)
        by_shard: dict[int, list[tuple[str, str]]] = {}
        for job_id in ids:
            key = job_id[1 : job_id.index("}")]
            by_shard.setdefault(self.store.keys.shard_of(key), []).append((job_id, key))
        got = self.store.hold(token, by_shard, SLOT_MS)
        for job_id in ids:
            job = self.jobs.get(job_id)
            # A beat that still has the lease entry holds it, even after its lease expired
            # (a slow beat, not a dead one), as long as no other beat took the job.
            held = job is not None and job.token == token and job_id in self.run[job.key]
            # Nothing to do (also True): its worker started it (lease "run", slot kept), or it
            # finished already (no job, no slot).
            key = job_id[1 : job_id.index("}")]
            started = job is not None and job.token == "run" and job_id in self.run[job.key]
            finished = job is None and job_id not in self.run.get(key, {})
            assert got[job_id] == (held or started or finished), (job_id, job)
            if held and job is not None:
                job.state, job.token, job.score = "running", "run", None
                self.run[job.key][job_id] = None
                self._count("hold:held")
            else:
                self._count("hold:refused")

    @rule(token=st.sampled_from(TOKENS), data=st.data())
    def stale_gate(self, token: str, data: st.DataObject) -> None:
        """Gate jobs this token does not hold: each is NOT_HELD and nothing changes for it."""
        others = sorted(i for i, j in self.jobs.items() if j.token != token)
        if not others:
            return
        job_id = data.draw(st.sampled_from(others))
        key = self.jobs[job_id].key
        shard = self.store.keys.shard_of(key)
        result = self.store.gate(token, {shard: [(job_id, self._gate(job_id))]}, SLOT_MS)
        assert result[job_id].decision == GateDecision.NOT_HELD
        own = OWN[key]
        self.seen[key] = "" if own is None else str(own)  # every key a call sees is recorded

    # -- workers -----------------------------------------------------------------------------

    @rule(data=st.data(), outcome=st.sampled_from(["succeeded", "failed"]))
    def release(self, data: st.DataObject, outcome: str) -> None:
        """A worker's task ends (its job may be running, still the beat's, expired or
        cancelled), or a release comes again for a slot given back already."""
        candidates = sorted(self.released_once)
        if not candidates:
            return
        job_id = data.draw(st.sampled_from(candidates))
        key = job_id[1 : job_id.index("}")]
        result = self.store.release(job_id, key, outcome)
        if job_id not in self.run[key]:
            assert result == ReleaseResult(False, 0, False)
            self._count("release:again")
            return
        del self.run[key][job_id]
        job = self.jobs.get(job_id)
        if job is not None:
            assert job.token not in (None, "gate"), job
            del self.jobs[job_id]
        assert result == ReleaseResult(True, self.promote(key), False)
        self._count("release:promoted" if result.promoted else "release:released")

    @rule(data=st.data())
    def retry(self, data: st.DataObject) -> None:
        """A running task retries with a countdown: the job is stored again (its lease
        dropped) and the worker's release ("retry") keeps it."""
        running = self._with("running")
        if not running:
            return
        job_id = data.draw(st.sampled_from(running))
        job = self.jobs[job_id]
        due = server_ms(self.client) - 500
        assert self.store.enqueue([(job_id, due, f"retry-{job_id}")]) == [(EnqueueOutcome.AFTER_HELD, due)]
        self.jobs[job_id] = Job(job.key, job.priority, due, score=due)
        del self.run[job.key][job_id]
        result = self.store.release(job_id, job.key, "retry")
        assert result == ReleaseResult(True, self.promote(job.key), False)
        self._count("release:retry")

    @rule(data=st.data(), what=st.sampled_from(["worker", "beat", "cancelled"]))
    def time_passes(self, data: st.DataObject, what: str) -> None:
        """A worker or a beat dies, or a cancelled running job's slot expires: see below."""
        {"worker": self.worker_dies, "beat": self.beat_dies, "cancelled": self.gone_slot_expires}[what](data)

    def worker_dies(self, data: st.DataObject) -> None:
        """A running job's worker died: its slot and its score expire (set to now - 1)."""
        running = self._with("running")
        if not running:
            return
        job_id = data.draw(st.sampled_from(running))
        job = self.jobs[job_id]
        expired = server_ms(self.client) - 1
        keys = self.store.keys.for_key(job.key)
        self.client.zadd(keys.due, {job_id: expired})
        self.client.zadd(keys.running(job.key), {job_id: expired})
        job.state, job.score = "expired", expired
        self.run[job.key][job_id] = expired
        self._count("worker_dies")

    def beat_dies(self, data: st.DataObject) -> None:
        """A beat died between publishing a released job and holding it: its lease expires."""
        released = self._with("released")
        if not released:
            return
        job_id = data.draw(st.sampled_from(released))
        job = self.jobs[job_id]
        expired = server_ms(self.client) - 1
        self.client.zadd(self.store.keys.for_key(job.key).due, {job_id: expired})
        job.state, job.score = "expired", expired
        self._count("beat_dies")

    @rule(data=st.data(), dies=st.booleans())
    def cancel(self, data: st.DataObject, dies: bool) -> None:
        """Cancel a job in any state; a running one keeps its slot until its worker releases
        it, or (``dies``: its worker dies too) until the slot expires; a promoted one's key is
        promoted again (lua/cancel.lua)."""
        if not self.jobs:
            return
        job_id = data.draw(st.sampled_from(sorted(self.jobs)))
        job = self.jobs.pop(job_id)
        # a gated job (lease "gate": parked or promoted) waited: it was never delivering
        expected = CancelOutcome.CANCELLED if job.token in (None, "gate") else CancelOutcome.DELIVERING
        assert self.store.cancel(job_id) == expected
        self._count(f"cancel:{job.state}")
        if job.state == "promoted":  # it carried the key's turn: the cancel promotes the key again
            self.promote(job.key)
        if dies and self.run[job.key].get(job_id, 0) is None:
            expired = server_ms(self.client) - 1
            self.client.zadd(self.store.keys.for_key(job.key).running(job.key), {job_id: expired})
            self.run[job.key][job_id] = expired

    def gone_slot_expires(self, data: st.DataObject) -> None:
        """The slot of a job cancelled while it ran expires (its worker died too)."""
        gone = sorted(
            (key, i)
            for key, slots in self.run.items()
            for i, s in slots.items()
            if i not in self.jobs and s is None
        )
        if not gone:
            return
        key, job_id = data.draw(st.sampled_from(gone))
        expired = server_ms(self.client) - 1
        self.client.zadd(self.store.keys.for_key(key).running(key), {job_id: expired})
        self.run[key][job_id] = expired

    # -- operators ---------------------------------------------------------------------------

    @rule(
        key=st.sampled_from(KEYS),
        op=st.sampled_from(["limit", "limit", "clear", "pause", "resume"]),
        limit=st.one_of(st.none(), st.integers(1, 4)),
    )
    def admin(self, key: str, op: str, limit: int | None) -> None:
        """An operator sets a limit (a number or none: raised, lowered), clears it, pauses or
        resumes the key; each promotes parked jobs into the free slots."""
        if op == "limit":
            got = self.store.set_limit(key, limit)
            self.override[key] = "none" if limit is None else str(limit)
        elif op == "clear":
            got = self.store.clear_limit(key)
            self.override.pop(key, None)
        elif op == "pause":
            got = self.store.pause(key)
            self.paused.add(key)
        else:
            got = self.store.resume(key)
            self.paused.discard(key)
        self.seen.setdefault(key, "")
        self._limit_changed(key)
        assert got == self.promote(key)
        self._count("admin:promoted" if got else "admin")

    # -- invariants --------------------------------------------------------------------------

    @invariant()
    def slots_within_the_limit(self) -> None:
        for key in KEYS:
            limit = self.in_force(key)
            running = len(self.run[key])
            if limit is None:
                self.allowed[key] = float("inf")
            else:
                self.allowed[key] = max(limit, min(self.allowed[key], running))
            assert running <= self.allowed[key], (key, running, limit)
            # Redis agrees on the count.
            assert self.client.zcard(self.store.keys.for_key(key).running(key)) == running

    @invariant()
    def redis_agrees_with_the_model(self) -> None:
        now = server_ms(self.client)
        with self.client.pipeline(transaction=False) as pipe:
            for index in range(SHARDS):
                keys = self.store.keys.shard(index)
                pipe.zrange(keys.due, 0, -1, withscores=True)
                pipe.hkeys(keys.jobs)
                pipe.hgetall(keys.leases)
            for key in KEYS:
                keys = self.store.keys.for_key(key)
                pipe.zrange(keys.running(key), 0, -1, withscores=True)
                pipe.zrange(keys.waiting(key), 0, -1, withscores=True)
            pipe.keys("*")
            replies = iter(pipe.execute())
        due: dict[str, float] = {}
        stored: set[str] = set()
        leases: dict[str, str] = {}
        for _ in range(SHARDS):
            due.update(next(replies))
            stored.update(next(replies))
            leases.update(next(replies))
        # No job lost, none invented.
        assert set(due) == stored == set(self.jobs)
        assert leases == {i: j.lease() for i, j in self.jobs.items() if j.token is not None}
        for job_id, job in self.jobs.items():
            score = due[job_id]
            if job.score is not None:
                assert score == job.score, (job_id, job, score)
            elif job.state == "promoted":
                assert score <= now - job.priority, (job_id, job, score)
            else:  # released (the beat's lease) or running (its slot)
                assert score > now, (job_id, job, score)
        for key in KEYS:
            run = dict(next(replies))
            wait = dict(next(replies))
            assert set(run) == set(self.run[key]), key
            for job_id, expired in self.run[key].items():
                assert run[job_id] == expired if expired is not None else run[job_id] > now
                if self.jobs.get(job_id) is not None and self.jobs[job_id].state == "running":
                    assert due[job_id] == run[job_id]  # a running job's score is its slot
            assert wait == {i: float(s) for i, s in self.wait[key].items()}, key
            # No job both parked and running; every parked job is in its key's list.
            for job_id, job in self.jobs.items():
                if job.key != key:
                    continue
                if job.state == "parked":
                    assert job_id in wait and job_id not in run
                if job_id in run:
                    assert job.state in ("released", "running", "expired"), (job_id, job)
        allowed = {
            f"{self.store.keys.shard(i).base}{name}"
            for i in range(SHARDS)
            for name in ("due", "jobs", "leases", "wake", "gate:keys")
        }
        allowed |= {self.store.keys.for_key(k).running(k) for k in KEYS}
        allowed |= {self.store.keys.for_key(k).waiting(k) for k in KEYS}
        assert set(next(replies)) <= allowed


@pytest.fixture
def gate_store(redis_url: str) -> Iterator[Store]:
    store = make_store(redis_url, reclaim_ttl=30.0, shards=SHARDS)
    yield store
    store.close()


@pytest.mark.slow
def test_the_gate_agrees_with_its_model(gate_store: Store) -> None:
    stats: Counter[str] = Counter()
    started = time.monotonic()

    def factory() -> GateMachine:
        return GateMachine(gate_store, stats)

    run_state_machine_as_test(cast(Any, factory), settings=SETTINGS)
    steps = sorted((k, v) for k, v in stats.items() if k != "examples")
    print(
        f"\ngate model: {stats['examples']} examples in {time.monotonic() - started:.1f} s; "
        + ", ".join(f"{k} {v}" for k, v in steps)
    )
    # The machine reached the paths that matter, not only the easy ones (each came up 4 times
    # or more in every run while this test was written; admin:promoted, rarer, is in the line).
    for name in (
        "gate:parked",
        "gate:released",
        "gate:redelivered",
        "purged",
        "hold:held",
        "release:promoted",
        "release:again",
        "release:retry",
        "cancel:running",
        "cancel:parked",
    ):
        assert stats[name] > 0, name
