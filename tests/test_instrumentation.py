"""Process-wide hooks and the OpenTelemetry and Prometheus metrics (issue 22, B), with
the real OpenTelemetry SDK (an in-memory reader) and the real Prometheus client."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from redis.asyncio import Redis

import asynclock
from asynclock import AcquireTimeout, LeaseEventKind, LockBusy, LockLost, instrumentation


@pytest.fixture(autouse=True)
def no_hooks_left() -> Iterator[None]:
    yield
    instrumentation.set_hooks([])


async def _scripted_run(client: Redis, other: Redis, prefix: str) -> None:
    """Two acquisitions (the second waits for the first), a busy attempt, a timeout,
    renewals, and a loss (the key deleted from outside, found by a renewal)."""
    async with asynclock.lease(client, "a", ttl=1.2, prefix=prefix):
        with pytest.raises(LockBusy):
            async with asynclock.lease(other, "a", blocking=False, prefix=prefix):
                pass
        with pytest.raises(AcquireTimeout):
            async with asynclock.lease(other, "a", blocking_timeout=0.05, prefix=prefix):
                pass
        await asyncio.sleep(0.9)  # (renewed at 0.4 s and 0.8 s)
    lost = asyncio.Event()

    def on_event(event: asynclock.LeaseEvent) -> None:
        if event.kind is LeaseEventKind.LOST:
            lost.set()

    with pytest.raises(LockLost):
        async with asynclock.lease(other, "a", ttl=0.9, prefix=prefix, on_event=on_event) as lock:
            await client.delete(lock.key)
            await lost.wait()


def test_set_hooks_checks_and_replaces() -> None:
    assert instrumentation.get_hooks() == ()
    with pytest.raises(TypeError, match="callable"):
        instrumentation.set_hooks([print, 3])  # type: ignore[list-item]
    assert instrumentation.get_hooks() == ()
    instrumentation.set_hooks([print])
    assert instrumentation.get_hooks() == (print,)
    instrumentation.set_hooks([])
    assert instrumentation.get_hooks() == ()


async def test_events_carry_what_metrics_need(client: Redis, prefix: str) -> None:
    """A hook that raises breaks nothing, and the hooks after it still run; the events
    carry wait, hold, renewal latency and slack; acquire_failed says busy or timeout."""
    seen: list[asynclock.LeaseEvent] = []

    def broken(event: asynclock.LeaseEvent) -> None:
        raise RuntimeError("a broken metrics exporter")

    instrumentation.set_hooks([broken, seen.append])
    async with asynclock.lease(client, "h", ttl=1.5, prefix=prefix):
        await asyncio.sleep(0.6)  # (renewed at 0.5 s)
        other = await asynclock.acquire(client, "h2", prefix=prefix)
        with pytest.raises(LockBusy):
            async with asynclock.lease(client, "h2", prefix=prefix, blocking=False):
                pass
        await other.release()
    by_kind: dict[LeaseEventKind, list[asynclock.LeaseEvent]] = {}
    for event in seen:
        by_kind.setdefault(event.kind, []).append(event)
    acquired = [e for e in by_kind[LeaseEventKind.ACQUIRED] if e.name == "h"]
    assert acquired[0].waited is not None
    assert 0 <= acquired[0].waited < 1
    renewed = by_kind[LeaseEventKind.RENEWED][0]
    assert renewed.latency is not None
    assert renewed.slack is not None
    assert 0 <= renewed.latency < 0.5
    assert 0.3 < renewed.slack < 1.5
    released = [e for e in by_kind[LeaseEventKind.RELEASED] if e.name == "h"]
    assert released[0].held is not None
    assert released[0].held >= 0.6
    (failed,) = by_kind[LeaseEventKind.ACQUIRE_FAILED]
    assert (failed.name, failed.detail) == ("h2", "busy")


def _otel_points(reader: Any) -> dict[str, list[Any]]:
    data = reader.get_metrics_data()
    points: dict[str, list[Any]] = {}
    for resource in data.resource_metrics:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                points.setdefault(metric.name, []).extend(metric.data.data_points)
    return points


def _sum(points: list[Any], **attributes: str) -> float:
    return sum(
        p.value for p in points if all(p.attributes.get(k) == v for k, v in attributes.items())
    )


async def test_opentelemetry_counts_a_scripted_run(
    client: Redis, make_client: Any, prefix: str
) -> None:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    instrumentation.set_hooks([instrumentation.OpenTelemetryHook(meter_provider=provider)])
    await _scripted_run(client, make_client(), prefix)
    points = _otel_points(reader)
    acquisitions = points["asynclock.lease.acquisitions"]
    assert _sum(acquisitions, outcome="acquired") == 2
    assert _sum(acquisitions, outcome="busy") == 1
    assert _sum(acquisitions, outcome="timeout") == 1
    assert _sum(points["asynclock.lease.renewals"], outcome="ok") >= 2
    assert _sum(points["asynclock.lease.losses"], reason="not_owner") == 1
    (hold,) = points["asynclock.lease.hold_time"]
    assert hold.count == 2  # (one released, one lost)
    assert sum(p.count for p in points["asynclock.lease.wait_time"]) == 4
    assert sum(p.count for p in points["asynclock.lease.renewal_slack"]) >= 2
    assert all("name" not in p.attributes for p in acquisitions)  # (no names by default)


async def test_prometheus_counts_a_scripted_run(
    client: Redis, make_client: Any, prefix: str
) -> None:
    registry = CollectorRegistry()
    hook = instrumentation.PrometheusHook(registry=registry)
    instrumentation.set_hooks([hook])
    await _scripted_run(client, make_client(), prefix)
    text = generate_latest(registry).decode()
    assert 'asynclock_lease_acquisitions_total{outcome="acquired"} 2.0' in text
    assert 'asynclock_lease_acquisitions_total{outcome="busy"} 1.0' in text
    assert 'asynclock_lease_acquisitions_total{outcome="timeout"} 1.0' in text
    assert 'asynclock_lease_losses_total{reason="not_owner"} 1.0' in text
    assert "asynclock_lease_hold_seconds_count 2.0" in text
    assert "asynclock_lease_wait_seconds_count 4.0" in text
    assert "asynclock_lease_renewal_slack_seconds_count" in text
    with pytest.raises(ValueError, match="Duplicated"):  # (one hook per registry)
        instrumentation.PrometheusHook(registry=registry)


async def test_a_name_label_is_opt_in(client: Redis, prefix: str) -> None:
    registry = CollectorRegistry()
    instrumentation.set_hooks(
        [
            instrumentation.PrometheusHook(
                registry=registry, name_label=lambda name: name.split(":")[0]
            )
        ]
    )
    async with asynclock.lease(client, "orders:42", prefix=prefix):
        pass
    text = generate_latest(registry).decode()
    assert 'asynclock_lease_acquisitions_total{name="orders",outcome="acquired"} 1.0' in text
    with pytest.raises(TypeError, match="name_label"):
        instrumentation.PrometheusHook(registry=CollectorRegistry(), name_label="x")  # type: ignore[arg-type]


async def test_opentelemetry_counters_only(client: Redis, prefix: str) -> None:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    reader = InMemoryMetricReader()
    hook = instrumentation.OpenTelemetryHook(
        meter_provider=MeterProvider(metric_readers=[reader]), histograms=False
    )
    instrumentation.set_hooks([hook])
    async with asynclock.lease(client, "c", prefix=prefix):
        pass
    points = _otel_points(reader)
    assert _sum(points["asynclock.lease.acquisitions"], outcome="acquired") == 1
    assert "asynclock.lease.hold_time" not in points


def test_batches_from_two_loops_are_counted_exactly(redis_server: Any, prefix: str) -> None:
    """Two event loops in two threads take 300 leases each (more than a batch of 256,
    so batches are tallied on the loops and the rest at collection): every acquisition
    and release is counted once, in both hooks, while a third thread collects
    meanwhile; a hook whose batch form raises breaks neither locking nor the others."""
    import threading

    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    class Broken(instrumentation.PrometheusHook):
        def _asynclock_sink(self, batch: list[Any]) -> None:
            raise RuntimeError("a broken metrics hook")

    registry = CollectorRegistry()
    prom = instrumentation.PrometheusHook(registry=registry)
    reader = InMemoryMetricReader()
    otel = instrumentation.OpenTelemetryHook(meter_provider=MeterProvider(metric_readers=[reader]))
    instrumentation.set_hooks([Broken(registry=CollectorRegistry()), prom, otel])
    done = threading.Event()

    def take_300(name: str) -> None:
        async def run() -> None:
            client = Redis.from_url(redis_server.url)
            try:
                for _ in range(300):
                    async with asynclock.lease(client, name, prefix=prefix):
                        pass
            finally:
                await client.aclose()

        asyncio.run(run())

    def collect_meanwhile() -> None:
        while not done.wait(0.01):
            generate_latest(registry)
            reader.get_metrics_data()

    workers = [threading.Thread(target=take_300, args=(n,)) for n in ("x", "y")]
    collector = threading.Thread(target=collect_meanwhile)
    for thread in (*workers, collector):
        thread.start()
    for thread in workers:
        thread.join(timeout=120)
    done.set()
    collector.join(timeout=10)
    assert not any(t.is_alive() for t in (*workers, collector))
    text = generate_latest(registry).decode()
    assert 'asynclock_lease_acquisitions_total{outcome="acquired"} 600.0' in text
    assert "asynclock_lease_hold_seconds_count 600.0" in text
    points = _otel_points(reader)
    assert _sum(points["asynclock.lease.acquisitions"], outcome="acquired") == 600


async def _every_cron() -> None:
    """``every(cron=...)``: raises before any I/O (the client has no server)."""

    async def job() -> None:
        pass

    await asynclock.every(Redis(host="127.0.0.1", port=1), "tick", None, job, cron="* * * * *")


@pytest.mark.parametrize(
    ("module", "extra", "use"),
    [
        ("prometheus_client", "prometheus", lambda: instrumentation.PrometheusHook()),
        ("opentelemetry.metrics", "opentelemetry", lambda: instrumentation.OpenTelemetryHook()),
        ("croniter", "cron", lambda: asyncio.run(_every_cron())),
    ],
    ids=["prometheus", "opentelemetry", "cron"],
)
def test_a_missing_extra_says_which_to_install(
    monkeypatch: pytest.MonkeyPatch, module: str, extra: str, use: Any
) -> None:
    """The extra's module cannot be imported (None in sys.modules): the feature raises
    ModuleNotFoundError (an ImportError) whose message gives the pip command."""
    monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(ModuleNotFoundError) as missing:
        use()
    assert f"pip install 'asynclock[{extra}]'" in str(missing.value)
    assert missing.value.name == module
    assert isinstance(missing.value.__cause__, ImportError)


async def test_once_reports_its_acquisitions_like_every_way_in(client: Redis, prefix: str) -> None:
    """once() reports acquired (with the wait) before released, and acquire_failed on a
    timeout, as lease() and acquire() do: a metrics hook counts its holds with their
    acquisitions."""
    seen: list[asynclock.LeaseEvent] = []
    instrumentation.set_hooks([seen.append])

    async def job() -> int:
        return 7

    assert await asynclock.once(client, "job", job, prefix=prefix) == 7
    kinds = [event.kind for event in seen if event.name == "job"]
    assert kinds[0] is LeaseEventKind.ACQUIRED
    assert LeaseEventKind.RELEASED in kinds
    acquired = next(e for e in seen if e.kind is LeaseEventKind.ACQUIRED)
    assert acquired.waited is not None
    assert acquired.waited >= 0

    seen.clear()
    gate = asyncio.Event()
    running = asyncio.Event()

    async def slow() -> int:
        running.set()  # (the first caller holds the job's lease)
        await gate.wait()
        return 8

    first = asyncio.create_task(asynclock.once(client, "slow", slow, prefix=prefix))
    await running.wait()
    with pytest.raises(AcquireTimeout):
        await asynclock.once(client, "slow", slow, blocking_timeout=0.1, prefix=prefix)
    gate.set()
    assert await first == 8
    failed = [e for e in seen if e.kind is LeaseEventKind.ACQUIRE_FAILED]
    assert [e.detail for e in failed] == ["timeout"]
