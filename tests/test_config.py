"""``DelayQConfig``: defaults, the Django namespace, the URL fallback, refused values."""

from __future__ import annotations

import time
from typing import Any

import pytest
from celery import Celery

from celery_delayq import DelayedTask, DelayQ
from celery_delayq.config import DEFAULTS, DelayQConfig
from celery_delayq.exceptions import ConfigurationError
from celery_delayq.store.facade import get_store
from tests.support.store import snapshot


def new_app(broker: str | None = "redis://127.0.0.1:6390/0", **conf: Any) -> Celery:
    app = Celery("cfg", broker=broker, set_as_current=False)
    app.conf.update(**conf)
    return app


def test_defaults() -> None:
    config = DelayQConfig.from_app(new_app())
    assert config.url == "redis://127.0.0.1:6390/0"
    for name, (default, meaning) in DEFAULTS.items():
        assert meaning
        if name != "delayq_url":
            assert getattr(config, name.removeprefix("delayq_")) == default
    assert ["delayq_" + f for f in DelayQConfig.field_names()] == list(DEFAULTS)
    assert (config.prefix, config.shards, config.reclaim_ttl, config.batch_size) == (
        "delayq",
        16,
        30.0,
        500,
    )
    assert (config.intercept_eta, config.dead_letter_unknown) == (False, True)


def test_settings_are_read_from_app_conf() -> None:
    app = new_app(
        delayq_url="redis://other:1/2",
        delayq_prefix="p",
        delayq_shards=3,
        delayq_reclaim_ttl="2.5",
        delayq_batch_size=5000,
        delayq_max_sleep=1,
        delayq_intercept_eta=1,
        delayq_dead_letter_unknown=0,
        delayq_max_payload="2048",
    )
    assert DelayQConfig.from_app(app) == DelayQConfig(
        url="redis://other:1/2",
        prefix="p",
        shards=3,
        reclaim_ttl=2.5,
        batch_size=5000,
        max_sleep=1.0,
        intercept_eta=True,
        dead_letter_unknown=False,
        max_payload=2048,
    )


def test_config_is_cached_per_app() -> None:
    app = new_app()
    first = DelayQConfig.from_app(app)
    app.conf.delayq_prefix = "changed"
    assert DelayQConfig.from_app(app) is first
    assert first.prefix != "changed"
    assert DelayQConfig.from_app(new_app(delayq_prefix="changed")).prefix == "changed"


def test_django_style_namespace(redis_url: str) -> None:
    class Settings:
        CELERY_BROKER_URL = redis_url
        CELERY_DELAYQ_PREFIX = "django"
        CELERY_DELAYQ_SHARDS = 4
        CELERY_DELAYQ_RECLAIM_TTL = 12

    app = Celery("dj", set_as_current=False)
    app.config_from_object(Settings, namespace="CELERY")
    config = DelayQConfig.from_app(app)
    assert (config.url, config.prefix, config.shards, config.reclaim_ttl) == (
        redis_url,
        "django",
        4,
        12.0,
    )

    @app.task(base=DelayedTask, name="dj.ping", shared=False)
    def ping() -> None:
        return None

    res = ping.apply_in(3600)
    client = get_store(app).client
    keys = client.keys("*")
    shard = get_store(app).keys.shard_of(res.id)
    assert f"django:{{django:{shard}}}:due" in keys
    assert all(key.startswith("django:") for key in keys)
    app.close()


def test_prefixes_keep_apps_apart(redis_url: str) -> None:
    def ping() -> None:
        return None

    apps = [new_app(redis_url, delayq_prefix=p) for p in ("one", "two")]
    for application in apps:
        application.task(base=DelayedTask, name="t.ping", shared=False)(ping)
    apps[0].tasks["t.ping"].apply_in(3600)
    apps[0].tasks["t.ping"].apply_in(3600)
    apps[1].tasks["t.ping"].apply_in(3600)
    assert [DelayQ(application).count() for application in apps] == [2, 1]
    for application in apps:
        application.close()


