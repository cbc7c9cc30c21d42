"""End to end: the chosen DST rule (``dst_gap``, ``dst_fold``) with a real ``celery beat -S
celery_delayq.Scheduler`` and a real worker, across clock changes that happen during the test.

The real clock cannot be moved, so the zone is: a TZif file (RFC 8536) written by the test,
``DelayQTest/Shift``, found by the beat and worker through ``PYTHONTZPATH`` (and by this
process through ``zoneinfo.reset_tzpath``). Its clocks go forward 12 s at ``G`` (about 20 s
after the test starts) and back 12 s at ``F = G + 20``. A 6-field cron, every 5 s of wall
time, then has three wall times that do not exist (``G``, ``G+5``, ``G+10`` on the wall) and
three that happen twice (``F``, ``F+5``, ``F+10`` on the wall): which instants run is
written out by hand below, per choice, and compared with the worker's records.
"""

from __future__ import annotations

import json
import re
import struct
import time
import zoneinfo
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
import redis

from celery_delayq.schedules.api import Schedules
from tests.support.polling import wait_for
from tests.support.processes import Procs, subprocess_env
from tests.support.stack import Producer, start_stack, warm_up

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ZONE = "DelayQTest/Shift"
SHIFT = 12  # seconds the clocks go forward at G, and back at F = G + 20


_POINT = re.compile(r"\{(?P<name>[^{}]+)\}@(?P<when>\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3})Z")


def point_runs(r: redis.Redis) -> dict[str, dict[int, int]]:
    """schedule name -> {point ms: number of runs}, from the worker's records (the point id
    ``{name}@<UTC time>`` names the instant)."""
    out: dict[str, dict[int, int]] = {}
    for task_id, count in r.hgetall("e2e:runs").items():
        m = _POINT.fullmatch(task_id)
        assert m is not None, f"a run that is not a schedule point: {task_id}"
        when = datetime.strptime(m["when"], "%Y-%m-%dT%H:%M:%S.%f").replace(tzinfo=UTC)
        out.setdefault(m["name"], {})[round(when.timestamp() * 1000)] = int(count)
    return out


def tzif(transitions: list[tuple[int, int]]) -> bytes:
    """A version-2 TZif file: offset 0 ("STD") before the first transition, then each
    ``(instant, type)`` with type 0 = offset 0, type 1 = offset ``SHIFT`` ("DST")."""
    types = [(0, 0, 0), (SHIFT, 1, 4)]  # (utoff, isdst, index into the abbreviations)
    chars = b"STD\0DST\0"

    def block(time_format: str) -> bytes:
        header = b"TZif2" + b"\0" * 15 + struct.pack(">6l", 0, 0, 0, len(transitions), len(types), len(chars))
        body = b"".join(struct.pack(">" + time_format, t) for t, _ in transitions)
        body += bytes(kind for _, kind in transitions)
        body += b"".join(struct.pack(">lBB", *ttinfo) for ttinfo in types)
        return header + body + chars

    return block("l") + block("q") + b"\nSTD0\n"


@pytest.fixture
def shifting_zone(tmp_path: Path) -> Iterator[Path]:
    """The directory of the zone, on this process's zone path (the file is written by
    :func:`write_zone`: each process reads it when it first uses the zone)."""
    root = tmp_path / "zones"
    (root / "DelayQTest").mkdir(parents=True)
    before = zoneinfo.TZPATH
    zoneinfo.reset_tzpath(to=[str(root), *before])
    zoneinfo.ZoneInfo.clear_cache(only_keys=[ZONE])
    yield root
    zoneinfo.reset_tzpath(to=before)
    zoneinfo.ZoneInfo.clear_cache(only_keys=[ZONE])


@pytest.fixture
def producer(redis_url: str) -> Iterator[Producer]:
    made = Producer(redis_url, redis_url)
    yield made
    made.close()


