"""Helpers for tests that run real `ddiloco` processes. ``Procs`` is the benchmarks'
launcher (scripts/benchlib.py): one way to start them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Callable

from ddiloco_cli.protocol import layout, ledger, records
from ddiloco_cli.store import open_store

from support import REPO

sys.path.insert(0, str(REPO / "scripts"))
from benchlib import Launcher  # noqa: E402


class Procs(Launcher):
    """The benchmarks' launcher; each process also tags its S3 requests with its name (User-Agent
    "app/NAME", from AWS_SDK_UA_APP_ID), so the tests' moto request log (DDILOCO_TEST_MOTO_LOG,
    tests/support/moto_proc.py) tells the processes apart."""

    def spawn(self, name: str, argv: list[str], *, env: dict[str, str] | None = None) -> subprocess.Popen:
        return super().spawn(name, argv, env={"AWS_SDK_UA_APP_ID": name, **(env or {})})


def wait_for(cond: Callable[[], bool], *, timeout_s: float, what: str, procs: Procs | None = None, poll_s: float = 0.25) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(poll_s)
    logs = ""
    if procs is not None:
        for p in procs.procs:
            logs += f"\n--- {p.name} (rc={p.poll()}) ---\n" + procs.log(p.name)[-3000:]
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}{logs}")


def terminate(proc: subprocess.Popen, *, timeout_s: float = 30) -> int:
    proc.send_signal(signal.SIGTERM)
    return proc.wait(timeout=timeout_s)


_STORES: dict[tuple[str, str | None, str | None], object] = {}


def store_for(url: str):
    """The store at ``url``, opened once per URL (and endpoint) for the helpers below, which tests
    call in their polling loops: opening an s3:// or gs:// store builds a filesystem and LISTs the
    bucket (~0.3 s CPU with botocore). Reusing it reads nothing stale: the fsspec stores keep no
    listings cache (ddiloco_cli/store/fsspec_store.py) and every read goes to the bucket."""
    key = (url, os.environ.get("AWS_ENDPOINT_URL"), os.environ.get("STORAGE_EMULATOR_HOST"))
    if key not in _STORES:
        _STORES[key] = open_store(url)
    return _STORES[key]


def versions(url: str, num_fragments: int) -> list[int]:
    store = store_for(url)
    return [ledger.latest_version(store, p) or 0 for p in range(num_fragments)]


def all_manifests(url: str) -> dict[int, list[dict]]:
    store = store_for(url)
    run = ledger.read_run(store)
    out = {}
    for p in range(int(run["num_fragments"])):
        out[p] = [ledger.read_manifest(store, p, v, run_id=run["run_id"]) for v in ledger.list_versions(store, p)]
    return out


def learner_heartbeat(url: str, learner_id: str) -> dict | None:
    store = store_for(url)
    try:
        return records.loads(store.get(layout.learner_heartbeat_key(learner_id)), "learner_heartbeat", where="hb")
    except Exception:  # noqa: BLE001
        return None
