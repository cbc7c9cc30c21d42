"""A naive ``eta`` (and ``expires``) is read as Celery reads it: established by experiment.

One real ``celery worker`` per configuration (``enable_utc`` on/off x ``timezone`` unset,
``Europe/Paris``, ``America/New_York``), each on its own queue, one delayq beat for all,
and one producer process per configuration. Every process runs with ``TZ=Asia/Kolkata``
(UTC+5:30), so this machine's local time differs from UTC and from both zones.

Each producer sends the same naive times twice, at the same moment: to a plain Celery
task (``e2e.plain``: Celery's own ETA, held by the worker) and to a ``DelayedTask``
(``e2e.record``) with ``delayq_intercept_eta`` on (stored by delayq, published by the
beat). The naive times are ``D`` seconds ahead under one reading and hours off under the
others: "now" in UTC, in the app's zone and in the local zone, plus ``D``; the UTC one
also as an ISO string; and two naive ``expires`` that expire before the due time under
one reading and after it under another.

The test asserts what plain Celery did (the rule: a naive value is UTC, whatever
``enable_utc``, ``timezone`` or the machine's zone), and that delayq started every job
at the same instant as plain Celery, or, like it, not at all.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import redis

from tests.support.polling import wait_for
from tests.support.processes import ROOT, Procs, subprocess_env

pytestmark = pytest.mark.e2e

#: Seconds ahead of "now" of every naive time, under the reading that makes it near.
D = 15.0
#: Two starts count as the same instant within this (a loaded 2-core machine; beat wakes
#: within ~2 s of a new job; the interpretations differ by an hour or more).
TOL = 5.0
STARTUP = 90.0
LOCAL_TZ = "Asia/Kolkata"

CONFIGS: list[dict[str, Any]] = [
    {"enable_utc": True},
    {"enable_utc": True, "timezone": "Europe/Paris"},
    {"enable_utc": True, "timezone": "America/New_York"},
    {"enable_utc": False},
    {"enable_utc": False, "timezone": "Europe/Paris"},
    {"enable_utc": False, "timezone": "America/New_York"},
]

#: Runs in a producer process (the app and its settings from DELAYQ_TEST_CONF, TZ set):
#: prints {case: {"eta": iso, "expires": iso|None, "sent": s, "errors": {...}}}.
PRODUCER = r"""
import json, sys, time
from datetime import UTC, datetime, timedelta
from tests.apps.e2e_app import app, plain, record

queue, d = sys.argv[1], float(sys.argv[2])
now = time.time()
utc = datetime.fromtimestamp(now, UTC).replace(tzinfo=None)
zone = datetime.fromtimestamp(now, app.timezone).replace(tzinfo=None)
local = datetime.fromtimestamp(now)
ahead = timedelta(seconds=d)
aware = datetime.fromtimestamp(now, UTC) + ahead
cases = {
    "utc": (utc + ahead, None),
    "utc-iso": ((utc + ahead).isoformat(), None),
    "zone": (zone + ahead, None),
    "local": (local + ahead, None),
    "expires-utc-early": (aware, utc + ahead / 2),
    "expires-utc-late": (aware, utc + ahead * 3),
    "expires-zone-early": (aware, zone + ahead / 2),
    "expires-zone-late": (aware, zone + ahead * 3),
}
out = {}
for case, (eta, expires) in cases.items():
    errors = {}
    for kind, task in (("plain", plain), ("dq", record)):
        try:
            task.apply_async(eta=eta, expires=expires, queue=queue, task_id=f"{queue}-{case}-{kind}")
        except Exception as exc:
            errors[kind] = repr(exc)
    show = lambda v: v if v is None or isinstance(v, str) else v.isoformat()
    out[case] = {"eta": show(eta), "expires": show(expires), "sent": now, "errors": errors}
