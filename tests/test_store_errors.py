"""Store errors are ours (issue 52): a store that cannot be reached, a wrong password and a wrong
database, met by a producer (``apply_at``, ``apply_in``, ``apply_at_many``, a result's
``cancel``/``reschedule``), by ``DelayQ`` and ``Schedules``, and by the CLI, each on a real
``redis-server``: a :class:`StoreUnreachable` or :class:`StoreRefused` that names the URL's host
and port (password redacted) and the setting, redis-py's error as its ``__cause__``.
"""

from __future__ import annotations

import ast
import logging
import os
import re
import signal
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from celery_delayq import DelayedTask, DelayQ, Schedules, StoreError
from celery_delayq.beat.scheduler import Scheduler
from celery_delayq.devtools.embedded import EmbeddedRedis, free_port
from celery_delayq.exceptions import StoreRefused, StoreTimeout, StoreUnreachable
from celery_delayq.producer.result import ScheduledResult
from tests.support.cli import invoke

PASSWORD = "right-pw-52"
WRONG = "wrong-pw-52"


@pytest.fixture(scope="module")
def locked_server() -> Iterator[EmbeddedRedis]:
    """A server whose default user needs :data:`PASSWORD` (``requirepass``, set once it answers:
    the start's own PING has no password)."""
    with EmbeddedRedis() as server:
        redis.Redis(port=server.port).config_set("requirepass", PASSWORD)
        yield server


#: fault -> (its URL from the session server and the locked one, the error, redis-py's cause)
FAULTS = ["unreachable", "wrong password", "no password", "wrong database"]


def fault_url(fault: str, server: EmbeddedRedis, locked: EmbeddedRedis) -> str:
    if fault == "unreachable":
        return f"redis://:{WRONG}@127.0.0.1:{free_port()}/0"  # a free port: nothing listens
    if fault == "wrong password":
        return f"redis://:{WRONG}@127.0.0.1:{locked.port}/0"
    if fault == "no password":
        return f"redis://127.0.0.1:{locked.port}/0"
    return f"{server.url}/99"  # 16 databases


def expected(fault: str) -> tuple[type[StoreError], type[BaseException], str]:
    """The error, the class of its cause, and what the message says."""
    if fault == "unreachable":
        return StoreUnreachable, redis.ConnectionError, "cannot reach Redis at redis://:***@127.0.0.1:"
    if fault == "wrong database":
        return StoreRefused, redis.ResponseError, "refused the database: DB index is out of range"
    return StoreRefused, redis.AuthenticationError, "refused the login: "


@pytest.fixture(params=FAULTS)
def broken(request: pytest.FixtureRequest, redis_server: EmbeddedRedis, locked_server: EmbeddedRedis) -> Any:
    """``(fault, url, app)``: an app whose store has the fault."""
    url = fault_url(request.param, redis_server, locked_server)
    app = Celery("broken", broker="memory://", set_as_current=False)
    app.conf.delayq_url = url

    @app.task(base=DelayedTask, name="t.remind", shared=False)
    def remind(x: int = 0) -> int:  # pragma: no cover - never runs
        return x

    yield request.param, url, app
    app.close()


def host_port(url: str) -> str:
    return url.split("@")[-1].split("//")[-1].rsplit("/", 1)[0]


def check(fault: str, url: str, exc: BaseException) -> None:
    error, cause, words = expected(fault)
    assert type(exc) is error, repr(exc)
    text = str(exc)
    assert words in text and host_port(url) in text and "(delayq_url)" in text, text
    assert WRONG not in text and PASSWORD not in text
    assert isinstance(exc.__cause__, cause), repr(exc.__cause__)
    assert len(text.splitlines()) == 1


