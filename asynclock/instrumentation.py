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

Design note. A hook runs on the event loop at every acquisition and release, where a
microsecond counts (an uncontended cycle is about 130 µs on loopback), and a measurement
through the OpenTelemetry SDK costs about 4 µs. So the two hooks here are not called per
event: a lease queues the event's figures once, for every such hook, and the queue is
handed to the hooks in batches (``_base._events.report``), when 256 events are queued or
when the metrics are collected (each hook drains the queue first); a batch is tallied
hot in the caches, several times faster per event. Tallying is cheap: a counter is a
dict entry incremented; a Prometheus histogram's bucket is found by bisection; an
OpenTelemetry histogram's value is queued. The tallies are handed over when the metrics
are collected: Prometheus reads them through a collector of ours at each scrape;
OpenTelemetry reads the counters through observable counters, and its histograms are fed
the queued values by a callback that runs at each collection, before the SDK reads them
(the queue keeps the latest 100,000 values, should nothing collect: the SDK is never
called on the loop). Batches are tallied under a lock, so tallies change in one thread
at a time whichever loop or collecting thread drains. Called directly (as a lease's own
``on_event``), a hook tallies the one event at once.
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

from ._base._events import EventHook, LeaseEvent, LeaseEventKind, Tallied
from ._base._events import drain as _drain
from ._base._events import hooks as _hooks
from ._base._events import set_hooks as _set_hooks
from ._base._events import tallied as _tallied
from ._base._optional import import_optional

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


_ACQUIRED = LeaseEventKind.ACQUIRED
_FAILED = LeaseEventKind.ACQUIRE_FAILED
_RENEWED = LeaseEventKind.RENEWED
_RENEW_FAILED = LeaseEventKind.RENEW_FAILED
_LOST = LeaseEventKind.LOST
_RELEASED = LeaseEventKind.RELEASED

Labels = tuple[str, ...]


class _Tally:
    """What both hooks count, cheaply, on the loop (see the design note): per metric, a
    dict of label values (the name label first, if any) to counts, and per histogram a
    callable taking (label values, value)."""

    def __init__(self, name_label: NameLabel | None) -> None:
        self._name_label = name_label
        self._lock = threading.Lock()  # (tallies change in one thread at a time)
        self.acquisitions: dict[Labels, int] = {}
        self.renewals: dict[Labels, int] = {}
        self.losses: dict[Labels, int] = {}

    def _observe(self, histogram: str, names: Labels, value: float) -> None:
        raise NotImplementedError

    def __call__(self, event: LeaseEvent) -> None:
        self._asynclock_sink([_tallied(event)])

    def _asynclock_sink(self, batch: list[Tallied]) -> None:
        """The hook's batch form (see ``_base._events.report``): tally ``batch``."""
        label = self._name_label
        acquisitions, renewals, losses = self.acquisitions, self.renewals, self.losses
        observe = self._observe
        with self._lock:
            for kind, name, detail, value in batch:
                names: Labels = () if label is None else (label(name),)
                if kind is _ACQUIRED or kind is _FAILED:
                    key = (*names, "acquired" if kind is _ACQUIRED else detail)
                    acquisitions[key] = acquisitions.get(key, 0) + 1
                    if value is not None:
                        observe("wait", names, value)
                elif kind is _RENEWED or kind is _RENEW_FAILED:
                    key = (*names, "ok" if kind is _RENEWED else "failed")
                    renewals[key] = renewals.get(key, 0) + 1
                    if value is not None:
                        observe("slack", names, max(value, 0.0))
                elif kind is _LOST or kind is _RELEASED:
                    if kind is _LOST:
                        key = (*names, detail)
                        losses[key] = losses.get(key, 0) + 1
                    if value is not None:
                        observe("hold", names, value)


