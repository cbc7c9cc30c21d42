"""What a pass does with each claimed job, decided from plain values (no Redis, no broker):
:func:`celery_delayq.beat.dispositions.disposition`, and the pass's state and result."""

from __future__ import annotations

import pytest

from celery_delayq.beat.dispositions import Disposition, PassResult, PassState, disposition, due_in_range
from celery_delayq.beat.firing import FireCall
from celery_delayq.beat.gating import GatePass
from celery_delayq.beat.publish import Outcome
from celery_delayq.due import MAX_DUE_MS
from celery_delayq.store.delivery import ClaimedJob, ClaimResult, PushResult
from celery_delayq.store.envelope import Envelope

DUE = 1_767_225_600_000  # 2026-01-01T00:00:00Z
KNOWN = frozenset({"t.add"})


def job(job_id: str = "j1", due_ms: int = DUE) -> ClaimedJob:
    return ClaimedJob(job_id, "{}", due_ms, 1)


def envelope(
    task: str = "t.add", headers: dict[str, object] | None = None, schedule: tuple[str, int] | None = None
) -> Envelope:
    body = b"[[], {}, {}]"
    return Envelope(task, headers or {}, {}, body, "application/json", "utf-8", {}, None, 0, schedule)


def decide(
    claimed: ClaimedJob,
    decoded: Envelope | ValueError,
    gate: GatePass | None = None,
    *,
    dead_letter_unknown: bool = True,
) -> Disposition:
    gate = gate or GatePass()
    return disposition(claimed, decoded, gate, registered=KNOWN, dead_letter_unknown=dead_letter_unknown)


def test_a_plain_job_of_a_known_task_is_published() -> None:
    assert decide(job(), envelope()) is Disposition.PUBLISH


@pytest.mark.parametrize("due_ms", [-1, MAX_DUE_MS + 1, 10**23])
def test_a_due_time_that_is_no_time_is_corrupt_before_anything_else(due_ms: int) -> None:
    """Even a job the gate keeps, with an envelope that does not read: the due time comes first."""
    bad = job(due_ms=due_ms)
    assert not due_in_range(bad)
    assert decide(bad, envelope()) is Disposition.CORRUPT_DUE
    assert decide(bad, ValueError("x"), GatePass(skip={"j1"})) is Disposition.CORRUPT_DUE


@pytest.mark.parametrize("due_ms", [0, DUE, MAX_DUE_MS])
def test_the_ends_of_the_due_range_are_times(due_ms: int) -> None:
    assert due_in_range(job(due_ms=due_ms))
    assert decide(job(due_ms=due_ms), envelope()) is Disposition.PUBLISH


def test_a_job_the_gate_keeps_is_kept_whatever_its_envelope() -> None:
    gate = GatePass(skip={"j1"})
    assert decide(job(), envelope(), gate) is Disposition.KEPT
    assert decide(job(), ValueError("does not read"), gate) is Disposition.KEPT
    assert decide(job(), envelope(task="t.unknown"), gate) is Disposition.KEPT
    assert decide(job("j2"), envelope(), gate) is Disposition.PUBLISH  # another job of the pass


def test_an_envelope_that_does_not_read_is_corrupt() -> None:
    assert decide(job(), ValueError("not JSON")) is Disposition.CORRUPT_ENVELOPE


def test_a_schedule_point_is_fired_even_when_its_task_is_unknown() -> None:
    point = envelope(task="t.unknown", schedule=("nightly", DUE))
    assert decide(job(), point) is Disposition.FIRE


def test_an_unknown_task_is_dead_lettered_unless_a_retry_or_allowed() -> None:
    assert decide(job(), envelope(task="t.unknown")) is Disposition.UNKNOWN_TASK
    assert decide(job(), envelope(task="t.unknown", headers={"retries": 2})) is Disposition.PUBLISH
    assert decide(job(), envelope(task="t.unknown", headers={"retries": True})) is Disposition.UNKNOWN_TASK
    assert decide(job(), envelope(task="t.unknown"), dead_letter_unknown=False) is Disposition.PUBLISH


def test_a_released_gated_job_is_released_unless_its_task_is_unknown() -> None:
    gate = GatePass(released={"j1": "key-a"})
    assert decide(job(), envelope(), gate) is Disposition.RELEASE
    assert decide(job(), envelope(task="t.unknown"), gate) is Disposition.UNKNOWN_TASK
    assert decide(job("j2"), envelope(), gate) is Disposition.PUBLISH


class NoBroker:
    """A publishing strategy for the pass's state; the pass's state never publishes."""

    def publish(self, shard: int, job: ClaimedJob, envelope: Envelope) -> Outcome:
        raise AssertionError("not called")


def test_the_pass_state_hands_on_its_acks_holds_and_fires_and_discards_them_all() -> None:
    state = PassState(GatePass(), NoBroker())
    assert state.pusher is None and state.misses == {}
    fire = FireCall(0, "p1", "nightly", DUE, "p1", "p2", DUE + 1, "{}")
    state.acks[3].append("j1")
    state.holds[5].append(("j2", "key-a"))
    state.fires.append(fire)
    state.sent.append(DUE)
    state.released.append(DUE)
    result = state.result()
    assert result == PassResult({3: ["j1"]}, {5: [("j2", "key-a")]}, [fire])
    state.discard()
    assert state.result() == PassResult() and state.sent == state.released == []
    assert result.acks == {3: ["j1"]}  # what was handed on is not changed by the discard


def test_a_claim_reads_as_a_push_that_pushed_nothing() -> None:
    """The pass reads both scripts' results with the same attributes, never by their type."""
    claim = ClaimResult(2, DUE, None, [job()])
    push = PushResult(2, DUE, None, [job()], 0, 3, [(5, 3)], [("celery", "t.add", 3)], {"j1": "f"})
    for result in (claim, push):
        assert {"pushed", "lateness", "used", "misses"} <= set(vars(result))
    assert (claim.pushed, claim.lateness, claim.used, claim.misses) == (0, [], [], {})
