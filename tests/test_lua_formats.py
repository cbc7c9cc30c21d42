"""The Python mirror (:mod:`celery_delayq.store.lua_formats`) against the Lua helpers it mirrors
(``lua/includes/lease.lua``, ``lua/includes/wake.lua``): small probe scripts include the helpers
through the loader, run on a real server (each supported kind in turn), and the two sides must
agree on every case."""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

import celery_delayq.store
from celery_delayq.store.keys import KeySpace
from celery_delayq.store.lua_formats import (
    lease_entry,
    lease_holds,
    parse_key_entry,
    parse_lease,
    parse_wake,
    wake_message,
)
from celery_delayq.store.scripts import script_from_text
from tests.support.server_kinds import redis_server

__all__ = ["redis_server"]  # a fixture, used by name

KEYS = KeySpace("probe", 1).shard(0).core

#: Reads each ARGV as a lease entry: {read (1/0), due ms, tries} per entry.
READ = """--[[ probe: lease_read ]]
--!include lease
local out = {}
for i = 1, #ARGV do
  local d, n = lease_read(ARGV[i])
  if d then
    out[#out + 1] = 1
    out[#out + 1] = d
    out[#out + 1] = n
  else
    out[#out + 1] = 0
    out[#out + 1] = 0
    out[#out + 1] = 0
  end
end
return out
"""

#: Builds an entry from each triple of ARGV (due ms, tries, token).
BUILD = """--[[ probe: lease_entry ]]
--!include lease
local out = {}
for i = 1, #ARGV, 3 do
  out[#out + 1] = lease_entry(tonumber(ARGV[i]), tonumber(ARGV[i + 1]), ARGV[i + 2])
end
return out
"""

#: Checks each pair of ARGV (entry, token): 1 when the entry is held by the token.
HOLDS = """--[[ probe: lease_holds and held ]]
--!include lease
local out = {}
for i = 1, #ARGV, 2 do
  out[#out + 1] = lease_holds(ARGV[i], ARGV[i + 1]) and 1 or 0
  redis.call('HSET', KEYS[3], 'job', ARGV[i])
  out[#out + 1] = held('job', ARGV[i + 1]) and 1 or 0
end
redis.call('DEL', KEYS[3])
out[#out + 1] = held('job', 'any') and 1 or 0
return out
"""

#: The wake message of each pair of ARGV (shard, due ms), due formatted as wake() does.
MESSAGE = """--[[ probe: wake_message ]]
--!include wake
local out = {}
for i = 1, #ARGV, 2 do
  out[#out + 1] = wake_message(ARGV[i], string.format('%d', tonumber(ARGV[i + 1])))
end
return out
"""

#: wake(channel, shard, due): ARGV channel, shard, due ms.
WAKE = """--[[ probe: wake ]]
--!include wake
wake(ARGV[1], ARGV[2], tonumber(ARGV[3]))
return redis.call('GET', KEYS[4])
"""


def run(client: redis.Redis, text: str, args: list[object]) -> list[object]:
    result = script_from_text("probe", text)(client, KEYS, args)
    assert isinstance(result, list)
    return result


