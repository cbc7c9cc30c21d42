"""What the action pages share: the fields of an action read the same way from a form or from
an ``/api/...`` JSON body, and a refusal of bad input that says why (400) without changing
anything.

A page's form names its item (a job id, a schedule's name, a key, a batch id) in a field; an item
holding a CR, a LF or a NUL (an id stored by an older version) goes in ``<field>.json`` instead,
as a JSON string (:func:`form_field`): a browser sends a form value's newline as CR LF (HTML's
form encoding), which would name another item. :class:`Fields` reads both.
"""

from __future__ import annotations

import json
from typing import Any, NoReturn

from flask import abort, request

__all__ = ["JSON_FIELD", "Fields", "fields", "form_field", "form_values", "refuse"]


def refuse(message: str) -> NoReturn:
    """Answer 400 with ``message`` now, through the app's 400 handler: the error page, or JSON
    ``{"error": ..., "status": 400}`` for the API, as every other error answers."""
    abort(400, description=message)


#: The suffix of a form field that holds its value as a JSON string (:func:`form_field`).
JSON_FIELD = ".json"


def form_field(name: str, value: str) -> tuple[str, str]:
    """The field name and value a page's form carries item ``value`` in: ``name`` and the value
    itself, or ``name.json`` and the value as a JSON string when a browser would not send it as
    it is (it holds a CR, a LF or a NUL).

    >>> form_field("ids", "invoice-42"), form_field("ids", "old\\nid")
    (('ids', 'invoice-42'), ('ids.json', '"old\\\\nid"'))
    """
    if any(c in value for c in "\r\n\0"):
        return name + JSON_FIELD, json.dumps(value)
    return name, value


def form_values(form: Any, name: str) -> list[str]:
    """The non-empty values of form field ``name``, then those sent as ``name.json``
    (:func:`form_field`), decoded; a ``name.json`` that is not a JSON string is refused (400)."""
    values = [v for v in form.getlist(name) if v]
    for text in form.getlist(name + JSON_FIELD):
        try:
            value = json.loads(text)
        except ValueError:
            value = None
        if not isinstance(value, str):
            refuse(f"{name}{JSON_FIELD} must be a JSON string, got {text!r}")
        if value:
            values.append(value)
    return values


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
        if name not in self._form and name + JSON_FIELD in self._form:
            return next(iter(form_values(self._form, name)), "")
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
            return form_values(self._form, name)
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