@pytest.mark.parametrize(
    ("conf", "expected"),
    [
        ({"broker_url": "redis://h:1/0"}, "redis://h:1/0"),
        ({"broker_url": "rediss://h:1/0?ssl_cert_reqs=required"}, "rediss://h:1/0?ssl_cert_reqs=required"),
        ({"broker_url": "redis://a:1/0;redis://b:1/0"}, "redis://a:1/0"),
        ({"broker_url": "amqp://x", "broker_write_url": "redis://w:1/0"}, "redis://w:1/0"),
        ({"broker_url": "amqp://x", "delayq_url": "redis://d:1/3"}, "redis://d:1/3"),
        ({"broker_url": "redis://h:1/0", "delayq_url": "redis://d:1/3"}, "redis://d:1/3"),
        ({"broker_url": "amqp://x", "delayq_url": "unix:///tmp/redis.sock"}, "unix:///tmp/redis.sock"),
    ],
    ids=["redis", "rediss", "failover-list", "write-url", "explicit", "explicit-wins", "unix"],
)
def test_url_falls_back_to_a_redis_broker(conf: dict[str, Any], expected: str) -> None:
    assert DelayQConfig.from_app(new_app(broker=None, **conf)).url == expected


@pytest.mark.parametrize(
    "conf",
    [
        {"broker_url": "amqp://guest@localhost//"},
        {"broker_url": "memory://"},
        {"broker_url": "amqp://x", "delayq_url": "http://redis:6379"},
        {"broker_url": "redis://h:1/0", "delayq_url": "memcached://x"},
    ],
    ids=["amqp", "memory", "http-url", "not-redis-url"],
)
def test_url_errors(conf: dict[str, Any]) -> None:
    with pytest.raises(ConfigurationError) as info:
        DelayQConfig.from_app(new_app(broker=None, **conf))
    assert isinstance(info.value, ValueError)


def test_a_url_error_does_not_show_the_password() -> None:
    with pytest.raises(ConfigurationError) as info:
        DelayQConfig.from_mapping({"delayq_url": "http://admin:s3cret@cache:6379/0"})
    assert "s3cret" not in str(info.value) and "http://admin:***@cache:6379/0" in str(info.value)


def test_from_mapping_without_an_app_needs_a_url() -> None:
    with pytest.raises(ConfigurationError, match="delayq_url"):
        DelayQConfig.from_mapping({})
    assert DelayQConfig.from_mapping({"delayq_url": "redis://x:1/0"}).shards == 16


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("delayq_shards", 0),
        ("delayq_shards", -4),
        ("delayq_shards", "many"),
        ("delayq_shards", None),
        ("delayq_batch_size", 0),
        ("delayq_batch_size", 5001),
        ("delayq_batch_size", "x"),
        ("delayq_reclaim_ttl", 0),
        ("delayq_reclaim_ttl", -1),
        ("delayq_reclaim_ttl", float("nan")),
        ("delayq_reclaim_ttl", float("inf")),
        ("delayq_reclaim_ttl", "soon"),
        ("delayq_max_sleep", 0),
        ("delayq_max_sleep", float("inf")),
        ("delayq_max_payload", 0),
        ("delayq_max_payload", 100),
        ("delayq_shards", 1.5),
        ("delayq_shards", True),
        ("delayq_batch_size", [5]),
        ("delayq_intercept_eta", "maybe"),
        ("delayq_dead_letter_unknown", 2),
        ("delayq_prefix", ""),
        ("delayq_prefix", "a b"),
        ("delayq_prefix", "{x}"),
        ("delayq_prefix", 5),
        ("delayq_cluster", "maybe"),
        ("delayq_wait_replicas", -1),
        ("delayq_wait_replicas", 1.5),
        ("delayq_wait_replicas", "some"),
    ],
)
def test_bad_values(name: str, value: Any) -> None:
    with pytest.raises(ConfigurationError, match=name):
        DelayQConfig.from_mapping({"delayq_url": "redis://x:1/0", name: value})


def test_bad_setting_fails_the_call_and_stores_nothing(redis_url: str) -> None:
    app = new_app(redis_url, delayq_shards=0)

    @app.task(base=DelayedTask, name="t.ping", shared=False)
    def ping() -> None:
        return None

    before = snapshot(redis_url)
    with pytest.raises(ConfigurationError, match="delayq_shards"):
        ping.apply_at(time.time() + 60)
    with pytest.raises(ConfigurationError):
        DelayQ(app)
    assert snapshot(redis_url) == before
    app.close()