def lease_cases() -> list[str]:
    """Entries that read, corrupt ones, and random strings over the format's alphabet."""
    cases = [
        "1767225600000|2|beat-1",
        "0|0|t",
        "-5|1|t",
        "-0|1|t",
        "007|01|t",
        "1|1|",
        "1|1||",
        "1|1|a|b",
        "1|1",
        "1||t",
        "|1|t",
        "1|-1|t",
        "+1|1|t",
        " 1|1|t",
        "1 |1|t",
        "1.5|1|t",
        "1e3|1|t",
        "x1|1|t",
        "1|x|t",
        "garbage",
        "",
        "|",
        "||",
        "--1|1|t",
        "-|1|t",
        "\u0661\u0662|1|t",
        "1|\u0661|t",
        "\uff11|1|t",
        "9007199254740991|1|t",
        "-9007199254740991|999999999|t",
        "123456789012345|123456789|é",
    ]
    rng = random.Random(14)

    def digits(most: int) -> str:
        return "".join(rng.choice("0123456789") for _ in range(rng.randint(0, most)))

    for _ in range(1000):  # shaped like an entry, often a little off
        due = rng.choice(["", "", "", "-", "+", " "]) + digits(18) + rng.choice(["", "", "", ".5"])
        tries = digits(11) + rng.choice(["", "", "", "é"])
        token = rng.choice(["beat-1", "", "a|b", "é", "1|2|3"])
        cases.append(rng.choice(["|"] * 6 + ["", "||", ":"]).join([due, tries, token]))
    alphabet = "0123456789|-x "
    for _ in range(1000):
        cases.append("".join(rng.choice(alphabet) for _ in range(rng.randint(0, 24))))
    return cases


#: Entries whose numbers are longer than the Python side reads (see lua_formats._LEASE): the
#: Lua side reads them, inexactly past 2**53. Nothing writes such an entry.
BEYOND = re.compile(r"-?([0-9]{16,}\|[0-9]+|[0-9]+\|[0-9]{10,})\|")


def test_parse_lease_reads_as_lease_read(r: redis.Redis) -> None:
    cases = lease_cases()
    replies = run(r, READ, list(cases))
    beyond = 0
    for i, case in enumerate(cases):
        read, due, tries = replies[3 * i : 3 * i + 3]
        lua = (due, tries) if read else None
        if BEYOND.match(case):
            beyond += 1
            assert read == 1
            if not re.match(r"-?[0-9]{1,17}\|[0-9]{1,9}\|", case):
                assert parse_lease(case) is None, case
            continue
        assert parse_lease(case) == lua, case
    assert beyond < len(cases) // 10  # the comparison covers almost every case


def test_lease_entry_is_built_as_lua_builds_it(r: redis.Redis) -> None:
    triples = [
        (1767225600000, 1, "beat-1"),
        (0, 0, "t"),
        (-5, 3, "host:1:abc"),
        (2**53 - 1, 999, "é"),
        (-(2**53) + 1, 1, ""),
        (1, 1, "a b"),
    ]
    args = [str(x) for triple in triples for x in triple]
    built = run(r, BUILD, args)
    assert built == [lease_entry(*triple) for triple in triples]
    assert [parse_lease(entry) for entry in built] == [(due, tries) for due, tries, _ in triples]


def test_lease_holds_as_lua_checks_it(r: redis.Redis) -> None:
    pairs = [
        ("1|1|beat-1", "beat-1"),
        ("1|1|my-beat-1", "beat-1"),
        ("1|1|beat-1", "eat-1"),
        ("1|1|beat-1", "1|beat-1"),
        ("1|1|beat-1", ""),
        ("garbage|beat-1", "beat-1"),
        ("beat-1", "beat-1"),
        ("", "beat-1"),
        ("1|1|é", "é"),
        ("1|1|beat-12", "beat-1"),
        ("|", ""),
        ("1|1|beat-1", "1|1|beat-1"),
    ]
    replies = run(r, HOLDS, [x for pair in pairs for x in pair])
    assert replies[-1] == 0  # held: a job without a lease entry is held by nobody
    for i, (entry, token) in enumerate(pairs):
        expected = 1 if lease_holds(entry, token) else 0
        assert replies[2 * i : 2 * i + 2] == [expected, expected], (entry, token)


def test_wake_message_is_built_and_read_as_lua_publishes_it(r: redis.Redis) -> None:
    pairs = [(0, 1767225600000), (3, 0), (15, -5), (1023, 2**53 - 1), (2, -(2**53) + 1)]
    messages = run(r, MESSAGE, [str(x) for pair in pairs for x in pair])
    assert messages == [wake_message(shard, due) for shard, due in pairs]
    assert [parse_wake(message) for message in messages] == [(s, float(d)) for s, d in pairs]


