"""Makes ``format("delayq")`` known to Spark with no registration call.

Spark 4 imports every top-level module named ``pyspark_*`` it finds and
registers its ``DefaultSource`` under ``DefaultSource.name()``. The source
itself is :mod:`celery_delayq.spark`.
"""

from celery_delayq.spark.source import DelayQDataSource as DefaultSource

__all__ = ["DefaultSource"]
