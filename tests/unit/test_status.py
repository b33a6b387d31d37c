"""`ddiloco status`: fragments, learners (alive by store-clock heartbeat age), syncers,
goodput and bytes; the Rich views render. (`status --watch` into a pipe and `--check`
against a killed syncer, as real processes: tests/integration/test_status_processes.py.)"""

from __future__ import annotations

import io
import json
import os
import time

import pytest
from rich.console import Console

from ddiloco_cli.cli.render import render_inspect, render_status, watch_status
from ddiloco_cli.errors import StoreAccessError
from ddiloco_cli.ops.observe import PILE_UP, bytes_moved, goodput, run_status
from ddiloco_cli.protocol import layout

from support.built_run import LEARNER, build_run, copy_run, invoke, write_contribution, write_learner_heartbeat

LEARNER_KEYS = {"learner_id", "alive", "state", "step", "tokens", "tokens_per_s", "loss", "last_contribution_age_s",
                "bytes_up", "bytes_down", "blocked_s"}
SYNCER_KEYS = {"epoch", "syncer_id", "alive", "state", "fragments", "heartbeat_age_s", "lag_versions", "backlog"}
FRAGMENT_KEYS = {"fragment", "version", "quorum_size", "epoch", "age_s"}


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    return build_run(str(tmp_path_factory.mktemp("template") / "run"), rounds=2)


@pytest.fixture
def built(template, tmp_path):
    """A copy of the template whose heartbeats are fresh: alive by the store clock however
    long ago the template was built."""
    run = copy_run(template, str(tmp_path / "run"))
    for key in (layout.learner_heartbeat_key(LEARNER), layout.syncer_heartbeat_key(template.syncer.epoch.epoch)):
        age_object(run.url, key, 0)
    return run


def age_object(root: str, key: str, seconds: float) -> None:
    """Make an object look ``seconds`` old to the (local) store clock."""
    t = time.time() - seconds
    os.utime(os.path.join(root, key), (t, t))


def test_status_json_has_required_keys(built):
    result = invoke("status", built.url, "--json")
    assert result.exit_code == 0, result.output
    status = json.loads(result.output)
    assert [f["fragment"] for f in status["fragments"]] == [0, 1]
    for f in status["fragments"]:
        assert FRAGMENT_KEYS <= set(f)
        assert (f["version"], f["quorum_size"], f["epoch"]) == (2, 1, built.syncer.epoch.epoch)
    (learner,) = status["learners"]
    assert LEARNER_KEYS <= set(learner)
    assert learner["learner_id"] == LEARNER and learner["alive"] and learner["tokens_per_s"] == 64 / 0.5
    assert learner["last_contribution_age_s"] is not None
    (syncer,) = status["syncers"]
    assert SYNCER_KEYS <= set(syncer)
    assert syncer["alive"] and syncer["fragments"] == [0, 1] and syncer["lag_versions"] == 0
    assert {"goodput", "tokens", "possible_tokens"} <= set(status["goodput"])
    assert status["bytes"]["data_parallel_bytes"] == 8 * status["num_params"] * 10


def test_alive_follows_heartbeat_age_and_state(built):
    lease_s = built.run["lease_s"]
    write_learner_heartbeat(built.store, built.run, "bob", state="left")
    write_learner_heartbeat(built.store, built.run, "carol")
    age_object(built.url, layout.learner_heartbeat_key("carol"), lease_s + 5)
    age_object(built.url, layout.syncer_heartbeat_key(built.syncer.epoch.epoch), lease_s + 5)
    status = run_status(built.store)
    alive = {r["learner_id"]: r["alive"] for r in status["learners"]}
    assert alive == {LEARNER: True, "bob": False, "carol": False}
    (syncer,) = status["syncers"]
    assert not syncer["alive"] and syncer["heartbeat_age_s"] > lease_s
    # one state column: what each is doing, or why it is not alive
    rows = {line.split()[0]: line.split()[1:3] for line in _text(render_status(status)).splitlines()
            if line.strip() and line.split()[0] in (LEARNER, "bob", "carol")}
    assert rows == {LEARNER: ["●", "running"], "bob": ["○", "left"], "carol": ["○", "down"]}, rows
    header = next(line for line in _text(render_status(status)).splitlines() if line.split()[:2] == ["learner", "state"])
    assert header.split().count("state") == 1


