"""Fixtures and helpers shared by the test modules, which import them from here explicitly.

* ``apps``: in-process Celery apps (``make_app``, ``app``, ``app_factory`` the one app factory,
  ``dispatchers``, ``forget_subscriptions``);
* ``servers``: the session's Redis server and one of each supported kind (``redis_url``, ``r``);
* ``server_kinds``: ``redis_server`` to import into a module that runs on every server kind;
* ``store``: a ``Store`` on a URL (``make_store``, the ``store`` fixture), what tests read from
  or write to Redis (server clock, snapshots, broker lists, ``bury``...) and ``expire_leases``,
  and ``expire_slots``, which end leases and slots on the server instead of waiting for them to
  run out;
* ``wake``: the wake channel seen from a test (``Wake``, the ``wake`` fixture);
* ``stack``: the end-to-end worker/beat stack and its producer (``start_stack``, ``Producer``,
  the ``producers`` fixture, ``check_exactly_once``, ``env_for``, ``rabbitmq_or_skip``...);
* ``messages``: dispatched messages against ``apply_async``'s (``OPTION_SETS``, ``normalized``);
* ``metrics``: reading a /metrics page (``scrape``, ``value``);
* ``acl``: the ACL rule of docs/security.md (``documented_rule``, ``server_kind``);
* ``cron``: cron expressions and their expected firing times;
* ``processes``: real celery worker/beat processes (``ROOT``, ``subprocess_env``, ``Procs``);
* ``polling``: ``wait_for``;
* ``clocks``: ``Clock``, a real clock a test sets ahead (a dispatcher's ``wall`` or ``clock``);
* ``cluster``: a local Redis Cluster (``LocalCluster``, ``redis_cluster``, ``cluster_url``);
* ``spark``: one local Spark session.

``tests/conftest.py`` registers the general fixture modules (``pytest_plugins``: ``apps``,
``servers``, ``processes``, ``store``, ``cluster``, ``wake``) so that their fixtures work by name
without an import; a fixture of one area (``producers``, ``dashboard``, ``spark``, ``browser``) is
imported by the modules that use it and named in their ``__all__``. No test module imports
another test module (``tests/test_layers.py`` checks it).
"""
