"""A fault-injecting TCP proxy: :class:`FaultProxy` and :class:`ProxyMode`.

Part of the public :mod:`asynclock.testing` kit (import from there, not from here).

:class:`FaultProxy` is an asyncio TCP proxy placed between a client and a server.  It
can delay, drop or hold traffic per direction, reset every connection, refuse new ones,
or lose exactly one reply after the server executed the request.

Design note: each accepted client connection becomes a ``_Pair`` of sockets (client and
upstream) with one ``_Flow`` per direction.  A flow forwards chunks at once, queues them
with a due time (``DELAY``), drops them (``BLACKHOLE``) or stops reading from its source
(``HOLD``, and whenever its queue or the destination's buffer is full), so backpressure
reaches the sender through TCP as it would through a slow network.  Only the standard
library is used.  All durations are in seconds (``float``).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import random
import socket
import struct
from collections import deque
from collections.abc import Sequence
from types import TracebackType
from typing import Final, Literal, Self

from ._servers import _STOP_TIMEOUT, LOOPBACK

__all__ = ["Direction", "FaultProxy", "ProxyMode"]


class ProxyMode(enum.Enum):
    """What a :class:`FaultProxy` does with the traffic of one direction."""

    PASS = "pass"
    """Forward every chunk at once."""
    DELAY = "delay"
    """Forward every chunk after ``delay ± jitter`` seconds, keeping the order."""
    BLACKHOLE = "blackhole"
    """Read and discard every chunk; the connection stays open."""
    HOLD = "hold"
    """Stop reading, so data piles up in kernel buffers and TCP backpressure builds.

    Held data is forwarded once the mode changes again."""


Direction = Literal["upstream", "downstream", "both"]
"""Which way a fault of the proxy hits: client to server, server to client, or both."""
_DIRECTIONS: Final = ("upstream", "downstream")

#: Bytes queued (delayed) in one direction of one connection before the proxy
#: stops reading from the source.
_QUEUE_HIGH_WATER: Final = 1 << 20


class _Rule:
    __slots__ = ("delay", "jitter", "mode")

    def __init__(self, mode: ProxyMode = ProxyMode.PASS, delay: float = 0.0, jitter: float = 0.0):
        self.mode = mode
        self.delay = delay
        self.jitter = jitter

    def due(self, now: float) -> float:
        if self.mode is not ProxyMode.DELAY:
            return now
        wait = self.delay
        if self.jitter:
            wait += random.uniform(-self.jitter, self.jitter)
        return now + max(wait, 0.0)


def _abort_with_rst(transport: asyncio.Transport | None) -> None:
    """Close *transport* at once, sending a TCP RST (SO_LINGER 0) where possible."""
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):  # already closed: nothing to reset
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()  # idempotent


class _Flow:
    """One direction of one proxied connection: src transport -> dst transport."""

    def __init__(self, pair: _Pair, direction: str) -> None:
        self.pair = pair
        self.direction = direction
        self.src: asyncio.Transport | None = None
        self.dst: asyncio.Transport | None = None
        self.queue: deque[tuple[float, bytes]] = deque()
        self.queued_bytes = 0
        self.handle: asyncio.TimerHandle | None = None
        self.dst_blocked = False  # dst transport asked us to pause writing
        self.reading_paused = False
        self.eof = False  # src sent EOF
        self.eof_forwarded = False

    def data_received(self, data: bytes) -> None:
        proxy = self.pair.proxy
        if self.direction == "downstream" and proxy._reset_next_reply:
            proxy._reset_next_reply = False
            self.pair.abort()
            return
        rule = proxy._rules[self.direction]
        if rule.mode is ProxyMode.BLACKHOLE:
            return
        loop = self.pair.loop
        due = rule.due(loop.time())
        if not self.queue and due <= loop.time() and self.dst is not None:
            self.dst.write(data)
            return
        self.queue.append((due, data))
        self.queued_bytes += len(data)
        if self.handle is None:
            self._schedule()
        self.update_reading()

    def eof_received(self) -> None:
        self.eof = True
        self.maybe_forward_eof()

    def _schedule(self) -> None:
        if self.queue:
            self.handle = self.pair.loop.call_at(self.queue[0][0], self._flush)

    def _flush(self) -> None:
        self.handle = None
        if self.dst is None or self.dst.is_closing():
            return
        now = self.pair.loop.time()
        while self.queue and self.queue[0][0] <= now:
            _, data = self.queue.popleft()
            self.queued_bytes -= len(data)
            self.dst.write(data)
        self._schedule()
        self.maybe_forward_eof()
        self.update_reading()

    def maybe_forward_eof(self) -> None:
        if not self.eof or self.queue or self.eof_forwarded or self.dst is None:
            return
        self.eof_forwarded = True
        if self.dst.can_write_eof() and not self.dst.is_closing():
            try:
                self.dst.write_eof()
            except OSError:  # e.g. ENOTCONN: dst was reset and its loss is not yet seen
                self.pair.abort()
                return
        self.pair.maybe_finished()

    def update_reading(self) -> None:
        src = self.src
        if src is None or src.is_closing():
            return
        rule = self.pair.proxy._rules[self.direction]
        should_pause = (
            rule.mode is ProxyMode.HOLD
            or self.dst is None
            or self.dst_blocked
            or self.queued_bytes > _QUEUE_HIGH_WATER
        )
        if should_pause and not self.reading_paused:
            src.pause_reading()
            self.reading_paused = True
        elif not should_pause and self.reading_paused:
            src.resume_reading()
            self.reading_paused = False

    def cancel(self) -> None:
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None
        self.queue.clear()
        self.queued_bytes = 0


class _Side(asyncio.Protocol):
    """Protocol for one socket of a pair; *inbound* is the flow whose source it is."""

    def __init__(self, pair: _Pair, inbound: _Flow, outbound: _Flow) -> None:
        self.pair = pair
        self.inbound = inbound
        self.outbound = outbound
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.inbound.src = transport
        self.outbound.dst = transport
        self.pair.side_connected(self)

    def data_received(self, data: bytes) -> None:
        self.inbound.data_received(data)

    def eof_received(self) -> bool:
        self.inbound.eof_received()
        return True  # keep the other direction open (half-close)

    def pause_writing(self) -> None:
        self.outbound.dst_blocked = True
        self.outbound.update_reading()

    def resume_writing(self) -> None:
        self.outbound.dst_blocked = False
        self.outbound.update_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self.pair.side_lost(self, exc)


class _Pair:
    """A client connection and the upstream connection made for it."""

    def __init__(self, proxy: FaultProxy, loop: asyncio.AbstractEventLoop) -> None:
        self.proxy = proxy
        self.loop = loop
        self.up = _Flow(self, "upstream")
        self.down = _Flow(self, "downstream")
        self.client = _Side(self, inbound=self.up, outbound=self.down)
        self.server = _Side(self, inbound=self.down, outbound=self.up)
        self.closed: asyncio.Future[None] = loop.create_future()
        self._open_sides = 0
        self._closing = False
        self.refused = False
        self.connect_task: asyncio.Task[None] | None = None

    @property
    def is_open(self) -> bool:
        return not self._closing and not self.refused and self.client.transport is not None

    def flows(self) -> tuple[_Flow, _Flow]:
        return self.up, self.down

    def side_connected(self, side: _Side) -> None:
        self._open_sides += 1
        if side is self.client:
            # Read nothing from the client until the server connection exists.
            self.up.update_reading()
            # (a pair reset between its accept and this call is no longer tracked: reset
            # this side too, or its connection would live on unseen)
            if self.proxy.refuse_new or self._closing:
                self.refused = True
                self.abort()
                return
            self.proxy.accepted_count += 1
            self.connect_task = self.loop.create_task(self._connect_upstream())
            self.connect_task.add_done_callback(lambda _: self._check_closed())
        else:
            if self._closing:
                _abort_with_rst(side.transport)
                return
            self.up.update_reading()
            self.down.update_reading()
            self.up.maybe_forward_eof()

    async def _connect_upstream(self) -> None:
        proxy = self.proxy
        try:
            await self.loop.create_connection(
                lambda: self.server, proxy.target_host, proxy.target_port
            )
        except OSError:
            self.abort()

    def maybe_finished(self) -> None:
        if self.up.eof_forwarded and self.down.eof_forwarded:
            self.close()

    def close(self) -> None:
        """Graceful close: pending writes are flushed."""
        if self._closing:
            return
        self._closing = True
        for flow in self.flows():
            flow.cancel()
        for side in (self.client, self.server):
            if side.transport is not None:
                side.transport.close()
        self._check_closed()

    def abort(self) -> None:
        """Abrupt close of both sockets (RST)."""
        self._closing = True
        for flow in self.flows():
            flow.cancel()
        if self.connect_task is not None and not self.connect_task.done():
            self.connect_task.cancel()
        _abort_with_rst(self.client.transport)
        _abort_with_rst(self.server.transport)
        self._check_closed()

    def side_lost(self, side: _Side, exc: Exception | None) -> None:
        self._open_sides -= 1
        if exc is not None:
            self.abort()
        else:
            self.close()
        self._check_closed()

    def _check_closed(self) -> None:
        connecting = self.connect_task is not None and not self.connect_task.done()
        if self._open_sides <= 0 and not connecting and not self.closed.done():
            self.closed.set_result(None)
            self.proxy._pairs.discard(self)


class FaultProxy:
    """An asyncio TCP proxy on a free ``127.0.0.1`` port in front of ``host:port``.

    Use it as an async context manager; everything it starts (listener,
    connections, timers, tasks) is closed on exit::

        async with FaultProxy("127.0.0.1", server.port) as proxy:
            client = redis.asyncio.Redis.from_url(proxy.url)
            proxy.set_mode(ProxyMode.DELAY, direction="downstream", delay=0.2)
            ...
            proxy.set_mode(ProxyMode.BLACKHOLE)      # both directions
            proxy.set_mode(ProxyMode.PASS)
            await proxy.reset_all()                  # RST every open connection
            proxy.refuse_new = True                  # new connections are reset at once
            proxy.reset_on_next_reply()              # lose exactly one reply

    The modes apply per direction to existing and new connections alike:
    ``"upstream"`` is client -> server, ``"downstream"`` is server -> client.

    Args:
        host: address of the real server.
        port: port of the real server.
    """

    def __init__(self, host: str, port: int) -> None:
        self.target_host = host
        self.target_port = port
        self.refuse_new = False
        """When true, each new client connection is reset as soon as it is accepted."""
        self.accepted_count = 0
        """Client connections accepted (and not refused) since start."""
        self._rules: dict[str, _Rule] = {d: _Rule() for d in _DIRECTIONS}
        self._reset_next_reply = False
        self._pairs: set[_Pair] = set()  # every pair whose sockets are not all released
        self._server: asyncio.Server | None = None
        self._port: int | None = None

    @property
    def host(self) -> str:
        """Always ``"127.0.0.1"``."""
        return LOOPBACK

    @property
    def port(self) -> int:
        """The proxy's listening port."""
        if self._port is None:
            raise RuntimeError("proxy has not been started")
        return self._port

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:PORT/0`` for the proxy's port."""
        return f"redis://{LOOPBACK}:{self.port}/0"

    @property
    def connection_count(self) -> int:
        """Number of currently open client connections (refused ones not counted)."""
        return sum(1 for p in self._pairs if p.is_open)

    def mode(self, direction: Literal["upstream", "downstream"]) -> ProxyMode:
        """The current mode of one direction."""
        return self._rules[direction].mode

    def set_mode(
        self,
        mode: ProxyMode,
        *,
        direction: Direction = "both",
        delay: float = 0.0,
        jitter: float = 0.0,
    ) -> None:
        """Set what happens to traffic in *direction* from now on.

        Args:
            mode: see :class:`ProxyMode`.
            direction: ``"upstream"`` (client -> server), ``"downstream"``
                (server -> client) or ``"both"``.
            delay: seconds each chunk is held back (``DELAY`` only).
            jitter: each chunk's delay is drawn uniformly from
                ``delay ± jitter`` seconds (clamped at 0); order is kept.

        Chunks already delayed keep their schedule.  Leaving ``HOLD`` forwards what
        had piled up.
        """
        if not isinstance(mode, ProxyMode):
            raise TypeError(f"mode must be a ProxyMode, not {mode!r}")
        if delay < 0 or jitter < 0:
            raise ValueError("delay and jitter must be >= 0 seconds")
        if direction == "both":
            directions: tuple[str, ...] = _DIRECTIONS
        elif direction in _DIRECTIONS:
            directions = (direction,)
        else:
            raise ValueError(
                f"direction must be 'upstream', 'downstream' or 'both', not {direction!r}"
            )
        for d in directions:
            self._rules[d] = _Rule(mode, delay, jitter)
        for pair in list(self._pairs):
            for flow in pair.flows():
                flow.update_reading()

    def reset_on_next_reply(self) -> None:
        """Arm a one-shot fault: the next server -> client chunk on any connection is
        dropped and that connection pair is reset (RST to the client).

        This simulates "the request was executed, but its reply was lost".  Arm it
        only once the client's connection is established (e.g. after a ``PING``):
        redis-py sends handshake commands (``CLIENT SETINFO``/``HELLO``) on connect,
        and their reply would otherwise be the one lost.
        """
        self._reset_next_reply = True

    @property
    def reset_armed(self) -> bool:
        """True while a :meth:`reset_on_next_reply` is still pending."""
        return self._reset_next_reply

    async def reset_all(self) -> None:
        """Abruptly close every current connection pair (TCP RST on both sides).

        Returns once the proxy has released all of their sockets.
        """
        pairs = list(self._pairs)
        for pair in pairs:
            pair.abort()
        await self._wait_pairs_closed(pairs)

    async def start(self) -> Self:
        """Start listening on a free loopback port."""
        if self._server is not None:
            return self
        loop = asyncio.get_running_loop()

        def factory() -> asyncio.Protocol:
            pair = _Pair(self, loop)
            self._pairs.add(pair)
            return pair.client

        self._server = await loop.create_server(factory, LOOPBACK, 0)
        self._port = self._server.sockets[0].getsockname()[1]
        return self

    async def aclose(self) -> None:
        """Stop listening and reset every connection.  Idempotent."""
        server = self._server
        if server is None:
            return
        self._server = None
        server.close()
        pairs = list(self._pairs)
        for pair in pairs:
            pair.abort()
        tasks = [p.connect_task for p in pairs if p.connect_task is not None]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        await self._wait_pairs_closed(pairs)
        await server.wait_closed()

    async def _wait_pairs_closed(self, pairs: Sequence[_Pair]) -> None:
        pending = [p.closed for p in pairs if not p.closed.done()]
        if pending:
            await asyncio.wait(pending, timeout=_STOP_TIMEOUT)
        # Let transports run their connection_lost callbacks and drop their sockets.
        await asyncio.sleep(0)

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()
