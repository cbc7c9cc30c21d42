"""The jobs: a searchable, paged list of what is stored (``/jobs``), one job's detail
(``/jobs/<id>``), the actions on them (``POST /jobs/action``: run now, reschedule, cancel), and
their JSON twins (``/api/jobs``: ``celery delayq ls --json``, plus ``"scan"`` for an id search;
``/api/jobs/<id>``: ``delayq show --json``; ``POST /api/jobs/action``).

A listing reads from its cursor on (O(log n) a shard and page, however many jobs are stored).
A filter by task, queue or state reads at most ``budget`` jobs a page (:data:`FILTER_BUDGET`;
then it says so and offers to go on); a search by id prefix looks the exact id up first, then
examines about ``budget`` ids a request (:data:`BUDGET`; a ``ZSCAN`` of each shard,
:meth:`~celery_delayq.store.facade.Store.search_ids`).
"""

from __future__ import annotations

from typing import Any

from flask import Blueprint, abort, jsonify, render_template, request, url_for
from werkzeug.datastructures import MultiDict

from ..admin.jobs import CANCELLED, MOVED
from ..admin.listing import JobFilter, id_search, jobs_page
from ..admin.status import GATED_BY
from ..admin.timeparse import is_relative, parse_when
from ..admin.views import JOB_STATES, cancel_result, job_detail, job_view, move_result, shown
from .context import action_response, dashboard, relative, require_actions
from .forms import form_values, refuse

__all__ = ["ACTIONS", "BUDGET", "FILTER_BUDGET", "PAGE", "bp"]

bp = Blueprint("jobs", __name__)

#: Jobs a page shows (``limit``, at most :data:`MAX_PAGE`).
PAGE = 50
MAX_PAGE = 500
#: Ids an id search examines a request, at most (``budget`` changes it, up to :data:`MAX_BUDGET`):
#: ``ZSCAN`` examines about 1.3 million a second (``MATCH`` runs in Redis).
BUDGET = 200_000
#: Jobs a page filtered by task, queue or state reads, at most (``budget`` changes it): each is
#: read whole, about 120,000 a second.
FILTER_BUDGET = 50_000
MAX_BUDGET = 5_000_000
#: The actions of ``POST /jobs/action``.
ACTIONS = ("run-now", "reschedule", "cancel")


def _when(text: str, what: str) -> int:
    """A WHEN as ``delayq reschedule`` takes it; relative ones count from the Redis server's clock."""
    board = dashboard()
    try:
        return parse_when(text, board.app, board.store.server_now_ms() if is_relative(text) else None)
    except ValueError as exc:
        refuse(f"{what}: {exc}")


def _number(args: MultiDict[str, str], name: str, default: int, top: int) -> int:
    text = (args.get(name) or "").strip()
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        refuse(f"{name}: {text!r} is not a whole number")
    if not 1 <= value <= top:
        refuse(f"{name}: {value} is out of range (1 to {top:,})")
    return value


def search_args(args: MultiDict[str, str]) -> dict[str, str]:
    """The search fields as given (the form shows them again; the pager keeps them)."""
    names = ("q", "task", "queue", "state", "from", "until", "limit", "budget")
    return {name: args[name] for name in names if args.get(name)}


def _page() -> dict[str, Any]:
    board = dashboard()
    args = request.args
    state = args.get("state") or None
    if state is not None and state not in JOB_STATES:
        refuse(f"state: {state!r} is not one of {', '.join(JOB_STATES)}")
    start, until = (args.get("from") or "").strip(), (args.get("until") or "").strip()
    where = JobFilter(
        task=(args.get("task") or "").strip() or None,
        queue=(args.get("queue") or "").strip() or None,
        state=state,
        start_ms=_when(start, "from") if start else None,
        end_ms=_when(until, "until") if until else None,
    )
    limit = _number(args, "limit", PAGE, MAX_PAGE)
    budget = _number(args, "budget", BUDGET if args.get("q") else FILTER_BUDGET, MAX_BUDGET)
    cursor = args.get("cursor") or None
    prefix = args.get("q") or ""
    try:
        if prefix:
            return id_search(board.store, board.default_queue, prefix, where, cursor, budget, limit)
        if where.narrowed:
            return jobs_page(board.store, board.default_queue, where, limit, 0, cursor, budget)
        return jobs_page(board.store, board.default_queue, where, limit, 0, cursor)
    except ValueError as exc:
        refuse(str(exc))


@bp.get("/api/jobs")
def api_jobs() -> Any:
    return jsonify(_page())


