"""Flow control: the gate keys (``/keys``, ``/keys/<key>``: limit in force and whether it was
set at run time, running, waiting, paused; pause, resume, set or clear the limit) and the
batches (``/batches``, ``/batches/<id>``: progress; cancel the waiting members), with their
JSON twins (``/api/keys``: ``celery delayq keys --json``, ``/api/keys/<key>``: ``key --json``,
``/api/batches``: ``batches --json``, ``/api/batches/<id>``: ``batch --json``). An action
answers the CLI's JSON of the key or batch after it, with its outcome and message.
"""

from __future__ import annotations

from typing import Any

from flask import Blueprint, abort, jsonify, render_template, url_for

from ..admin.inputs import InputError, limit_of
from ..admin.jobs import MISSING, SCHEDULE_ACTIONS, check_key_target
from ..admin.views import batch_json, batches_view, key_json, keys_view
from ..exceptions import InvalidOptions, UnknownKey
from ..flow.gate import check_key
from .context import action_response, dashboard, require_actions
from .forms import fields, refuse

__all__ = ["bp", "key_action"]

bp = Blueprint("flow", __name__)


@bp.get("/api/keys")
def api_keys() -> Any:
    return jsonify(keys_view(dashboard().store))


@bp.get("/keys")
def keys() -> str:
    return render_template("keys.html", view=keys_view(dashboard().store))


def _key(key: str | None) -> str:
    try:
        return check_key(key, "key")
    except InvalidOptions as exc:
        refuse(str(exc))


def _key_view(key: str) -> dict[str, Any]:
    return key_json(dashboard().store.key_state(_key(key)))


@bp.get("/api/keys/<path:key>")
def api_key(key: str) -> Any:
    return jsonify(_key_view(key))


@bp.get("/keys/<path:key>")
def key(key: str) -> str:
    return render_template("key.html", k=_key_view(key))


def key_action(action: str, key: str, limit: str | None, new: bool = False) -> dict[str, Any]:
    """Pause, resume or limit (``limit``: n, none or clear) ``key``: the key's JSON after it
    (``delayq pause|resume|limit --json``: with ``released``) plus outcome and message. A key
    never seen, or a schedule's name (see :func:`check_key_target`), is refused (outcome
    ``unknown-key``) unless ``new``."""
    store = dashboard().store
    if action == "limit" and limit is not None and limit.lower() != "clear":
        try:
            limit_of(limit, "limit")
        except InputError as exc:
            refuse(str(exc))
    try:
        check_key_target(store, key, action, new)
    except UnknownKey as exc:
        return {"key": key, "outcome": "unknown-key", "message": _unknown_key_text(exc)}
    if action == "limit":
        if limit is None:
            refuse("limit: give a whole number >= 1, 'none' (no cap) or 'clear'")
        if limit.lower() == "clear":
            released, outcome, what = store.clear_limit(key), "limit-cleared", "run-time limit cleared"
        else:
            try:
                number = limit_of(limit, "limit")
            except InputError as exc:
                refuse(str(exc))
            released = store.set_limit(key, number)
            outcome = "limit-set"
            what = "run-time limit none (no cap)" if number is None else f"run-time limit {number}"
    elif action == "pause":
        released, outcome, what = store.pause(key), "paused", "paused"
    else:
        released, outcome, what = store.resume(key), "resumed", "resumed"
    view = key_json(store.key_state(key))
    if action == "limit":
        what += f"; limit in force: {'none' if view['limit'] is None else view['limit']}"
    if released:
        what += f"; {released:,} waiting job(s) released"
    return {**view, "released": released, "outcome": outcome, "message": what}


def _unknown_key_text(exc: UnknownKey) -> str:
    if exc.schedule:
        return (
            f"{exc.key!r} is a schedule, not a gate key: {SCHEDULE_ACTIONS[exc.action]} it on its page, "
            f"/schedules/{exc.key} (or send new to {exc.action} a new gate key of that name)"
        )
    return (
        f"no gate key {exc.key!r} has been seen (no job of it stored or gated, no limit or pause "
        f"set): check the name, or send new to {exc.action} it anyway"
    )


