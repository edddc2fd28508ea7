"""Key templates and clients taken from a call's arguments, for the decorators.

``"charge:{order_id}"`` is a ``str.format`` template whose fields name parameters of the
decorated function: each call's arguments are bound to its signature (defaults applied)
and the template filled from them, attribute and item access included
(``"{order.id}"``, ``"{ctx[job_id]}"``). A field that names no parameter is refused when
the template is made (at decoration time), not at the first call.

The same field syntax names where a client is found: ``client_from("ctx[redis]")`` takes
arq's ``ctx["redis"]`` from each call's ``ctx`` argument.
"""

from __future__ import annotations

import inspect
import string
from collections.abc import Callable, Mapping
from typing import Any, Final

from redis.asyncio import Redis

from .._base._options import Client, is_client

__all__ = [
    "ClientFrom",
    "ClientSource",
    "KeyTemplate",
    "checked_source",
    "client_from",
    "is_template",
    "key_maker",
    "placeholder",
    "resolver",
]

_FORMATTER: Final = string.Formatter()
_BY_NAME: Final = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def is_template(text: str) -> bool:
    """Whether ``text`` is a template with a replacement field (``{...}``), for
    ``once()``: a key that has none, or does not parse as one (a lone ``{``), is a
    literal key, as it always was."""
    try:
        return any(field is not None for _, field, _, _ in _FORMATTER.parse(text))
    except ValueError:
        return False


def _fields(template: str, argument: str) -> list[str]:
    """The field names of ``template`` (those nested in format specs too).

    Raises:
        ValueError: the template does not parse, or has an empty or numbered field.
    """
    try:
        parsed = list(_FORMATTER.parse(template))
    except ValueError as exc:
        raise ValueError(
            f"{argument}: {template!r} is not a valid template ({exc}; write a literal "
            "brace as '{{' or '}}')"
        ) from None
    names: list[str] = []
    for _, field, spec, _ in parsed:
        if field is None:
            continue
        names.append(field)
        if spec:
            names.extend(_fields(spec, argument))
    return names


def _root(field: str) -> str:
    """The parameter a field starts from: ``order`` for ``order.id`` or ``order[0]``."""
    return field.split(".", 1)[0].split("[", 1)[0]


def _check_field(field: str, signature: inspect.Signature, argument: str, func: str) -> str:
    """``field``'s parameter, or ``ValueError`` naming the field."""
    root = _root(field)
    if not root or root.isdigit():
        raise ValueError(
            f"{argument}: the field {{{field}}} must name a parameter of {func}, not a position"
        )
    parameter = signature.parameters.get(root)
    if parameter is None or parameter.kind not in _BY_NAME:
        named = ", ".join(name for name, p in signature.parameters.items() if p.kind in _BY_NAME)
        raise ValueError(
            f"{argument}: the field {{{field}}} names no parameter of {func} "
            f"(its parameters: {named or 'none'})"
        )
    return root


def _describe(func: Callable[..., Any]) -> str:
    return getattr(func, "__qualname__", None) or repr(func)


def _signature(func: Callable[..., Any], argument: str) -> inspect.Signature:
    try:
        return inspect.signature(func)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{argument}: the signature of {func!r} cannot be read ({exc})") from None