def pages(total: int, limit: int, number: int) -> dict[str, int]:
    """Where page ``number`` of the unfiltered list stands: its number, the count of pages, the
    position (1-based) of its first job, and the total.

    >>> pages(5469, 50, 2)
    {'page': 2, 'pages': 110, 'first': 51, 'total': 5469}
    >>> pages(0, 50, 1), pages(120, 50, 9)["page"]
    ({'page': 1, 'pages': 1, 'first': 0, 'total': 0}, 3)
    """
    count = max(1, -(-total // limit))
    number = min(number, count)  # a page number from an old link, when jobs have gone since
    return {"page": number, "pages": count, "first": min((number - 1) * limit + 1, total), "total": total}


@bp.get("/jobs")
def jobs() -> str:
    view = _page()
    search = search_args(request.args)
    stored = dashboard().store.count()  # one ZCARD a shard
    where = None
    if not any(search.get(name) for name in ("q", "task", "queue", "state", "from", "until")):
        # The whole list: the page number is carried by the pager's links (a cursor page
        # knows no rank of its own).
        number = _number(request.args, "page", 1, 10**9) if request.args.get("cursor") else 1
        where = pages(stored, int(search.get("limit") or PAGE), number)
    return render_template(
        "jobs.html", view=view, search=search, states=JOB_STATES, actions=ACTIONS, where=where, stored=stored,
        gated_by=GATED_BY,
    )  # fmt: skip


def _detail(job_id: str) -> dict[str, Any]:
    board = dashboard()
    view = job_detail(board.store, board.default_queue, job_id)
    if view is None:
        abort(404, description=f"no job with id {job_id!r}")
    return view


@bp.get("/api/jobs/<path:job_id>")
def api_job(job_id: str) -> Any:
    return jsonify(_detail(job_id))


@bp.get("/jobs/<path:job_id>")
def job(job_id: str) -> str:
    return render_template("job.html", job=_detail(job_id), gated_by=GATED_BY)


#: A job moved to within this many ms of now may be delivered before its page is read again:
#: after such a move the browser goes to the jobs list, not to the job's page.
SOON_MS = 10_000


def act(action: str, ids: list[str], when: str | None) -> tuple[list[dict[str, Any]], bool]:
    """Do ``action`` to each job of ``ids``: the results ``delayq cancel|reschedule|run-now
    --json`` prints, and whether the jobs left (cancelled) or are about to (moved to within
    :data:`SOON_MS` of now: a beat delivers them, and their pages are gone). A bad action, no
    ids or a bad WHEN answers 400 before anything changes. A job moved to now says that it
    was sent and where to follow it (``message``)."""
    board = dashboard()
    if action not in ACTIONS:
        refuse(f"action: {action!r} is not one of {', '.join(ACTIONS)}")
    if not ids:
        refuse("no job chosen: tick at least one job (ids)")
    if action == "cancel":
        return [cancel_result(board.dq, board.store, job_id) for job_id in ids], True
    now = board.store.server_now_ms()
    if action == "run-now":
        due_ms, what = now, "run"
    else:
        if not (when or "").strip():
            refuse("when: give the time to reschedule to (ISO-8601, UNIX s, now, +10m, -1h)")
        due_ms, what = _when(when or "", "when"), "reschedule"
    due_text = f"due {board.when(due_ms)} ({relative(due_ms)})"
    soon = due_ms <= now + SOON_MS
    results = []
    for job_id in ids:
        record = board.store.get(job_id) if soon else None
        task = job_view(record, board.default_queue)["task"] if record is not None else None
        result = move_result(board.dq, board.store, job_id, due_ms, what, due_text)
        if soon and result["outcome"] == MOVED:
            result["message"] = sent_text(job_id, task, due_text)
        results.append(result)
    return results, soon


def sent_text(job_id: str, task: str | None, due_text: str) -> str:
    """What a job moved to now says: sent to the beats, and where to follow it once delivered
    (its page is gone then: the task id is the job id).

    >>> text = sent_text("j1", "proj.add", "due now")
    >>> text.startswith("sent: proj.add is due now; a beat publishes it"), "AsyncResult('j1')" in text
    (True, True)
    """
    what = task or "the job"
    return (
        f"sent: {what} is {due_text}; a beat publishes it within moments, and then it leaves the store: "
        f"follow task id {shown(job_id)} in your result backend (AsyncResult({job_id!r})) or Flower"
    )


def _ok(action: str) -> set[str]:
    return {CANCELLED} if action == "cancel" else {MOVED}


@bp.post("/jobs/action")
def action() -> Any:
    require_actions()
    name = request.form.get("action", "")
    ids = form_values(request.form, "ids")
    results, left = act(name, ids, request.form.get("when"))
    # A job cancelled, or moved to now (a beat delivers it in a moment), has no page any more.
    gone = [url_for("jobs.job", job_id=job_id) for job_id in ids] if left else []
    return action_response(results, _ok(name), url_for("jobs.jobs"), gone)


@bp.post("/api/jobs/action")
def api_action() -> Any:
    require_actions()
    body = request.get_json(silent=True)
    if not isinstance(body, dict):
        refuse('send a JSON object: {"action": "cancel", "ids": ["..."], "when": "+10m"}')
    name, ids, when = body.get("action"), body.get("ids"), body.get("when")
    if not isinstance(name, str):
        refuse(f"action: give one of {', '.join(ACTIONS)}")
    if not isinstance(ids, list) or not all(isinstance(i, str) and i for i in ids):
        refuse("ids: give a list of job ids (strings)")
    if when is not None and not isinstance(when, str):
        refuse("when: give a time as text (ISO-8601, UNIX s, now, +10m, -1h)")
    return action_response(act(name, ids, when)[0], _ok(name), "/jobs")
