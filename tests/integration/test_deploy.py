"""Deployment examples: SkyPilot task YAMLs (parsed by SkyPilot itself, their run scripts
executed against a local bucket), the Dockerfile and the plain-VM cloud-init unit."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import signal
import stat
import subprocess
import sys

import pytest
import tomllib
import yaml

from ddiloco_cli.ops import metrics
from ddiloco_cli.store import open_store

from support import REPO
from support.procs import learner_heartbeat, wait_for

ROOT = str(REPO)
SKY_DIR = os.path.join(ROOT, "examples", "skypilot")
YAMLS = sorted(f for f in os.listdir(SKY_DIR) if f.endswith(".yaml"))
# top-level keys of a SkyPilot task (sky/utils/schemas.py get_task_schema), for machines without skypilot
SKY_TASK_KEYS = {"name", "workdir", "event_callback", "num_nodes", "resources", "file_mounts", "service", "pool",
                 "setup", "run", "envs", "secrets", "volumes", "config", "inputs", "outputs"}


def _load(name: str) -> dict:
    with open(os.path.join(SKY_DIR, name)) as f:
        return yaml.safe_load(f)


def test_both_tasks_are_present():
    assert YAMLS == ["learner.yaml", "syncer.yaml"]


@pytest.mark.parametrize("name", YAMLS)
def test_yaml_shape(name):
    cfg = _load(name)
    assert set(cfg) <= SKY_TASK_KEYS, set(cfg) - SKY_TASK_KEYS
    assert cfg["envs"]["DDILOCO_URL"] is None, "the bucket must be required (SkyPilot refuses a null env)"
    assert "ddiloco " in cfg["run"] and "$DDILOCO_URL" in cfg["run"]


@pytest.mark.parametrize("name", YAMLS)
def test_skypilot_parses_the_yaml(name, monkeypatch):
    sky = pytest.importorskip("sky")
    monkeypatch.chdir(ROOT)  # workdir: . is the repository
    task = sky.Task.from_yaml_config(_load(name), env_overrides=[("DDILOCO_URL", "s3://my-bucket/runs/exp1")])
    assert task.envs["DDILOCO_URL"] == "s3://my-bucket/runs/exp1"
    resources = list(task.resources)
    if name == "learner.yaml":
        assert len(resources) > 1, "any of several GPU types"
        for r in resources:
            assert r.use_spot and r.accelerators and r.cloud is None, r  # spot, GPU, any cloud
            assert r.job_recovery["strategy"] == "FAILOVER"
    else:
        (r,) = resources
        assert not r.use_spot and not r.accelerators and r.job_recovery["max_restarts_on_errors"] > 0


def _shim_path(tmp_path) -> str:
    """A PATH whose `ddiloco` runs this checkout's package with this interpreter."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "ddiloco"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m ddiloco_cli "$@"\n')
    shim.chmod(shim.stat().st_mode | stat.S_IEXEC)
    return f"{bin_dir}{os.pathsep}{os.environ['PATH']}"


