"""Smoke test of the Spark write benchmark: ``python -m bench.spark --rows 2000`` runs to the end.

It checks that the benchmark works (exit 0, both figures in the table, the stored-count check
passed), never how fast anything is: the figures depend on the machine and what else runs on it.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench.spark import spark_problem

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.spark
@pytest.mark.timeout(420)
def test_spark_benchmark_runs() -> None:
    problem = spark_problem()
    if problem:
        pytest.skip(problem)
    proc = subprocess.run(
        [sys.executable, "-m", "bench.spark", "--rows", "2000"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=400,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    out = proc.stdout
    assert "machine: " in out and "| what " in out and "| met? |" in out
    first = '| spark: rows/s, 2,000 rows, format("delayq")'
    line = next((row for row in out.splitlines() if row.startswith(first)), None)
    assert line is not None, out
    cells = [cell.strip() for cell in line.strip("|").split("|")]
    ours, baseline, ratio, target = cells[1:5]
    assert re.fullmatch(r"[\d,]+ rows/s", ours), line
    assert re.fullmatch(r"[\d,]+ rows/s", baseline), line
    assert ratio.endswith("x") and target == "≥0.8x", line
    assert "rows/s per core" in out
    assert "stored-count check passed: Spark: 2,000 stored" in out
    assert "write_rows: 2,000 stored" in out
    assert "stream: 2,000 stored" in out and "Spark from files: 2,000 stored" in out
    streaming = next((row for row in out.splitlines() if row.startswith("| spark: streaming sink")), None)
    assert streaming is not None and streaming.count("rows/s") == 2, out


def test_master_cores() -> None:
    from bench.harness import BenchError
    from bench.spark import master_cores

    assert master_cores("local[2]") == 2
    assert master_cores("local") == 1
    with pytest.raises(BenchError):
        master_cores("spark://host:7077")


@pytest.mark.slow
def test_rows_are_the_same_on_both_sides() -> None:
    """The Python rows (the baselines') match what the Spark DataFrame is built from."""
    pytest.importorskip("pyarrow")
    from bench.spark import Rows

    rows = Rows(30, 1_800_000_000)
    dicts = rows.dicts()
    arrow = [row for batch in rows.arrow_batches() for row in batch.to_pylist()]
    assert [d["user_id"] for d in dicts] == [a["user_id"] for a in arrow] == list(range(30))
    assert [d["due"] for d in dicts] == [a["due"] for a in arrow]
    assert [d["text"] for d in dicts] == [a["text"] for a in arrow]
    assert [d["day"] for d in dicts] == [a["day"] for a in arrow]
    assert rows.job_id(3) == f"reminder:3:{dicts[3]['day']}"


def test_the_row_is_skipped_without_spark(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without pyspark or Java the suite's row says why, as the RabbitMQ row does, and starts nothing."""
    import bench.spark
    from bench.harness import QUICK, Context

    monkeypatch.setattr(bench.spark, "spark_problem", lambda: "no Java runtime (Spark needs Java 17)")
    ctx = Context(QUICK, "quick", selected=["spark"])
    try:
        result = bench.spark.row_spark(ctx)
        assert not ctx.servers
    finally:
        ctx.cleanup()
    assert not result.error
    assert [line.skipped for line in result.lines] == ["no Java runtime (Spark needs Java 17)"]
