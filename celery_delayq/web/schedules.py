"""The recurring schedules: the list (``/schedules``), one schedule with its run history
(``/schedules/<name>``), the edit and new forms, and the actions (pause, resume, run now,
delete); with their JSON twins (``/api/schedules``: ``celery delayq schedules ls --json``,
``/api/schedules/<name>``: ``schedules show --json``, ``POST /api/schedules/<name>``:
``schedules update --json``, ``POST /api/schedules``: ``schedules add --json``).

A form is read as the CLI reads its options (:mod:`..cli.inputs`) and stored through
:meth:`Schedules.add` / :meth:`Schedules.update`, which check everything before anything is
stored: a bad cron expression, timezone, JSON value or task shows the form again with the
message, the input kept, and nothing changed. The edit form sends only what was changed.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from flask import Blueprint, abort, flash, jsonify, redirect, render_template, request, url_for

from ..admin.inputs import InputError, add_schedule, json_value, options_value, rule_of, update_schedule
from ..admin.jobs import MISSING
from ..admin.timeparse import is_relative, parse_when
from ..admin.views import iso, schedule_json
from ..exceptions import ScheduleError, ScheduleExists, ScheduleNotFound, UnknownTask
from ..schedules.rules import DST_FOLD, DST_GAP
from ..schedules.spec import MISSED_POLICIES, OVERLAP_POLICIES, Schedule
from ..store.keys import point_id
from .context import action_response, dashboard, require_actions, wants_json
from .forms import Fields, fields, refuse

__all__ = ["FORM_FIELDS", "bp"]

bp = Blueprint("schedules", __name__)

#: The text fields of the edit and new forms (``name`` and ``task`` too on the new one).
FORM_FIELDS = ("cron", "every", "at", "tz", "args", "kwargs", "options", "queue", "missed", "max_missed",
               "grace", "task", "dst_gap", "dst_fold", "overlap")  # fmt: skip
RULE_FIELDS = ("cron", "every", "at")


@bp.app_template_filter("iso_ms")
def iso_ms(text: str | None) -> int | None:
    """An ISO-8601 time of a JSON view back in ms (for the ``when`` and ``relative`` filters).

    >>> iso_ms("2023-11-14T22:13:20.500Z"), iso_ms(None)
    (1700000000500, None)
    """
    if not text:
        return None
    return round(datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp() * 1000)


def _listing() -> dict[str, Any]:
    found = sorted(dashboard().schedules.list(), key=lambda x: x.name)
    return {"schedules": [schedule_json(x) for x in found], "count": len(found)}


@bp.get("/api/schedules")
def api_schedules() -> Any:
    return jsonify(_listing())


@bp.get("/schedules")
def schedules() -> str:
    return render_template("schedules.html", view=_listing())


def _get(name: str) -> Schedule:
    try:
        found = dashboard().schedules.get(name)
    except ScheduleError as exc:  # a name no schedule can have
        abort(404, description=str(exc))
    if found is None:
        abort(404, description=f"no schedule named {name!r}")
    return found


@bp.get("/api/schedules/<path:name>")
def api_schedule(name: str) -> Any:
    return jsonify(schedule_json(_get(name)))


@bp.get("/schedules/<path:name>")
def schedule(name: str) -> str:
    sch = _get(name)
    view = schedule_json(sch)
    next_ms = round(sch.next_run.timestamp() * 1000) if sch.next_run else None
    return render_template(
        "schedule.html", s=view, sch=sch, next_id=point_id(sch.name, next_ms) if next_ms else None
    )


# -- actions ---------------------------------------------------------------------------------------


def _one(action: str, name: str) -> dict[str, Any]:
    """One schedule action's result (the CLI's ``--json`` shape, with outcome and message)."""
    board = dashboard()
    schedules = board.schedules
    try:
        if action == "delete":
            gone = schedules.delete(name)
            return {"name": name, "outcome": "deleted" if gone else MISSING,
                    "message": "deleted" if gone else f"no schedule named {name!r}"}  # fmt: skip
        if action == "run-now":
            result = schedules.run_now(name)
            due_ms = result.due.timestamp() * 1000 if result.due else None
            return {"name": name, "id": result.id, "due": iso(due_ms), "created": result.created,
                    "outcome": "stored" if result.created else "kept",
                    "message": f"stored {result.id}, due {board.when(due_ms)}"}  # fmt: skip
        sch = schedules.pause(name) if action == "pause" else schedules.resume(name)
    except ScheduleNotFound:
        return {"name": name, "outcome": MISSING, "message": f"no schedule named {name!r}"}
    done = "paused" if action == "pause" else "resumed"
    return {**schedule_json(sch), "outcome": done, "message": done}


@bp.post("/api/schedules/action")
@bp.post("/schedules/action")  # the last applied, first registered: url_for builds this one
def action() -> Any:
    """``action`` (pause, resume, run-now, delete) on the schedule(s) ``name``."""
    require_actions()
    given = fields()
    what = given.text("action")
    if what not in ("pause", "resume", "run-now", "delete"):
        refuse(f"action must be pause, resume, run-now or delete, got {what!r}")
    names = given.texts("name")
    if not names:
        refuse("name the schedule: the name field")
    results = [_one(what, name) for name in names]
    ok = {"paused", "resumed", "deleted", "stored", "kept"}
    # A deleted schedule has no page any more: back to the list, not a 404.
    gone = [url_for("schedules.schedule", name=name) for name in names] if what == "delete" else []
    return action_response(results, ok, url_for("schedules.schedules"), gone)


# -- the edit and new forms ------------------------------------------------------------------------


def _every_text(every_ms: int) -> str:
    """An interval as the form shows it: ``30s``, ``1500ms``.

    >>> _every_text(30_000), _every_text(1_500), _every_text(86_400_000)
    ('30s', '1500ms', '86400s')
    """
    return f"{every_ms // 1000}s" if every_ms % 1000 == 0 else f"{every_ms}ms"


def initial(sch: Schedule) -> dict[str, str]:
    """The edit form's fields as they are stored (what is sent unchanged is not a change)."""
    rule = sch.rule.to_json()
    return {
        "cron": rule["expr"] if rule["type"] == "cron" else "",
        "every": _every_text(rule["every_ms"]) if rule["type"] == "interval" else "",
        "at": iso(rule["at_ms"]) or "" if rule["type"] == "once" else "",
        "tz": sch.tz,
        "args": json.dumps(sch.args, ensure_ascii=False),
        "kwargs": json.dumps(sch.kwargs, ensure_ascii=False),
        "options": json.dumps(sch.options, ensure_ascii=False),
        "queue": str(sch.options.get("queue") or ""),
        "missed": sch.missed,
        "max_missed": str(sch.max_missed),
        "grace": f"{sch.grace:g}",
        "task": sch.task,
        "dst_gap": sch.dst_gap or "cron",
        "dst_fold": sch.dst_fold or "cron",
        "overlap": sch.overlap,
    }


