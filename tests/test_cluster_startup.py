"""A Cluster store whose startup nodes are down (issue 52): ``delayq_url`` may name several
startup nodes; a store is made while none answers, and each call meets ``StoreUnreachable``
(redis-py's Cluster error as its cause) until one does. The processes (a worker and a beat
starting while the URL's node is down) are in ``tests/test_cluster_e2e.py``."""

from __future__ import annotations

import pytest
from celery import Celery
from redis.exceptions import RedisClusterException

from celery_delayq import DelayedTask, DelayQ
from celery_delayq.config import DelayQConfig
from celery_delayq.devtools.embedded import free_port
from celery_delayq.exceptions import ConfigurationError, StoreUnreachable
from celery_delayq.store.facade import Store, get_store
from tests.support.cluster import cluster_url, redis_cluster

__all__ = ["cluster_url", "redis_cluster"]  # fixtures, used by name

pytestmark = pytest.mark.cluster


def cluster_app(url: str) -> Celery:
    app = Celery("startup", broker="memory://", set_as_current=False)
    app.conf.update(delayq_url=url, delayq_cluster=True)

    @app.task(base=DelayedTask, name="t.remind", shared=False)
    def remind(x: int = 0) -> int:  # pragma: no cover - never runs
        return x

    return app


def test_a_url_may_name_several_startup_nodes_and_the_first_may_be_down(cluster_url: str) -> None:
    live = cluster_url.split("//", 1)[1]
    app = cluster_app(f"redis://127.0.0.1:{free_port()},{live}")
    result = app.tasks["t.remind"].apply_in(600, (1,), task_id="several-nodes")
    assert DelayQ(app).get(result.id) is not None and DelayQ(app).count() == 1
    app.close()


def test_a_store_is_made_while_no_startup_node_answers_and_calls_raise_ours(cluster_url: str) -> None:
    """As a beat or a worker's start check makes its store at start: no error then; each call
    says the store cannot be reached; once a named node answers, the same store works."""
    dead = f"127.0.0.1:{free_port()}"
    store = Store(DelayQConfig.from_mapping({"delayq_url": f"redis://{dead}", "delayq_cluster": True}))
    assert store.is_cluster
    for _ in range(2):  # tried again at each call
        with pytest.raises(StoreUnreachable) as caught:
            store.count()
        assert f"cannot reach Redis at redis://{dead} (delayq_url): " in str(caught.value)
        assert isinstance(caught.value.__cause__, RedisClusterException)
    store.close()  # closing a store whose client was never made connects nowhere
    # The same store, once a node it names answers (here: a URL naming the live node too).
    live = cluster_url.split("//", 1)[1]
    store.config = DelayQConfig.from_mapping({"delayq_url": f"redis://{dead},{live}", "delayq_cluster": True})
    assert store.count() == 0 and store.is_cluster


def test_a_producer_on_a_cluster_whose_nodes_are_down_gets_store_unreachable() -> None:
    app = cluster_app(f"redis://127.0.0.1:{free_port()},127.0.0.1:{free_port()}")
    get_store(app)  # made at once, as before a call
    with pytest.raises(StoreUnreachable, match=r"\(delayq_url\): Redis Cluster cannot be connected"):
        app.tasks["t.remind"].apply_in(60, (1,), task_id="down")
    app.close()


def test_several_nodes_need_delayq_cluster_and_a_cluster_has_database_0_only() -> None:
    with pytest.raises(ConfigurationError, match=r"names several nodes .* set delayq_cluster = True"):
        DelayQConfig.from_mapping({"delayq_url": "redis://:pw@h1:7000,h2:7001"})
    config = DelayQConfig.from_mapping({"delayq_url": "redis://h1:7000,h2:7001/3", "delayq_cluster": True})
    with pytest.raises(ValueError, match="database 0 only"):
        Store(config)
    config = DelayQConfig.from_mapping({"delayq_url": "redis://h1:7000,h2:x", "delayq_cluster": True})
    with pytest.raises(ValueError, match="a startup node is host:port, got 'h2:x'"):
        Store(config)
