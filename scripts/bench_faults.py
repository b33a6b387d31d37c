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

With ``--kills N`` the syncer is also killed with SIGKILL N times, each a seeded
random time (uniform in [--kill-min-s, --kill-max-s]) after it claimed its
epoch, and restarted at once, while the learners train; after the last kill the
learners stop (SIGTERM), the syncer drains and stops. Then also:

* double-applied contributions: a (learner, seq) that more than one manifest
  (or one manifest twice) lists as used; must be 0;
* replay: a fresh syncer restores from checkpoints + ledger and another from
  the ledger alone (checkpoints removed, replay from version 0); their states
  (momentum, raw and published values, high-water marks) must be
  bit-identical and hold the published latest value; and a strict replay from
  version 0, which re-encodes every version and fails unless each payload's
  sha256 is the manifest's, must pass every checkpoint the killed syncers
  wrote with the same momentum, raw value and step count.

    python scripts/bench_faults.py                           # ~1 min
    python scripts/bench_faults.py --rate 0.05 --learners 3 --steps 60 --json /tmp/faults.json
    python scripts/bench_faults.py --rate 0 --kills 40 --json /tmp/kill9.json     # ~5 min
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import signal
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from ddiloco_cli.errors import InvalidPayloadError, ProtocolError  # noqa: E402
from ddiloco_cli.protocol import layout, ledger  # noqa: E402
from ddiloco_cli.protocol.published import FragmentReader  # noqa: E402
from ddiloco_cli.store import open_store  # noqa: E402
from ddiloco_cli.store.faults import FAULTS_ENV  # noqa: E402
from ddiloco_cli.syncer import replay
from ddiloco_cli.syncer.core import Syncer, SyncerOptions  # noqa: E402
from ddiloco_cli.syncer.update import FragmentValue  # noqa: E402

import benchlib  # noqa: E402

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


def double_applied(cluster: benchlib.Cluster) -> int:
    """(fragment, learner, seq) listed as used more than once over all manifests."""
    used = Counter((m["fragment"], e["learner_id"], e["seq"])
                   for m in cluster.manifests() for e in m["contributions"] if e["used"])
    return sum(n - 1 for n in used.values() if n > 1)


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _same_value(a: FragmentValue, b: FragmentValue) -> bool:
    return (a.version, a.outer.num_steps, a.cycle) == (b.version, b.outer.num_steps, b.cycle) \
        and _same(a.outer.state_tensors(), b.outer.state_tensors()) and _same(a.raw, b.raw) \
        and _same(a.published, b.published)


def replay_check(cluster: benchlib.Cluster) -> dict[str, int]:
    """Bit-exact replay. A fresh syncer restores from checkpoints + ledger, another from the
    ledger alone (checkpoints removed): their states must be identical and hold the published
    latest value. A strict replay from version 0 (``replay.replay``, which re-encodes every
    version and fails unless each payload's sha256 is the manifest's) must pass every
    checkpoint the killed syncers wrote with the same momentum, raw value and step count."""
    with_ckpt = Syncer(open_store(cluster.url), options=SyncerOptions(syncer_id="replay-ckpt", gc=False))
    with_ckpt.restore()
    bare_dir = os.path.join(cluster.workdir, "no-checkpoints")
    shutil.copytree(cluster.bucket, bare_dir, ignore=lambda d, names: ["checkpoints"] if d == cluster.bucket else [])
    from_zero = Syncer(open_store(bare_dir), options=SyncerOptions(syncer_id="replay-zero", gc=False))
    from_zero.restore()
    store, config, plan = with_ckpt.store, with_ckpt.config, with_ckpt.plan
    out = Counter(restore_mismatches=0, published_mismatches=0, strict_replay_failures=0, checkpoints_replayed=0,
                  checkpoint_mismatches=0, checkpoints_refused=0)
    for p, state in with_ckpt.states.items():
        a, b = state.current, from_zero.states[p].current
        out["restore_mismatches"] += not (_same_value(a, b) and state.high_water == from_zero.states[p].high_water)
        reader = FragmentReader(store, run_id=config.run_id, plan=plan, fragment=p)
        out["published_mismatches"] += not _same(a.published, reader.read(a.version))
        zero = reader.read(0)
        value = FragmentValue(0, zero, zero, replay.new_outer(config), replay.manifest_cycle(reader.manifest(0)))
        try:
            for info in store.list(layout.checkpoint_prefix(p)):
                v = layout.parse_num(info.key)
                if v is None or v == 0 or v > a.version:
                    continue
                if v > value.version:
                    value = replay.replay(config=config, fragment=p, reader=reader, fetch=with_ckpt.intake.fetch_used,
                                          start=value, latest=v)
                try:
                    tensors, meta = replay.decode_checkpoint(store.get(info.key), plan=plan, fragment=p,
                                                             where=info.key)
                except (ProtocolError, InvalidPayloadError) as exc:  # restores skip it too
                    print(f"fragment {p}: checkpoint refused by its loader: {exc}")
                    out["checkpoints_refused"] += 1
                    continue
                shapes = replay.checkpoint_shapes(plan, p)
                momentum = {k: t for k, t in tensors.items() if k in plan.fragment_shapes(p)}
                raw = {k[len(replay.RAW_PREFIX):]: t for k, t in tensors.items() if k.startswith(replay.RAW_PREFIX)}
                out["checkpoints_replayed"] += 1
                out["checkpoint_mismatches"] += not (
                    shapes.keys() <= tensors.keys() and meta["outer_steps"] == value.outer.num_steps
                    and _same(momentum, value.outer.state_tensors()) and _same(raw, value.raw))
            if a.version > value.version:
                value = replay.replay(config=config, fragment=p, reader=reader, fetch=with_ckpt.intake.fetch_used,
                                      start=value, latest=a.version)
            out["restore_mismatches"] += not _same_value(a, value)
        except (ProtocolError, InvalidPayloadError) as exc:
            print(f"fragment {p}: strict replay failed: {exc}")
            out["strict_replay_failures"] += 1
    shutil.rmtree(bare_dir, ignore_errors=True)
    return {f"replay_{k}" if not k.startswith("checkpoint") else k: n for k, n in out.items()}


