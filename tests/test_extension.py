"""The per-app extension (``celery_delayq.config.extension``): one object per app, made anew when the
app's settings change; and the worker side attached per app, so that an app without delayq in
the same process gets no delayq receiver, step or state."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from celery import Celery

from celery_delayq import config as extension_module
from celery_delayq.config import DelayQConfig, extension, installed, reconfigure
from celery_delayq.producer.plans import app_state
from celery_delayq.store.facade import get_store
from tests.support.apps import make_app

ROOT = Path(__file__).resolve().parent.parent

#: Run in a process of its own (no receiver another test connected): two apps, ``with_dq``
#: (a DelayedTask, so delayq's worker step) and ``plain`` (no delayq at all); a worker is built
#: for each (Celery's WorkController: its bootsteps are applied; it is not started, so no
#: broker is needed); then each app's task runs with the headers a beat's message carries.
TWO_APPS = """
import json, time
import pytest
from celery import Celery
from celery.signals import task_prerun, task_postrun, task_revoked, worker_init, worker_ready
from celery.signals import worker_process_shutdown, worker_shutdown
from celery.worker import WorkController

import celery_delayq
from celery_delayq import DelayedTask
from celery_delayq.flow import slots
from celery_delayq.worker import lateness as worker

SIGNALS = {"task_prerun": task_prerun, "task_postrun": task_postrun, "task_revoked": task_revoked,
           "worker_init": worker_init, "worker_ready": worker_ready,
           "worker_process_shutdown": worker_process_shutdown, "worker_shutdown": worker_shutdown}

def delayq_receivers():
    out = {}
    for name, signal in SIGNALS.items():
        uids = [str(key[0]) for key, _ in signal.receivers]
        found = [u for u in uids if "delayq" in u]
        if found:
            out[name] = found
    return out

after_import = delayq_receivers()

with_dq = Celery("with_dq", broker="redis://127.0.0.1:1/0", set_as_current=False)
with_dq.conf.update(delayq_record_lateness=True)
plain = Celery("plain", broker="redis://127.0.0.1:1/0", set_as_current=False)

@with_dq.task(base=DelayedTask, name="dq.add", shared=False)
def add(x, y):
    return x + y

@plain.task(name="plain.add", shared=False)
def plain_add(x, y):
    return x + y

with_dq.finalize(); plain.finalize()
kw = dict(pool_cls="solo", concurrency=1, without_heartbeat=True, without_mingle=True,
          without_gossip=True, loglevel="WARNING")
w_plain = WorkController(app=plain, **kw)
w_dq = WorkController(app=with_dq, **kw)

headers = {"delayq_gate": "not a gate", "delayq_due": (time.time() - 1) * 1000}
for task in (plain.tasks["plain.add"], with_dq.tasks["dq.add"]):
    task.push_request(id="x-" + task.name, **headers)
    try:
        task_prerun.send(sender=task, task_id="x-" + task.name, task=task, args=(), kwargs={})
        task_postrun.send(sender=task, task_id="x-" + task.name, task=task, state="SUCCESS")
    finally:
        task.pop_request()

def steps(w):
    return sorted({type(s).__name__ for s in w.blueprint.order}
                  | {type(s).__name__ for s in w.consumer.blueprint.order})

