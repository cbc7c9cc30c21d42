"""Row cluster_dispatch: beats delivering from a local 3-primary Redis Cluster into a Redis broker."""

from __future__ import annotations

import json
import time
from typing import Any

import redis

from celery_delayq.devtools.embedded import EmbeddedRedis, free_port

from .dispatch import QUEUE, Drained, _fill_due, cpu_text, drain_measured
from .harness import BenchError, Context, producer
from .report import Line, RowResult

#: Primaries of the local cluster, beats of the row's many-beat side, shards of the store.
MASTERS = 3
BEATS = 4
SHARDS = 48


def start_cluster(ctx: Context, masters: int = MASTERS, timeout: float = 60.0) -> list[EmbeddedRedis]:
    """``masters`` primaries, no replicas, each with a bus port of its own and an equal range of
    the 16,384 slots (CLUSTER ADDSLOTSRANGE, then MEET); the servers are the context's, stopped
    by its cleanup."""
    nodes: list[EmbeddedRedis] = []
    buses: list[int] = []
    for _ in range(masters):
        port = free_port()
        bus = free_port()  # its own bus port (--cluster-port), not port + 10000
        buses.append(bus)
        node = EmbeddedRedis(
            port=port,
            extra_args=[
                "--cluster-enabled",
                "yes",
                "--cluster-port",
                str(bus),
                "--cluster-config-file",
                f"nodes-{port}.conf",
                "--cluster-node-timeout",
                "15000",
            ],
        )
        with ctx._lock:
            ctx.servers.append(node)
        nodes.append(node.start())
    clients = [redis.Redis(host="127.0.0.1", port=node.port, decode_responses=True) for node in nodes]
    try:
        per = 16384 // masters
        for i, client in enumerate(clients):
            last = 16383 if i == masters - 1 else (i + 1) * per - 1
            client.execute_command("CLUSTER", "ADDSLOTSRANGE", i * per, last)
            if i:
                client.execute_command("CLUSTER", "MEET", "127.0.0.1", nodes[0].port, buses[0])
        deadline = time.monotonic() + timeout
        while not all(
            c.cluster("info")["cluster_state"] == "ok"
            and int(c.cluster("info")["cluster_known_nodes"]) == masters
            for c in clients
        ):
            if time.monotonic() > deadline:
                raise BenchError(f"the local cluster was not ok within {timeout:.0f} s")
            time.sleep(0.1)
    finally:
        for client in clients:
            client.close()
    return nodes


class Subscribers:
    """``pubsub_numsub`` summed over every node: a beat's subscription lives on one of them."""

    def __init__(self, nodes: list[EmbeddedRedis]) -> None:
        self.clients = [
            redis.Redis(host="127.0.0.1", port=node.port, decode_responses=True) for node in nodes
        ]

    def pubsub_numsub(self, channel: str) -> list[tuple[str, int]]:
        return [(channel, sum(int(dict(c.pubsub_numsub(channel)).get(channel, 0)) for c in self.clients))]

    def close(self) -> None:
        for client in self.clients:
            client.close()


