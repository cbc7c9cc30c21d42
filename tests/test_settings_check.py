"""Unknown ``delayq_*`` names are named where the user looks (issue 52), and what
``delayq_intercept_eta`` covers is said at start.

* A ``delayq_*`` name that is not a setting (``delayq_urll``) is logged once per app, with the
  closest setting: at a producer's first use (its stderr), and in a real beat's and a real
  worker's start log; ``delayq_strict_settings`` makes it a ``ConfigurationError`` (a beat
  and a worker stop with one line).
* With ``delayq_intercept_eta`` on, a beat and a worker log how many tasks it covers and which
  plain tasks keep Celery's ETA path.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap

import pytest
from celery import Celery

from celery_delayq import DelayedTask
from celery_delayq.beat.scheduler import BeatConfigurationError, Scheduler
from celery_delayq.config import (
    DelayQConfig,
    check_settings,
    intercept_line,
    reconfigure,
    unknown_settings,
)
from celery_delayq.exceptions import ConfigurationError
from tests.support.polling import wait_for
from tests.support.processes import ROOT, Procs, subprocess_env
from tests.support.stack import STARTUP, log_of

TYPO = "unknown setting delayq_urll (did you mean delayq_url?)"


def new_app(**conf: object) -> Celery:
    app = Celery("typo", broker="redis://127.0.0.1:6390/0", set_as_current=False)
    app.conf.update(conf)
    return app


def test_unknown_names_with_the_closest_setting() -> None:
    app = new_app(
        delayq_urll="redis://x:1/0",
        delayq_shard=4,
        delayq_intercept_etas=True,
        delayq_batchsize=10,
        delayq_prefix="ok",  # a setting
        delayq_nothing_like_it=1,
        other_delayq_url=1,  # not a delayq_* name
    )
    assert unknown_settings(app) == [
        "unknown setting delayq_batchsize (did you mean delayq_batch_size?)",
        "unknown setting delayq_intercept_etas (did you mean delayq_intercept_eta?)",
        "unknown setting delayq_nothing_like_it",
        "unknown setting delayq_shard (did you mean delayq_shards?)",
        TYPO,
    ]
    assert unknown_settings(new_app(delayq_url="redis://x:1/0", delayq_shards=2)) == []


def test_django_namespace_names_them_as_spelled() -> None:
    app = Celery("dj", set_as_current=False)
    settings = type(
        "Settings",
        (),
        {"CELERY_BROKER_URL": "redis://127.0.0.1:6390/0", "CELERY_DELAYQ_URLL": "x", "DELAYQ_SHARD": 1},
    )
    app.config_from_object(settings, namespace="CELERY")
    # DELAYQ_SHARD has no CELERY_ prefix: Celery does not read it, and neither does delayq
    assert unknown_settings(app) == ["unknown setting CELERY_DELAYQ_URLL (did you mean CELERY_DELAYQ_URL?)"]


def test_a_producer_warns_once_per_app(caplog: pytest.LogCaptureFixture) -> None:
    app = new_app(delayq_urll="redis://x:1/0")
    with caplog.at_level(logging.WARNING, logger="celery_delayq.config"):
        DelayQConfig.from_app(app)
        DelayQConfig.from_app(app)
        app.conf.delayq_prefix = "changed"  # a new extension, the same app: not named again
        reconfigure(app)
        assert DelayQConfig.from_app(app).prefix == "changed"
        assert check_settings(app) == []
        app.conf.delayq_shard = 4  # a new unknown name is named when the settings are read again
        reconfigure(app)
        DelayQConfig.from_app(app)
        other = new_app(delayq_urll="redis://x:1/0")  # another app: its own warning
        DelayQConfig.from_app(other)
    lines = [r.getMessage() for r in caplog.records if r.name == "celery_delayq.config"]
    assert lines == [
        f"delayq: {TYPO}",
        "delayq: unknown setting delayq_shard (did you mean delayq_shards?)",
        f"delayq: {TYPO}",
    ]


def test_strict_mode_raises_at_the_first_use_and_at_the_beats_start() -> None:
    app = new_app(delayq_urll="redis://x:1/0", delayq_strict_settings=True)
    with pytest.raises(ConfigurationError, match=r"^unknown setting delayq_urll \(did you mean delayq_url\?"):
        DelayQConfig.from_app(app)
    with pytest.raises(BeatConfigurationError, match=r"delayq: unknown setting delayq_urll"):
        Scheduler(app, lazy=True)
    # on, with no unknown name: nothing to say
    assert DelayQConfig.from_app(new_app(delayq_strict_settings="on")).strict_settings is True


@pytest.mark.slow
def test_a_typo_appears_once_in_a_producers_stderr(redis_url: str) -> None:
    script = textwrap.dedent(
        f"""
        from celery import Celery
        from celery_delayq import DelayedTask, DelayQ

        app = Celery("producer", broker={redis_url!r})
        app.conf.delayq_urll = "redis://elsewhere:6379/0"

        @app.task(base=DelayedTask)
        def remind(n):
            return n

        for n in range(3):
            remind.apply_in(60, args=(n,))
        print(DelayQ(app).count())
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=str(ROOT)
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "3"
    assert done.stderr.count("unknown setting") == 1, done.stderr
    assert f"delayq: {TYPO}" in done.stderr