@dataclass
class Reading:
    """A form (or JSON body) read: the values for the API, or the errors that stop it."""

    values: dict[str, Any] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    def take(self, key: str, read: Any) -> None:
        try:
            value = read()
        except InputError as exc:
            self.errors.append(str(exc))
        else:
            if value is not None:
                self.values[key] = value


def _when(text: str) -> int:
    board = dashboard()
    return parse_when(text, board.app, board.store.server_now_ms() if is_relative(text) else None)


def _json(given: Fields, name: str, kind: type) -> Any:
    value = given.raw(name)
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if isinstance(value, str):
        return json_value(value, name, kind)
    if not isinstance(value, kind):
        raise InputError(f"{name} must be a JSON {'array' if kind is list else 'object'}, got {value!r}")
    return value


def _number(given: Fields, name: str, kind: type) -> Any:
    value = given.raw(name)
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if isinstance(value, str):
        try:
            return kind(value.strip())
        except ValueError:
            what = "a whole number >= 1" if kind is int else "a number of seconds >= 0"
            raise InputError(f"{name} must be {what}, got {value!r}") from None
    return value


def read_schedule(given: Fields, current: Schedule | None) -> Reading:
    """The fields of a schedule (all for a new one; for ``current``, only those given) read as
    the CLI reads its options; the API checks the rest."""
    out = Reading()
    rules = {k: given.text(k) for k in RULE_FIELDS}
    required = current is None
    out.take("rule", lambda: rule_of(rules["cron"], rules["every"], rules["at"], required, _when, prefix=""))
    out.take("args", lambda: _json(given, "args", list))
    out.take("kwargs", lambda: _json(given, "kwargs", dict))
    base = current.options if current is not None else None
    queue = given.raw("queue")
    queue_text = None if queue is None else str(queue).strip()
    options_given = given.raw("options")
    if isinstance(options_given, dict):
        options_given = json.dumps(options_given)
    elif options_given is not None and not str(options_given).strip():
        options_given = None
    if queue_text == "" and current is not None:  # the queue field emptied: the default queue
        merged = dict(base or {}) if options_given is None else None
        if merged is not None:
            merged.pop("queue", None)
            out.values["options"] = merged
        else:
            out.take("options", lambda: {k: v for k, v in
                                         (json_value(options_given, "options", dict) or {}).items()
                                         if k != "queue"})  # fmt: skip
    else:
        out.take("options", lambda: options_value(options_given, queue_text or None, base, "options"))
    for name in ("tz", "missed", "task", "dst_gap", "dst_fold", "overlap"):
        text = given.text(name)
        if text is not None:
            out.values[name] = text
    out.take("max_missed", lambda: _number(given, "max_missed", int))
    out.take("grace", lambda: _number(given, "grace", float))
    return out