CALLS: dict[str, Callable[[Celery], Any]] = {
    "apply_at": lambda app: app.tasks["t.remind"].apply_at(datetime.now(UTC) + timedelta(hours=1), (1,)),
    "apply_in": lambda app: app.tasks["t.remind"].apply_in(60, (1,), task_id="job-1"),
    "apply_at_many": lambda app: app.tasks["t.remind"].apply_at_many([(2_000_000_000, (1,), {})]),
    "result.cancel": lambda app: ScheduledResult("job-1", app=app).cancel(),
    "result.reschedule": lambda app: ScheduledResult("job-1", app=app).reschedule(2_000_000_000),
    "DelayQ.count": lambda app: DelayQ(app).count(),
    "DelayQ.pending": lambda app: list(DelayQ(app).pending()),
    "DelayQ.get": lambda app: DelayQ(app).get("job-1"),
    "DelayQ.dead": lambda app: list(DelayQ(app).dead()),
    "Schedules.list": lambda app: list(Schedules(app).list()),
    "Schedules.get": lambda app: Schedules(app).get("nightly"),
    "Schedules.add": lambda app: Schedules(app).add("nightly", "t.remind", "0 2 * * *"),
}


def test_every_public_call_raises_our_error_naming_the_url_and_the_setting(broken: Any) -> None:
    fault, url, app = broken
    for name, call in CALLS.items():
        with pytest.raises(StoreError) as caught:
            call(app)
        try:
            check(fault, url, caught.value)
        except AssertionError as failure:
            raise AssertionError(f"{name}: {failure}") from None


def test_an_unreachable_store_is_still_a_redis_connection_error(redis_server: EmbeddedRedis) -> None:
    """Code written to retry on redis-py's ConnectionError (as docs/errors.md said) keeps working;
    a refused login is not one (a retry does not fix it)."""
    app = Celery("down", broker="memory://", set_as_current=False)
    app.conf.delayq_url = f"redis://127.0.0.1:{free_port()}/0"
    with pytest.raises(redis.ConnectionError):
        DelayQ(app).count()
    assert issubclass(StoreUnreachable, redis.ConnectionError)
    assert not issubclass(StoreRefused, redis.RedisError)


def test_the_setting_is_named_as_the_configuration_spells_it(redis_server: EmbeddedRedis) -> None:
    app = Celery("django", set_as_current=False)
    app.config_from_object({"CELERY_DELAYQ_URL": f"{redis_server.url}/99"}, namespace="CELERY")
    with pytest.raises(StoreRefused, match=r"/99 \(CELERY_DELAYQ_URL\) refused the database"):
        DelayQ(app).count()


def test_other_errors_of_a_reachable_redis_pass_as_they_are(redis_url: str, r: redis.Redis) -> None:
    """An error reply that is not about reaching the store (here a key of the wrong type) is not
    turned into a StoreError: it says what Redis said."""
    app = Celery("wrongtype", broker="memory://", set_as_current=False)
    app.conf.delayq_url = redis_url
    store = DelayQ(app).store
    r.set(store.keys.shard(0).due, "not a sorted set")
    with pytest.raises(redis.ResponseError, match="WRONGTYPE") as caught:
        DelayQ(app).count()
    assert not isinstance(caught.value, StoreError)


def test_the_cli_says_each_fault_in_one_line_with_exit_3(broken: Any) -> None:
    fault, url, app = broken
    for command in (["status"], ["ls"], ["schedules", "ls"], ["cancel", "job-1"]):
        result = invoke(app, *command)
        assert result.exit_code == 3, (command, result.output)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and result.stdout == "", (command, result.output)
        _, _, words = expected(fault)
        assert lines[0].startswith(("Error: cannot reach Redis at ", "Error: Redis at ")), lines[0]
        assert words in lines[0] and lines[0].count("Redis at") == 1, lines[0]
        assert host_port(url) in lines[0] and "(delayq_url)" in lines[0], lines[0]
        assert WRONG not in lines[0] and PASSWORD not in lines[0]


