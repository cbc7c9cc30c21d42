"""How the ``jobs`` hash keeps an envelope (:mod:`.envelope`): without its own id, and with its
*shape* kept once per shard in the ``shapes`` hash.

:func:`stored_form` and :func:`loaded_form` take the id out and put it back; :func:`shared_form`
cuts the shape out (``lua/enqueue.lua`` writes both forms), :func:`shape_id_of` and
:func:`joined_form` put it back. Every reader outside the store gets whole envelopes
(:meth:`.base.StoreBase._loaded` joins the shape back before :func:`loaded_form`), so
:func:`.envelope.decode_envelope` never sees these forms.
"""

from __future__ import annotations

import hashlib
from json.encoder import encode_basestring_ascii as _jstr

__all__ = [
    "SHAPE_ID_LENGTH",
    "id_opening",
    "joined_form",
    "loaded_form",
    "shape_id_of",
    "shared_form",
    "stored_form",
]


# -- as the jobs hash keeps it -----------------------------------------------------------------

# An envelope opens with its task id. Stored under that same id it is kept without it (the
# hash field holds it: about 45 bytes less a job) and given it back whenever it is read: claim,
# get, scan. decode_envelope always sees whole envelopes. (Version 2 was kept the same way.)
_OPENINGS = ('{"v":3,', '{"v":2,')


def id_opening(job_id: str) -> str:
    """How an envelope of ``job_id`` opens (``lua/requeue.lua`` gets it as ARGV[3]).

    >>> id_opening("a")
    '{"v":3,"i":"a",'
    """
    return '{"v":3,"i":' + _jstr(job_id) + ","


def stored_form(job_id: str, envelope: str) -> str:
    """``envelope`` as the ``jobs`` hash keeps it under ``job_id``: without its id when it is
    an envelope of that very id, else unchanged.

    >>> stored_form("a", '{"v":3,"i":"a","t":"t.add","c":1}')
    '{"v":3,"t":"t.add","c":1}'
    >>> stored_form("b", '{"v":3,"i":"a","t":"t.add","c":1}')
    '{"v":3,"i":"a","t":"t.add","c":1}'
    """
    for opening in _OPENINGS:
        prefix = opening + '"i":' + _jstr(job_id) + ","
        if envelope.startswith(prefix):
            return opening + envelope[len(prefix) :]
    return envelope


def loaded_form(job_id: str, stored: str) -> str:
    """The envelope of ``job_id`` from what the ``jobs`` hash keeps (see :func:`stored_form`).

    >>> loaded_form("a", '{"v":3,"t":"t.add","c":1}')
    '{"v":3,"i":"a","t":"t.add","c":1}'
    >>> loaded_form("a", "anything else")
    'anything else'
    """
    for opening in _OPENINGS:
        if stored.startswith(opening) and not stored.startswith('"i":', len(opening)):
            return opening + '"i":' + _jstr(job_id) + "," + stored[len(opening) :]
    return stored


# -- a shape many stored jobs share ---------------------------------------------------------------
#
# Jobs of one task scheduled by one producer with the same options have the same text from "t" to
# "c" in their envelopes: their *shape* (task name, origin, reply_to, other headers and properties,
# queue). The jobs hash keeps such a job with the id of its shape in place of it, and the shard's
# shapes hash keeps the shape once (about 90 bytes less a job):
#
#     {"v":3,"a":"...","k":"...","j":"...","S":"<shape id: 16 hex digits>","c":...}
#
# lua/enqueue.lua writes both (it stores the job whole when the shard's shapes hash is full);
# lua/push.lua keys its message templates by the shape id; every other reader gets the envelope
# whole (:meth:`.Store` joins the shape back before loaded_form).

#: The length of a shape id (hex digits).
SHAPE_ID_LENGTH = 16
_PARTS_FIRST = '{"v":3,"a":"'
_SHAPE_AT = '","S":"'


def shared_form(stored: str, keep_whole: tuple[str, ...] = ()) -> tuple[str, str, str] | None:
    """``(shape id, shape, stored form with the shape's id)`` of an envelope as the jobs hash
    keeps it (:func:`stored_form`); None for one kept whole: not a version-3 envelope with the
    job's own parts first, an expiry, a schedule point, or a name of ``keep_whole`` in its shape.

    >>> shape_id, shape, shared = shared_form('{"v":3,"a":"()","k":"{}","j":"[[], {}","t":"t.add","c":1}')
    >>> shape_id, shape
    ('55795f21a2e23178', '"t":"t.add"')
    >>> shared
    '{"v":3,"a":"()","k":"{}","j":"[[], {}","S":"55795f21a2e23178","c":1}'
    """
    if not stored.startswith(_PARTS_FIRST):
        return None
    start = stored.find('","t":')  # (JSON-escaped texts hold no '","': the first is the shape's)
    end = stored.rfind(',"c":')
    if start < 0 or end < start or not stored.endswith("}") or not stored[end + 5 : -1].isdigit():
        return None
    shape = stored[start + 2 : end]
    if ',"x":' in shape:
        return None
    for name in keep_whole:  # (a loop, not any() over a generator: a µs less a job)
        if name in shape:
            return None
    shape_id = hashlib.blake2b(shape.encode(), digest_size=SHAPE_ID_LENGTH // 2).hexdigest()
    return shape_id, shape, stored[: start + 2] + '"S":"' + shape_id + '"' + stored[end:]


def shape_id_of(stored: str) -> str | None:
    """The id of the shape a stored envelope leaves to the shapes hash, or None."""
    if not stored.startswith(_PARTS_FIRST):
        return None
    at = stored.find(_SHAPE_AT)
    return None if at < 0 else stored[at + 7 : at + 7 + SHAPE_ID_LENGTH]


def joined_form(stored: str, shape: str | None) -> str:
    """A stored envelope with its ``shape`` back in place of the shape's id (unchanged when it
    has none, or ``shape`` is None: :func:`decode_envelope` then says the shape is missing).

    >>> joined_form('{"v":3,"a":"()","k":"{}","j":"[[], {}","S":"55795f21a2e23178","c":1}', '"t":"t.add"')
    '{"v":3,"a":"()","k":"{}","j":"[[], {}","t":"t.add","c":1}'
    """
    if shape is None or not stored.startswith(_PARTS_FIRST):
        return stored
    at = stored.find(_SHAPE_AT)
    if at < 0:
        return stored
    return stored[: at + 2] + shape + stored[at + 7 + SHAPE_ID_LENGTH + 1 :]
