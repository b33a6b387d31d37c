"""Training through store faults: real learners and a syncer, each process's
bucket wrapped in the seeded fault injector (ddiloco_cli/store/faults.py), on a
local-directory bucket.

Every store call of every process fails, stalls, loses its response after
succeeding, or dies midway through a write with probability --rate (each
process with its own seed). The retry policy must carry the run through. After
the learners finish, the syncer drains, and the bucket is checked without
faults:

* ``ddiloco inspect --verify`` passes (no corrupt version);
* lost contributions: contribution objects that no manifest's ledger names (as
  merged or superseded) after the drain; must be 0;
* uploads a learner gave up on (its log says so); must be 0;
* quarantined inputs; must be 0 (a fault must never look like bad data);
* temp debris: ``.tmp-*`` files left by injected partial writes (never listed
  as objects; ``gc`` removes them after the grace).

    python scripts/bench_faults.py                           # ~2 min
    python scripts/bench_faults.py --rate 0.05 --learners 3 --steps 60 --json /tmp/faults.json
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchlib  # noqa: E402

from ddiloco_cli import layout  # noqa: E402
from ddiloco_cli.store.faults import FAULTS_ENV  # noqa: E402

_FAULT_LINE = re.compile(r"faults: (\w+) injected")


def fault_counts(log_dir: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for name in os.listdir(log_dir):
        with open(os.path.join(log_dir, name), errors="replace") as f:
            for m in _FAULT_LINE.finditer(f.read()):
                counts[m.group(1)] = counts.get(m.group(1), 0) + 1
    return counts


def count_in_logs(log_dir: str, text: str) -> int:
    n = 0
    for name in os.listdir(log_dir):
        with open(os.path.join(log_dir, name), errors="replace") as f:
            n += f.read().count(text)
    return n


def ledger_check(cluster: benchlib.Cluster) -> dict[str, int]:
    """Contribution objects against the ledger entries of every manifest."""
    named = set()
    for m in cluster.manifests():
        named.update(e["key"] for e in m["contributions"])
        named.update(e["key"] for e in m.get("superseded", []))
    objects = {i.key for i in cluster.store.list(layout.CONTRIBUTION_ROOT)}
    return {"contribution_objects": len(objects), "ledger_entries": len(named),
            "lost_contributions": len(objects - named),
            "quarantined": len(cluster.store.list("quarantine/"))}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=0.05, help="fault probability per store call")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--spike-s", type=float, default=0.5, help="longest injected latency spike")
    ap.add_argument("--learners", type=int, default=2)
    ap.add_argument("--steps", type=int, default=60, help="inner steps per learner")
    ap.add_argument("--fragments", type=int, default=4)
    ap.add_argument("--sync-every", type=int, default=8)
    ap.add_argument("--timeout-s", type=float, default=600)
    ap.add_argument("--json", default=None)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--keep-workdir", action="store_true")
    args = ap.parse_args(argv)
    os.environ.pop(FAULTS_ENV, None)  # this process reads the bucket without faults
    workdir = args.workdir or f"/tmp/bench_faults_{uuid.uuid4().hex[:8]}"

    def faults(i: int) -> list[str]:
        return ["-o", f"faults={args.rate},seed={args.seed * 1000 + i},spike_s={args.spike_s}"]

    cluster = benchlib.Cluster(workdir)
    ids = [f"l{i}" for i in range(args.learners)]
    t0 = time.monotonic()
    try:
        run = cluster.init(task="tiny", fragments=args.fragments, sync_every=args.sync_every, overlap_steps=1,
                           codec="int8", total_steps=args.steps, lr_schedule="constant", warmup_steps=0,
                           lease=10, heartbeat=1, max_staleness=16, quorum=1)
        cluster.start_syncer("--poll", "0.1", *faults(0))
        for i, lid in enumerate(ids):
            cluster.start_learner(lid, "--steps", str(args.steps), *faults(i + 1))
        cluster.wait_learners_finished(ids, timeout_s=args.timeout_s)
        unmerged = cluster.drain(timeout_s=120)
        syncer_alive = cluster.syncer.poll() is None
        cluster.stop_syncer()
        elapsed_s = time.monotonic() - t0
        verify = subprocess.run([sys.executable, "-m", "ddiloco_cli", "inspect", cluster.url, "--verify"],
                                env={k: v for k, v in cluster.env.items() if k != FAULTS_ENV},
                                capture_output=True, text=True, timeout=300)
        debris = sum(1 for d, _, names in os.walk(cluster.bucket) for n in names if n.startswith(".tmp-"))
        out = {
            "rate": args.rate, "seed": args.seed, "learners": args.learners, "steps": args.steps,
            "fragments": int(run["num_fragments"]), "elapsed_s": round(elapsed_s, 1),
            "versions": cluster.versions(), "syncer_survived": syncer_alive,
            "faults_injected": fault_counts(cluster.log_dir),
            "retries_logged": count_in_logs(cluster.log_dir, "; retry "),
            "uploads_given_up": count_in_logs(cluster.log_dir, "giving up on"),
            "unmerged_after_drain": unmerged,
            **ledger_check(cluster),
            "verify_exit_code": verify.returncode,
            "temp_debris_files": debris,
        }
        if verify.returncode != 0:
            out["verify_output"] = (verify.stdout + verify.stderr)[-2000:]
    finally:
        cluster.close()
    rows = [[k, v] for k, v in out.items() if k != "verify_output"]
    print(f"training through {args.rate:.0%} injected store faults ({benchlib.load_text()})")
    print(benchlib.fmt_table(["figure", "value"], rows))
    if "verify_output" in out:
        print(out["verify_output"])
    return benchlib.write_result(out, json_path=args.json, workdir=workdir, keep_workdir=args.keep_workdir)


if __name__ == "__main__":
    main()