def test_cluster_settings() -> None:
    config = DelayQConfig.from_mapping(
        {"delayq_url": "redis://node-1:7000", "delayq_cluster": "yes", "delayq_wait_replicas": "1"}
    )
    assert (config.cluster, config.wait_replicas) == (True, 1)
    with pytest.raises(ConfigurationError, match="delayq_cluster"):
        DelayQConfig.from_mapping({"delayq_url": "unix:///tmp/redis.sock", "delayq_cluster": True})


#: One bad value for each setting (delayq_url: a missing one, with a RabbitMQ broker).
ONE_BAD_VALUE: dict[str, Any] = {
    "delayq_url": None,
    "delayq_prefix": "a b",
    "delayq_shards": "many",
    "delayq_reclaim_ttl": 0,
    "delayq_batch_size": 5001,
    "delayq_max_sleep": float("inf"),
    "delayq_intercept_eta": "maybe",
    "delayq_dead_letter_unknown": 2,
    "delayq_max_payload": 100,
    "delayq_push": "maybe",
    "delayq_push_on_claim": "maybe",
    "delayq_cluster": "maybe",
    "delayq_wait_replicas": -1,
    "delayq_record_lateness": "maybe",
    "delayq_publish_eta": "maybe",
    "delayq_metrics_port": 70_000,
    "delayq_metrics_addr": "a b",
    "delayq_past_warning": -1,
    "delayq_behind_warning": -1,
    "delayq_slot_ttl": 0.1,
    "delayq_start_ttl": 0.1,
    "delayq_start_check": "maybe",
    "delayq_batch_expires": 0,
    "delayq_strict_settings": "maybe",
}


def test_past_warning_setting() -> None:
    read = DelayQConfig.from_mapping
    assert read({"delayq_url": "redis://x:1/0"}).past_warning == 3600.0
    assert read({"delayq_url": "redis://x:1/0", "delayq_past_warning": "600"}).past_warning == 600.0
    assert read({"delayq_url": "redis://x:1/0", "delayq_past_warning": None}).past_warning is None
    assert read({"delayq_url": "redis://x:1/0", "delayq_past_warning": ""}).past_warning is None
    for bad in (-1, "soon", float("nan"), True):
        with pytest.raises(ConfigurationError, match=r"^delayq_past_warning must"):
            read({"delayq_url": "redis://x:1/0", "delayq_past_warning": bad})


def test_every_setting_has_a_bad_value_in_the_spelling_test() -> None:
    assert sorted(ONE_BAD_VALUE) == sorted(DEFAULTS)


@pytest.mark.parametrize("name", sorted(ONE_BAD_VALUE))
@pytest.mark.parametrize("namespace", [None, "CELERY"])
def test_a_settings_error_names_the_setting_as_the_user_spells_it(name: str, namespace: str | None) -> None:
    """Django's ``config_from_object(settings, namespace="CELERY")`` reads CELERY_DELAYQ_URL:
    the error must say that name, not ``delayq_url`` or ``app.conf.delayq_url``."""
    values: dict[str, Any] = {"broker_url": "amqp://guest@127.0.0.1:5672//", "delayq_url": "redis://x:1/0"}
    values[name] = ONE_BAD_VALUE[name]
    app = Celery("spell", set_as_current=False)
    if namespace:
        settings = type("Settings", (), {f"{namespace}_{k.upper()}": v for k, v in values.items()})
        app.config_from_object(settings, namespace=namespace)
        spelled = f"CELERY_{name.upper()}"
    else:
        app.conf.update(values)
        spelled = name
    with pytest.raises(ConfigurationError) as info:
        DelayQConfig.from_app(app)
    message = str(info.value)
    assert message.startswith(spelled), message
    if namespace:
        assert "delayq_" not in message, message
    if name == "delayq_url":
        expected = "set CELERY_DELAYQ_URL = " if namespace else "set app.conf.delayq_url = "
        assert expected in message and "\n" not in message


def test_cluster_with_a_unix_url_names_both_settings_under_the_namespace() -> None:
    app = Celery("spell", set_as_current=False)
    settings = type("S", (), {"CELERY_DELAYQ_URL": "unix:///tmp/r.sock", "CELERY_DELAYQ_CLUSTER": True})
    app.config_from_object(settings, namespace="CELERY")
    with pytest.raises(ConfigurationError, match=r"^CELERY_DELAYQ_CLUSTER needs .* in CELERY_DELAYQ_URL"):
        DelayQConfig.from_app(app)