def test_pending_contributions_show_as_backlog(built):
    write_contribution(built.store, built.run, built.plan, fragment=1, seq=50, base_version=2)
    write_contribution(built.store, built.run, built.plan, fragment=1, seq=51, base_version=2, learner_id="bob")
    status = run_status(built.store)
    assert [f["pending"] for f in status["fragments"]] == [0, 2]
    assert status["syncers"][0]["backlog"] == 2


def test_status_without_a_run_is_a_clean_error(tmp_path):
    result = invoke("status", str(tmp_path / "nothing"))
    assert result.exit_code == 3
    assert "error: no ddiloco run" in result.output


def test_goodput_definition():
    learners = [
        # ran the whole 100 s at 10 tok/s
        {"tokens": 1000, "tokens_per_s": 10.0, "state": "running", "heartbeat_age_s": 1.0},
        # died 50 s ago (still "running", stale): could have done 2000, did 1000
        {"tokens": 1000, "tokens_per_s": 20.0, "state": "running", "heartbeat_age_s": 50.0},
        # finished on purpose 60 s ago after 40 s of work at 5 tok/s: its window ends then
        {"tokens": 200, "tokens_per_s": 5.0, "state": "finished", "heartbeat_age_s": 60.0},
        {"tokens": 7, "tokens_per_s": None, "state": "running", "heartbeat_age_s": 0.0},
    ]
    g = goodput(learners, run_age_s=100.0)
    assert g["possible_tokens"] == 1000 + 2000 + 200
    assert g["tokens"] == 2200 and g["num_unrated"] == 1
    assert g["goodput"] == pytest.approx(2200 / 3200)
    assert goodput([], run_age_s=5.0)["goodput"] is None


def test_bytes_against_data_parallel():
    learners = [{"bytes_up": 100, "bytes_down": 300, "step": 10}, {"bytes_up": 50, "bytes_down": 50, "step": 30}]
    b = bytes_moved(learners, num_params=1000)
    assert b["bytes_total"] == 500
    assert b["data_parallel_bytes"] == 2 * 4 * 1000 * 40
    assert b["reduction"] == pytest.approx(320000 / 500)


def _text(renderable) -> str:
    console = Console(file=io.StringIO(), width=160, color_system=None)
    console.print(renderable)
    return console.file.getvalue()


def test_render_status_and_inspect(built):
    from ddiloco_cli.ops.observe import inspect_run

    status = run_status(built.store)
    text = _text(render_status(status))
    assert LEARNER in text and "test-syncer" in text and "goodput" in text
    many = dict(status, fragments=[dict(status["fragments"][0], fragment=p, version=p) for p in range(40)])
    compact = _text(render_status(many))
    assert "40: versions 0..39" in compact and "stalest" in compact
    text = _text(render_inspect(inspect_run(built.store)))
    for section in ("run", "fragments", "epochs", "objects", "learner heartbeats"):
        assert section in text
    result = invoke("status", built.url)
    assert result.exit_code == 0 and LEARNER in result.output


def flaky_fetch(built):
    """A status fetch that fails once (bucket unreachable), then is interrupted (Ctrl-C)
    on its 4th call; returns (fetch, calls)."""
    calls = []

    def fetch():
        calls.append(1)
        if len(calls) == 2:
            raise StoreAccessError("bucket unreachable")
        if len(calls) == 4:
            raise KeyboardInterrupt
        return run_status(built.store)

    return fetch, calls


def test_watch_status_redraws_until_ctrl_c(built):
    fetch, calls = flaky_fetch(built)

    console = Console(file=io.StringIO(), width=160, color_system=None, force_terminal=True)
    watch_status(console, fetch, interval_s=0.0, live=True)
    assert len(calls) == 4
    out = console.file.getvalue()
    assert "bucket unreachable" in out and LEARNER in out