rec = worker.recorder_for(with_dq)
print(json.dumps({
    "after_import": after_import,
    "receivers": delayq_receivers(),
    "ids": {"with_dq": str(id(with_dq)), "plain": str(id(plain))},
    "steps": {"with_dq": steps(w_dq), "plain": steps(w_plain)},
    "keepers": {"with_dq": slots.keeper_for(with_dq) is not None,
                "plain": slots.keeper_for(plain) is not None},
    "recorders": {"with_dq": rec is not None, "plain": worker.recorder_for(plain) is not None},
    "recorded": rec.histogram.snapshot().count if rec else None,
    "app_attrs": {"with_dq": sorted(k for k in vars(with_dq) if "delayq" in k),
                  "plain": sorted(k for k in vars(plain) if "delayq" in k)},
}))
rec.histogram.pending.clear()
"""


@pytest.mark.slow
def test_two_apps_in_one_process_only_the_delayq_one_gets_receivers_and_steps() -> None:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(TWO_APPS)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    import json

    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["after_import"] == {}  # importing celery_delayq connects nothing
    dq_id, plain_id = seen["ids"]["with_dq"], seen["ids"]["plain"]
    receivers = seen["receivers"]
    # the delayq app's worker connected its receivers, each for that app only
    assert set(receivers) == {"task_prerun", "task_postrun", "task_revoked", "worker_process_shutdown",
                              "worker_shutdown"}  # fmt: skip
    every = [uid for uids in receivers.values() for uid in uids]
    assert all(uid.endswith(":" + dq_id) for uid in every), every
    assert not any(plain_id in uid for uid in every)
    assert {"DelayQWorker", "SlotReceivers", "StartCheck"} <= set(seen["steps"]["with_dq"])
    assert not {"DelayQWorker", "SlotReceivers", "StartCheck"} & set(seen["steps"]["plain"]), seen["steps"][
        "plain"
    ]
    # the gated, delayq-due run of the plain app's task met no delayq code; the other's did
    assert seen["keepers"] == {"with_dq": True, "plain": False}
    assert seen["recorders"] == {"with_dq": True, "plain": False}
    assert seen["recorded"] == 1
    assert seen["app_attrs"]["plain"] == []


def test_installed_by_a_delayed_task_or_by_install_and_not_otherwise(redis_url: str) -> None:
    import celery_delayq

    bare = make_app(redis_url)
    assert not installed(bare)
    bare.conf.delayq_prefix = "p"
    assert not installed(bare)  # settings alone attach nothing
    assert celery_delayq.install(bare) is bare and installed(bare)
    celery_delayq.install(bare)  # idempotent
    assert len(bare.steps["worker"]) == 2  # the slot receivers' step and DelayQWorker

    with_task = make_app(redis_url)

    @with_task.task(base=celery_delayq.DelayedTask, name="t.x", shared=False)
    def x() -> None:
        return None

    with_task.finalize()
    assert installed(with_task)


def test_one_object_holds_config_store_plans_and_results(app: Celery) -> None:
    ext = extension(app)
    config, store, state = DelayQConfig.from_app(app), get_store(app), app_state(app)
    app.tasks["t.add"].apply_in(60, (1, 2))
    assert ext.parts["config"] is config and ext.parts["store"] is store and ext.parts["state"] is state
    assert ext.parts["results"]  # the results cache of that apply_in
    assert [k for k in vars(app) if "delayq" in k] == ["delayq_extension"]


def test_a_changed_setting_makes_the_whole_object_anew(app: Celery) -> None:
    ext = extension(app)
    config, store, state = DelayQConfig.from_app(app), get_store(app), app_state(app)
    app.conf.delayq_prefix = "changed"
    assert extension(app) is ext  # read again at most every RECHECK_EVERY seconds
    ext.checked -= extension_module.RECHECK_EVERY  # (as if that time had passed)
    new = extension(app)
    assert new is not ext and new.parts == {}
    assert DelayQConfig.from_app(app) is not config and DelayQConfig.from_app(app).prefix == "changed"
    assert get_store(app) is not store and get_store(app).keys.prefix == "changed"
    assert app_state(app) is not state
    new.checked -= extension_module.RECHECK_EVERY
    assert extension(app) is new  # nothing changed since: the same object
    app.conf.task_default_queue = "elsewhere"  # a Celery setting a stored message is built from
    new.checked -= extension_module.RECHECK_EVERY
    assert extension(app) is not new


def test_another_configuration_object_is_seen_at_the_next_call(app: Celery) -> None:
    ext = extension(app)
    app.config_from_object({"delayq_url": app.conf.delayq_url, "delayq_shards": 4})
    assert extension(app) is not ext
    assert DelayQConfig.from_app(app).shards == 4


def test_reconfigure_makes_it_anew_at_once(app: Celery) -> None:
    ext = extension(app)
    DelayQConfig.from_app(app)
    app.conf.delayq_shards = 8
    assert reconfigure(app) is not ext
    assert DelayQConfig.from_app(app).shards == 8
