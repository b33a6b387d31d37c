"""Store faults: the retry policy, timeouts, a full or read-only disk, temp
files, and the fault-injecting wrapper (ddiloco_cli/store/faults.py)."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import threading

import pytest

from ddiloco_cli.errors import StoreAccessError, UsageError
from ddiloco_cli.protocol import layout
from ddiloco_cli.store import NotFound, TransientStoreError, open_store
from ddiloco_cli.store.faults import FAULTS_ENV, FaultSpec, FaultyStore
from ddiloco_cli.store.retry import RetryingStore, RetryPolicy, retrying

from support import REPO

FAST = {"retry_base_delay_s": 0.0, "retry_max_delay_s": 0.0}


def _temp_files(root: str) -> list[str]:
    return [os.path.join(d, n) for d, _, names in os.walk(root) for n in names if n.startswith(".tmp-")]


# -- the retry policy ----------------------------------------------------------


def test_retrying_retries_transient_errors_only():
    calls = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise TransientStoreError("try again")
        return "ok"

    assert retrying(flaky, what="flaky", policy=RetryPolicy(attempts=3, base_delay_s=0)) == "ok"
    assert len(calls) == 3
    calls.clear()
    with pytest.raises(TransientStoreError):
        retrying(flaky, what="flaky", policy=RetryPolicy(attempts=2, base_delay_s=0))
    assert len(calls) == 2

    def broken() -> None:
        calls.append(1)
        raise KeyError("not transient")

    calls.clear()
    with pytest.raises(KeyError):
        retrying(broken, what="broken")
    assert len(calls) == 1


def test_retry_options_are_checked():
    opts = {"retry_attempts": 3, "retry_deadline_s": 5, "endpoint_url": "x"}
    assert RetryPolicy.pop_options(opts) == RetryPolicy(attempts=3, deadline_s=5.0)
    assert opts == {"endpoint_url": "x"}
    for bad in ({"retry_attempts": 0}, {"retry_deadline_s": "soon"}, {"retry_max_delay_s": -1}):
        with pytest.raises(UsageError):
            RetryPolicy.pop_options(bad)


# -- endpoints that accept connections and never answer -------------------------


@pytest.fixture
def silent_endpoint():
    """An HTTP endpoint that accepts every connection and never sends a byte."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    held: list[socket.socket] = []
    done = threading.Event()

    def accept() -> None:
        while not done.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                return
            held.append(conn)

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    done.set()
    server.close()
    for conn in held:
        conn.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_a_silent_endpoint_fails_instead_of_hanging(silent_endpoint, scheme, monkeypatch):
    # finding: an S3 endpoint that never answered took 419 s to fail; now the read
    # timeout and the retry deadline bound it (here set small; defaults 20 s and 60 s)
    for k, v in {"AWS_ACCESS_KEY_ID": "t", "AWS_SECRET_ACCESS_KEY": "t", "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)
    options = {"endpoint_url": silent_endpoint, "connect_timeout_s": 0.5, "read_timeout_s": 0.5,
               "retry_deadline_s": 1.0, **FAST}
    with pytest.raises(StoreAccessError, match="cannot reach"):
        open_store(f"{scheme}://silent-bucket/run", options=options)


def test_timeout_options_are_checked():
    with pytest.raises(UsageError, match="read_timeout_s"):
        open_store("s3://b/run", options={"endpoint_url": "http://127.0.0.1:9", "read_timeout_s": 0})


# -- a full or read-only local disk ---------------------------------------------


@pytest.fixture
def tiny_disk(tmp_path):
    """A 256 KiB tmpfs (needs root); skipped where it cannot be mounted."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


class _RetryLogged(logging.Handler):
    """Sets ``event`` at the first retry log line, and holds the retrying thread there (the
    line is logged between two attempts, in that thread) until ``resume`` is set: the test
    then looks at the disk while no attempt runs (with a 0.02 s back-off, the next attempt's
    temp file could otherwise already be there on a loaded machine)."""

    def __init__(self) -> None:
        super().__init__()
        self.event = threading.Event()
        self.resume = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if "retry" in record.getMessage() and not self.event.is_set():
            self.event.set()
            self.resume.wait(120)


@pytest.fixture
def retry_logged():
    handler = _RetryLogged()
    logger = logging.getLogger("ddiloco_cli.store.retry")
    level = logger.level  # a CLI command run in-process before (CliRunner) quiets it: see its lines here
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    yield handler
    handler.resume.set()  # a failed test must not leave the writer held
    logger.removeHandler(handler)
    logger.setLevel(level)


def test_disk_full_is_retried_and_leaves_no_temp_file(tiny_disk, retry_logged):
    store = open_store(str(tiny_disk / "run"), options={"retry_attempts": 1000, "retry_deadline_s": 120,
                                                         "retry_base_delay_s": 0.02, "retry_max_delay_s": 0.1})
    store.put_if_absent("run.json", b"{}")
    filler = tiny_disk / "run" / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        while os.write(fd, b"\0" * 4096):
            pass
    except OSError:  # ENOSPC: the disk is full
        pass
    finally:
        os.close(fd)
    data = os.urandom(64 << 10)
    result: list = []
    writer = threading.Thread(target=lambda: result.append(store.put_if_absent("c/obj.bin", data)))
    writer.start()
    assert retry_logged.event.wait(60), "the full disk was not retried"
    assert _temp_files(str(tiny_disk)) == []  # the failed attempt removed its temp file (the writer is held)
    os.unlink(filler)  # an operator frees space; the retry goes through
    retry_logged.resume.set()
    writer.join(60)
    assert result == [True]
    assert store.get("c/obj.bin") == data
    assert _temp_files(str(tiny_disk)) == []


def test_disk_full_fails_with_a_transient_error_after_the_policy(tiny_disk):
    store = open_store(str(tiny_disk / "run"), options={"retry_attempts": 2, **FAST})
    with pytest.raises(TransientStoreError, match="No space left"):
        store.put_if_absent("c/obj.bin", os.urandom(1 << 20))
    assert _temp_files(str(tiny_disk)) == []
    with pytest.raises(NotFound):
        store.get("c/obj.bin")


def test_read_only_remount_is_transient_and_reads_go_on(tiny_disk):
    store = open_store(str(tiny_disk / "run"), options={"retry_attempts": 2, **FAST})
    store.put_if_absent("a.json", b"1")
    subprocess.run(["mount", "-o", "remount,ro", str(tiny_disk)], check=True)
    try:
        with pytest.raises(TransientStoreError, match="Read-only"):
            store.put("b.json", b"2")
        assert store.get("a.json") == b"1"
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(tiny_disk)], check=True)
    store.put("b.json", b"2")
    assert store.get("b.json") == b"2"


# -- the fault-injecting store ----------------------------------------------------


def test_fault_spec_parse():
    assert FaultSpec.parse("0.05") == FaultSpec(rate=0.05)
    assert FaultSpec.parse("0.1,seed=7,spike_s=0.01") == FaultSpec(rate=0.1, seed=7, spike_s=0.01)
    for bad in ("lots", "0.1,seed", "0.1,color=red", "1.5", "0.1,spike_s=-1"):
        with pytest.raises(UsageError):
            FaultSpec.parse(bad)


def _workload(store, n: int) -> dict[str, bytes]:
    """Creates, overwrites, reads, lists and deletes; returns what must remain."""
    want = {}
    for i in range(n):
        key = layout.contribution_key(i % 3, "alice", i)
        data = os.urandom(100 + i)
        assert store.put_if_absent(key, data) is True
        assert store.put_if_absent(key, b"someone else") is False
        assert store.get(key) == data
        want[key] = data
        store.put(layout.learner_heartbeat_key("alice"), str(i).encode())
        if i % 5 == 0:
            store.delete(key)
            del want[key]
    want[layout.learner_heartbeat_key("alice")] = str(n - 1).encode()
    assert {o.key for o in store.list()} == set(want)
    return want


@pytest.mark.parametrize("backend", ["memory", "local"])
def test_retries_carry_a_workload_through_injected_faults(store_url, backend):
    spec = FaultSpec(rate=0.3, seed=3, spike_s=0.001)
    inner = open_store(store_url(backend))
    faulty = FaultyStore(inner.inner.inner, spec=spec)  # the backend under the default layers
    store = RetryingStore(faulty, policy=RetryPolicy(attempts=30, base_delay_s=0))
    want = _workload(store, 60)
    assert set(faulty.injected) == {"error", "spike", "lost_response", "partial_write"}
    for key, data in want.items():
        assert inner.get(key) == data
    if backend == "local":
        # partial writes left temp debris, never an object; gc's sweep removes it
        debris = _temp_files(inner.root)
        assert len(debris) == faulty.injected["partial_write"] > 0
        assert {o.key for o in inner.list()} == set(want)
        removed = inner.remove_stale_temp(older_than_s=1e-9)
        assert len(removed) == len(debris) and _temp_files(inner.root) == []


def test_faults_are_seeded(store_url):
    def run(seed: int) -> list:
        faulty = FaultyStore(open_store(store_url("memory")), spec=FaultSpec(rate=0.5, seed=seed, spike_s=0))
        out = []
        for i in range(40):
            try:
                faulty.put(f"k/{i}", b"x")
                out.append(None)
            except TransientStoreError as exc:
                out.append(str(exc))
        return out

    assert run(1) == run(1)
    assert run(1) != run(2)


def test_faults_from_the_environment(store_url, monkeypatch):
    monkeypatch.setenv(FAULTS_ENV, "1.0,seed=1,spike_s=0")
    store = open_store(store_url("memory"), options={"retry_attempts": 1, **FAST})
    failures = []
    for _ in range(20):  # every call is disturbed: an error or a (zero-length) spike
        try:
            store.list()
        except TransientStoreError as exc:
            failures.append(str(exc))
    assert failures and all("injected fault (error)" in f for f in failures)
    with pytest.raises(UsageError, match="RATE"):
        open_store(store_url("memory"), options={"faults": "often"})


@pytest.mark.slow
def test_training_through_injected_faults_loses_and_corrupts_nothing(tmp_path):
    """Real learners and a syncer train through 10% injected store faults: every
    contribution ends in the ledger, no version is corrupt, nothing is quarantined."""
    import sys

    sys.path.insert(0, str(REPO / "scripts"))
    import bench_faults

    out = bench_faults.main(["--rate", "0.1", "--spike-s", "0.05", "--learners", "2", "--steps", "40",
                             "--fragments", "2", "--workdir", str(tmp_path / "run")])
    assert out["verify_exit_code"] == 0, out
    assert sum(out["faults_injected"].values()) > 0 and out["retries_logged"] > 0, out
    assert out["syncer_survived"] and out["unmerged_after_drain"] == 0, out
    assert out["lost_contributions"] == 0 and out["contribution_objects"] == out["ledger_entries"] > 0, out
    assert out["uploads_given_up"] == 0 and out["quarantined"] == 0 and out["double_applied"] == 0, out


@pytest.mark.slow
def test_syncer_kill9_at_random_points_loses_nothing_and_replays_bit_exactly(tmp_path):
    """The syncer is SIGKILLed at seeded random points while learners train: no
    contribution is lost or applied twice, and a fresh restore (from checkpoints, or
    from the ledger alone) reproduces the published value and every checkpoint."""
    import sys

    sys.path.insert(0, str(REPO / "scripts"))
    import bench_faults

    out = bench_faults.main(["--rate", "0", "--kills", "3",
                             "--learners", "2", "--fragments", "2", "--workdir", str(tmp_path / "run")])
    assert out["syncer_kills"] == 3 and out["verify_exit_code"] == 0, out
    assert out["unmerged_after_drain"] == 0, out
    assert out["lost_contributions"] == 0 and out["contribution_objects"] == out["ledger_entries"] > 0, out
    assert out["double_applied"] == 0 and out["quarantined"] == 0, out
    assert out["replay_restore_mismatches"] == 0 and out["replay_published_mismatches"] == 0, out
    assert out["replay_strict_replay_failures"] == 0, out
    assert out["checkpoints_replayed"] > 0 and out["checkpoint_mismatches"] == 0, out