@bp.post("/api/keys/action")
@bp.post("/keys/action")  # the last applied, first registered: url_for builds this one
def keys_action() -> Any:
    """``action`` pause, resume or limit (``limit``: n, none, clear) on gate key ``key``."""
    require_actions()
    given = fields()
    what = given.text("action")
    if what not in ("pause", "resume", "limit"):
        refuse(f"action must be pause, resume or limit, got {what!r}")
    limit = given.raw("limit")
    limit_text = None if limit is None else str(limit).strip() or None
    result = key_action(what, _key(given.text("key")), limit_text, given.flag("new"))
    ok = {"paused", "resumed", "limit-set", "limit-cleared"}
    return action_response([result], ok, url_for("flow.keys"))


# -- batches ----------------------------------------------------------------------------------------


@bp.get("/api/batches")
def api_batches() -> Any:
    return jsonify(batches_view(dashboard().store))


@bp.get("/batches")
def batches() -> str:
    return render_template("batches.html", view=batches_view(dashboard().store))


def _batch(batch_id: str) -> dict[str, Any]:
    state = dashboard().store.batch_state(batch_id)
    if state is None:
        abort(404, description=f"no batch with id {batch_id!r}")
    return batch_json(state)


@bp.get("/api/batches/<path:batch_id>")
def api_batch(batch_id: str) -> Any:
    return jsonify(_batch(batch_id))


@bp.get("/batches/<path:batch_id>")
def batch(batch_id: str) -> str:
    return render_template("batch.html", bt=_batch(batch_id))


def _cancel(batch_id: str) -> dict[str, Any]:
    """``delayq batch ID --cancel --json`` plus outcome and message (missing: no batch)."""
    store = dashboard().store
    if store.batch_state(batch_id) is None:
        return {"id": batch_id, "outcome": MISSING, "message": f"no batch with id {batch_id!r}"}
    cancelled = store.cancel_batch(batch_id)
    state = store.batch_state(batch_id)
    view = batch_json(state) if state is not None else {"id": batch_id}
    return {**view, "cancelled_now": cancelled, "outcome": "cancelled",
            "message": f"{cancelled:,} waiting member(s) cancelled"}  # fmt: skip


def _delete(batch_id: str, force: bool) -> dict[str, Any]:
    """``delayq batch ID --delete [--force]``: outcome deleted, missing or pending."""
    outcome = dashboard().store.delete_batch(batch_id, force=force)
    messages = {
        "deleted": "deleted",
        "missing": f"no batch with id {batch_id!r}",
        "pending": "not finished (members waiting or running): cancel it first, or delete it "
        "with its waiting members",
    }
    return {"id": batch_id, "outcome": outcome, "message": messages[outcome]}


@bp.post("/api/batches/action")
@bp.post("/batches/action")  # the last applied, first registered: url_for builds this one
def batches_action() -> Any:
    """``action`` on batch ``id``: cancel (its members not released yet are removed), delete
    (a finished batch's record), force-delete (any batch; its waiting members cancelled first).
    A form that deleted goes back to the batches list (the batch's page is gone)."""
    require_actions()
    given = fields()
    what = given.text("action")
    if what not in ("cancel", "delete", "force-delete"):
        refuse(f"action must be cancel, delete or force-delete, got {what!r}")
    ids = given.texts("id")
    if not ids:
        refuse("name the batch: the id field")
    if what == "cancel":
        return action_response([_cancel(i) for i in ids], {"cancelled"}, url_for("flow.batches"))
    results = [_delete(i, what == "force-delete") for i in ids]
    gone = [url_for("flow.batch", batch_id=i) for i in ids]
    return action_response(results, {"deleted"}, url_for("flow.batches"), gone)
