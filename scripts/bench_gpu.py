"""The learner's cost on a CUDA device: ddiloco's learner loop against the same plain loop,
wall time per step as a user measures it (steps per second), on a model large enough for
~100 ms steps (benchtasks' ``big``: an 85M-parameter GPT, batch 32 x 256 tokens; ``--task mid``
for a quick check).

Three arms, each a fresh process, interleaved (the order rotates every round) for --reps rounds,
with one ``ddiloco sync`` process serving the run (CPU, a local-directory bucket, P = H = 24,
tau 2, K 1, int4) so versions come back and the receive path runs:
  * plain:    AdamW loop on the device (lr, forward, backward, clip, step); the batch copied
              with non_blocking as the learner copies it, the loss not read back (the learner
              reads it every --log-every steps only): nothing in the loop syncs the stream;
  * ddiloco:  ``Learner.train`` with --device cuda: a send copies its fragment into pinned
              memory without waiting for the device, a receive adds a pinned increment;
  * blocking: the same learner with the copies made as before (a blocking device-to-host copy
              at every send and a pageable increment at every receive: each syncs the stream);
  * io:       the same learner with its io helper process (``--io-process``): the send's pinned
              copy goes into a shared block once it has landed, the helper encodes and uploads,
              and polls, downloads and decodes.
Steady state: the device is synchronized at step --skip and at the last step; ms/step is the
time between them over the steps between them. The headline is the median over the rounds of
each round's ratio against its plain process; peak device memory (max_memory_allocated) and the
learner's own report of its cost (its heartbeats' fields) are printed beside.

    .venv/bin/python scripts/bench_gpu.py                         # big, 3 rounds
    .venv/bin/python scripts/bench_gpu.py --task mid --steps 60 --skip 20 --reps 1   # smoke
    .venv/bin/python scripts/bench_gpu.py --json /tmp/gpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402
from bench_overhead import INNER_LR, REPO, SEED, TASKS, WARMUP, init_bench_run  # noqa: E402
from overheadlib import record_cost_reports, steady_reports  # noqa: E402

from ddiloco_cli.protocol import layout  # noqa: E402

THIS = os.path.abspath(__file__)
ARMS = ("plain", "ddiloco", "blocking", "io")


def _marks(step: int, *, skip: int, steps: int, marks: dict) -> None:
    if step in (skip, steps):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        marks[str(step)] = time.perf_counter()


def plain_worker(args) -> dict:
    torch.manual_seed(SEED)
    _, task, batch_size = TASKS[args.task]
    device = torch.device(args.device)
    model = task.build_model().to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=INNER_LR, betas=(0.9, 0.95), weight_decay=0.1)
    batches = task.batches(shard=0, num_shards=1, seed=12345, batch_size=batch_size)
    marks: dict = {}
    for step in range(1, args.steps + 1):
        for group in optimizer.param_groups:
            group["lr"] = INNER_LR * step / WARMUP if step <= WARMUP else INNER_LR
        x, y = (t.to(device, non_blocking=True) for t in next(batches))  # as the learner's to_device
        loss = task.loss(model, (x, y))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        _marks(step, skip=args.skip, steps=args.steps, marks=marks)
    return {"marks": marks, "loss": float(loss.detach())}


def ddiloco_worker(args) -> dict:
    from ddiloco_cli import SyncOptions
    from ddiloco_cli.learner import Learner, LearnerOptions
    from ddiloco_cli.learner import island, receiver
    from ddiloco_cli.store import open_store

    if args.worker == "blocking":  # the copies as they were: blocking, pageable
        gather, difference = island.gather_fragment, receiver.difference
        island.gather_fragment = lambda plan, p, params, non_blocking=False: gather(plan, p, params)
        receiver.difference = lambda a, b, pin=False: difference(a, b)
    reports = record_cost_reports()
    marks: dict = {}
    learner = Learner(open_store(args.url), options=LearnerOptions(
        learner_id=args.learner_id, steps=args.steps, log_every=10**9, task=TASKS[args.task][0], device=args.device,
        sync=SyncOptions(io_process=args.worker == "io")),
        on_progress=lambda p: _marks(p["step"], skip=args.skip, steps=args.steps, marks=marks))
    reason = learner.train()
    s = learner.stats
    return {"marks": marks, "reason": reason, "versions_received": sum(1 for v in s.versions.values() if v > 0),
            "blocked_s": s.blocked_s, "num_contributions": s.num_contributions,
            "cost_reports": steady_reports(reports, skip=args.skip, steps=args.steps)}


def run_arm(arm: str, rep: int, args, url: str, workdir: str) -> dict:
    out = os.path.join(workdir, f"{arm}-{rep}.json")
    cmd = [sys.executable, THIS, "--worker", arm, "--out", out, "--steps", str(args.steps), "--skip", str(args.skip),
           "--task", args.task, "--url", url, "--learner-id", f"{arm}-{rep}", "--device", args.device]
    subprocess.run(cmd, check=True, cwd=str(REPO))
    with open(out) as f:
        rec = json.load(f)
    m = rec.pop("marks")
    rec.update(arm=arm, rep=rep, ms_per_step=1e3 * (m[str(args.steps)] - m[str(args.skip)]) / (args.steps - args.skip))
    print(f"  rep {rep} {arm:8s} {rec['ms_per_step']:8.2f} ms/step  device memory "
          f"{rec['max_memory_allocated'] / 2**20:8.0f} MiB", flush=True)
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", choices=sorted(TASKS), default="big")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--skip", type=int, default=30)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of the script itself (no figure)")
    ap.add_argument("--worker", choices=ARMS, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--url", help=argparse.SUPPRESS)
    ap.add_argument("--learner-id", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.device != "cpu" and not torch.cuda.is_available():
        sys.exit("bench_gpu.py: no CUDA device is visible to torch")
    if args.worker:
        rec = plain_worker(args) if args.worker == "plain" else ddiloco_worker(args)
        rec["max_memory_allocated"] = torch.cuda.max_memory_allocated() if args.device != "cpu" else 0
        with open(args.out, "w") as f:
            json.dump(rec, f)
        return
    workdir = tempfile.mkdtemp(prefix="bench-gpu-")
    url = os.path.join(workdir, "run")
    init_bench_run(url, args.task)
    launcher = benchlib.Launcher(workdir, cwd=str(REPO))
    syncer = launcher.start("syncer", "sync", url)
    beats, deadline = os.path.join(url, layout.SYNCER_HEARTBEAT_PREFIX), time.monotonic() + 300
    while not (os.path.isdir(beats) and os.listdir(beats)):  # serving before the first arm starts
        if syncer.poll() is not None or time.monotonic() > deadline:
            sys.exit(f"bench_gpu.py: the syncer did not start:\n{launcher.log('syncer')[-2000:]}")
        time.sleep(0.2)
    name = torch.cuda.get_device_name() if args.device != "cpu" else "cpu"
    print(f"{name}, task {args.task}, {args.steps} steps ({args.skip} left out), "
          f"{args.reps} rounds; load {os.getloadavg()[0]:.2f}", flush=True)
    records = []
    try:
        for rep in range(args.reps):
            order = ARMS[rep % len(ARMS):] + ARMS[:rep % len(ARMS)]
            records += [run_arm(arm, rep, args, url, workdir) for arm in order]
    finally:
        syncer.terminate()
        syncer.wait(timeout=60)
        launcher.close()
    by = {arm: {r["rep"]: r for r in records if r["arm"] == arm} for arm in ARMS}
    result = {"task": args.task, "device": name, "records": records}
    for arm in ARMS[1:]:
        ratios = [by[arm][i]["ms_per_step"] / by["plain"][i]["ms_per_step"] for i in range(args.reps)]
        share = [f["sync_step_ms"] for r in by[arm].values() for f in r["cost_reports"] if "sync_step_ms" in f]
        result[arm] = {"overhead_per_rep": [x - 1 for x in ratios], "overhead_median": statistics.median(ratios) - 1,
                       "ms_per_step": statistics.median(r["ms_per_step"] for r in by[arm].values()),
                       "sync_step_ms": statistics.median(share) if share else None,
                       "versions_received": [r["versions_received"] for r in by[arm].values()]}
        print(f"{arm:8s}: wall per step {100 * result[arm]['overhead_median']:+.1f}% against plain "
              f"(rounds {', '.join(f'{100 * (x - 1):+.1f}' for x in ratios)}); its own report: "
              f"{result[arm]['sync_step_ms']} ms a step in ddiloco's call; versions received "
              f"{result[arm]['versions_received']}")
    result["plain_ms_per_step"] = statistics.median(r["ms_per_step"] for r in by["plain"].values())
    print(f"plain   : {result['plain_ms_per_step']:.2f} ms/step")
    benchlib.write_result(result, json_path=args.json, workdir=workdir, keep_workdir=False)


if __name__ == "__main__":
    main()