def test_watch_off_a_terminal_prints_one_plain_line_per_refresh(built):
    fetch, calls = flaky_fetch(built)

    console = Console(file=io.StringIO(), width=80, color_system=None)
    watch_status(console, fetch, interval_s=0.0, live=False)
    lines = console.file.getvalue().splitlines()
    assert len(lines) == 3 and "\x1b" not in "".join(lines)
    assert "run " in lines[0] and "learners 1/1 alive" in lines[0] and "bucket unreachable" in lines[1]


# ------------------------------------------------------ what a person wants to see
def test_versions_behind_eta_throughput_and_training_window(built):
    now = time.time()
    # bob holds fragment 0 at version 0 and fragment 1 at version 2 (the newest is 2): 2 behind;
    # his session started 100 s ago by his own clock, which runs 1000 s fast
    write_learner_heartbeat(built.store, built.run, "bob", step=40, versions={"0": 0, "1": 2},
                            started_s=now + 1000 - 100, time_s=now + 1000)
    age_object(built.url, layout.RUN_CONFIG, 5000)  # the run was created long before anyone trained
    bob_written_s = os.stat(os.path.join(built.url, layout.learner_heartbeat_key("bob"))).st_mtime
    status = run_status(built.store)
    bob = next(r for r in status["learners"] if r["learner_id"] == "bob")
    alice = next(r for r in status["learners"] if r["learner_id"] == LEARNER)
    assert bob["versions_behind"] == 2 and alice["versions_behind"] is None  # alice reports no versions
    total = built.run["inner"]["total_steps"]
    assert bob["eta_s"] == pytest.approx((total - 40) * 0.5)
    assert status["throughput"]["tokens_per_s"] == pytest.approx(2 * 64 / 0.5)
    assert status["throughput"]["eta_s"] == pytest.approx((total - 10) * 0.5)  # the slowest: alice, at step 10
    # from bob's start (100 s before his heartbeat was stored, by the store clock), not from init; exact
    # however long a loaded machine took between the write and the status
    assert status["training_age_s"] == pytest.approx(status["now_s"] - (bob_written_s - 100))
    assert status["run_age_s"] >= 5000
    rates = sum(r["tokens_per_s"] for r in status["learners"])
    assert status["goodput"]["possible_tokens"] == pytest.approx(rates * status["training_age_s"], rel=0.01)
    text = _text(render_status(status))
    assert "throughput" in text and "ETA" in text and "behind" in text


def test_learners_table_has_one_state_column(built):
    """Issue 26 item 3: no empty-headed column repeating the state (`○ left   left`)."""
    write_learner_heartbeat(built.store, built.run, "carol", state="left")
    text = _text(render_status(run_status(built.store)))
    carol = next(line for line in text.splitlines() if line.lstrip().startswith("carol"))
    assert "○ left" in carol and carol.count("left") == 1, carol
    header = next(line for line in text.splitlines() if "learner" in line and "step" in line)
    assert header.split()[:3] == ["learner", "state", "step"], header


def test_alerts_no_syncer_and_piling_up(built):
    assert run_status(built.store)["alerts"] == []
    for seq in range(50, 50 + PILE_UP):
        write_contribution(built.store, built.run, built.plan, fragment=1, seq=seq, base_version=2)
    (alert,) = run_status(built.store)["alerts"]
    assert "piling up on fragments 1" in alert and f"up to {PILE_UP} pending" in alert
    age_object(built.url, layout.syncer_heartbeat_key(built.syncer.epoch.epoch), built.run["lease_s"] + 5)
    alerts = run_status(built.store)["alerts"]
    assert len(alerts) == 2 and alerts[0].startswith("no syncer alive")
    assert "ALERT: no syncer alive" in _text(render_status(run_status(built.store)))


def test_status_check_exit_code(built):
    result = invoke("status", built.url, "--check")
    assert result.exit_code == 0 and "ALERT" not in result.output and result.output.count("\n") == 1
    age_object(built.url, layout.syncer_heartbeat_key(built.syncer.epoch.epoch), built.run["lease_s"] + 5)
    result = invoke("status", built.url, "--check")
    assert result.exit_code == 1 and "alert: no syncer alive" in result.output


