"""The recurring schedules (``/schedules``) and their JSON twin (``/api/schedules``:
``celery delayq schedules ls --json``).
"""

from __future__ import annotations

from typing import Any

from flask import Blueprint, jsonify, render_template

from ..views import schedule_json
from .context import dashboard

__all__ = ["bp"]

bp = Blueprint("schedules", __name__)


def _listing() -> dict[str, Any]:
    found = sorted(dashboard().schedules.list(), key=lambda x: x.name)
    return {"schedules": [schedule_json(x) for x in found], "count": len(found)}


@bp.get("/api/schedules")
def api_schedules() -> Any:
    return jsonify(_listing())


@bp.get("/schedules")
def schedules() -> str:
    return render_template("schedules.html", view=_listing())