def _own_tasks_only(app: Celery) -> None:
    """Unregister the shared tasks other test modules of this process bound to ``app`` (a
    ``@shared_task`` joins every app), so the counts are the test's own."""
    for name in [n for n in app.tasks if not n.startswith(("celery.", "typo."))]:
        app.tasks.unregister(name)


def test_intercept_line_counts_covered_and_plain_tasks() -> None:
    app = new_app()
    assert intercept_line(app) is None  # off: nothing to say
    app.conf.delayq_intercept_eta = True
    reconfigure(app)

    def work() -> None: ...

    for n in range(2):
        app.task(base=DelayedTask, name=f"typo.delayed{n}", shared=False)(work)
    for n in range(7):
        app.task(name=f"typo.plain{n}", shared=False)(work)
    _own_tasks_only(app)
    line = intercept_line(app)
    assert line == (
        "delayq_intercept_eta is on: it covers 2 tasks; 7 plain tasks keep Celery's ETA path "
        "(eta/countdown wait in a worker): typo.plain0, typo.plain1, typo.plain2, typo.plain3, "
        "typo.plain4, ... (2 more); give them base=DelayedTask or a base with DelayQTaskMixin "
        "(docs/one-off.md)"
    )
    assert "celery." not in line  # Celery's builtins are not counted
    only = new_app(delayq_intercept_eta=True)
    only.task(base=DelayedTask, name="typo.one", shared=False)(work)
    _own_tasks_only(only)
    assert intercept_line(only) == (
        "delayq_intercept_eta is on: it covers 1 task; no plain task keeps Celery's ETA path"
    )


@pytest.mark.e2e
@pytest.mark.slow
def test_a_real_beat_and_worker_name_a_typo_and_what_intercept_covers(redis_url: str, procs: Procs) -> None:
    conf = {"delayq_urll": "redis://elsewhere:6379/0", "delayq_intercept_eta": True}
    env = subprocess_env(redis_url, redis_url, DELAYQ_TEST_CONF=json.dumps(conf))
    procs.start("beat", env)
    procs.start("worker", env)
    for index in (0, 1):
        assert wait_for(lambda i=index: "delayq_intercept_eta is on" in log_of(procs, i), STARTUP, 0.1), (
            procs.logs()
        )
    for index in (0, 1):
        log = log_of(procs, index)
        assert log.count("unknown setting") == 1, log
        assert f"delayq: {TYPO}" in log
        # e2e_app: e2e.record, e2e.flaky, e2e.record_late have the mixin; e2e.plain and
        # e2e.plain_record do not
        assert "it covers 3 tasks; 2 plain tasks keep Celery's ETA path" in log, log
        assert "e2e.plain, e2e.plain_record; give them base=DelayedTask" in log


@pytest.mark.e2e
@pytest.mark.slow
def test_strict_mode_stops_a_real_beat_and_worker_with_one_line(redis_url: str, procs: Procs) -> None:
    conf = {"delayq_urll": "redis://elsewhere:6379/0", "delayq_strict_settings": True}
    env = subprocess_env(redis_url, redis_url, DELAYQ_TEST_CONF=json.dumps(conf))
    started = [procs.start("beat", env), procs.start("worker", env)]
    for index, proc in enumerate(started):
        assert proc.wait(timeout=STARTUP) == 1
        log = log_of(procs, index)
        assert f"Error: delayq: {TYPO} (delayq_strict_settings is on)" in log, log
        assert "Traceback" not in log