class OpenTelemetryHook(_Tally):
    """Lease metrics through OpenTelemetry (extra ``asynclock[opentelemetry]``).

    Instruments, on the meter ``asynclock`` of ``meter_provider`` (default: the global
    one): ``asynclock.lease.acquisitions`` (counter; attribute ``outcome``: acquired,
    busy, timeout), ``asynclock.lease.wait_time`` and ``asynclock.lease.hold_time``
    (histograms, s), ``asynclock.lease.renewals`` (counter; ``outcome``: ok, failed),
    ``asynclock.lease.renewal_slack`` (histogram, s: time left before the safe deadline
    when a renewal was confirmed; near 0 means leases are about to be lost) and
    ``asynclock.lease.losses`` (counter; ``reason``). With ``name_label``, every
    measurement also gets the attribute ``name``. The counters are observable counters,
    read when the metrics are collected (see the module's design note). The Python SDK
    spends about 4 µs on each histogram value (on the collecting thread, when it
    collects: two values per lease, more with renewals); ``histograms=False`` keeps the
    counters only.

    Raises:
        ModuleNotFoundError: ``opentelemetry-api`` is not installed (the message says
            ``pip install 'asynclock[opentelemetry]'``).
        TypeError: ``name_label`` is not callable.
    """

    _KEPT = 100_000  # queued histogram values kept while nothing collects (the latest)

    def __init__(
        self,
        meter_provider: Any = None,
        name_label: NameLabel | None = None,
        *,
        histograms: bool = True,
    ) -> None:
        metrics = import_optional("opentelemetry.metrics", "opentelemetry", "OpenTelemetryHook")
        super().__init__(_check_label(name_label))
        self._keep_values = histograms
        self._queue: deque[tuple[str, Labels, float]] = deque(maxlen=self._KEPT)
        self._flushing = threading.Lock()
        if meter_provider is None:
            meter = metrics.get_meter("asynclock")
        else:
            meter = meter_provider.get_meter("asynclock")
        self._histograms = {
            "wait": meter.create_histogram(
                "asynclock.lease.wait_time", unit="s", description="time to acquire a lease"
            ),
            "hold": meter.create_histogram(
                "asynclock.lease.hold_time", unit="s", description="time a lease was held"
            ),
            "slack": meter.create_histogram(
                "asynclock.lease.renewal_slack",
                unit="s",
                description="time left before the safe deadline when a renewal was confirmed",
            ),
        }
        self._attribute_names = ("name",) if name_label is not None else ()
        meter.create_observable_counter(
            "asynclock.lease.acquisitions",
            [self._reader(lambda: self.acquisitions, "outcome")],
            unit="1",
            description="lease acquisitions",
        )
        meter.create_observable_counter(
            "asynclock.lease.renewals",
            [self._reader(lambda: self.renewals, "outcome")],
            unit="1",
            description="lease renewals",
        )
        meter.create_observable_counter(
            "asynclock.lease.losses",
            [self._reader(lambda: self.losses, "reason")],
            unit="1",
            description="leases lost while held",
        )

    def _observe(self, histogram: str, names: Labels, value: float) -> None:
        if not self._keep_values:
            return
        self._queue.append((histogram, names, value))

    def _attributes(self, names: Labels, *extra: tuple[str, str]) -> dict[str, str]:
        return {**dict(zip(self._attribute_names, names, strict=True)), **dict(extra)}

    def _flush(self) -> None:
        """Hand the queued histogram values to the SDK (from any thread)."""
        with self._flushing:
            queue = self._queue
            while queue:
                try:
                    histogram, names, value = queue.popleft()
                except IndexError:  # pragma: no cover - emptied meanwhile
                    break
                # (None rather than {}: the SDK takes a fifth less time per value)
                attributes = self._attributes(names) if names else None
                self._histograms[histogram].record(value, attributes)

    def _reader(self, counts: Callable[[], dict[Labels, int]], label: str) -> Callable[[Any], Any]:
        from opentelemetry.metrics import Observation

        def observe(options: Any) -> list[Any]:
            _drain()  # (every event reported so far, tallied)
            self._flush()  # (the histograms' values, before the SDK reads them)
            snapshot = dict(counts())  # (one C call: consistent under the GIL)
            return [
                Observation(total, self._attributes(key[:-1], (label, key[-1])))
                for key, total in snapshot.items()
            ]

        return observe


