"""Modules of the optional extras (``pip install 'asynclock[EXTRA]'``), imported when a
feature that needs one is used, so that a missing one says which extra to install."""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["import_optional"]


def import_optional(module: str, extra: str, feature: str) -> ModuleType:
    """``importlib.import_module(module)``, for ``feature`` (named in the message).

    Raises:
        ModuleNotFoundError: ``module`` (or a module it needs) cannot be imported; the
            message names the extra: ``pip install 'asynclock[EXTRA]'``. The import's
            own error is chained as ``__cause__``.
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ModuleNotFoundError(
            f"{feature} needs the module {module!r}, from an extra of asynclock: "
            f"pip install 'asynclock[{extra}]'",
            name=module,
        ) from exc