def _bind(
    signature: inspect.Signature, func: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> dict[str, Any]:
    """The call's arguments by parameter name, defaults applied.

    Raises:
        TypeError: the arguments do not fit the signature (as calling ``func`` would).
    """
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as exc:
        raise TypeError(f"{func}() {exc}") from None
    bound.apply_defaults()
    return bound.arguments


class KeyTemplate:
    """A key template checked against a function's signature; :meth:`render` fills it
    from one call's arguments. A template without fields renders as itself."""

    __slots__ = ("_func", "_literal", "_signature", "template")

    def __init__(self, template: str, func: Callable[..., Any], argument: str = "key") -> None:
        """
        Raises:
            TypeError: ``template`` is not a ``str``.
            ValueError: it does not parse, is empty, or a field names no parameter of
                ``func`` (``argument`` and the field named in the message).
        """
        if not isinstance(template, str):
            raise TypeError(
                f"{argument} must be a str or a callable, not {type(template).__name__}"
            )
        if not template:
            raise ValueError(f"{argument} must not be empty")
        self.template = template
        self._func = _describe(func)
        fields = _fields(template, argument)
        self._literal: str | None = None
        if not fields:
            self._literal = template.format()  # ('{{' and '}}' are literal braces)
            self._signature: inspect.Signature | None = None
            return
        self._signature = _signature(func, argument)
        for field in fields:
            _check_field(field, self._signature, argument, self._func)

    def render(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str:
        """The key for a call with ``args`` and ``kwargs``.

        Raises:
            TypeError: the arguments do not fit the function's signature.
            ValueError: a field could not be filled (an attribute or item missing, a
                format spec that does not apply), the cause chained; or it gave ''.
        """
        if self._literal is not None:
            return self._literal
        assert self._signature is not None
        arguments = _bind(self._signature, self._func, args, kwargs)
        try:
            key = self.template.format_map(arguments)
        except (AttributeError, KeyError, IndexError, TypeError, ValueError) as exc:
            raise ValueError(
                f"key template {self.template!r} of {self._func} could not be filled: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        if not key:
            raise ValueError(f"key template {self.template!r} of {self._func} gave ''")
        return key

    def __repr__(self) -> str:
        return f"KeyTemplate({self.template!r})"


def key_maker(
    key: str | Callable[..., str], func: Callable[..., Any], argument: str = "key"
) -> Callable[[tuple[Any, ...], Mapping[str, Any]], str]:
    """How each call of ``func`` makes its key: a :class:`KeyTemplate` filled from its
    arguments, or ``key(*args, **kwargs)`` for a callable.

    Raises:
        TypeError: ``key`` is neither a ``str`` nor a callable.
        ValueError: as :class:`KeyTemplate`.
    """
    if isinstance(key, str):
        return KeyTemplate(key, func, argument).render
    if not callable(key):
        raise TypeError(
            f"{argument} must be a template (str) or a callable of the function's "
            f"arguments, not {key!r}"
        )
    return lambda args, kwargs: key(*args, **kwargs)


class ClientFrom:
    """Where each call of a decorated function finds its client: a field of its
    arguments (``"ctx[redis]"``, ``"self.redis"``, ``"request.app.state.redis"``).
    Made by :func:`client_from`; bound to a function with :meth:`bind`."""

    __slots__ = ("field",)

    def __init__(self, field: str) -> None:
        if not isinstance(field, str):
            raise TypeError(f"field must be a str, not {type(field).__name__}")
        if not field or _root(field) == "" or "{" in field or "}" in field:
            raise ValueError(
                f"field must name a parameter, then attributes or items (like "
                f"'ctx[redis]'), got {field!r}"
            )
        self.field = field

    def bind(self, func: Callable[..., Any], argument: str = "redis") -> Callable[..., Any]:
        """A callable of ``(args, kwargs)`` returning the client found in a call of
        ``func``.

        Raises:
            ValueError: the field names no parameter of ``func``.
        """
        signature = _signature(func, argument)
        name = _describe(func)
        _check_field(self.field, signature, argument, name)
        field = self.field

        def find(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
            arguments = _bind(signature, name, args, kwargs)
            try:
                return _FORMATTER.get_field(field, (), arguments)[0]
            except (AttributeError, KeyError, IndexError, TypeError) as exc:
                raise ValueError(
                    f"{argument}: client_from({field!r}) found no client in this call of "
                    f"{name}: {type(exc).__name__}: {exc}"
                ) from exc

        return find

    def __repr__(self) -> str:
        return f"client_from({self.field!r})"


def client_from(field: str) -> ClientFrom:
    """Take the client of each call of a decorated function from its arguments, for
    :func:`asynclock.exclusive` and :func:`asynclock.idempotent`: ``field`` names a
    parameter, then attributes and items as a ``str.format`` field does.

    ::

        @asynclock.exclusive(asynclock.client_from("ctx[redis]"), "sync:{user_id}")
        async def sync_user(ctx: dict[str, Any], user_id: int) -> None:  # an arq job
            ...

    Raises:
        TypeError: ``field`` is not a ``str``.
        ValueError: it is empty or has braces; one that names no parameter of the
            function is refused when decorating.
    """
    return ClientFrom(field)


ClientSource = Client | Callable[[], Client] | ClientFrom
"""What a decorator is given to find its client: a client, a zero-argument callable
called at each call (a client made in FastAPI's ``lifespan``), or :func:`client_from`."""

_PLACEHOLDER: list[Redis] = []


def placeholder() -> Redis:
    """A client that never connects, to check a decorator's options against before its
    own client is known (made once; creating it does no I/O)."""
    if not _PLACEHOLDER:
        _PLACEHOLDER.append(Redis())
    return _PLACEHOLDER[0]


def checked_source(redis: object, argument: str = "redis") -> Any:
    """What a decorator's options are checked against, before any I/O: ``redis`` itself
    when it is a client (or a list of them, a Redlock's), else a :func:`placeholder`.

    Raises:
        TypeError: ``redis`` is neither a client (or a list of them), nor a callable
            taking no arguments, nor :func:`client_from`.
    """
    if is_client(redis) or isinstance(redis, list | tuple):
        return redis
    if isinstance(redis, ClientFrom):
        return placeholder()
    if callable(redis):
        try:
            inspect.signature(redis).bind()
        except TypeError:
            raise TypeError(
                f"{argument}: a callable given for the client must take no arguments (it "
                f"is called at each call), got {redis!r}; use client_from(...) to take it "
                "from the call's arguments"
            ) from None
        except ValueError:  # (no signature to read: a builtin; called as it is)
            pass
        return placeholder()
    raise TypeError(
        f"{argument} must be a redis.asyncio.Redis or RedisCluster client (or "
        "valkey-py's Valkey or ValkeyCluster), a zero-argument callable returning one, "
        "or client_from(...), not "
        f"{type(redis).__module__}.{type(redis).__qualname__}"
    )


def resolver(
    redis: object, func: Callable[..., Any], argument: str = "redis"
) -> Callable[[tuple[Any, ...], Mapping[str, Any]], Any]:
    """How each call of ``func`` finds its client, from what a decorator was given (the
    client, what a callable returns, or what ``client_from`` finds; the lease checks it).

    Raises:
        TypeError: as :func:`checked_source`.
        ValueError: ``client_from``'s field names no parameter of ``func``.
    """
    checked_source(redis, argument)
    if isinstance(redis, ClientFrom):
        return redis.bind(func, argument)
    if not callable(redis) or is_client(redis):
        return lambda args, kwargs: redis
    factory = redis

    def call(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
        client = factory()
        if inspect.isawaitable(client) and not is_client(client):  # (a client is awaitable)
            close = getattr(client, "close", None)
            if callable(close):
                close()  # (a coroutine never awaited would warn)
            raise TypeError(
                f"{argument}: {factory!r} returned an awaitable: it must return the client itself"
            )
        return client

    return call
