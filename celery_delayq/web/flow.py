"""Flow control: the gate keys (``/keys``: limit, running, waiting, paused) and the batches
(``/batches``: progress), with their JSON twins (``/api/keys``, ``/api/batches``: ``celery
delayq keys --json``, ``batches --json``).
"""

from __future__ import annotations

from typing import Any

from flask import Blueprint, jsonify, render_template

from ..views import batches_view, keys_view
from .context import dashboard

__all__ = ["bp"]

bp = Blueprint("flow", __name__)


@bp.get("/api/keys")
def api_keys() -> Any:
    return jsonify(keys_view(dashboard().store))


@bp.get("/keys")
def keys() -> str:
    return render_template("keys.html", view=keys_view(dashboard().store))


@bp.get("/api/batches")
def api_batches() -> Any:
    return jsonify(batches_view(dashboard().store))


@bp.get("/batches")
def batches() -> str:
    return render_template("batches.html", view=batches_view(dashboard().store))
