"""The Redis ACL rule docs/security.md documents for the store's user: :func:`documented_rule`,
changed for the server it runs on (:func:`server_kind`)."""

from __future__ import annotations

import re
from pathlib import Path

import redis

SECURITY = Path(__file__).resolve().parent.parent.parent / "docs" / "security.md"
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
