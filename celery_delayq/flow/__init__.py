"""Flow control at release time: concurrency caps per key, batches, pause, rate limits.

``gate`` (what a gated job carries, and the names every part agrees on; the decision itself is
``store/lua/gate.lua``), ``slots`` (the worker side: a running gated task's slot renewed and given
back), ``batch`` (many signatures stored as the members of one key, with completion).

May import: the root modules, ``store`` and ``producer`` (a batch builds its members' envelopes).
``gate`` imports nothing but ``exceptions``: the store reads its names.
"""
