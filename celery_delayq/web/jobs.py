"""The jobs: a searchable, paged list of what is stored (``/jobs``), one job's detail
(``/jobs/<id>``), and their JSON twins (``/api/jobs``: ``celery delayq ls --json``;
``/api/jobs/<id>``: ``delayq show --json``).
"""

from __future__ import annotations

from typing import Any

from flask import Blueprint, abort, jsonify, render_template, request

from ..views import JobFilter, job_detail, jobs_page
from .context import dashboard

__all__ = ["bp"]

bp = Blueprint("jobs", __name__)

#: Jobs a page shows.
PAGE = 50


def _page() -> dict[str, Any]:
    board = dashboard()
    cursor = request.args.get("cursor") or None
    try:
        return jobs_page(board.store, board.default_queue, JobFilter(), PAGE, 0, cursor)
    except ValueError as exc:
        abort(400, description=str(exc))


@bp.get("/api/jobs")
def api_jobs() -> Any:
    return jsonify(_page())


@bp.get("/jobs")
def jobs() -> str:
    return render_template("jobs.html", view=_page())


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
    return render_template("job.html", job=_detail(job_id))