def test_a_beat_on_a_store_it_cannot_use_warns_and_keeps_trying(
    broken: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """The beat's loop treats each fault as an outage (a line, a back-off), never a crash, and
    counts it as ``unreachable`` (as redis-py's AuthenticationError was)."""
    fault, _, app = broken
    app.conf.beat_schedule = {}
    with caplog.at_level(logging.WARNING, logger="celery_delayq"):
        beat = Scheduler(app, lazy=False)
        try:
            assert "will keep trying" in caplog.text or "cannot store beat_schedule" in caplog.text
            delays = [beat.tick() for _ in range(2)]
            assert delays == [0.5, 1.0], delays
            assert beat.dispatcher is not None and beat.dispatcher.stats.redis_errors["unreachable"] == 2
        finally:
            beat.close()
    error, _, words = expected(fault)
    assert f"delayq: Redis unavailable ({error.__name__}: " in caplog.text and words in caplog.text
    assert WRONG not in caplog.text


def test_a_store_that_does_not_answer_in_time_is_a_timeout_still(redis_url: str) -> None:
    """A paused server (SIGSTOP) past the URL's socket_timeout: StoreTimeout, which is also
    redis-py's TimeoutError (as the error was before) and a StoreUnreachable."""
    with EmbeddedRedis() as server:
        app = Celery("paused", broker="memory://", set_as_current=False)
        app.conf.delayq_url = f"{server.url}/0?socket_timeout=0.2"
        DelayQ(app).count()  # connected
        assert server.process is not None
        os.kill(server.process.pid, signal.SIGSTOP)
        try:
            with pytest.raises(StoreTimeout) as caught:
                DelayQ(app).count()
        finally:
            os.kill(server.process.pid, signal.SIGCONT)
    assert isinstance(caught.value, redis.TimeoutError) and isinstance(caught.value, StoreUnreachable)
    assert isinstance(caught.value.__cause__, redis.TimeoutError)
    assert f"127.0.0.1:{server.port}/0?socket_timeout=0.2 (delayq_url) did not answer in time" in str(
        caught.value
    )


def test_the_beat_s_start_lines_say_what_went_wrong(broken: Any, caplog: pytest.LogCaptureFixture) -> None:
    """The lines a beat logs at its start and its stop (the store cannot be asked, beat_schedule
    cannot be stored, the heartbeat cannot be written or removed) carry the error's message, the
    URL and the setting: redis-py 8's ``repr`` of its errors, which a ``StoreError`` inherits, is
    ``network:StoreUnreachable`` and nothing else (the lines said only that)."""
    fault, _, app = broken
    app.conf.beat_schedule = {}
    with caplog.at_level(logging.WARNING, logger="celery_delayq"):
        beat = Scheduler(app, lazy=False)
        try:
            assert beat.dispatcher is not None
            beat.dispatcher.chores(force=True)  # the heartbeat written now
        finally:
            beat.close()
    error, _, words = expected(fault)
    starts = (
        "delayq: cannot reach Redis at start",
        "delayq: cannot store beat_schedule",
        "delayq: cannot write this beat's heartbeat",
        "delayq: cannot remove this beat's heartbeat",
    )
    lines = [rec.getMessage() for rec in caplog.records if rec.getMessage().startswith(starts)]
    assert len({line[:30] for line in lines}) >= 3, caplog.text
    for line in lines:
        assert f"({error.__name__}: " in line and words in line and "(delayq_url)" in line, line
    assert WRONG not in caplog.text


def _logged_with_repr(path: Path) -> list[str]:
    """``file:line`` of each ``logger.<level>(format, ...)`` call of ``path`` that formats an
    exception (an argument named ``exc``, ``err``, ``error`` or ``e``) with ``%r``."""
    spec = re.compile(r"%[-#0 +]*\d*(?:\.\d+)?([sdrfi%])")
    hits: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "logger"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            continue
        kinds = [m.group(1) for m in spec.finditer(node.args[0].value) if m.group(1) != "%"]
        for kind, arg in zip(kinds, node.args[1:], strict=False):
            if kind == "r" and isinstance(arg, ast.Name) and arg.id in {"exc", "err", "error", "e"}:
                hits.append(f"{path}:{node.lineno}")
    return hits


def test_no_log_line_shows_an_exception_by_its_repr() -> None:
    """redis-py 8's ``repr`` of its errors (and so of every ``StoreError``, and of kombu's Redis
    transport errors) is ``network:ConnectionError``: a log line that formats one with ``%r``
    says neither what failed nor where (the URL, ``delayq_url``). Each uses ``error_text``."""
    assert repr(StoreUnreachable("cannot reach Redis at redis://h:1/0 (delayq_url): x")) in {
        "network:StoreUnreachable",  # redis-py 8
        "StoreUnreachable('cannot reach Redis at redis://h:1/0 (delayq_url): x')",  # redis-py 5-7
    }
    package = Path(__file__).resolve().parent.parent / "celery_delayq"
    hits = [hit for path in sorted(package.rglob("*.py")) for hit in _logged_with_repr(path)]
    assert hits == [], "\n".join(hits)