def _message(exc: ScheduleError) -> str:
    """What a form says for an error of the API."""
    if isinstance(exc, UnknownTask) and exc.task is not None:
        return (f"task {exc.task!r} is not registered in this app; import its module first "
                "(or accept unknown tasks: no_check_task)")  # fmt: skip
    if isinstance(exc, ScheduleExists):
        return f"a schedule named {exc.name!r} exists: edit it instead"
    return str(exc.args[0]) if exc.args else str(exc)


def _changed(sch: Schedule) -> Fields:
    """The edit form's fields that differ from :func:`initial` (what the user changed)."""
    before = initial(sch)
    form = request.form
    kept: dict[str, Any] = {}
    rules_before = {k: before[k] for k in RULE_FIELDS}
    rules_now = {k: (form.get(k) or "").strip() for k in RULE_FIELDS}
    if rules_now != rules_before:
        kept.update({k: v for k, v in rules_now.items() if v})
        if not any(rules_now.values()):
            kept["rule"] = ""  # emptied: rule_of says to give one
    for name in FORM_FIELDS:
        if name in RULE_FIELDS:
            continue
        value = (form.get(name) or "").strip()
        same_json = name in ("args", "kwargs", "options") and _same_json(value, before[name])
        if value == before[name] or same_json:
            continue
        kept[name] = value
    return Fields(kept)


def _same_json(text: str, before: str) -> bool:
    """Whether a JSON field says what it said (spacing aside; empty: the empty ``[]``/``{}``)."""
    if not text:
        return before in ("[]", "{}")
    try:
        return bool(json.loads(text) == json.loads(before))
    except ValueError:
        return False


def _form_page(**args: Any) -> str:
    """The edit (``new`` False) or new form, with its ``values`` and ``errors``."""
    return render_template(
        "schedule_edit.html",
        policies=MISSED_POLICIES,
        dst_gaps=DST_GAP,
        dst_folds=DST_FOLD,
        overlaps=OVERLAP_POLICIES,
        **args,
    )


def _form_errors(template_args: dict[str, Any], errors: list[str]) -> Any:
    if wants_json():
        response = jsonify({"error": "; ".join(errors), "errors": errors, "status": 400})
        response.status_code = 400
        return response
    return _form_page(errors=errors, **template_args), 400