def write_zone(root: Path) -> int:
    """Write the zone, its clocks forward at ``G`` and back at ``G + 20``; returns ``G``, a
    multiple of 5 s 15-20 s from now."""
    g = (int(time.time()) // 5 + 4) * 5
    (root / ZONE).write_bytes(tzif([(g, 1), (g + 20, 0)]))
    return g


def test_the_zone_file_reads_as_intended(shifting_zone: Path) -> None:
    g = write_zone(shifting_zone)
    tz = zoneinfo.ZoneInfo(ZONE)
    assert datetime.fromtimestamp(g - 1, tz).utcoffset().total_seconds() == 0  # type: ignore[union-attr]
    assert datetime.fromtimestamp(g, tz).utcoffset().total_seconds() == SHIFT  # type: ignore[union-attr]
    assert datetime.fromtimestamp(g + 20, tz).utcoffset().total_seconds() == 0  # type: ignore[union-attr]
    assert datetime.fromtimestamp(g + 1000, tz).utcoffset().total_seconds() == 0  # type: ignore[union-attr]


def test_beat_and_worker_run_what_each_choice_says_across_real_transitions(
    redis_url: str, r: redis.Redis, procs: Procs, producer: Producer, shifting_zone: Path
) -> None:
    conf = json.dumps({"delayq_reclaim_ttl": 30.0})
    env = subprocess_env(redis_url, redis_url, DELAYQ_TEST_CONF=conf, PYTHONTZPATH=str(shifting_zone))
    start_stack(procs, env)
    warm_up(producer, r, procs)
    g = write_zone(shifting_zone)  # before any process reads the zone
    f = g + 20

    schedules = Schedules(producer.app)
    every_5s = "* * * * * */5"  # seconds last: every 5 s of wall time
    choices = {
        "jump-both": ("jump", "both"),
        "skip-both": ("skip", "both"),
        "skip-first": ("skip", "first"),
        "skip-last": ("skip", "last"),
    }
    for name, (gap, fold) in choices.items():
        made = schedules.add(name, "e2e.record", every_5s, tz=ZONE, dst_gap=gap, dst_fold=fold)
        assert (made.dst_gap, made.dst_fold) == (gap, fold)
    assert time.time() < g - 6, "the schedules were stored too late: the first point is too close"
    shown = schedules.get("skip-last")
    assert shown is not None and shown.rule.describe().endswith("(DST gap skip, fold last)")

    end = f + 20
    assert wait_for(
        lambda: all(end * 1000 in point_runs(r).get(n, {}) for n in choices), end - time.time() + 20, 0.2
    ), (
        point_runs(r),
        procs.logs(),
    )

    # Wall time every 5 s: before G the offset is 0 (instants at multiples of 5); the wall times
    # G, G+5, G+10 do not exist (the clocks go from G to G+12); between G and F it is +12 s
    # (wall G+15 at G+3, then F at G+8, F+5 at G+13, F+10 at G+18); after F it is 0 again (the
    # wall times F, F+5, F+10 come a second time).
    before, middle_unique, first_occurrence = [g - 5], [g + 3], [g + 8, g + 13, g + 18]
    second_occurrence, after = [f, f + 5, f + 10], [f + 15, f + 20]
    expected = {
        "jump-both": [*before, g, *middle_unique, *first_occurrence, *second_occurrence, *after],
        "skip-both": before + middle_unique + first_occurrence + second_occurrence + after,
        "skip-first": before + middle_unique + first_occurrence + after,
        "skip-last": before + middle_unique + second_occurrence + after,
    }
    runs = point_runs(r)
    for name, instants in expected.items():
        seen = runs.get(name, {})
        window = {t: n for t, n in seen.items() if (g - 5) * 1000 <= t <= end * 1000}
        assert sorted(window) == [t * 1000 for t in instants], (name, sorted(window), procs.logs())
        assert set(window.values()) == {1}, (name, window)  # each point ran once
