"""The dead letters (``/dead``: reason, task, dead at, due, tries), one dead letter
(``/dead/<id>``), and requeue or delete of one, a selection or all (``POST /dead/action``);
with their JSON twins (``/api/dead``: ``celery delayq dead ls --json``, ``/api/dead/<id>``:
``dead show --json``, ``POST /api/dead/action``: the results ``dead requeue|rm --json`` print).
"""

from __future__ import annotations

from typing import Any

from flask import Blueprint, abort, jsonify, render_template, request, url_for

from ..admin.jobs import MISSING, NO_ENVELOPE, REQUEUED
from ..admin.timeparse import is_relative, parse_when
from ..admin.views import dead_page, dead_view, iso
from ..exceptions import CorruptData
from .context import action_response, dashboard, require_actions
from .forms import fields, refuse

__all__ = ["PAGE", "bp", "delete_results", "requeue_results"]

bp = Blueprint("dead", __name__)

#: Dead letters a page shows.
PAGE = 50

#: What a requeue that did not happen says (``delayq dead requeue``'s words).
NOT_REQUEUED = {
    MISSING: "no dead letter with id {id!r}",
    "stored": "{id!r} not requeued: a job with this id is stored (see its page under /jobs)",
    NO_ENVELOPE: "{id!r} not requeued: its dead letter holds no message",
}


def _number(name: str, default: int, least: int) -> int:
    text = request.args.get(name) or ""
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        value = least - 1
    if value < least:
        refuse(f"{name} must be a whole number >= {least}, got {text!r}")
    return value


def _listing() -> dict[str, Any]:
    board = dashboard()
    task = request.args.get("task") or None
    limit = _number("limit", PAGE, 1)
    offset = _number("offset", 0, 0)
    return dead_page(board.store, board.default_queue, board.dq.dead(), task, limit, offset)


@bp.get("/api/dead")
def api_dead() -> Any:
    return jsonify(_listing())


@bp.get("/dead")
def dead() -> str:
    view = _listing()
    offset = _number("offset", 0, 0)
    more = view["total"] > offset + view["count"]
    return render_template(
        "dead.html", view=view, task=request.args.get("task") or "", offset=offset,
        limit=_number("limit", PAGE, 1), next_offset=offset + view["count"] if more else None,
    )  # fmt: skip


def _detail(job_id: str) -> dict[str, Any]:
    board = dashboard()
    try:
        record = board.store.dead_record(job_id)
    except CorruptData as exc:  # shown with why, as the listing shows it
        record = {"reason": str(exc), "envelope": ""}
    if record is None:
        abort(404, description=f"no dead letter with id {job_id!r}")
    return dead_view(board.store, board.default_queue, job_id, record, detail=True)


@bp.get("/api/dead/<path:job_id>")
def api_dead_letter(job_id: str) -> Any:
    return jsonify(_detail(job_id))


@bp.get("/dead/<path:job_id>")
def dead_letter(job_id: str) -> str:
    return render_template("dead_letter.html", job=_detail(job_id))


def requeue_results(ids: list[str], due_ms: int | None) -> list[dict[str, Any]]:
    """Requeue each dead letter (due at ``due_ms``, default now on the server's clock): the
    results ``delayq dead requeue --json`` prints."""
    board = dashboard()
    results = []
    for job_id in ids:
        at = due_ms if due_ms is not None else board.store.server_now_ms()
        outcome = board.dq.requeue_dead(job_id, at / 1000.0)
        text = f"requeued, due {board.when(at)}" if outcome == REQUEUED else NOT_REQUEUED[outcome]
        message = text.format(id=job_id)
        results.append({"id": job_id, "outcome": str(outcome), "message": message, "due": iso(at)})
    return results


def delete_results(ids: list[str]) -> list[dict[str, Any]]:
    """Forget each dead letter: the results ``delayq dead rm --json`` prints."""
    dq = dashboard().dq
    results = []
    for job_id in ids:
        gone = dq.delete_dead(job_id)
        results.append({"id": job_id, "outcome": "deleted" if gone else MISSING,
                        "message": "deleted" if gone else f"no dead letter with id {job_id!r}"})  # fmt: skip
    return results


@bp.post("/api/dead/action")
@bp.post("/dead/action")  # the last applied, first registered: url_for builds this one
def action() -> Any:
    """``action``: requeue or delete the dead letters ``ids`` (requeue ``at`` WHEN, default
    now), or requeue-all / delete-all."""
    require_actions()
    given = fields()
    what = given.text("action")
    if what not in ("requeue", "delete", "requeue-all", "delete-all"):
        refuse(f"action must be requeue, delete, requeue-all or delete-all, got {what!r}")
    board = dashboard()
    due_ms = None
    at = given.text("at")
    if at is not None and what.startswith("requeue"):
        try:
            due_ms = parse_when(at, board.app, board.store.server_now_ms() if is_relative(at) else None)
        except ValueError as exc:
            refuse(f"at: {exc}")
    if what == "delete-all":
        removed = board.dq.delete_all_dead()
        results = [{"id": "all dead letters", "outcome": "deleted", "removed": removed,
                    "message": f"removed {removed:,} dead letter(s)"}]  # fmt: skip
        return action_response(results, {"deleted"}, url_for("dead.dead"))
    if what == "requeue-all":
        ids = sorted({job_id for job_id, _ in board.dq.dead()})
    else:
        ids = given.texts("ids")
        if not ids:
            refuse("tick the dead letters to " + what + " (the ids field)")
    # A requeued or deleted dead letter has no page any more: back to the list, not a 404.
    gone = [url_for("dead.dead_letter", job_id=job_id) for job_id in ids]
    if what.startswith("requeue"):
        return action_response(requeue_results(ids, due_ms), {REQUEUED}, url_for("dead.dead"), gone)
    return action_response(delete_results(ids), {"deleted"}, url_for("dead.dead"), gone)
