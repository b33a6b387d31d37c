"""The throttling proxy (scripts/netem.py) on real loopback sockets.

Timing asserts are lower bounds only (a loaded machine can only make things
slower): a limited link can never carry bytes faster than its rate, and a
round trip can never beat twice the one-way latency.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from support import REPO

SCRIPTS = REPO / "scripts"

sys.path.insert(0, str(SCRIPTS))
from netem import Direction, LinkProxy  # noqa: E402


@pytest.fixture
def echo_server():
    """A TCP echo server; yields its (host, port)."""
    srv = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def handle(conn: socket.socket) -> None:
        with conn:
            while data := conn.recv(65536):
                conn.sendall(data)

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            threading.Thread(target=handle, args=(conn,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    yield srv.getsockname()[:2]
    stop.set()
    srv.close()


def echo_through(address: tuple[str, int], payload: bytes) -> bytes:
    """Send payload through address to the echo server, half-close, return all that came back."""
    with socket.create_connection(address, timeout=30) as s:
        sender = threading.Thread(target=lambda: (s.sendall(payload), s.shutdown(socket.SHUT_WR)))
        sender.start()
        got = bytearray()
        while data := s.recv(65536):
            got += data
        sender.join()
    return bytes(got)


def test_bytes_pass_unchanged_both_ways_and_are_counted(echo_server):
    payloads = [os.urandom(n) for n in (1, 1000, 300_000)]
    with LinkProxy(echo_server, up=Direction(rate_Bps=20e6, latency_s=0.001),
                   down=Direction(rate_Bps=20e6, latency_s=0.001)) as proxy:
        assert proxy.address[0] == "127.0.0.1" and proxy.address[1] != echo_server[1]
        results: dict[int, bytes] = {}
        threads = [threading.Thread(target=lambda i=i, p=p: results.__setitem__(i, echo_through(proxy.address, p)))
                   for i, p in enumerate(payloads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [results[i] for i in range(len(payloads))] == payloads
        total = sum(map(len, payloads))
        assert (proxy.bytes_up, proxy.bytes_down, proxy.num_connections) == (total, total, len(payloads))


def test_unlimited_link_passes_bytes_unchanged(echo_server):
    payload = os.urandom(2_000_000)
    with LinkProxy(echo_server) as proxy:
        assert echo_through(proxy.address, payload) == payload


def test_rate_limit_is_a_lower_bound_on_transfer_time(echo_server):
    rate_Bps, burst = 1e6, 16384
    payload = os.urandom(400_000)
    with LinkProxy(echo_server, up=Direction(rate_Bps=rate_Bps, burst_bytes=burst)) as proxy:
        t0 = time.monotonic()
        assert echo_through(proxy.address, payload) == payload
        elapsed_s = time.monotonic() - t0
    assert elapsed_s >= (len(payload) - burst) / rate_Bps


def test_connections_share_one_link(echo_server):
    """Two connections at once get the link's rate together, not each."""
    rate_Bps, burst = 1e6, 16384
    payloads = [os.urandom(200_000), os.urandom(200_000)]
    with LinkProxy(echo_server, down=Direction(rate_Bps=rate_Bps, burst_bytes=burst)) as proxy:
        results: list[bytes] = [b"", b""]
        threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, echo_through(proxy.address, payloads[i])))
                   for i in range(2)]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed_s = time.monotonic() - t0
    assert results == payloads
    assert elapsed_s >= (sum(map(len, payloads)) - burst) / rate_Bps


def test_latency_is_a_lower_bound_on_round_trip(echo_server):
    latency_s = 0.03
    with LinkProxy(echo_server, up=Direction(latency_s=latency_s), down=Direction(latency_s=latency_s)) as proxy:
        with socket.create_connection(proxy.address, timeout=10) as s:
            for _ in range(3):
                t0 = time.monotonic()
                s.sendall(b"x")
                assert s.recv(1) == b"x"
                assert time.monotonic() - t0 >= 2 * latency_s


def test_stop_closes_open_connections(echo_server):
    proxy = LinkProxy(echo_server).start()
    s = socket.create_connection(proxy.address, timeout=10)
    s.sendall(b"ping")
    assert s.recv(4) == b"ping"
    proxy.stop()
    assert s.recv(1) == b""  # closed by the proxy, not left hanging
    s.close()
    with pytest.raises(OSError):
        socket.create_connection(proxy.address, timeout=2).close()


def test_invalid_direction_is_refused():
    with pytest.raises(ValueError, match="rate_Bps"):
        Direction(rate_Bps=0)


@pytest.mark.s3
def test_s3_store_through_the_proxy(moto_server):
    """The use it exists for: a bucket client pointed at the proxy sees the same objects."""
    from ddiloco_cli.store import open_store

    host, port = re.match(r"http://([\d.]+):(\d+)", moto_server).groups()
    with LinkProxy((host, int(port)), up=Direction(latency_s=0.005), down=Direction(latency_s=0.005)) as proxy:
        store = open_store(f"s3://ddiloco-test/netem-{os.getpid()}", options={"endpoint_url": proxy.endpoint_url})
        data = os.urandom(100_000)
        assert store.put_if_absent("blob", data)
        assert open_store(f"s3://ddiloco-test/netem-{os.getpid()}").get("blob") == data  # direct, not proxied
        assert store.get("blob") == data
        assert proxy.bytes_up > len(data) and proxy.bytes_down > len(data)


def test_command_line(echo_server):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPTS / "netem.py"), "--listen", "127.0.0.1:0",
         "--target", f"{echo_server[0]}:{echo_server[1]}", "--rate-mbps", "80", "--latency-ms", "1"],
        stdout=subprocess.PIPE, text=True, env=env)
    try:
        first = proc.stdout.readline()
        host, port = re.search(r"http://([\d.]+):(\d+)", first).groups()
        payload = os.urandom(50_000)
        assert echo_through((host, int(port)), payload) == payload
        proc.send_signal(signal.SIGTERM)
        rest = proc.communicate(timeout=20)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0
    assert "up 50000 B, down 50000 B, 1 connections" in rest
