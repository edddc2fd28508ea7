"""Metrics for every lease of the process: hooks set once, and two ready-made ones.

::

    from asynclock import instrumentation

    instrumentation.set_hooks([instrumentation.PrometheusHook()])

A hook is any callable taking one :class:`asynclock.LeaseEvent`; it runs on the event
loop, after the lease's own ``on_event``, and an exception from it is logged and never
breaks locking. :class:`OpenTelemetryHook` needs the ``opentelemetry`` extra
(``opentelemetry-api``), :class:`PrometheusHook` the ``prometheus`` extra
(``prometheus-client``); each is imported only when used.

Lock names are not a label by default: a lock per order would make a series per order.
``name_label`` opts in, with a function of the name (``lambda name: name.split(":")[0]``
keeps the part before the first colon).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from ._base._events import EventHook, LeaseEvent, LeaseEventKind
from ._base._events import hooks as _hooks
from ._base._events import set_hooks as _set_hooks

__all__ = ["OpenTelemetryHook", "PrometheusHook", "get_hooks", "set_hooks"]

NameLabel = Callable[[str], str]


def set_hooks(hooks: Iterable[EventHook]) -> None:
    """Make ``hooks`` the process's hooks (replacing those set before; ``[]`` removes
    them). Every lease of every client calls them with each of its events.

    Raises:
        TypeError: a hook is not callable (nothing is changed).
    """
    new = tuple(hooks)
    for hook in new:
        if not callable(hook):
            raise TypeError(f"a hook must be callable, not {type(hook).__name__}")
    _set_hooks(new)


def get_hooks() -> tuple[EventHook, ...]:
    """The process's hooks, as :func:`set_hooks` set them."""
    return _hooks()


def _check_label(name_label: object) -> NameLabel | None:
    if name_label is not None and not callable(name_label):
        raise TypeError(f"name_label must be callable, not {type(name_label).__name__}")
    return name_label


_RENEW_FAILED = LeaseEventKind.RENEW_FAILED


class OpenTelemetryHook:
    """Lease metrics through OpenTelemetry (extra ``asynclock[opentelemetry]``).

    Instruments, on the meter ``asynclock`` of ``meter_provider`` (default: the global
    one): ``asynclock.lease.acquisitions`` (counter; attribute ``outcome``: acquired,
    busy, timeout), ``asynclock.lease.wait_time`` and ``asynclock.lease.hold_time``
    (histograms, s), ``asynclock.lease.renewals`` (counter; ``outcome``: ok, failed),
    ``asynclock.lease.renewal_slack`` (histogram, s: time left before the safe deadline
    when a renewal was confirmed; near 0 means leases are about to be lost) and
    ``asynclock.lease.losses`` (counter; ``reason``). With ``name_label``, every
    measurement also gets the attribute ``name``.

    Raises:
        ImportError: ``opentelemetry-api`` is not installed.
        TypeError: ``name_label`` is not callable.
    """

    def __init__(self, meter_provider: Any = None, name_label: NameLabel | None = None) -> None:
        from opentelemetry import metrics

        self._name_label = _check_label(name_label)
        if meter_provider is None:
            meter = metrics.get_meter("asynclock")
        else:
            meter = meter_provider.get_meter("asynclock")
        self._acquisitions = meter.create_counter(
            "asynclock.lease.acquisitions", unit="1", description="lease acquisitions"
        )
        self._wait = meter.create_histogram(
            "asynclock.lease.wait_time", unit="s", description="time to acquire a lease"
        )
        self._hold = meter.create_histogram(
            "asynclock.lease.hold_time", unit="s", description="time a lease was held"
        )
        self._renewals = meter.create_counter(
            "asynclock.lease.renewals", unit="1", description="lease renewals"
        )
        self._slack = meter.create_histogram(
            "asynclock.lease.renewal_slack",
            unit="s",
            description="time left before the safe deadline when a renewal was confirmed",
        )
        self._losses = meter.create_counter(
            "asynclock.lease.losses", unit="1", description="leases lost while held"
        )

    def __call__(self, event: LeaseEvent) -> None:
        kind = event.kind
        base: dict[str, str] = {}
        if self._name_label is not None:
            base["name"] = self._name_label(event.name)
        if kind is LeaseEventKind.ACQUIRED or kind is LeaseEventKind.ACQUIRE_FAILED:
            outcome = "acquired" if kind is LeaseEventKind.ACQUIRED else event.detail
            self._acquisitions.add(1, {**base, "outcome": outcome})
            if event.waited is not None:
                self._wait.record(event.waited, {**base, "outcome": outcome})
        elif kind is LeaseEventKind.RENEWED:
            self._renewals.add(1, {**base, "outcome": "ok"})
            if event.slack is not None:
                self._slack.record(max(event.slack, 0.0), base)
        elif kind is _RENEW_FAILED:
            self._renewals.add(1, {**base, "outcome": "failed"})
        elif kind is LeaseEventKind.LOST:
            self._losses.add(1, {**base, "reason": event.detail})
            if event.held is not None:
                self._hold.record(event.held, base)
        elif kind is LeaseEventKind.RELEASED and event.held is not None:
            self._hold.record(event.held, base)


