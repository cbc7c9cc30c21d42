"""How fast one beat publishes with ``delayq_publish_eta`` on and off.

``python -m bench.publish_eta [N] [ROUNDS]`` stores N jobs due at once in a throwaway
Redis (broker and store on one server), then lets one real ``celery beat`` publish them all,
the way the ``dispatch`` row of ``python -m bench`` does (see :func:`bench.dispatch.drain`).
It does this for each publish path (``push``: the beat builds kombu's message and
``push_claimed.lua`` pushes it; ``kombu``: ``delayq_push = False``) and each mode, ROUNDS
times in turn (off, on, off, on, ...), and prints the publish rate (jobs/s between 5 % and
95 % published) and the time until all N were in the queue list.

Figures: docs/benchmarks.md ("A past eta on delayq messages").
"""

from __future__ import annotations

import sys

from .dispatch import QUEUE, _fill_due, drain
from .harness import QUICK, Context, producer


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 100_000
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    ctx = Context(QUICK, "publish_eta", selected=["publish_eta"])
    try:
        for push in (True, False):
            for round_ in range(rounds):
                for publish_eta in (False, True):
                    conf = {"delayq_publish_eta": publish_eta, "delayq_push": push}
                    server = ctx.redis()
                    url = server.url + "/0"
                    with producer(url, url) as p:
                        rate, took, _ = drain(
                            ctx,
                            p,
                            url,
                            url,
                            1,
                            n,
                            lambda: int(p.client.llen(QUEUE)),
                            lambda: _fill_due(p, n),
                            conf,
                        )
                        eta = p.client.lindex(QUEUE, 0) or ""
                    ctx.stop_redis(server)
                    path = "push" if push else "kombu"
                    carries = '"eta": "' in eta
                    print(
                        f"{path:6} round {round_ + 1} publish_eta={publish_eta!s:5}: {n:,} jobs, "
                        f"{rate:,.0f} jobs/s, all published {took:.1f} s after the start "
                        f"(message has an eta: {carries})",
                        flush=True,
                    )
    finally:
        ctx.cleanup()


if __name__ == "__main__":
    main()