@pytest.fixture
def subscriber(r: redis.Redis) -> Iterator[redis.client.PubSub]:
    pubsub = r.pubsub()
    pubsub.subscribe("probe-wake")
    assert pubsub.get_message(timeout=5) is not None  # subscribed
    yield pubsub
    pubsub.close()


def test_wake_lowers_the_marker_and_publishes_the_message_parse_wake_reads(
    r: redis.Redis, subscriber: redis.client.PubSub
) -> None:
    assert run_wake(r, 5, 2_000_000_000_000) == "2000000000000"  # no marker: set
    assert run_wake(r, 5, 2_000_000_000_001) == "2000000000000"  # later: kept, no message
    assert run_wake(r, 7, 1_999_999_999_999) == "1999999999999"  # earlier: lowered
    r.publish("probe-wake", "end")  # after every message the calls sent (one channel keeps order)
    got = []
    while (message := subscriber.get_message(timeout=5)) is not None:
        if message["data"] in ("end", b"end"):
            break
        got.append(message["data"])
    assert got == [wake_message(5, 2_000_000_000_000), wake_message(7, 1_999_999_999_999)]
    assert [parse_wake(data) for data in got] == [(5, 2e12), (7, 1_999_999_999_999.0)]


def run_wake(client: redis.Redis, shard: int, due: int) -> object:
    return script_from_text("probe", WAKE)(client, KEYS, ["probe-wake", shard, due])


@pytest.mark.parametrize("data", ["sentinel", "x:1", "1", "", b"3:1", None, "1:x"])
def test_parse_wake_refuses_what_is_not_a_wake_message(data: object) -> None:
    assert parse_wake(data) is None


#: Reads each ARGV as a gate:keys entry (includes/gate.lua key_read): {own, override ("" for
#: none), paused (1/0), the entry key_entry writes back} per entry.
KEY_ENTRY = """--[[ probe: key_read, key_entry ]]
--!include args
--!include sliced
--!include lease
--!include wake
--!include gate
local out = {}
for i = 1, #ARGV do
  local own, override, paused = key_read(ARGV[i])
  out[#out + 1] = own
  out[#out + 1] = override or ''
  out[#out + 1] = paused and 1 or 0
  out[#out + 1] = key_entry(own, override, paused)
end
return out
"""


def test_parse_key_entry_reads_as_key_read(r: redis.Redis) -> None:
    cases = ["", "2", "2||", "2|none|", "2||1", "|5|1", "|none|", "lots", "2|x", "1|2|3|4", "||", "7|lots|"]
    rng = random.Random(26)
    cases += ["".join(rng.choice("12|n") for _ in range(rng.randint(0, 7))) for _ in range(200)]
    replies = run(r, KEY_ENTRY, list(cases))
    for i, case in enumerate(cases):
        own, override, paused, written = replies[4 * i : 4 * i + 4]
        assert parse_key_entry(case) == (own, override or None, paused == 1), case
        assert parse_key_entry(written) == parse_key_entry(case), case
    assert parse_key_entry(None) == (None, None, False)


def test_the_gate_key_names_lua_builds_are_those_python_names() -> None:
    """``lua/includes/gate.lua`` builds the names of a shard's gate keys from ``GATE_BASE`` (not
    passed in KEYS); each must be a name :class:`ShardKeys` gives, which the Python side reads
    and writes (and the other way round)."""
    text = (Path(celery_delayq.store.__file__).parent / "lua" / "includes" / "gate.lua").read_text()
    built = set(re.findall(r"GATE_BASE \.\. '([^']+)'", text))
    shard = KeySpace("probe", 1).shard(0)
    named = [shard.gate_keys, shard.gate_rates, shard.gate_booked, shard.gate_check, shard.gate_overlap]
    named += [shard.batches, shard.batch_expiry, shard.running(""), shard.waiting(""), shard.batch("")]
    assert built == {name.removeprefix(shard.base) for name in named}