def row_cluster_dispatch(ctx: Context) -> RowResult:
    """One beat, then four, deliver ``cluster_jobs`` due at once from a 3-primary cluster."""
    result = RowResult("cluster_dispatch")
    n = ctx.sizes.cluster_jobs
    nodes = start_cluster(ctx)
    broker_server = ctx.redis()
    broker = broker_server.url + "/0"
    store = nodes[0].url
    conf: dict[str, Any] = {"delayq_cluster": True, "delayq_shards": SHARDS}
    servers = {f"redis node {i + 1}": node.process.pid for i, node in enumerate(nodes) if node.process}
    if broker_server.process:
        servers["redis broker"] = broker_server.process.pid
    subscribers = Subscribers(nodes)
    runs: dict[int, Drained] = {}
    try:
        with producer(broker, store, **conf) as p:
            broker_client = redis.Redis.from_url(broker)
            for beats in (1, BEATS):
                _flush(nodes)
                broker_client.flushall()
                ctx.say(
                    f"cluster_dispatch: {beats} beat(s), storing {n:,} due jobs on the cluster, "
                    "then publishing them"
                )
                runs[beats] = drain_measured(
                    ctx,
                    p,
                    broker,
                    store,
                    beats,
                    n,
                    lambda: int(broker_client.llen(QUEUE)),
                    lambda: _fill_due(p, n),
                    conf,
                    servers,
                    subscribers,
                    before_stop=lambda: _published_per_beat(p),
                )
                result.notes.append(
                    f"{beats} beat(s): all {n:,} published {runs[beats].took:.1f} s after "
                    f"the start; {_shares(runs[beats].after, n)}; {cpu_text(runs[beats])}"
                )
            broker_client.close()
    finally:
        subscribers.close()
        for node in nodes:
            ctx.stop_redis(node)
        ctx.stop_redis(broker_server)
    many = runs[BEATS].rate
    result.lines.append(
        Line(f"cluster_dispatch: 1 beat, {MASTERS}-primary cluster, {n:,} due", runs[1].rate, "jobs/s")
    )
    result.lines.append(
        Line(f"cluster_dispatch: {BEATS} beats, in total (vs 1 beat)", many, "jobs/s", baseline=runs[1].rate)
    )
    counts = sorted(runs[BEATS].after or [])
    if len(counts) == BEATS and sum(counts) > 0:
        low, high = counts[0] / sum(counts) * many, counts[-1] / sum(counts) * many
        result.lines.append(Line(f"cluster_dispatch: {BEATS} beats, per beat (least)", low, "jobs/s"))
        result.lines.append(Line(f"cluster_dispatch: {BEATS} beats, per beat (most)", high, "jobs/s"))
    else:
        result.lines.append(
            Line(f"cluster_dispatch: {BEATS} beats, per beat (total / {BEATS})", many / BEATS, "jobs/s")
        )
    result.notes.append(
        f"the kombu path: the store is a local Redis Cluster ({MASTERS} primaries, no replicas, "
        f"{SHARDS} shards, delayq_cluster=True) and the broker a separate Redis server (kombu has no "
        "cluster transport), so each beat claims from the cluster, publishes through kombu, then acks; "
        "beats frozen while the jobs are stored, as in dispatch; rate between 5% and 95% of LLEN of the "
        "broker list; per beat: the total rate times each beat's share of the jobs, read from the "
        "'published' count of its heartbeat (delayq's <prefix>:beats hash) after the drain (total / 4 if "
        "the heartbeats cannot be read)"
    )
    if n < 1_000_000:
        result.notes.append(
            f"{n:,} jobs due at once, not the issue's 1,000,000: python -m bench --full "
            "--only cluster_dispatch runs 1M"
        )
    return result


def _published_per_beat(p: Any) -> list[int]:
    """Each running beat's ``published`` count, from its heartbeat, once it has been refreshed
    after the drain (the beats refresh it every ``HEARTBEAT_EVERY`` seconds)."""
    from celery_delayq.beat.heartbeat import HEARTBEAT_EVERY
    from celery_delayq.store.facade import get_store

    time.sleep(HEARTBEAT_EVERY + 1.0)
    try:
        store = get_store(p.app)
        entries = store.client.hgetall(store.keys.beats)
        return [int(json.loads(raw).get("published", 0)) for raw in entries.values()]
    except Exception:  # the heartbeat's format or place changed: fall back to total / beats
        return []


def _shares(counts: list[int] | None, n: int) -> str:
    if not counts:
        return "each beat's count could not be read"
    return "jobs per beat (heartbeats): " + ", ".join(f"{c:,}" for c in sorted(counts, reverse=True))


def _flush(nodes: list[EmbeddedRedis]) -> None:
    for node in nodes:
        client = redis.Redis(host="127.0.0.1", port=node.port)
        client.flushall()
        client.close()
