"""The DiLoCoSync examples run against a local bucket with a real syncer process:
the plain PyTorch loop and the Hugging Face Trainer callback."""

from __future__ import annotations

import subprocess
import sys

import pytest

from support import REPO
from support.built_run import invoke
from support.procs import Procs, all_manifests, terminate

pytestmark = pytest.mark.slow

EXAMPLES = REPO / "examples"
RUN = ["-P", "2", "-H", "4", "--overlap-steps", "1", "--codec", "int8", "--total-steps", "0", "--lease", "3",
       "--heartbeat", "0.5"]


def _run_example(tmp_path, task: str, script: str, learner_id: str, steps: int) -> None:
    url = str(tmp_path / "bucket")
    procs = Procs(tmp_path)
    try:
        r = invoke("init", url, "--task", task, *RUN)  # in this process: no process start
        assert r.exit_code == 0, r.output
        syncer = procs.start("syncer", "sync", url, "--poll", "0.1")
        out = subprocess.run([sys.executable, str(EXAMPLES / script), url, "--learner-id", learner_id, "--steps", str(steps),
                              *(["--output-dir", str(tmp_path / "out")] if "hf_" in script else [])],
                             env=procs.env, capture_output=True, text=True, timeout=240)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        assert f"done: steps at step {steps}" in out.stdout
        assert terminate(syncer) == 0, procs.log("syncer")
        used = [c for ms in all_manifests(url).values() for m in ms for c in m["contributions"]
                if c["learner_id"] == learner_id and c["used"]]
        assert len(used) >= 2, "the example's contributions were not merged"
    finally:
        procs.close()


def test_own_loop_example(tmp_path):
    _run_example(tmp_path, "ddiloco_cli.tasks.gpt:tiny", "own_loop.py", "own", 24)


def test_hf_trainer_example(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    _run_example(tmp_path, f"{EXAMPLES / 'hf_trainer.py'}:task", "hf_trainer.py", "hf", 24)
