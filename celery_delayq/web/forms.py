"""What the action pages share: the fields of an action read the same way from a form or from
an ``/api/...`` JSON body, and a refusal of bad input that says why (400) without changing
anything."""

from __future__ import annotations

from typing import Any, NoReturn

from flask import abort, request

__all__ = ["Fields", "fields", "refuse"]


def refuse(message: str) -> NoReturn:
    """Answer 400 with ``message`` now, through the app's 400 handler: the error page, or JSON
    ``{"error": ..., "status": 400}`` for the API, as every other error answers."""
    abort(400, description=message)


class Fields:
    """An action's fields: a form's (``ids`` repeated) or a JSON object's (``ids`` a list)."""

    def __init__(self, data: dict[str, Any] | None, form: Any = None) -> None:
        self._json = data
        self._form = form

    @property
    def is_json(self) -> bool:
        return self._json is not None

    def raw(self, name: str) -> Any:
        """The value as sent: a JSON value, or a form field's text (None: not sent)."""
        if self._json is not None:
            return self._json.get(name)
        return self._form.get(name)

    def text(self, name: str) -> str | None:
        """The field as text, stripped; None when not sent or empty."""
        value = self.raw(name)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, str | int | float):
            refuse(f"{name} must be text, got {value!r}")
        text = str(value).strip()
        return text or None

    def texts(self, name: str) -> list[str]:
        """A repeated field (a form's ``ids=a&ids=b``; JSON: a list, or one text)."""
        if self._json is None:
            return [v for v in self._form.getlist(name) if v]
        value = self._json.get(name)
        if value is None:
            return []
        if isinstance(value, str):
            return [value]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            refuse(f"{name} must be a list of strings, got {value!r}")
        return list(value)

    def flag(self, name: str) -> bool:
        """A checkbox (``on``/``1``/``true``) or a JSON boolean."""
        value = self.raw(name)
        if isinstance(value, str):
            return value.strip().lower() in ("on", "1", "true", "yes")
        return bool(value)


def fields() -> Fields:
    """The fields of this request: its JSON object (``/api/...``), else its form."""
    if request.path.startswith("/api/") or request.is_json:
        body = request.get_json(silent=True)
        if body is None:
            body = {}
        if not isinstance(body, dict):
            refuse(f"the body must be a JSON object, got {type(body).__name__}")
        return Fields(body)
    return Fields(None, request.form)
