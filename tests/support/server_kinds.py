"""Running a module's tests on every supported server kind: a test module imports
:func:`redis_server` from here, and its ``redis_server`` (and so ``redis_url`` and ``r``) is
each server of ``each_server`` in turn (tests/support/servers.py) instead of the session's one.

Not in ``pytest_plugins``: registered there it would clash with the session ``redis_server``.
"""

from __future__ import annotations

import pytest

from celery_delayq.devtools.embedded import EmbeddedRedis


@pytest.fixture(scope="module")
def redis_server(each_server: EmbeddedRedis) -> EmbeddedRedis:
    """This module's server (``redis_url``, ``r``): each supported kind in turn."""
    return each_server
