"""The dead letters (``/dead``) and their JSON twin (``/api/dead``: ``celery delayq dead ls --json``)."""

from __future__ import annotations

from typing import Any

from flask import Blueprint, jsonify, render_template

from ..views import dead_page
from .context import dashboard

__all__ = ["bp"]

bp = Blueprint("dead", __name__)


def _listing() -> dict[str, Any]:
    board = dashboard()
    return dead_page(board.store, board.default_queue, board.dq.dead(), None, 50, 0)


@bp.get("/api/dead")
def api_dead() -> Any:
    return jsonify(_listing())


@bp.get("/dead")
def dead() -> str:
    return render_template("dead.html", view=_listing())
