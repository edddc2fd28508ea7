"""Refusals by the server's ACL, told apart from other errors and explained.

Design note. A user without a permission asynclock needs gets an error reply, never a
lease that fails later by itself: a command, key or channel refused at the top level is a
``NOPERM`` reply (redis-py's ``NoPermissionError``), and since Redis 7 a command that a
Lua script calls is checked too. Inside a script, Redis 7.0 does not say which command
it refused, only the script's SHA1 and the line (``The user executing the script can't
run this command or subcommand script: <sha>, on @user_script:18.``); Valkey names it
(``ACL failure in script: User u has no permissions to run the 'exists' command ...``).
:func:`explain` names the command from the script's source when the reply does not, so
that the error says which rule is missing, and points at ``asynclock acl``.

A refusal is a configuration error: retrying does not help until an administrator
changes the user, so the watchdog loses a lease whose renewal is refused at once
(``watchdog_failed``, this error as the cause) instead of retrying it until its deadline.
"""

from __future__ import annotations

import re
from typing import Final

from redis.exceptions import NoPermissionError, ResponseError

__all__ = ["explain", "is_refusal"]

_IN_SCRIPT: Final = ("The user executing the script can't", "ACL failure in script")
_NAMED: Final = re.compile(r"run the '([^']+)' command")
_LINE: Final = re.compile(r"@user_script:(\d+)")
_CALLED: Final = re.compile(r"""redis\.p?call\(\s*['"]([A-Za-z]+)['"]""")
_HINT: Final = "`asynclock acl` prints the rules a user of asynclock needs"


def is_refusal(error: BaseException) -> bool:
    """Whether ``error`` is the server's ACL refusing a command, a key or a channel (at
    the top level, or inside a script)."""
    if isinstance(error, NoPermissionError):
        return True
    return isinstance(error, ResponseError) and any(text in str(error) for text in _IN_SCRIPT)


def explain(error: BaseException, what: str, source: str | None = None) -> NoPermissionError:
    """``error``, a refusal (see :func:`is_refusal`) of ``what`` (e.g. "the renewal of
    'orders'"), as a ``NoPermissionError`` that names the missing rule (found in the
    script ``source`` by the line the reply gives, when the reply does not name the
    command) and points at ``asynclock acl``; ``error`` is its cause."""
    text = str(error)
    rule = _missing_rule(text, source)
    message = f"the server's ACL refused {what}"
    if rule is not None:
        message += f": the user lacks {rule}"
    explained = NoPermissionError(f"{message} (the server said: {text}); {_HINT}")
    explained.__cause__ = error
    return explained


def _missing_rule(text: str, source: str | None) -> str | None:
    named = _NAMED.search(text)
    if named is not None:
        return f"+{named.group(1).lower()}"
    if "access a key" in text or "one of the keys" in text:
        return "the key pattern (~<prefix>*)"
    if "channel" in text:
        return "the channel pattern (&<prefix>*)"
    line = _LINE.search(text)
    if line is None or source is None:
        return None
    lines = source.split("\n")
    number = int(line.group(1))
    if not 1 <= number <= len(lines):
        return None
    called = _CALLED.findall(lines[number - 1])
    if len(called) != 1:
        return None
    return f"+{called[0].lower()} (called by the script)"
