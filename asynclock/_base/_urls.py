"""Redis URLs in messages: every message that names a server shows it through
:func:`safe_url`, so that no password or token reaches a terminal, cron mail or a CI log.
"""

from __future__ import annotations

import re
from typing import Final

__all__ = ["safe_url"]

_MASK: Final = "***"

_SECRET_PARAMETER: Final = re.compile(
    r"(?i)([?&;][^=&;#]*(?:pass|pwd|token|secret|auth)[^=&;#]*=)[^&;#]*"
)
"""A query parameter whose name says it is a secret (``password=``, ``ssl_password=``,
``token=``, ...), and its value up to the next parameter."""


def safe_url(url: str) -> str:
    """``url`` with its credentials masked, for messages.

    ``user:password@`` reads ``user:***@``, ``:password@`` reads ``:***@``, a user alone
    (``token@``, which some services use for a token) reads ``***@``, and the value of
    every query parameter whose name says password, token, secret or auth reads ``***``.
    Everything before the last ``@`` counts as credentials, so a password holding an
    unescaped ``@`` or ``/`` is masked whole (a URL that is not one is masked rather than
    shown). Never raises.
    """
    masked = _SECRET_PARAMETER.sub(lambda found: found.group(1) + _MASK, url)
    scheme, sep, rest = masked.partition("://")
    if not sep:  # (not a URL, e.g. 'user:password@host': mask what looks like credentials)
        scheme, rest = "", masked
    credentials, at, host = rest.rpartition("@")
    if not at:
        return masked
    user, colon, _password = credentials.partition(":")
    shown = f"{user}:{_MASK}" if colon else _MASK
    return f"{scheme}{sep}{shown}@{host}"
