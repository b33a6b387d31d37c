"""Learner sessions as real processes: one live session per learner id (a second
is refused, a zombie that wakes up after a takeover stops), and the warning a
learner logs when no new version arrives because the syncer died."""

from __future__ import annotations

import re
import signal
import socket

import pytest

from ddiloco_cli.learner.session import read_heartbeat
from ddiloco_cli.ops.observe import run_status
from ddiloco_cli.store import open_store

from support.built_run import invoke
from support.procs import Procs, learner_heartbeat, terminate, versions, wait_for

pytestmark = pytest.mark.slow

H = 4
INIT = ["--task", "ddiloco_cli.tasks.gpt:tiny", "-P", "2", "-H", str(H), "--overlap-steps", "1", "--codec", "int8",
        "--total-steps", "0", "--warmup-steps", "0", "--batch-size", "4", "--lease", "2", "--heartbeat", "0.4"]
LEARN = ["--threads", "1", "--poll", "0.1"]


def _init(procs: Procs, url: str) -> None:
    r = invoke("init", url, *INIT)  # in this process: no process start
    assert r.exit_code == 0, r.output


def _first_session_training(procs: Procs, url: str):
    """Init the run, start learner a's first session and wait until it has trained 2 steps."""
    _init(procs, url)
    first = procs.start("first", "learn", url, "--learner-id", "a", *LEARN)
    wait_for(lambda: (learner_heartbeat(url, "a") or {}).get("step", 0) >= 2, timeout_s=120,
             what="the first session training", procs=procs)
    return first


def test_second_live_session_is_refused_and_a_woken_zombie_stops(tmp_path):
    url = str(tmp_path / "bucket")
    procs = Procs(tmp_path)
    store = open_store(url)
    try:
        first = _first_session_training(procs, url)

        twin = procs.run("learn", url, "--learner-id", "a", *LEARN)
        assert twin.returncode != 0
        message = twin.stdout + twin.stderr
        assert "learner id 'a' is live" in message and socket.gethostname() in message, message
        assert re.search(r"last heartbeat \d+\.\d+s ago", message), message
        assert first.poll() is None, "the refused twin must not disturb the live session"

        # a stopped (not dead) session loses the id once its heartbeat is past the lease
        first.send_signal(signal.SIGSTOP)
        wait_for(lambda: read_heartbeat(store, "a").age_s > 2.5, timeout_s=60, what="the lease to lapse")
        second = procs.start("second", "learn", url, "--learner-id", "a", *LEARN)
        first_session = learner_heartbeat(url, "a")["session"]
        wait_for(lambda: learner_heartbeat(url, "a")["session"] != first_session, timeout_s=120,
                 what="the second session's heartbeat", procs=procs)
        first.send_signal(signal.SIGCONT)
        assert first.wait(timeout=60) == 0
        assert "was taken over by a newer session" in procs.log("first")
        hb = learner_heartbeat(url, "a")
        assert hb["session"] != first_session and hb["state"] == "running", "the zombie overwrote the heartbeat"
        assert second.poll() is None
        assert terminate(second) == 0
    finally:
        procs.close()


def test_learner_warns_within_2h_steps_when_the_syncer_dies(tmp_path):
    url = str(tmp_path / "bucket")
    procs = Procs(tmp_path)
    try:
        _init(procs, url)
        syncer = procs.start("syncer", "sync", url, "--poll", "0.1", "--no-gc")
        learner = procs.start("learner", "learn", url, "--learner-id", "a", *LEARN)
        wait_for(lambda: min(versions(url, 2)) >= 2, timeout_s=120, what="two versions of each fragment", procs=procs)
        syncer.send_signal(signal.SIGKILL)
        syncer.wait()

        pattern = re.compile(r"no new version of any fragment in (\d+) steps \(last at step (\d+), now step (\d+)\); (.*)")
        wait_for(lambda: "no syncer heartbeat is live" in procs.log("learner"), timeout_s=120,
                 what="the dead-syncer warning", procs=procs)
        alerts = [pattern.search(line) for line in procs.log("learner").splitlines()]
        alerts = [m for m in alerts if m]
        quiet, last, now, _ = alerts[0].groups()
        assert int(quiet) == 2 * H and int(now) - int(last) == 2 * H
        assert "start one with `ddiloco sync URL`" in alerts[-1].group(4)
        assert learner.poll() is None, "the learner keeps training without a syncer"
        assert terminate(learner) == 0
    finally:
        procs.close()


def test_goodput_counts_from_the_first_session_across_a_kill_and_restart(tmp_path):
    """Issue 26 item 1: a learner killed with SIGKILL and restarted carries its first session's
    start in its heartbeat (``first_started_s``), so `status` counts goodput from it: the
    time the learner was dead is lost goodput, not forgotten."""
    url = str(tmp_path / "bucket")
    procs = Procs(tmp_path)
    store = open_store(url)
    try:
        first = _first_session_training(procs, url)
        first.send_signal(signal.SIGKILL)
        first.wait()
        hb1 = learner_heartbeat(url, "a")
        assert hb1["first_started_s"] == hb1["started_s"]  # a first session starts its own count

        second = procs.start("second", "learn", url, "--learner-id", "a", *LEARN)
        wait_for(lambda: (learner_heartbeat(url, "a") or {}).get("session") != hb1["session"]
                 and learner_heartbeat(url, "a")["step"] > hb1["step"], timeout_s=120,
                 what="the second session training", procs=procs)
        hb2 = learner_heartbeat(url, "a")
        assert hb2["started_s"] > hb1["time_s"]  # a new session...
        # ...that dates the id's first start to the first session's (one clock here; the carried
        # value may only be early by the moments between the second session's clock and store reads)
        assert hb1["started_s"] - 30 < hb2["first_started_s"] <= hb1["started_s"] + 0.01, (hb1, hb2)

        status = run_status(store)
        assert status["training_age_s"] >= status["now_s"] - (hb1["started_s"] + 0.01) - 1.0
        g = status["goodput"]
        assert g["goodput"] is not None and g["goodput"] < 1.0, g  # the dead time is lost goodput
        assert g["possible_tokens"] > g["tokens"] > 0
        assert terminate(second) == 0
        assert learner_heartbeat(url, "a")["first_started_s"] == hb2["first_started_s"]
    finally:
        procs.close()