class PrometheusHook:
    """Lease metrics for Prometheus (extra ``asynclock[prometheus]``), registered in
    ``registry`` (default: ``prometheus_client``'s global one):
    ``asynclock_lease_acquisitions_total{outcome}`` (acquired, busy, timeout),
    ``asynclock_lease_wait_seconds`` and ``asynclock_lease_hold_seconds`` (histograms),
    ``asynclock_lease_renewals_total{outcome}`` (ok, failed),
    ``asynclock_lease_renewal_slack_seconds`` (histogram: time left before the safe
    deadline when a renewal was confirmed) and ``asynclock_lease_losses_total{reason}``.
    With ``name_label``, every metric also has the label ``name``.

    Make one per registry: registering the same metric names twice raises there.

    Raises:
        ImportError: ``prometheus-client`` is not installed.
        ValueError: the registry already has these metrics.
        TypeError: ``name_label`` is not callable.
    """

    def __init__(self, registry: Any = None, name_label: NameLabel | None = None) -> None:
        import prometheus_client as prom

        self._name_label = _check_label(name_label)
        options: dict[str, Any] = {}
        if registry is not None:
            options["registry"] = registry
        extra = ["name"] if name_label is not None else []
        self._acquisitions = prom.Counter(
            "asynclock_lease_acquisitions",
            "Lease acquisitions, by outcome (acquired, busy, timeout).",
            [*extra, "outcome"],
            **options,
        )
        self._wait = prom.Histogram(
            "asynclock_lease_wait_seconds", "Time to acquire a lease.", extra, **options
        )
        self._hold = prom.Histogram(
            "asynclock_lease_hold_seconds", "Time a lease was held.", extra, **options
        )
        self._renewals = prom.Counter(
            "asynclock_lease_renewals",
            "Lease renewals, by outcome (ok, failed).",
            [*extra, "outcome"],
            **options,
        )
        self._slack = prom.Histogram(
            "asynclock_lease_renewal_slack_seconds",
            "Time left before the safe deadline when a renewal was confirmed.",
            extra,
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, float("inf")),
            **options,
        )
        self._losses = prom.Counter(
            "asynclock_lease_losses",
            "Leases lost while held, by reason.",
            [*extra, "reason"],
            **options,
        )

    def _labels(self, event: LeaseEvent) -> list[str]:
        return [self._name_label(event.name)] if self._name_label is not None else []

    def __call__(self, event: LeaseEvent) -> None:
        kind = event.kind
        names = self._labels(event)
        if kind is LeaseEventKind.ACQUIRED or kind is LeaseEventKind.ACQUIRE_FAILED:
            outcome = "acquired" if kind is LeaseEventKind.ACQUIRED else event.detail
            self._acquisitions.labels(*names, outcome).inc()
            if event.waited is not None:
                _observe(self._wait, names, event.waited)
        elif kind is LeaseEventKind.RENEWED:
            self._renewals.labels(*names, "ok").inc()
            if event.slack is not None:
                _observe(self._slack, names, max(event.slack, 0.0))
        elif kind is _RENEW_FAILED:
            self._renewals.labels(*names, "failed").inc()
        elif kind is LeaseEventKind.LOST:
            self._losses.labels(*names, event.detail).inc()
            if event.held is not None:
                _observe(self._hold, names, event.held)
        elif kind is LeaseEventKind.RELEASED and event.held is not None:
            _observe(self._hold, names, event.held)


def _observe(histogram: Any, names: list[str], value: float) -> None:
    (histogram.labels(*names) if names else histogram).observe(value)
