"""`ddiloco init` and `learn --wait-for-run` as real processes: a kill -9 in the middle of
writing version 0 (resumed, or removed with --force-clean), a learner that waits for the
run to appear, and the environment variables each command's --help names. The in-process
init tests are in tests/unit/test_init.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from ddiloco_cli.ops.observe import verify_run
from ddiloco_cli.protocol import layout, ledger, records
from ddiloco_cli.store import open_store

from support import SUPPORT
from support.built_run import invoke
from support.procs import Procs, wait_for

SMALL = ["--fragments", "2", "--sync-every", "4", "--overlap-steps", "1"]


@pytest.mark.slow
def test_kill_9_mid_init_then_resume_or_clean(tmp_path):
    """A real init process killed with SIGKILL after plan.json, before run.json: `sync`
    finds no run, the same init resumes it, and --force-clean starts over."""
    procs = Procs(tmp_path)
    task = f"{SUPPORT / 'wide_task.py'}:WideTask"
    args = ["--task", task, "--fragments", "8", "--sync-every", "8", "--codec", "none"]
    try:
        for attempt in range(5):  # the window is ~1 s wide; a retry only if the kill missed it
            url = str(tmp_path / f"run{attempt}")
            proc = procs.start(f"init{attempt}", "init", url, *args)
            wait_for(lambda: os.path.exists(os.path.join(url, layout.PLAN)) or proc.poll() is not None,
                     timeout_s=120, what="plan.json", procs=procs, poll_s=0.005)
            assert proc.poll() is None or ledger.run_exists(open_store(url)), procs.log(f"init{attempt}")
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            if not os.path.exists(os.path.join(url, layout.RUN_CONFIG)):
                break
        else:
            pytest.fail("init finished before every kill: WideTask is too small for this machine")

        result = procs.run("sync", url, "--max-runtime", "5")
        assert result.returncode == 3 and "no ddiloco run" in result.stderr
        result = procs.run("init", url, *args, "--lr-schedule", "constant")
        assert result.returncode == 2 and "--force-clean" in result.stderr and "Traceback" not in result.stderr
        result = procs.run("init", url, *args)
        assert result.returncode == 0, result.stderr
        assert "resuming the init of run" in result.stderr
        assert verify_run(open_store(url)) == []

        clean_url = str(tmp_path / "clean")
        proc = procs.start("init-clean", "init", clean_url, *args)
        wait_for(lambda: os.path.exists(os.path.join(clean_url, layout.PLAN)) or proc.poll() is not None,
                 timeout_s=120, what="plan.json", procs=procs, poll_s=0.005)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        result = procs.run("init", clean_url, *args, "--force-clean")
        assert result.returncode == 0, result.stderr
        assert verify_run(open_store(clean_url)) == []
    finally:
        procs.close()


@pytest.mark.slow
def test_learn_wait_for_run_starts_when_the_run_appears(tmp_path):
    url = str(tmp_path / "run")
    procs = Procs(tmp_path)
    try:
        learner = procs.start("learner", "learn", url, "--learner-id", "early", "--steps", "2",
                              "--wait-for-run", "inf")
        wait_for(lambda: "waiting for `ddiloco init`" in procs.log("learner"), timeout_s=60, what="the wait message",
                 procs=procs)
        assert learner.poll() is None
        # init in this process: done sooner than a process start, before the learner's backoff grows
        result = invoke("init", url, *SMALL)
        assert result.exit_code == 0, result.output
        assert learner.wait(timeout=120) == 0, procs.log("learner")
        hb = records.loads(open_store(url).get(layout.learner_heartbeat_key("early")), "learner_heartbeat", where="hb")
        assert hb["step"] == 2
    finally:
        procs.close()


def test_env_vars_name_the_run_and_show_in_help(tmp_path, monkeypatch):
    url = str(tmp_path / "run")
    monkeypatch.setenv("DDILOCO_URL", url)
    assert invoke("init", *SMALL).exit_code == 0
    result = invoke("status", "--json")
    assert result.exit_code == 0 and json.loads(result.output)["num_fragments"] == 2
    expected = {"init": ("DDILOCO_URL", "DDILOCO_STORAGE_OPTIONS"),
                "learn": ("DDILOCO_URL", "DDILOCO_LEARNER_ID", "DDILOCO_DEVICE", "DDILOCO_STORAGE_OPTIONS"),
                "sync": ("DDILOCO_URL", "DDILOCO_SYNCER_ID", "DDILOCO_STORAGE_OPTIONS")}
    helps = {command: subprocess.Popen([sys.executable, "-m", "ddiloco_cli", command, "--help"], stdout=subprocess.PIPE,
                                       text=True, env={**os.environ, "COLUMNS": "200"})
             for command in expected}  # started together: each spends its time importing
    for command, names in expected.items():
        text = helps[command].communicate(timeout=120)[0]
        for name in names:
            assert name in text, (command, name)
        assert "<bool>" not in text, text  # flags take no value


def _concurrent_inits(url: str, args: list[str], env: dict[str, str], n: int) -> list[subprocess.CompletedProcess]:
    procs = [subprocess.Popen([sys.executable, "-m", "ddiloco_cli", "init", url, *args], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(n)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        results.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return results


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["local", pytest.param("s3", marks=pytest.mark.s3)])
def test_six_concurrent_identical_inits_all_succeed_on_one_run(backend, tmp_path, request):
    """Issue 26 item 12: a fleet's start-up scripts all running the same `ddiloco init` at
    once: every one exits 0 on the same run (the others saying it exists with the same
    settings), the run is consistent, and an init of another config is still refused."""
    if backend == "s3":
        url, env = request.getfixturevalue("s3_url")
        from ddiloco_cli.protocol.signing import load_admin_key

        admin = str(tmp_path / "admin.pem")
        load_admin_key(admin, create=True)  # the fleet's admin key, made once
        signed = ["--admin-key", admin]
    else:
        url, env, signed = str(tmp_path / "run"), dict(os.environ), []
    args = ["--task", "ddiloco_cli.tasks.gpt:tiny", *SMALL, *signed]
    results = _concurrent_inits(url, args, env, 6)
    logs = "\n".join(f"--- rc={r.returncode}\n{r.stdout}{r.stderr}" for r in results)
    assert all(r.returncode == 0 for r in results), logs
    assert "Traceback" not in logs
    store = open_store(url)
    run_id = ledger.read_run(store)["run_id"]
    assert sum("created run" in r.stderr for r in results) >= 1, logs
    assert all(f"created run {run_id}" in r.stderr or f"run {run_id} exists at {url} with the same settings"
               in r.stderr for r in results), logs
    assert verify_run(store) == []
    other = subprocess.run([sys.executable, "-m", "ddiloco_cli", "init", url, *args, "--quorum", "2"], env=env,
                           capture_output=True, text=True, timeout=300)
    assert other.returncode == 2 and "a run already exists" in other.stderr and "--quorum" in other.stderr
    assert ledger.read_run(store)["run_id"] == run_id
