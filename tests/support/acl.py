"""The Redis ACL rule docs/security.md documents for the store's user: :func:`documented_rule`,
changed for the server it runs on (:func:`server_kind`); the commands the store's Lua scripts
call (:func:`script_commands`) and the words docs/security.md adds for the push path
(:func:`push_path_words`)."""

from __future__ import annotations

import re
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parent.parent.parent
SECURITY = ROOT / "docs" / "security.md"
LUA = ROOT / "celery_delayq" / "store" / "lua"
STORE_PASSWORD = "store-pw"


def documented_rule(user: str = "delayq", password: str = STORE_PASSWORD, server: str = "") -> list[str]:
    """The ``ACL SETUSER`` arguments of docs/security.md (after ``<!-- acl-line -->``), for
    ``user`` with ``password``; for ``server`` ("Redis 7.0", "Redis 6.2"), changed as the table
    after ``<!-- acl-versions -->`` says."""
    text = SECURITY.read_text()
    found = re.search(r"<!-- acl-line -->\n```text\n(ACL SETUSER .*?)\n```", text)
    assert found, "docs/security.md has no ACL line after <!-- acl-line -->"
    words = found.group(1).split()
    assert words[:3] == ["ACL", "SETUSER", "delayq"] and ">CHANGE-ME" in words
    if server:
        table = re.search(r"<!-- acl-versions -->\n(.*?)\n\n", text, re.S)
        assert table, "docs/security.md has no table of servers after <!-- acl-versions -->"
        [change] = [row for row in table.group(1).splitlines() if row.startswith(f"| {server} |")]
        without = re.fullmatch(r"\| .* \| without `(.*)` \|", change)
        added = re.fullmatch(r"\| .* \| with `(.*)` added \|", change)
        assert without or added, change
        if without:
            words.remove(without.group(1).replace("\\|", "|"))
        elif added:
            words.append(added.group(1).replace("\\|", "|"))
    return [user, *(f">{password}" if w == ">CHANGE-ME" else w for w in words[3:])]


def server_kind(client: redis.Redis) -> str:
    """ "Redis 7.0" or "Redis 6.2" (the servers docs/security.md changes the rule for), else ""."""
    info = client.info("server")
    if "valkey_version" in info:
        return ""
    version = str(info["redis_version"])
    return next((f"Redis {v}" for v in ("7.0", "6.2") if version.startswith(v + ".")), "")


#: A command named in a script: ``redis.call('X'``, ``redis.pcall("X"`` or ``call_sliced('X'``
#: (includes/sliced.lua: ``redis.call(command, ...)`` with the name its caller gives).
NAMED_CALL = re.compile(r"""\b(?:redis\.p?call|call_sliced)\(\s*(['"])([A-Za-z|]+)\1""")
ANY_CALL = re.compile(r"\bredis\.p?call\b")


def script_commands() -> dict[str, list[str]]:
    """Every command the Lua scripts under celery_delayq/store/lua (includes/ too) call, lower
    case, with the files that call it. A ``redis.call`` or ``redis.pcall`` whose command is not
    a literal fails the parse (its command cannot be read from the text), except the one of
    ``call_sliced`` in includes/sliced.lua, whose callers name theirs."""
    found: dict[str, list[str]] = {}
    for path in sorted(LUA.rglob("*.lua")):
        name = str(path.relative_to(LUA))
        text = re.sub(r"--\[(=*)\[.*?\]\1\]", "", path.read_text(), flags=re.S)  # block comments
        code = "\n".join(line.split("--", 1)[0] for line in text.splitlines())
        named = [m.start() for m in NAMED_CALL.finditer(code)]
        unnamed = [m.start() for m in ANY_CALL.finditer(code) if m.start() not in named]
        allowed = 1 if name == "includes/sliced.lua" else 0
        assert len(unnamed) == allowed, f"{name}: a redis.call whose command is not a literal"
        for match in NAMED_CALL.finditer(code):
            found.setdefault(match.group(2).lower(), []).append(name)
    return found


def push_path_words() -> list[str]:
    """What docs/security.md says a store user needs besides the rule when the beat pushes into
    the broker's lists itself (section "When the broker is the store's server and database")."""
    found = re.search(r"that is at least\s+`(\+lpush[^`]*)`", SECURITY.read_text())
    assert found, "docs/security.md does not say what the push path adds to the rule"
    return found.group(1).split()
