"""Fixtures and helpers shared by the test modules, which import them from here explicitly.

* ``apps``: in-process Celery apps (``make_app``, ``app``, ``app_factory``, ``dispatchers``);
* ``servers``: the session's Redis server and one of each supported kind (``redis_url``, ``r``);
* ``store``: a ``Store`` on a URL and what tests read from Redis (server clock, snapshots...);
* ``processes``: real celery worker/beat processes (``ROOT``, ``subprocess_env``, ``Procs``);
* ``polling``: ``wait_for``;
* ``cluster``: a local Redis Cluster (``LocalCluster``, ``redis_cluster``, ``cluster_url``);
* ``spark``: one local Spark session.

``tests/conftest.py`` registers the fixture modules (``pytest_plugins``) so that fixtures
used by name keep working without an import.
"""
