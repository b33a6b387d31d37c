"""A throttling TCP proxy: rehearse a thin, distant link on loopback.

``LinkProxy`` listens on a local port and forwards every connection to one
target (a bucket endpoint). All connections through one proxy share one link,
modelled per direction as a FIFO wire:

* bandwidth: bytes leave at ``rate`` bytes/s (``None``: unlimited); at most
  ``burst_bytes`` may go ahead of that pace after the link has been idle;
* latency: every byte arrives ``latency_s`` after it left (one way), so a
  request/response costs one round trip on top of its transfer time, and the
  latency does not cut the throughput (the wire holds rate x latency bytes).

The proxy reads from a socket only as fast as its wire drains, so a sender
feels the limit as TCP back-pressure, as it would on a real link.

    python scripts/netem.py --listen 127.0.0.1:9001 --target 127.0.0.1:9000 --rate-mbps 8 --latency-ms 20
    ddiloco learn s3://bucket/run -o endpoint_url=http://127.0.0.1:9001 --learner-id a

In Python::

    proxy = LinkProxy(("127.0.0.1", 9000), up=Direction(rate_Bps=1e6, latency_s=0.02),
                      down=Direction(rate_Bps=1e6, latency_s=0.02))
    proxy.start()            # proxy.address == ("127.0.0.1", port)
    ...; proxy.bytes_up, proxy.bytes_down
    proxy.stop()

"up" is client -> target, "down" is target -> client.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import logging
import signal
import threading
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)

_READ_BYTES = 65536
_SLICE_S = 0.002  # pace in slices of at most this much wire time, so delivery is smooth


@dataclass(frozen=True)
class Direction:
    """One direction of the link. ``rate_Bps=None`` means unlimited bandwidth."""

    rate_Bps: float | None = None
    latency_s: float = 0.0
    burst_bytes: int = 16384

    def __post_init__(self) -> None:
        if self.rate_Bps is not None and self.rate_Bps <= 0:
            raise ValueError(f"rate_Bps must be positive or None, got {self.rate_Bps}")
        if self.latency_s < 0 or self.burst_bytes < 0:
            raise ValueError("latency_s and burst_bytes must be >= 0")


class _Wire:
    """The shared pacing state of one direction (used from the event loop only)."""

    def __init__(self, spec: Direction):
        self.spec = spec
        self.free_at = 0.0  # monotonic time at which the wire has sent everything queued so far
        self.num_bytes = 0

    def depart(self, n: int, now: float) -> float:
        """Reserve the wire for n bytes; returns when the last of them has left."""
        self.num_bytes += n
        if self.spec.rate_Bps is None:
            return now
        start = max(self.free_at, now - self.spec.burst_bytes / self.spec.rate_Bps)
        self.free_at = start + n / self.spec.rate_Bps
        return max(now, self.free_at)  # burst credit lets bytes go at once, never before they came


class LinkProxy:
    """A TCP proxy to ``target`` with a rate-limited, delayed link per direction.

    ``start()`` binds ``listen`` (port 0: any free port) and serves from a
    background thread; ``address`` is then the bound ``(host, port)``. ``stop()``
    closes the listener and every open connection. ``bytes_up`` /
    ``bytes_down`` count the payload bytes carried each way (TCP payload, not
    headers), ``num_connections`` the connections accepted.
    """

    def __init__(self, target: tuple[str, int], *, up: Direction = Direction(), down: Direction = Direction(),
                 listen: tuple[str, int] = ("127.0.0.1", 0)):
        self.target, self.listen = target, listen
        self._up, self._down = _Wire(up), _Wire(down)
        self.num_connections = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.base_events.Server | None = None
        self._thread: threading.Thread | None = None
        self._tasks: set[asyncio.Task] = set()
        self.address: tuple[str, int] | None = None

    @property
    def bytes_up(self) -> int:
        return self._up.num_bytes

    @property
    def bytes_down(self) -> int:
        return self._down.num_bytes

    @property
    def endpoint_url(self) -> str:
        assert self.address is not None, "start() the proxy first"
        return f"http://{self.address[0]}:{self.address[1]}"

    # ------------------------------------------------------------ lifecycle
    def start(self) -> LinkProxy:
        """Bind and serve in a daemon thread; returns self once listening."""
        ready = threading.Event()
        failure: list[BaseException] = []

        def serve() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                self._server = loop.run_until_complete(asyncio.start_server(self._handle, *self.listen))
                self.address = self._server.sockets[0].getsockname()[:2]
            except BaseException as exc:  # noqa: BLE001 - reported to the caller of start()
                failure.append(exc)
                ready.set()
                loop.close()
                return
            ready.set()
            loop.run_forever()
            loop.close()

        self._thread = threading.Thread(target=serve, name="netem-proxy", daemon=True)
        self._thread.start()
        ready.wait()
        if failure:
            raise failure[0]
        return self

    def stop(self) -> None:
        """Close the listener and all connections; idempotent."""
        loop = self._loop
        if loop is None or not loop.is_running():
            return

        async def shutdown() -> None:
            self._server.close()
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shutdown(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        self._thread.join(timeout=10)

    def __enter__(self) -> LinkProxy:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------- forwarding
    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._tasks.add(task)
        self.num_connections += 1
        try:
            try:
                target_r, target_w = await asyncio.open_connection(*self.target)
            except OSError as exc:
                log.warning("netem: cannot reach target %s:%d: %s", *self.target, exc)
                return
            try:
                await asyncio.gather(self._pump(client_r, target_w, self._up),
                                     self._pump(target_r, client_w, self._down))
            finally:
                target_w.close()
        except asyncio.CancelledError:
            pass
        finally:
            client_w.close()
            self._tasks.discard(task)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, wire: _Wire) -> None:
        """Move bytes one way: pace them onto the wire, deliver each after the latency."""
        loop = asyncio.get_running_loop()
        in_flight: collections.deque[tuple[float, bytes]] = collections.deque()
        arrived = asyncio.Event()
        done = False

        async def deliver() -> None:
            while in_flight or not done:
                if not in_flight:
                    arrived.clear()
                    await arrived.wait()
                    continue
                at, data = in_flight[0]
                delay = at - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                in_flight.popleft()
                writer.write(data)
                await writer.drain()

        delivering = asyncio.ensure_future(deliver())
        try:
            rate = wire.spec.rate_Bps
            slice_bytes = _READ_BYTES if rate is None else max(1024, int(rate * _SLICE_S))
            while True:
                try:
                    data = await reader.read(_READ_BYTES)
                except (ConnectionError, OSError):
                    data = b""
                for i in range(0, len(data), slice_bytes):
                    piece = data[i:i + slice_bytes]
                    now = loop.time()
                    left_at = wire.depart(len(piece), now)
                    in_flight.append((left_at + wire.spec.latency_s, piece))
                    arrived.set()
                    if left_at > now:  # back-pressure: read no faster than the wire drains
                        await asyncio.sleep(left_at - now)
                if not data:
                    break
            done = True
            arrived.set()
            await delivering
            if writer.can_write_eof():
                writer.write_eof()
        except (ConnectionError, OSError):
            pass
        finally:
            done = True
            arrived.set()
            if not delivering.done():
                delivering.cancel()
                await asyncio.gather(delivering, return_exceptions=True)


def _host_port(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: write HOST:PORT, like 127.0.0.1:9000")
    return host or "127.0.0.1", int(port)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="scripts/netem.py", description=__doc__.splitlines()[0])
    ap.add_argument("--listen", type=_host_port, default=("127.0.0.1", 0), help="HOST:PORT to listen on (port 0: any)")
    ap.add_argument("--target", type=_host_port, required=True, help="HOST:PORT to forward to (the bucket endpoint)")
    ap.add_argument("--rate-mbps", type=float, default=None, help="bandwidth each way, Mbit/s (default unlimited)")
    ap.add_argument("--up-mbps", type=float, default=None, help="client->target bandwidth, overrides --rate-mbps")
    ap.add_argument("--down-mbps", type=float, default=None, help="target->client bandwidth, overrides --rate-mbps")
    ap.add_argument("--latency-ms", type=float, default=0.0, help="one-way latency added each way, ms")
    ap.add_argument("--burst-kib", type=float, default=16.0, help="bytes that may go ahead of the pace after idle, KiB")
    args = ap.parse_args(argv)

    def direction(mbps: float | None) -> Direction:
        mbps = mbps if mbps is not None else args.rate_mbps
        return Direction(rate_Bps=None if mbps is None else mbps * 1e6 / 8, latency_s=args.latency_ms / 1e3,
                         burst_bytes=int(args.burst_kib * 1024))

    proxy = LinkProxy(args.target, up=direction(args.up_mbps), down=direction(args.down_mbps), listen=args.listen)
    proxy.start()
    print(f"netem: {proxy.endpoint_url} -> {args.target[0]}:{args.target[1]} (Ctrl-C to stop)", flush=True)
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    t0 = time.monotonic()
    try:
        while not stopping.wait(1.0):
            pass
    except KeyboardInterrupt:
        pass
    proxy.stop()
    wall_s = time.monotonic() - t0
    print(f"netem: up {proxy.bytes_up} B, down {proxy.bytes_down} B, {proxy.num_connections} connections "
          f"in {wall_s:.1f} s", flush=True)


if __name__ == "__main__":
    main()