class PrometheusHook(_Tally):
    """Lease metrics for Prometheus (extra ``asynclock[prometheus]``), registered in
    ``registry`` (default: ``prometheus_client``'s global one):
    ``asynclock_lease_acquisitions_total{outcome}`` (acquired, busy, timeout),
    ``asynclock_lease_wait_seconds`` and ``asynclock_lease_hold_seconds`` (histograms),
    ``asynclock_lease_renewals_total{outcome}`` (ok, failed),
    ``asynclock_lease_renewal_slack_seconds`` (histogram: time left before the safe
    deadline when a renewal was confirmed) and ``asynclock_lease_losses_total{reason}``.
    With ``name_label``, every metric also has the label ``name``. The values are read at
    each scrape, from a collector of the hook's own (see the module's design note).

    Make one per registry: registering the same metric names twice raises there.

    Raises:
        ModuleNotFoundError: ``prometheus-client`` is not installed (the message says
            ``pip install 'asynclock[prometheus]'``).
        ValueError: the registry already has these metrics.
        TypeError: ``name_label`` is not callable.
    """

    _BUCKETS: ClassVar[dict[str, tuple[float, ...]]] = {
        "wait": (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
        "hold": (0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300, 900, 3600),
        "slack": (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
    }

    def __init__(self, registry: Any = None, name_label: NameLabel | None = None) -> None:
        prometheus_client = import_optional("prometheus_client", "prometheus", "PrometheusHook")
        super().__init__(_check_label(name_label))
        self._label_names = ["name"] if name_label is not None else []
        # per histogram: label values -> [count per bucket (the last: +Inf), sum]
        self._histograms: dict[str, dict[Labels, list[float]]] = {h: {} for h in self._BUCKETS}
        target = prometheus_client.REGISTRY if registry is None else registry
        target.register(_Collector(self))

    def _observe(self, histogram: str, names: Labels, value: float) -> None:
        series = self._histograms[histogram].get(names)
        if series is None:
            buckets = self._BUCKETS[histogram]
            series = self._histograms[histogram][names] = [0.0] * (len(buckets) + 2)
        series[bisect_left(self._BUCKETS[histogram], value)] += 1
        series[-1] += value


class _Collector:
    """Reads a :class:`PrometheusHook`'s tallies at each scrape."""

    _DOCS: ClassVar[dict[str, tuple[str, str]]] = {
        "wait": ("asynclock_lease_wait_seconds", "Time to acquire a lease."),
        "hold": ("asynclock_lease_hold_seconds", "Time a lease was held."),
        "slack": (
            "asynclock_lease_renewal_slack_seconds",
            "Time left before the safe deadline when a renewal was confirmed.",
        ),
    }

    def __init__(self, hook: PrometheusHook) -> None:
        self._hook = hook

    def describe(self) -> list[Any]:
        return self.collect()

    def collect(self) -> list[Any]:
        from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

        _drain()  # (every event reported so far, tallied)
        hook = self._hook
        with hook._lock:  # (a snapshot: counts and sums that agree with each other)
            acquisitions, renewals = dict(hook.acquisitions), dict(hook.renewals)
            losses = dict(hook.losses)
            histograms = {
                h: {key: list(series) for key, series in tallies.items()}
                for h, tallies in hook._histograms.items()
            }
        names = hook._label_names
        families: list[Any] = []
        for metric, doc, label, counts in (
            (
                "asynclock_lease_acquisitions",
                "Lease acquisitions, by outcome (acquired, busy, timeout).",
                "outcome",
                acquisitions,
            ),
            (
                "asynclock_lease_renewals",
                "Lease renewals, by outcome (ok, failed).",
                "outcome",
                renewals,
            ),
            ("asynclock_lease_losses", "Leases lost while held, by reason.", "reason", losses),
        ):
            counter = CounterMetricFamily(metric, doc, labels=[*names, label])
            for key, total in counts.items():
                counter.add_metric(list(key), total)
            families.append(counter)
        for histogram, (metric, doc) in self._DOCS.items():
            family = HistogramMetricFamily(metric, doc, labels=names)
            bounds = hook._BUCKETS[histogram]
            for key, values in histograms[histogram].items():
                cumulative, buckets = 0.0, []
                for bound, count in zip((*bounds, float("inf")), values[:-1], strict=True):
                    cumulative += count
                    buckets.append((_bound(bound), cumulative))
                family.add_metric(list(key), buckets, values[-1])
            families.append(family)
        return families


def _bound(value: float) -> str:
    return "+Inf" if value == float("inf") else repr(float(value))