print(json.dumps(out))
"""


def _utc_reading(value: str) -> float:
    """Seconds since the epoch of an ISO time, a naive one read as UTC."""
    parsed = datetime.fromisoformat(value)
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=UTC)
    return parsed.timestamp()


def _log(procs: Procs, index: int) -> str:
    _, path = procs.procs[index]
    return path.read_text(errors="replace") if path.exists() else ""


def test_a_naive_eta_starts_when_plain_celery_starts_it(
    procs: Procs, redis_url: str, r: redis.Redis, tmp_path: Path
) -> None:
    conf_env = {"TZ": LOCAL_TZ}
    beat_conf = json.dumps({"delayq_intercept_eta": True})
    procs.start("beat", subprocess_env(redis_url, redis_url, DELAYQ_TEST_CONF=beat_conf, **conf_env))
    for n, conf in enumerate(CONFIGS):
        env = subprocess_env(
            redis_url,
            redis_url,
            **conf_env,
            DELAYQ_TEST_CONF=json.dumps({**conf, "delayq_intercept_eta": True}),
        )
        procs.start("worker", env, "-Q", f"q{n}", pool="threads -c 2")
    ready = wait_for(
        lambda: (
            "delayq: beat" in _log(procs, 0)
            and all("ready." in _log(procs, i) for i in range(1, len(CONFIGS) + 1))
        ),
        STARTUP,
        0.2,
    )
    assert ready, f"worker(s) or beat did not start\n{procs.logs()}"

    producers = []
    for n, conf in enumerate(CONFIGS):
        env = subprocess_env(
            redis_url,
            redis_url,
            **conf_env,
            DELAYQ_TEST_CONF=json.dumps({**conf, "delayq_intercept_eta": True}),
        )
        producers.append(
            subprocess.Popen(
                [sys.executable, "-c", PRODUCER, f"q{n}", str(D)],
                env=env,
                cwd=str(ROOT),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
        )
    sent: dict[str, dict[str, Any]] = {}
    failures = []
    for n, proc in enumerate(producers):
        out, err = proc.communicate(timeout=STARTUP)
        assert proc.returncode == 0, err.decode(errors="replace")
        for case, info in json.loads(out).items():
            if info["errors"]:
                failures.append(f"{CONFIGS[n]} {case}: refused: {info['errors']}")
            sent[f"q{n}-{case}"] = info

    # Wait for every job that is to start within the window under the UTC reading, then a
    # little longer so that a job started "too early" or "too late" is seen too.
    last = max(info["sent"] for info in sent.values()) + D
    while time.time() < last + 2 * TOL:
        time.sleep(0.5)
    starts: dict[str, float] = {}
    for raw in r.lrange("e2e:starts", 0, -1):
        row = json.loads(raw)
        assert row["id"] not in starts, f"{row['id']} ran twice"
        starts[row["id"]] = row["start"]

    report = []
    for n, conf in enumerate(CONFIGS):
        for case in [key.split("-", 1)[1] for key in sent if key.startswith(f"q{n}-")]:
            info = sent[f"q{n}-{case}"]
            due = _utc_reading(info["eta"])
            expired = info["expires"] is not None and _utc_reading(info["expires"]) < due
            # Celery's rule (the UTC reading): when it starts, or None when it does not
            # start in this window (expired, or hours ahead).
            expected = None if expired or due > info["sent"] + D + TOL else max(due, info["sent"])
            plain_start = starts.get(f"q{n}-{case}-plain")
            dq_start = starts.get(f"q{n}-{case}-dq")
            report.append(
                f"{conf} {case}: expected {None if expected is None else expected - info['sent']} "
                f"plain {None if plain_start is None else round(plain_start - info['sent'], 2)} "
                f"delayq {None if dq_start is None else round(dq_start - info['sent'], 2)}"
            )
            if (plain_start is None) != (expected is None) or (
                plain_start is not None and expected is not None and abs(plain_start - expected) > TOL
            ):
                failures.append(f"plain Celery did not follow the UTC reading: {report[-1]}")
            if (dq_start is None) != (plain_start is None) or (
                dq_start is not None and plain_start is not None and abs(dq_start - plain_start) > TOL
            ):
                failures.append(f"delayq differs from plain Celery: {report[-1]}")
    print("\n".join(report))
    assert not failures, "\n".join(failures) + "\n" + procs.logs()