def wait_for_first_version(cluster: benchlib.Cluster, ids: list[str], *, timeout_s: float) -> None:
    """Until every learner trains and a version beyond 0 is committed (kills then hit a working run)."""
    deadline = time.monotonic() + timeout_s
    while len(cluster.learners_up()) < len(ids) or sum(cluster.versions()) == 0:
        if time.monotonic() > deadline:
            raise RuntimeError(f"no training after {timeout_s}s:\n{cluster.log_tail('syncer')}\n"
                               f"{cluster.log_tail('learner-' + ids[0])}")
        time.sleep(0.25)


def latest_epoch(cluster: benchlib.Cluster) -> int:
    epochs = ledger.list_epochs(cluster.store, run_id=cluster.run["run_id"])
    return epochs[-1].epoch if epochs else 0


def kill_loop(cluster: benchlib.Cluster, *, kills: int, seed: int, min_s: float, max_s: float,
              syncer_args: list[str], timeout_s: float) -> list[float]:
    """SIGKILL the syncer ``kills`` times, each at a seeded random time after it claimed
    its epoch (so it dies while restoring, merging, committing or checkpointing, not
    while Python starts), restarting it each time; returns those times in seconds."""
    rng = random.Random(seed)
    ages = []
    known = latest_epoch(cluster)  # the running syncer's: it has committed already
    for i in range(kills):
        deadline = time.monotonic() + timeout_s
        while i and latest_epoch(cluster) <= known:  # a restarted syncer waits out the lease, then claims
            if cluster.syncer.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the syncer did not claim an epoch (exit {cluster.syncer.poll()}):\n"
                                   f"{cluster.log_tail('syncer')}")
            time.sleep(0.02)
        known = latest_epoch(cluster)
        age = rng.uniform(min_s, max_s)
        claimed = time.monotonic()
        while time.monotonic() - claimed < age:
            if cluster.syncer.poll() is not None:
                raise RuntimeError(f"the syncer exited on its own ({cluster.syncer.returncode}):\n"
                                   f"{cluster.log_tail('syncer')}")
            time.sleep(0.01)
        cluster.syncer.send_signal(signal.SIGKILL)
        cluster.syncer.wait()
        ages.append(round(age, 3))
        cluster.start_syncer(*syncer_args)
    return ages


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=0.05, help="fault probability per store call")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--spike-s", type=float, default=0.5, help="longest injected latency spike")
    ap.add_argument("--learners", type=int, default=2)
    ap.add_argument("--steps", type=int, default=60, help="inner steps per learner")
    ap.add_argument("--fragments", type=int, default=4)
    ap.add_argument("--sync-every", type=int, default=8)
    ap.add_argument("--kills", type=int, default=0, help="SIGKILL the syncer this many times while training")
    ap.add_argument("--kill-min-s", type=float, default=0.0, help="shortest time from a syncer's claim to its kill")
    ap.add_argument("--kill-max-s", type=float, default=3.0, help="longest time from a syncer's claim to its kill")
    ap.add_argument("--timeout-s", type=float, default=600)
    ap.add_argument("--json", default=None)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--keep-workdir", action="store_true")
    args = ap.parse_args(argv)
    os.environ.pop(FAULTS_ENV, None)  # this process reads the bucket without faults
    workdir = args.workdir or f"/tmp/bench_faults_{uuid.uuid4().hex[:8]}"

    def faults(i: int) -> list[str]:
        if args.rate <= 0:
            return []
        return ["-o", f"faults={args.rate},seed={args.seed * 1000 + i},spike_s={args.spike_s}"]

    cluster = benchlib.Cluster(workdir)
    ids = [f"l{i}" for i in range(args.learners)]
    t0 = time.monotonic()
    try:
        # with kills the learners train until the kills are done, then stop; else they run --steps
        learner_steps = 10**6 if args.kills else args.steps
        run = cluster.init(task="tiny", fragments=args.fragments, sync_every=args.sync_every, overlap_steps=1,
                           codec="int8", total_steps=learner_steps, lr_schedule="constant", warmup_steps=0,
                           lease=2, heartbeat=0.5, max_staleness=16, quorum=1, checkpoint_every=2)
        syncer_args = ["--poll", "0.1", *faults(0)]
        cluster.start_syncer(*syncer_args)
        for i, lid in enumerate(ids):
            cluster.start_learner(lid, "--steps", str(learner_steps), *faults(i + 1))
        kill_ages: list[float] = []
        if args.kills:
            wait_for_first_version(cluster, ids, timeout_s=args.timeout_s)
            kill_ages = kill_loop(cluster, kills=args.kills, seed=args.seed, min_s=args.kill_min_s,
                                  max_s=args.kill_max_s, syncer_args=syncer_args, timeout_s=args.timeout_s)
            cluster.terminate_learners()
        else:
            cluster.wait_learners_finished(ids, timeout_s=args.timeout_s)
        unmerged = cluster.drain(timeout_s=120)
        syncer_alive = cluster.syncer.poll() is None
        cluster.stop_syncer()
        elapsed_s = time.monotonic() - t0
        verify = cluster.launcher.run("inspect", cluster.url, "--verify", timeout_s=300,
                                      env={FAULTS_ENV: ""})  # empty: no faults
        replay = replay_check(cluster) if args.kills else {}
        debris = sum(1 for d, _, names in os.walk(cluster.bucket) for n in names if n.startswith(".tmp-"))
        out = {
            "rate": args.rate, "seed": args.seed, "kill_ages_s": kill_ages, "learners": args.learners, "steps": args.steps,
            "fragments": int(run["num_fragments"]), "elapsed_s": round(elapsed_s, 1),
            "versions": cluster.versions(), "syncer_survived": syncer_alive,
            "faults_injected": fault_counts(cluster.log_dir),
            "retries_logged": count_in_logs(cluster.log_dir, "; retry "),
            "uploads_given_up": count_in_logs(cluster.log_dir, "giving up on"),
            "syncer_kills": len(kill_ages),
            "unmerged_after_drain": unmerged,
            **ledger_check(cluster),
            "double_applied": double_applied(cluster),
            **replay,
            "verify_exit_code": verify.returncode,
            "temp_debris_files": debris,
        }
        if verify.returncode != 0:
            out["verify_output"] = (verify.stdout + verify.stderr)[-2000:]
    finally:
        cluster.close()
    rows = [[k, v] for k, v in out.items() if k not in ("verify_output", "kill_ages_s")]
    print(f"training through {args.rate:.0%} injected store faults and {args.kills} syncer kills "
          f"({benchlib.load_text()})")
    print(benchlib.fmt_table(["figure", "value"], rows))
    if "verify_output" in out:
        print(out["verify_output"])
    return benchlib.write_result(out, json_path=args.json, workdir=workdir, keep_workdir=args.keep_workdir)


if __name__ == "__main__":
    benchlib.exit_on_sigterm()
    main()
