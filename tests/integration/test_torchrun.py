"""One learner = one island: `torchrun --nproc_per_node 2 ... learn` runs DDP inside
the island (gloo on CPU); only rank 0 touches the bucket."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from support.built_run import invoke
from support.procs import Procs, learner_heartbeat, terminate, versions

pytestmark = pytest.mark.slow

TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")


@pytest.mark.skipif(shutil.which("torchrun") is None and not os.path.exists(os.path.join(os.path.dirname(sys.executable), "torchrun")),
                    reason="torchrun not installed")
def test_island_of_two_ranks_trains_and_contributes(tmp_path):
    url = str(tmp_path / "bucket")
    procs = Procs(tmp_path)
    try:
        r = invoke("init", url, "--task", "ddiloco_cli.tasks.gpt:tiny", "-P", "2", "-H", "4", "--total-steps", "0",
                   "--lr-schedule", "constant", "--warmup-steps", "0", "--batch-size", "8", "--lease", "3",
                   "--heartbeat", "0.5")  # in this process: no process start
        assert r.exit_code == 0, r.output
        syncer = procs.start("syncer", "sync", url, "--poll", "0.1")
        torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
        out = subprocess.run([torchrun, "--standalone", "--nproc_per_node", "2", "-m", "ddiloco_cli", "learn",
                              url, "--learner-id", "island", "--steps", "16", "--threads", "1"],
                             env=procs.env, capture_output=True, text=True, timeout=240)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        # rank 0 logs, once: the session's summary line, and no step line from rank 1
        assert out.stderr.count("learner island: this session's --steps done; step 16, 16,384 tokens") == 1, out.stderr[-3000:]
        assert out.stderr.count("step 8 loss") <= 1, out.stderr[-3000:]
        hb = learner_heartbeat(url, "island")
        assert hb["step"] == 16 and hb["state"] == "left"
        assert hb["tokens"] == 16 * 8 * 64 * 2  # both ranks' batches count
        assert hb["num_contributions"] >= 6  # 16 steps, P=2, H=4: 8 sends, the first ones surely merged
        assert min(versions(url, 2)) >= 1
        assert terminate(syncer) == 0
    finally:
        procs.close()


def _lockstep_island(tmp_path, parallel: str) -> dict:
    """Two lock-step rounds of a 2-rank island (P=1, H=4, M=1, codec none): the global model after them."""
    from ddiloco_cli.protocol import ledger
    from ddiloco_cli.protocol.published import read_global_params
    from ddiloco_cli.store import open_store

    url = str(tmp_path / f"bucket-{parallel}")
    procs = Procs(tmp_path)
    try:
        r = invoke("init", url, "--task", "ddiloco_cli.tasks.gpt:tiny", "-P", "1", "-H", "4", "--overlap-steps", "0",
                   "--mode", "lockstep", "--codec", "none", "--total-steps", "8", "--lr-schedule", "constant",
                   "--warmup-steps", "0", "--batch-size", "4", "--lease", "3", "--heartbeat", "0.5")  # in this process: no process start
        assert r.exit_code == 0, r.output
        syncer = procs.start(f"syncer-{parallel}", "sync", url, "--poll", "0.05")
        out = subprocess.run([TORCHRUN, "--standalone", "--nproc_per_node", "2", "-m", "ddiloco_cli", "learn", url,
                              "--learner-id", "island", "--threads", "1", "--parallel", parallel, "--poll", "0.05"],
                             env=procs.env, capture_output=True, text=True, timeout=240)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        assert terminate(syncer) == 0
        store = open_store(url)
        run = ledger.read_run(store)
        params, got_versions = read_global_params(store, run_id=run["run_id"], plan=ledger.read_plan(store, run_id=run["run_id"]))
        assert got_versions == {0: 2}
        return params
    finally:
        procs.close()


@pytest.mark.skipif(not os.path.exists(TORCHRUN), reason="torchrun not installed")
def test_fsdp2_island_matches_a_ddp_island(tmp_path):
    """FSDP2 shards the parameters inside the island; fragments still travel as full values
    (gathered for the send, each rank's shard written back on receive), so the global model
    after two lock-step rounds is the DDP island's up to reduction-order rounding."""
    import torch

    ddp, fsdp = _lockstep_island(tmp_path, "ddp"), _lockstep_island(tmp_path, "fsdp")
    init = __import__("ddiloco_cli.tasks", fromlist=["load_task"]).load_task("tiny").build_model()
    for name, want in ddp.items():
        moved = (want - dict(init.named_parameters())[name].detach()).abs().max()
        assert moved > 1e-4, f"{name} did not train"
        torch.testing.assert_close(fsdp[name], want, rtol=0, atol=5e-5, msg=lambda m: f"{name}: {m}")