def test_send_to_receive_lag_shows_per_learner_and_a_median_over_tau_is_noted(built):
    """Issue 24 (latency control): a learner reports the median and p95 of its send -> receive
    lags in steps; `status` shows them and notes a live learner whose median is over tau."""
    tau = built.run["overlap_steps"]
    write_learner_heartbeat(built.store, built.run, "quick", lag_p50=tau, lag_p95=tau + 1)
    write_learner_heartbeat(built.store, built.run, "late", lag_p50=tau + 7, lag_p95=tau + 12)
    write_learner_heartbeat(built.store, built.run, "gone", state="left", lag_p50=tau + 9, lag_p95=tau + 9)
    status = run_status(built.store)
    rows = {r["learner_id"]: r for r in status["learners"]}
    assert (rows["quick"]["lag_p50"], rows["quick"]["lag_p95"]) == (tau, tau + 1)
    assert rows[LEARNER]["lag_p50"] is None  # an older learner's heartbeat has no lag fields
    (note,) = status["notes"]  # not "quick" (within tau), not "gone" (not live)
    assert note.startswith("learner late: versions come back a median") and f"tau = {tau}" in note
    assert status["alerts"] == []  # a tuning note, not a page
    text = _text(render_status(status))
    assert f"{tau + 7}/{tau + 12}" in text and "warning: learner late" in text


def test_a_learner_blocked_on_the_bucket_is_noted_with_what_to_change(built):
    """A live learner blocked on the bucket more than BLOCKED_NOTE of its time (steps x step
    time, here 10 x 0.5 s) gets a note naming the remedies; one under it, or gone, does not."""
    write_learner_heartbeat(built.store, built.run, "thin", blocked_s=2.0)  # 40% of 5 s
    write_learner_heartbeat(built.store, built.run, "fine", blocked_s=0.4)  # 8%
    write_learner_heartbeat(built.store, built.run, "gone", state="left", blocked_s=4.0)
    status = run_status(built.store)
    (note,) = status["notes"]
    assert note.startswith("learner thin: blocked on the bucket 40% of its time (2 s over 10 steps)")
    assert "--codec sparse" in note and "sync --fragments" in note
    assert status["alerts"] == []
    assert "warning: learner thin: blocked" in _text(render_status(status))


def test_held_versions_and_given_up_uploads_are_noted(built):
    """A live learner for which most receives were held versions ([L8]: its merges do not come
    back within a cycle) gets a note naming held_alpha and the remedies; a few receives, a
    minority of held ones, or a learner that left do not. A learner that gave contributions up
    is noted whether or not it is alive: that work reached no ledger; so is one whose
    contributions a ledger refused, with the newest reason."""
    write_learner_heartbeat(built.store, built.run, "late", receives=40, held_receives=36)
    write_learner_heartbeat(built.store, built.run, "early", receives=4, held_receives=4)
    write_learner_heartbeat(built.store, built.run, "fine", receives=40, held_receives=3)
    write_learner_heartbeat(built.store, built.run, "gone", state="left", receives=40, held_receives=40,
                            uploads_failed=2)
    write_learner_heartbeat(built.store, built.run, "old", refused=3, last_refusal="fragment 2 seq 9: arrived late")
    status = run_status(built.store)
    held, failed, refused = status["notes"]
    assert held.startswith("learner late: 36 of its 40 receives were versions without its contribution in flight")
    assert f"held_alpha = {built.run['held_alpha']:g}" in held and "sync --fragments" in held
    assert failed.startswith("learner gone: gave up 2 contribution(s) this session")
    assert refused.startswith("learner old: 3 of its contributions were refused this session (newest: fragment 2 "
                              "seq 9: arrived late)")
    assert status["alerts"] == []
    rows = {r["learner_id"]: r for r in status["learners"]}
    assert (rows["fine"]["receives"], rows["fine"]["held_receives"], rows["fine"]["uploads_failed"]) == (40, 3, None)
