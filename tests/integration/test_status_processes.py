"""`ddiloco status` as a real process: `--watch` into a pipe, and `--check` against a
syncer killed with SIGKILL. The in-process status tests are in tests/unit/test_status.py."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from ddiloco_cli.ops.observe import run_status
from ddiloco_cli.store import open_store

from support.built_run import BuiltRun, build_run, invoke
from support.procs import Procs, wait_for


@pytest.fixture
def built(tmp_path) -> BuiltRun:
    return build_run(str(tmp_path / "run"), rounds=2)


def test_watch_piped_from_the_cli_prints_lines(built):
    """`status --watch` with stdout not a terminal (a pipe): plain lines, no redraw codes."""
    proc = subprocess.Popen([sys.executable, "-m", "ddiloco_cli", "status", built.url, "--watch", "--interval", "0.2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines = [proc.stdout.readline() for _ in range(2)]
    finally:
        proc.kill()
        proc.wait()
    assert all(line.endswith("\n") and "run " in line and "\x1b" not in line for line in lines), lines


@pytest.mark.slow
def test_status_check_fails_when_the_syncer_is_killed(tmp_path):
    """Real processes: `status --check` passes while a syncer serves, and fails within
    a lease after the syncer is killed with SIGKILL."""
    url = str(tmp_path / "run")
    procs = Procs(tmp_path)
    try:
        result = invoke("init", url, "--fragments", "2", "--sync-every", "4", "--overlap-steps", "1",
                        "--lease", "2", "--heartbeat", "0.5")  # in this process: no process start
        assert result.exit_code == 0, result.output
        assert procs.run("status", url, "--check").returncode == 1  # no syncer yet
        syncer = procs.start("syncer", "sync", url, "--poll", "0.05")
        # the waits read the status in this process (a `status` process per poll spent most of this
        # test starting Python and torch); each state, once seen, is then checked through the CLI
        store = open_store(url)
        wait_for(lambda: not run_status(store)["alerts"], timeout_s=60, what="no alerts with a live syncer",
                 procs=procs)
        wait_for(lambda: procs.run("status", url, "--check").returncode == 0, timeout_s=60,
                 what="status --check to pass with a live syncer", procs=procs)
        syncer.send_signal(signal.SIGKILL)
        syncer.wait()
        wait_for(lambda: run_status(store)["alerts"], timeout_s=60, what="an alert after the syncer died", procs=procs)
        result = procs.run("status", url, "--check")
        assert result.returncode == 1 and "alert: no syncer alive" in result.stderr, result.stderr
        assert "Traceback" not in result.stderr
    finally:
        procs.close()
