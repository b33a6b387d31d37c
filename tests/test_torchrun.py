"""One learner = one island: `torchrun --nproc_per_node 2 ... learn` runs DDP inside
the island (gloo on CPU); only rank 0 touches the bucket."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from tests.procs import Procs, learner_heartbeat, terminate, versions

pytestmark = pytest.mark.slow


@pytest.mark.skipif(shutil.which("torchrun") is None and not os.path.exists(os.path.join(os.path.dirname(sys.executable), "torchrun")),
                    reason="torchrun not installed")
def test_island_of_two_ranks_trains_and_contributes(tmp_path):
    url = str(tmp_path / "bucket")
    procs = Procs(tmp_path)
    try:
        r = procs.run("init", url, "--task", "ddiloco_cli.tasks.gpt:tiny", "-P", "2", "-H", "4", "--total-steps", "0",
                      "--lr-schedule", "constant", "--warmup-steps", "0", "--batch-size", "8", "--lease", "3",
                      "--heartbeat", "0.5")
        assert r.returncode == 0, r.stderr
        syncer = procs.start("syncer", "sync", url, "--poll", "0.1")
        torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
        out = subprocess.run([torchrun, "--standalone", "--nproc_per_node", "2", "-m", "ddiloco_cli", "learn",
                              url, "--learner-id", "island", "--steps", "16", "--threads", "1"],
                             env=procs.env, capture_output=True, text=True, timeout=240)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        hb = learner_heartbeat(url, "island")
        assert hb["step"] == 16 and hb["state"] == "left"
        assert hb["tokens"] == 16 * 8 * 64 * 2  # both ranks' batches count
        assert hb["num_contributions"] >= 6  # 16 steps, P=2, H=4: 8 sends, the first ones surely merged
        assert min(versions(url, 2)) >= 1
        assert terminate(syncer) == 0
    finally:
        procs.close()