def _update(name: str, given: Fields, template_args: dict[str, Any]) -> Any:
    sch = _get(name)
    reading = read_schedule(given, sch)
    if given.raw("rule") == "":
        reading.errors.insert(0, "give the rule: cron '0 9 * * 1-5', every 30s or at 2026-12-01T09:00:00Z")
    if reading.errors:
        return _form_errors(template_args, reading.errors)
    if not reading.values:
        if wants_json():
            refuse("nothing to change: give cron/every/at, args, kwargs, tz, queue, options, ...")
        flash(f"{name}: nothing changed", "ok")
        return redirect(url_for("schedules.schedule", name=name), code=303)
    schedules = dashboard().schedules
    return _stored(lambda: update_schedule(schedules, name, reading.values), "updated", template_args)


def _stored(store: Callable[[], Schedule], done: str, template_args: dict[str, Any]) -> Any:
    """Call ``store`` (add or update): the schedule's JSON, or a flash and its page; the form
    again with the API's error; 404 when the schedule is gone."""
    try:
        sch = store()
    except ScheduleNotFound as exc:
        abort(404, description=str(exc))
    except ScheduleError as exc:
        return _form_errors(template_args, [_message(exc)])
    except InputError as exc:
        return _form_errors(template_args, [str(exc)])
    if wants_json():
        return jsonify(schedule_json(sch))
    flash(f"{sch.name}: {done}", "ok")
    return redirect(url_for("schedules.schedule", name=sch.name), code=303)


@bp.route("/schedules/<path:name>/edit", methods=["GET", "POST"])
def edit(name: str) -> Any:
    sch = _get(name)
    if request.method == "GET":
        return _form_page(name=name, values=initial(sch), errors=[], new=False)
    require_actions()
    values = {k: request.form.get(k, "") for k in FORM_FIELDS}
    return _update(name, _changed(sch), {"name": name, "values": values, "new": False})


@bp.post("/api/schedules/<path:name>")
def api_update(name: str) -> Any:
    """``schedules update NAME --json``: the fields given are the changes."""
    require_actions()
    return _update(name, fields(), {"name": name, "values": {}, "new": False})


def _add(given: Fields, template_args: dict[str, Any]) -> Any:
    reading = read_schedule(given, None)
    name = given.text("name") or ""
    task = given.text("task") or ""
    missing = [] if name else ["give the schedule a name"]
    if not task:
        missing.append("give the task to run (its registered name)")
    if missing or reading.errors:
        return _form_errors(template_args, missing + reading.errors)
    values = dict(reading.values)
    rule = values.pop("rule")
    args, kwargs = values.pop("args", None), values.pop("kwargs", None)
    values.pop("task", None)
    settings = {**values, "enabled": not given.flag("paused"), "check_task": not given.flag("no_check_task")}
    schedules = dashboard().schedules
    return _stored(lambda: add_schedule(schedules, name, task, rule, args, kwargs, **settings), "stored",
                   template_args)  # fmt: skip


NEW_DEFAULTS = {"args": "[]", "kwargs": "{}", "options": "{}", "missed": "once", "max_missed": "10",
                "grace": "60", "dst_gap": "cron", "dst_fold": "cron", "overlap": "allow"}  # fmt: skip


@bp.route("/schedules/new", methods=["GET", "POST"])
def new() -> Any:
    if request.method == "GET":
        values = {k: request.args.get(k, NEW_DEFAULTS.get(k, "")) for k in (*FORM_FIELDS, "name")}
        return _form_page(name="", values=values, errors=[], new=True)
    require_actions()
    values = {k: request.form.get(k, "") for k in (*FORM_FIELDS, "name")}
    values.update(paused=request.form.get("paused", ""), no_check_task=request.form.get("no_check_task", ""))
    return _add(fields(), {"name": "", "values": values, "new": True})


@bp.post("/api/schedules")
def api_add() -> Any:
    """``schedules add NAME TASK ... --json``."""
    require_actions()
    return _add(fields(), {"name": "", "values": {}, "new": True})
