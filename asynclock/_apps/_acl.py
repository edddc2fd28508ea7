"""The ACL rules a user of asynclock needs (``asynclock acl``), derived from the code.

Design note. Since Redis 7, the commands a Lua script calls are checked against the
user's ACL like the commands a client sends, so a user of asynclock needs every command
of every script it may run, besides those it sends itself. The rules are therefore not a
hand-kept list: the commands of the scripts are read from their sources (each
``redis.call``/``redis.pcall`` names its command as a literal, and a script that did not
would make :func:`script_commands` raise), and the commands the Python code sends itself
are declared once, here, in :data:`DIRECT`, with what sends each. ``tests/test_acl.py``
checks both against the code and runs the whole contract under a user made from these
rules, with ``ACL LOG`` empty at the end.

Keys and channels: every key of a lock starts with ``<prefix>{<name>}``, and so does every
channel it publishes on (a channel per lock, and one per client for grants), so the rules
give ``~<prefix>*`` and ``&<prefix>*``.

``readonly``: what ``inspect``/``list`` (and ``statistics()``) need, for an operator's
account that may look but not take or release anything: the commands it is given only
read (the statistics script's too), though its key pattern is the same.

``cluster``: a Redis Cluster client's waiters subscribe with ``SSUBSCRIBE`` and its
scripts publish with ``SPUBLISH`` (sharded pub/sub: see ``_redis._cluster``); redis-py's
cluster client reads the slot map (``CLUSTER SLOTS``) and the command table
(``COMMAND``); a lease on a migrating slot sends ``ASKING``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from types import ModuleType
from typing import Final

from .._redis import _scripts
from .._redis._scripts import STATISTICS, Script
from . import _inspect

__all__ = [
    "CLUSTER",
    "DIRECT",
    "READONLY",
    "TOLERATED",
    "acl_rules",
    "render",
    "script_commands",
    "scripts",
]

DIRECT: Final[Mapping[str, str]] = {
    "evalsha": "every lease operation runs a Lua script by its SHA1",
    "eval": "... and by its source when the server does not know the script (NOSCRIPT)",
    "script|load": "the watchdog reloads the scripts a restarted server forgot",
    "hdel": "a blocking waiter that leaves withdraws its client's registration",
    "subscribe": "waiters listen for releases and grants (one connection per client)",
    "unsubscribe": "... and stop listening when the last waiter of a lock leaves",
    "ping": "the heartbeat of that subscription connection",
    "wait": "leases with min_replicas wait for their replicas after each write",
    "set": "every(): the claim of a tick (the server whose claim lands runs it); a plain "
    "lease's renewal on Valkey 8.1 and later (SET ... IFEQ)",
    "del": "forget(): a stored result of once()",
    "hmget": "once(): the result read back when Redis did not answer whether it stored it",
    "get": "inspect(): the holder's value and the fencing counter",
    "pttl": "inspect(): how long each of a lock's keys lives",
    "zrange": "asynclock release --force: the shared holders to release",
    "scan": "asynclock list: the locks' keys",
}
"""The commands asynclock's Python code sends itself (ACL names, lowercase), with what
sends them; the commands of its scripts come from the scripts themselves."""

CLUSTER: Final[Mapping[str, str]] = {
    "ssubscribe": "waiters of a cluster's lock listen on its node (sharded pub/sub)",
    "sunsubscribe": "... and stop listening",
    "asking": "a lease renewed or released while its slot migrates",
    "cluster|slots": "redis-py's cluster client reads the slot map",
    "command": "redis-py's cluster client reads the command table (key positions)",
}
"""What a Redis Cluster client sends besides, instead of ``SUBSCRIBE``/``UNSUBSCRIBE``."""

_NOT_ON_CLUSTER: Final = frozenset({"subscribe", "unsubscribe"})

READONLY: Final = frozenset({"evalsha", "eval", "get", "pttl", "scan"})
"""The commands of :data:`DIRECT` that ``inspect``/``list``/``statistics()`` send; the
statistics script is all they run."""

TOLERATED: Final[Mapping[str, str]] = {
    "config|get": "a client's first lease reads maxmemory-policy to warn of evictions "
    "(skipped quietly when refused: it may show secrets, so the rules leave it out)",
    "client|setinfo": "redis-py names its library on connecting (Redis 7.2 and later; "
    "a refusal is ignored by redis-py)",
    "waitaof": "wait_aof=True only (Redis/Valkey 7.2 and later; Redis 7.0 refuses "
    "the rule): add +waitaof for it",
    "select": "sent by redis-py on connecting to a database other than 0: add +select",
    "hello": "a client's first lease asks the server's name and version (to renew by "
    "SET ... IFEQ where it can); allowed without a rule, and a refusal leaves the scripts",
}
"""Commands that may be sent but are left out of the rules, and why: each is refused
without harm, or needed only by an option or a setting that the notes name."""

_CALL: Final = re.compile(r"redis\.p?call\(")
_CALLED: Final = re.compile(r"""redis\.p?call\(\s*(['"])([A-Za-z]+)\1""")
_RULE_SAFE: Final = re.compile(r"[^\s\x00-\x1f\x7f]*")

_SCRIPT_MODULES: Final[tuple[ModuleType, ...]] = (_scripts, _inspect)


def scripts(modules: Iterable[ModuleType] = _SCRIPT_MODULES) -> list[Script]:
    """Every :class:`Script` defined at the top level of ``modules`` (by default, the
    modules of asynclock that define scripts), each once, in order of definition."""
    found: dict[int, Script] = {}
    for module in modules:
        for value in vars(module).values():
            if isinstance(value, Script):
                found.setdefault(id(value), value)
    return list(found.values())


def script_commands(source: str) -> set[str]:
    """The commands (ACL names, lowercase) that the Lua ``source`` calls.

    Raises ``ValueError`` if a ``redis.call``/``redis.pcall`` there does not name its
    command as a string literal (its rule could not be known).
    """
    named = {match.group(2).lower() for match in _CALLED.finditer(source)}
    if len(_CALLED.findall(source)) != len(_CALL.findall(source)):
        raise ValueError("a script calls a command whose name is not a string literal")
    return named


def acl_rules(
    prefix: str = "asynclock:", *, cluster: bool = False, readonly: bool = False
) -> list[str]:
    """The ACL rules (``ACL SETUSER`` arguments after the user's name, password and
    ``on``) that a user of asynclock with key prefix ``prefix`` needs: no commands but
    those asynclock sends, its Lua scripts' included; keys ``~<prefix>*``, channels
    ``&<prefix>*``. ``cluster``: for a Redis Cluster (sharded pub/sub). ``readonly``: only
    what ``inspect``/``list``/``statistics()`` need (no channels).

    Raises ``TypeError`` (not a str) or ``ValueError`` (braces, whitespace or control
    characters) for a bad ``prefix``, naming it.
    """
    if not isinstance(prefix, str):
        raise TypeError(f"prefix must be a str, not {type(prefix).__name__}")
    if "{" in prefix or "}" in prefix:
        raise ValueError("prefix must not contain '{' or '}' (the name is the hash tag)")
    if not _RULE_SAFE.fullmatch(prefix):
        raise ValueError(f"prefix must not contain whitespace or control characters: {prefix!r}")
    if readonly:
        used = [STATISTICS]
        direct = set(READONLY)
    else:
        used = scripts()
        direct = set(DIRECT)
    if cluster:
        used = [script.sharded for script in used]
        direct = (direct - _NOT_ON_CLUSTER) | (
            {"cluster|slots", "command"} if readonly else set(CLUSTER)
        )
    commands = set(direct)
    for script in used:
        commands |= script_commands(script.source)
    pattern = _glob_escape(prefix) + "*"
    channels = [] if readonly else [f"&{pattern}"]  # (inspect and list subscribe to none)
    return [
        "resetkeys",
        "resetchannels",
        "-@all",
        f"~{pattern}",
        *channels,
        *(f"+{command}" for command in sorted(commands)),
    ]


def _glob_escape(text: str) -> str:
    """``text`` matched literally by an ACL pattern (Redis's glob)."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def render(
    prefix: str = "asynclock:",
    *,
    cluster: bool = False,
    readonly: bool = False,
    user: str = "asynclock",
) -> str:
    """What ``asynclock acl`` prints: the ``ACL SETUSER`` command and the ACL file line
    for ``user`` (the password to fill in), with notes. Raises as :func:`acl_rules`
    does, and ``ValueError`` for a ``user`` name that an ACL line cannot hold."""
    if not isinstance(user, str) or not user or not _RULE_SAFE.fullmatch(user):
        raise ValueError(f"user must be a name without whitespace: {user!r}")
    rules = " ".join(acl_rules(prefix, cluster=cluster, readonly=readonly))
    what = "inspect and list, read only" if readonly else "leases, once(), every(), the CLI"
    where = ", on every node of a Redis Cluster" if cluster else ""
    lines = [
        f"# asynclock's ACL rules ({what}; key prefix {prefix!r}{where}): its keys and",
        "# channels, and every command it sends, those its Lua scripts call included.",
        "# Replace PASSWORD (or use #<sha256 of it>).",
        f"ACL SETUSER {user} on >PASSWORD {rules}",
        "# The same user in an ACL file (aclfile):",
        f"user {user} on >PASSWORD {rules}",
    ]
    if not readonly:
        lines.append("# wait_aof=True (Redis/Valkey 7.2+) needs +waitaof as well;")
    lines.append("# a database other than 0 (redis://.../N) needs +select.")
    return "\n".join(lines) + "\n"