@pytest.mark.slow
def test_yaml_run_scripts_train_against_a_local_bucket_and_rejoin_under_the_same_id(tmp_path):
    """The syncer's and the learner's `run` scripts, with the envs SkyPilot would set,
    train a run; a second learner launch with the same SKYPILOT_TASK_ID (a recovery)
    rejoins under the same learner id. Both write metrics; plot and export read them."""
    bucket = str(tmp_path / "bucket")
    env = {**os.environ, "PATH": _shim_path(tmp_path), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    subprocess.run(["ddiloco", "init", bucket, "-P", "2", "-H", "4", "--overlap-steps", "1", "--total-steps", "0",
                    "--heartbeat", "0.5", "--lease", "3"], env=env, check=True, capture_output=True)
    syncer_cfg, learner_cfg = _load("syncer.yaml"), _load("learner.yaml")
    task_id = "sky-managed-2026-12-01-00-00-00-000001_ddiloco-learner-7_7-0"
    sky_env = {"SKYPILOT_TASK_ID": task_id, "SKYPILOT_MANAGED_JOB_ID": "7"}
    syncer_env = {**env, **{k: str(v) for k, v in syncer_cfg["envs"].items() if v is not None},
                  "DDILOCO_URL": bucket, "EVAL_EVERY": "2", "SYNC_ARGS": "--poll 0.05"}
    learner_env = {**env, **sky_env, **{k: str(v) for k, v in learner_cfg["envs"].items() if v is not None},
                   "DDILOCO_URL": bucket, "DEVICE": "cpu", "LEARN_ARGS": "--steps 24 --threads 1"}
    learner_id = "spot-" + hashlib.sha256(task_id.encode()).hexdigest()[:12]

    with open(tmp_path / "syncer.log", "wb") as log:
        syncer = subprocess.Popen(["bash", "-c", syncer_cfg["run"]], env=syncer_env, stdout=log, stderr=subprocess.STDOUT)
    try:
        for session in (1, 2):
            done = subprocess.run(["bash", "-c", learner_cfg["run"]], env=learner_env, capture_output=True, text=True,
                                  timeout=240)
            assert done.returncode == 0, done.stdout + done.stderr
            assert f"ddiloco learner id: {learner_id}" in done.stdout
            beat = learner_heartbeat(bucket, learner_id)
            assert beat is not None and beat["step"] == 24 * session, beat
        store = open_store(bucket)
        wait_for(lambda: any("global_val_loss" in r.fields for r in metrics.read_metrics(store, role="syncer")),
                 timeout_s=120, what="the syncer's background evaluation in its metrics")
    finally:
        syncer.send_signal(signal.SIGTERM)  # `exec` made the syncer the script's process
        syncer.wait(timeout=60)
    assert syncer.returncode == 0, (tmp_path / "syncer.log").read_text()[-3000:]

    learner_records = metrics.read_metrics(store, role="learner")
    assert {r.writer_id for r in learner_records} == {learner_id}
    assert [r.step for r in learner_records] == list(range(10, 25, 10)) + list(range(30, 49, 10))
    assert [r.step for r in learner_records if r.fields.get("event") == "start"] == [10, 30], "one start per session"
    assert all(r.fields["loss"] > 0 and r.fields["bytes_up"] > 0 for r in learner_records)

    plot = subprocess.run(["ddiloco", "plot", bucket, str(tmp_path / "out" / "loss.png")], env=env,
                          capture_output=True, text=True)
    assert plot.returncode == 0, plot.stderr
    assert re.search(r"1 learner\(s\), [1-9]\d* global val points", plot.stderr), plot.stderr
    with open(tmp_path / "out" / "loss.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    csv_out = subprocess.run(["ddiloco", "metrics", bucket, "--csv", str(tmp_path / "m.csv")], env=env,
                             capture_output=True, text=True)
    assert csv_out.returncode == 0, csv_out.stderr
    header = (tmp_path / "m.csv").read_text().splitlines()[0].split(",")
    for column in ("loss", "tokens_per_s", "step_time_s", "blocked_s", "bytes_up", "versions_behind", "merges",
                   "quorum_max", "grace_s", "quarantined", "global_val_loss"):
        assert column in header, column


def test_dockerfile_variants_and_entrypoint():
    text = open(os.path.join(ROOT, "Dockerfile")).read()
    assert re.search(r"^ARG VARIANT=cpu$", text, re.M)
    assert 'ENTRYPOINT ["ddiloco"]' in text
    cpu = re.search(r"cpu\)\s+pip install \"torch==\$\{TORCH_VERSION\}\" --index-url https://download.pytorch.org/whl/cpu", text)
    assert cpu and re.search(r"^ARG TORCH_VERSION=2\.13\.0$", text, re.M), "CPU variant installs torch first, from the CPU index"
    assert text.index("torch==") < text.index('pip install ".['), "torch before ddiloco"
    extras = set(re.search(r"^ARG EXTRAS=(\S+)$", text, re.M).group(1).split(","))
    assert {"hf", "yaml"} <= extras, "export --hf-dir and --config x.yaml work in the image"
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        assert extras <= set(tomllib.load(f)["project"]["optional-dependencies"]), extras
    assert "DDILOCO_KEY=" in text and "-o 1000" in text, "the key mount for the non-root user is documented"
    assert "setup.py" in re.search(r"^COPY (.+) \./$", text, re.M).group(1), "the compiled kernels' build"
    for src in re.findall(r"^COPY (.+) \./", text, re.M):
        for path in src.split():
            assert os.path.exists(os.path.join(ROOT, path)), path


def test_cloud_init_unit_is_valid_systemd(tmp_path):
    path = os.path.join(ROOT, "examples", "vm", "cloud-init.yaml")
    with open(path) as f:
        first = f.readline()
        cfg = yaml.safe_load(first + f.read())
    assert first.strip() == "#cloud-config"
    files = {f["path"]: f["content"] for f in cfg["write_files"]}
    unit = files["/etc/systemd/system/ddiloco-learner.service"]
    assert "Restart=on-failure" in unit and "StartLimitIntervalSec=0" in unit and "EnvironmentFile=/etc/ddiloco/env" in unit
    assert "DDILOCO_URL=" in files["/etc/ddiloco/env"]
    assert any("systemctl enable --now ddiloco-learner.service" in c for c in cfg["runcmd"])
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed")
    unit_path = tmp_path / "ddiloco-learner.service"
    unit_path.write_text(unit)
    result = subprocess.run(["systemd-analyze", "verify", str(unit_path)], capture_output=True, text=True)
    complaints = [line for line in result.stderr.splitlines() if unit_path.name in line]
    assert result.returncode == 0 and not complaints, result.stderr


def _signed_run(url: str, env: dict, tmp_path) -> str:
    """A signed run at ``url`` (s3 on moto) made through the CLI; returns the admin key path."""
    admin = str(tmp_path / "admin.pem")
    subprocess.run(["ddiloco", "init", url, "--task", "ddiloco_cli.tasks.gpt:tiny", "-P", "2", "-H", "4",
                    "--overlap-steps", "1", "--total-steps", "0", "--admin-key", admin], env=env, check=True,
                   capture_output=True)
    return admin


def _wait_for_line(proc: subprocess.Popen, log_path, pattern: str, timeout_s: float = 180) -> re.Match:
    found: list[re.Match] = []

    def seen() -> bool:
        m = re.search(pattern, log_path.read_text())
        if m:
            found.append(m)
        return bool(m) or proc.poll() is not None

    wait_for(seen, timeout_s=timeout_s, what=pattern)
    assert found, log_path.read_text()[-3000:]
    return found[0]


@pytest.mark.slow
@pytest.mark.s3
def test_deployments_start_admitted_learners_in_a_signed_run(tmp_path, s3_url):
    """Issue 26 item 4: in a signed run on S3 (moto), the commands the SkyPilot learner task
    and the cloud-init unit run start learners that are admitted: with a key given as a
    secret / credential, and (SkyPilot) without one: the learner makes its key, prints the
    admit command and waits until the admin runs it (`admit --from-file`)."""
    url, base_env = s3_url
    env = {**base_env, "PATH": _shim_path(tmp_path), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "HOME": str(tmp_path / "home")}
    admin = _signed_run(url, env, tmp_path)
    subprocess.run(["ddiloco", "keys", "new", str(tmp_path / "a1.pem")], env=env, check=True, capture_output=True)
    subprocess.run(["ddiloco", "admit", url, "a1", (tmp_path / "a1.pem.pub").read_text().strip(), "--admin-key",
                    admin], env=env, check=True, capture_output=True)
    learn_args = "--steps 2 --threads 1 --poll 0.1"

    # SkyPilot, the key as a secret
    cfg = _load("learner.yaml")
    assert "DDILOCO_KEY_PEM" in cfg["secrets"]
    sky_env = {**env, **{k: str(v) for k, v in cfg["envs"].items() if v is not None}, "DDILOCO_URL": url,
               "DEVICE": "cpu", "LEARN_ARGS": learn_args, "SKYPILOT_TASK_ID": "sky-managed-1_ddiloco-learner-1_1-0"}
    done = subprocess.run(["bash", "-c", cfg["run"]], env={**sky_env, "LEARNER_ID": "a1",
                          "DDILOCO_KEY_PEM": (tmp_path / "a1.pem").read_text()},
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    assert learner_heartbeat(url, "a1")["step"] == 2

    # SkyPilot, no key: the learner makes one and waits for its admission
    log_path = tmp_path / "sky-nokey.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(["bash", "-c", cfg["run"]], env={**sky_env, "HOME": str(tmp_path / "home2")},
                                stdout=log, stderr=subprocess.STDOUT)
    try:
        m = _wait_for_line(proc, log_path, r"learner (\S+) public key ([0-9a-f]{64}): waiting for the run's admin")
        assert proc.poll() is None, log_path.read_text()
        (tmp_path / "fleet.txt").write_text(f"# the fleet\n{m.group(1)} {m.group(2)}\n")
        subprocess.run(["ddiloco", "admit", url, "--from-file", str(tmp_path / "fleet.txt"), "--admin-key", admin],
                       env=env, check=True, capture_output=True)
        assert proc.wait(timeout=240) == 0, log_path.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert learner_heartbeat(url, m.group(1))["step"] == 2

    # cloud-init: the unit's ExecStart with the env file and the credential systemd would provide
    with open(os.path.join(ROOT, "examples", "vm", "cloud-init.yaml")) as f:
        files = {x["path"]: x["content"] for x in yaml.safe_load(f)["write_files"]}
    unit = files["/etc/systemd/system/ddiloco-learner.service"]
    assert "RestartPreventExitStatus=2 3" in unit and "LoadCredential=learner-key:/etc/ddiloco/learner.pem" in unit
    exec_start = re.search(r"^ExecStart=/bin/sh -c '(.*)'$", unit, re.M).group(1)
    exec_start = exec_start.replace("/opt/ddiloco/venv/bin/ddiloco", "ddiloco")
    creds = tmp_path / "creds"
    creds.mkdir()
    (creds / "learner-key").write_bytes((tmp_path / "a1.pem").read_bytes())
    (creds / "learner-key").chmod(0o400)
    vm_env = {**env, "DDILOCO_URL": url, "DEVICE": "cpu", "LEARNER_ID": "a1", "LEARN_ARGS": learn_args,
              "CREDENTIALS_DIRECTORY": str(creds), "STATE_DIRECTORY": str(tmp_path / "state")}
    done = subprocess.run(["/bin/sh", "-c", exec_start], env=vm_env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    assert learner_heartbeat(url, "a1")["step"] == 4  # the same id, continued
