"""The store: the one door to Redis, and everything that knows how data sits in it.

``facade`` (:class:`~celery_delayq.store.facade.Store`: enqueue, claim, ack, bury, cancel, ...),
composed of its parts by seam (``jobs``, ``delivery``, ``reads``, ``dead``, ``schedules``,
``flow``, ``batches``, ``beats``, over ``base``: the client, the script calls, the per-shard loop),
``connection`` (the client factory and Redis's errors), ``scripts`` (the Lua scripts of ``lua/``,
called by SHA), ``direct`` (single script calls over the store's own connections), ``keys``
(every key name), ``envelope`` (the stored format of a job), ``stored_forms`` (how the jobs
hash keeps it: without its id, its shape once a shard), ``bounded`` (bounded reads of
stored data), ``lua_formats`` (the Python mirror of the Lua helpers' text formats),
``lateness`` (the lateness histograms kept in Redis).

May import: the root modules and ``flow.gate`` (the names a gated job carries). Only this
package imports ``redis`` or the script table (``tests/test_layers.py``).
"""
