"""One local Spark session for the whole test session (the ``spark`` fixture); it skips,
with the reason, when a local Spark cannot run here."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from bench.spark import spark_problem  # "can a local Spark run here", shared with the benchmark
from tests.support.processes import ROOT


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    """One local Spark session (``local[2]``) for the whole test session.

    Executors run this interpreter (``PYSPARK_PYTHON``) with the project on
    ``PYTHONPATH``, so ``format("delayq")`` is found the way an installed package is.
    """
    problem = spark_problem()
    if problem:
        pytest.skip(problem)
    env = pytest.MonkeyPatch()  # undone when the session ends
    env.setenv("SPARK_LOCAL_IP", "127.0.0.1")  # nothing but loopback
    env.setenv("PYSPARK_PYTHON", sys.executable)
    env.setenv("PYSPARK_DRIVER_PYTHON", sys.executable)
    env.setenv("PYTHONPATH", str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    import warnings

    from pyspark.sql import SparkSession

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # pyspark's pandas-version FutureWarning
        session = (
            SparkSession.builder.master("local[2]")
            .appName("delayq-tests")
            .config("spark.ui.enabled", "false")
            .config("spark.ui.showConsoleProgress", "false")
            .config("spark.sql.session.timeZone", "UTC")
            .config("spark.sql.shuffle.partitions", "4")
            .config("spark.sql.python.filterPushdown.enabled", "true")
            .config("spark.driver.bindAddress", "127.0.0.1")
            .config("spark.driver.host", "127.0.0.1")
            .getOrCreate()
        )
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()
    env.undo()
