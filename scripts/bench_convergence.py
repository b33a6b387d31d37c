"""Convergence benchmark: Decoupled DiLoCo vs data-parallel at equal total tokens.

Real processes (`ddiloco init`, one `ddiloco sync`, M `ddiloco learn`) on a
local-directory bucket, built-in tiny GPT on the shipped Shakespeare excerpt.
Every arm trains on M * N * batch tokens:

  (a) dp        one process, batch M*B, N plain AdamW steps (same inner lr, betas,
                weight decay, clip, warmup and schedule as a learner); no ddiloco code
  (b) lockstep  streaming DiLoCo, --mode lockstep, K = M
  (b') diloco   classic DiLoCo, the reference for what DiLoCo itself reaches here: (b) with one
                fragment (P = 1), no overlap (tau = 0) and exact outer gradients (codec none)
  (c) decoupled Decoupled DiLoCo, K = 1 + grace window, RDA merge
  (d) mean      (c) with --merge mean
  (e) chaos     (c) while learners are SIGKILLed and restarted (seeded exponential
                trace); a restarted learner resumes its step count, each stops at N
  (f) mixed     (c) with half of the learners paced 1.5x slower (they sleep half a
                measured step per step), so learners drift out of phase
  (g) m8        (c) with 8 learners of batch M*B/8: the same tokens, twice the learners
                of M = 4 (M*B must be divisible by 8)
  (h) diloco8   (b') with the 8 learners of (g): the synchronous reference of m8

Lock-step is Streaming DiLoCo: K = M, mean merge, plain overwrite on receive, no lr
scaling, exact published values. The decoupled arms use the run defaults (outer_lr_scaling =
participation) unless --outer-lr-scaling says otherwise.
Per arm the JSON has val_loss, ratio_to_dp and merged_token_fraction: tokens of the
used ledger entries (averaged over fragments) / tokens the learners trained.

(b)-(e) run `init --total-steps N`, wait for every learner to finish, let the syncer
merge what is left, stop it and evaluate the latest global model. Every arm is
scored on the same fixed validation batches (the whole val split).

    .venv/bin/python scripts/bench_convergence.py                     # CPU defaults, ~5 min on 2 cores
    .venv/bin/python scripts/bench_convergence.py --steps-per-learner 1000 --learners 4 --json /tmp/conv.json
    .venv/bin/python scripts/bench_convergence.py --arms dp,decoupled --outer-lr 0.5   # a subset, tuning
    .venv/bin/python scripts/bench_convergence.py --learners 4 --steps-per-learner 1200 --arms decoupled,mixed \\
        --repeats 3 --dp-val-loss 1.6968     # mean and range of 3 runs against a known dp figure
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402
from ddiloco_cli.protocol.runconfig import MODE_DEFAULTS  # noqa: E402
from ddiloco_cli.tasks import load_task  # noqa: E402

ARMS = ("dp", "diloco", "lockstep", "decoupled", "mean", "chaos", "mixed", "m8", "diloco8")
TARGETS = {"decoupled": 1.03, "chaos": 1.03, "mixed": 1.03, "m8": 1.03}  # loss ratio to dp at most
MIN_MERGED_TOKEN_FRACTION = 0.99
DETERMINISTIC_ARMS = ("diloco", "lockstep", "diloco8")
EIGHT = ("m8", "diloco8")  # arms of 8 learners of batch M*B/8
SYNC_REFERENCE = {"m8": "diloco8"}  # the classic DiLoCo arm each arm is compared with (default: diloco)  # lock-step merges everyone every cycle: the same run every time


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--learners", type=int, default=3, help="M")
    ap.add_argument("--steps-per-learner", type=int, default=400, help="N inner steps per learner (= dp steps)")
    ap.add_argument("--task", default="ddiloco_cli.tasks.gpt:tiny")
    ap.add_argument("--batch-size", type=int, default=16, help="B per learner (dp uses M*B)")
    ap.add_argument("--fragments", "-P", type=int, default=4)
    ap.add_argument("--sync-every", "-H", type=int, default=16)
    ap.add_argument("--overlap-steps", type=int, default=8,
                    help="tau: must cover a sync round trip (upload, syncer poll 0.1 s, merge, download) at ~30 ms "
                         "steps; tau=1 gave val 2.417, tau=8 2.266 (outer lr 0.7, N=400)")
    ap.add_argument("--inner-lr", type=float, default=3e-3)
    ap.add_argument("--warmup-steps", type=int, default=20)
    ap.add_argument("--lr-schedule", default="cosine")
    ap.add_argument("--outer-lr", type=float, default=None, help="default: the run's (0.7, DiLoCo's; sparse: 1)")
    ap.add_argument("--outer-lr-scaling", default="participation", help="decoupled arms: participation (the run default) or none")
    ap.add_argument("--no-error-feedback", dest="error_feedback", action="store_false",
                    help="decoupled arms: learners without error feedback on their contributions")
    ap.add_argument("--outer-momentum", type=float, default=None, help="default: the run's (0.9; sparse: 0)")
    ap.add_argument("--codec", default="int4")
    ap.add_argument("--codec-block", type=int, default=None, help="default: the run's (64 for int4)")
    ap.add_argument("--codec-qmax", type=int, default=None, help="default: the run's (3 for int4)")
    ap.add_argument("--codec-density", type=float, default=None, help="sparse: default the run's (0.02)")
    ap.add_argument("--publish-codec", default=None, help="default: the run's (= --codec)")
    ap.add_argument("--publish-density", type=float, default=None, help="sparse: default --codec-density")
    ap.add_argument("--error-feedback-decay", type=float, default=None,
                    help="default: the run's (0.95 for sparse, 1 otherwise)")
    ap.add_argument("--grace-gamma", type=float, default=0.5)
    ap.add_argument("--grace-max", type=float, default=None, help="default: the run's")
    ap.add_argument("--chaos-mean-s", type=float, default=40.0, help="mean seconds between kills, per learner")
    ap.add_argument("--chaos-restart-s", type=float, default=2.0, help="seconds from kill to restart")
    ap.add_argument("--seed", type=int, default=0, help="chaos trace seed")
    ap.add_argument("--step-ms", type=float, default=None,
                    help="every learner paced to this fixed step time (benchlib.PACED_TASK, $DDILOCO_BENCH_STEP_MS), "
                         "so how many steps fit into a round trip does not depend on the host's speed; tiny GPT only")
    ap.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated subset of {','.join(ARMS)}")
    ap.add_argument("--workdir", default=None, help="runs go here (default: a temp dir, removed after)")
    ap.add_argument("--timeout-s", type=float, default=1800, help="per arm")
    ap.add_argument("--repeats", type=int, default=1,
                    help="runs of each decoupled arm; val_loss is their mean, val_losses each run's (dp and the "
                         "lock-step arms diloco and lockstep are deterministic: run once)")
    ap.add_argument("--dp-val-loss", type=float, default=None,
                    help="data-parallel's val loss from an earlier run of the same settings (it is deterministic), "
                         "instead of running the dp arm")
    ap.add_argument("--json", dest="json_path", default=None)
    args = ap.parse_args(argv)
    args.arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in args.arms if a not in ARMS]
    if unknown:
        ap.error(f"--arms: unknown {unknown}; use {','.join(ARMS)}")
    return args


def init_flags(args, *, arm: str) -> dict:
    M = args.learners
    flags = dict(task=args.task, fragments=args.fragments, sync_every=args.sync_every,
                 overlap_steps=args.overlap_steps, codec=args.codec, codec_block=args.codec_block,
                 codec_qmax=args.codec_qmax, codec_density=args.codec_density, publish_codec=args.publish_codec,
                 publish_density=args.publish_density,
                 error_feedback_decay=args.error_feedback_decay, inner_lr=args.inner_lr,
                 warmup_steps=args.warmup_steps, lr_schedule=args.lr_schedule, total_steps=args.steps_per_learner,
                 batch_size=args.batch_size, outer_lr=args.outer_lr, outer_momentum=args.outer_momentum,
                 grace_gamma=args.grace_gamma, grace_max=args.grace_max, lease=6, heartbeat=1,
                 max_staleness=16, quorum=1, mode="decoupled", merge="rda")
    flags.update(outer_lr_scaling=args.outer_lr_scaling, error_feedback=args.error_feedback)
    if arm in ("lockstep", "diloco", "diloco8"):  # a lockstep run has one merge, receive, lr scaling and publish codec
        for name, _, _ in MODE_DEFAULTS:
            flags.pop(name, None)
    if arm == "lockstep":  # Streaming DiLoCo
        flags.update(mode="lockstep", quorum=M)
    elif arm in ("diloco", "diloco8"):  # classic DiLoCo: the whole model every H steps, waited for, sent exactly
        flags.update(mode="lockstep", quorum=8 if arm == "diloco8" else M, fragments=1, overlap_steps=0,
                     codec="none")
    if getattr(args, "step_ms", None):
        if args.task != "ddiloco_cli.tasks.gpt:tiny":
            raise SystemExit("--step-ms paces the built-in tiny GPT; drop --task")
        flags.update(task=benchlib.PACED_TASK)
    if arm == "mixed":
        if args.task != "ddiloco_cli.tasks.gpt:tiny":
            raise SystemExit("--arms mixed paces the built-in tiny GPT; drop --task or the arm")
        flags.update(task=benchlib.PACED_TASK)
    elif arm == "mean":
        flags.update(merge="mean")
    if arm in EIGHT:
        flags.update(batch_size=M * args.batch_size // 8)
    return flags


def mean_of_runs(runs: list[dict]) -> dict:
    """One arm's result from its repeated runs: the first run's record with val_loss,
    merged_token_fraction and mean_quorum averaged (the worst merged fraction is kept too),
    each run's val_loss in val_losses and train_s summed."""
    out = dict(runs[0])
    if len(runs) == 1:
        return out
    for key in ("val_loss", "merged_token_fraction", "mean_quorum"):
        if all(key in r for r in runs):
            out[key] = statistics.fmean(r[key] for r in runs)
    out["val_losses"] = [r["val_loss"] for r in runs]
    if all("merged_token_fraction" in r for r in runs):
        out["min_merged_token_fraction"] = min(r["merged_token_fraction"] for r in runs)
    out["train_s"] = sum(r["train_s"] for r in runs)
    out["runs"] = runs
    return out


def arm_learners(args, arm: str) -> list[str]:
    return [f"l{i}" for i in range(8 if arm in EIGHT else args.learners)]


def run_ddiloco_arm(args, *, arm: str, workdir: str, task, inner_out: dict) -> dict:
    ids = arm_learners(args, arm)
    fixed = {benchlib.STEP_ENV: str(args.step_ms)} if getattr(args, "step_ms", None) else {}
    cluster = benchlib.Cluster(os.path.join(workdir, arm), env=fixed)
    t0 = time.monotonic()
    try:
        run = cluster.init(**init_flags(args, arm=arm))
        inner_out.update(run["inner"])
        cluster.start_syncer("--poll", "0.1")
        for i, lid in enumerate(ids):
            slow = arm == "mixed" and i % 2 == 1
            cluster.start_learner(lid, env=benchlib.slow_env(args.step_s, 1.5) if slow else None)
        driver = None
        if arm == "chaos":
            trace = benchlib.failure_trace(seed=args.seed, learner_ids=ids, mean_between_s=args.chaos_mean_s,
                                           restart_delay_s=args.chaos_restart_s, duration_s=args.timeout_s)
            driver = benchlib.ChaosDriver(trace)
        load_during = []

        def tick(c):
            if driver is not None:
                driver.tick(c)
            if not load_during or time.monotonic() - load_during[-1][0] > 10:
                load_during.append((time.monotonic(), os.getloadavg()[0]))

        cluster.wait_learners_finished(ids, timeout_s=args.timeout_s, on_tick=tick)
        train_s = time.monotonic() - t0
        unmerged = cluster.drain(timeout_s=30)
        cluster.stop_syncer()
        model, versions = cluster.global_model(task)
        loss = benchlib.val_loss(task, model)
        beats = cluster.heartbeats()
        manifests = cluster.manifests()
        quorum_sizes = [m["quorum_size"] for m in manifests if m["version"] > 0]
        tokens = sum(int(beats[lid]["tokens"]) for lid in ids)
        merged = benchlib.merged_tokens(manifests, num_fragments=int(run["num_fragments"]))
        return {
            "arm": arm, "val_loss": loss, "train_s": train_s, "versions": versions,
            "steps": {lid: beats[lid]["step"] for lid in ids},
            "tokens": tokens, "merged_tokens": merged, "merged_token_fraction": merged / tokens if tokens else None,
            "refused": sum(1 for m in manifests for c in m["contributions"] if c.get("status") == "refused"),
            "mean_quorum": sum(quorum_sizes) / max(1, len(quorum_sizes)),
            # send -> receive lag in steps, per learner (p50, p95), from its last heartbeat
            "lag_steps": {lid: [beats[lid].get("lag_p50"), beats[lid].get("lag_p95")] for lid in ids},
            "unmerged_at_stop": unmerged,
            "kills": sum(1 for e in (driver.events if driver else []) if e[1] == "kill"),
            "chaos_events": driver.events if driver else [],
            "mean_load_1m": sum(l for _, l in load_during) / max(1, len(load_during)),
        }
    finally:
        cluster.close()


def main(argv=None) -> dict:
    args = parse_args(argv)
    benchlib.exit_on_sigterm()  # so each Cluster's finally kills its processes
    torch.set_num_threads(1)
    task = load_task(args.task)
    M, N, B = args.learners, args.steps_per_learner, args.batch_size
    workdir = args.workdir or tempfile.mkdtemp(prefix="bench_conv_")
    args.step_s = benchlib.measure_step_s(task, batch_size=B)  # paces the mixed arm's slow learners
    print(f"M={M} N={N} B={B} P={args.fragments} H={args.sync_every} tau={args.overlap_steps} "
          f"inner_lr={args.inner_lr} outer_lr={args.outer_lr} momentum={args.outer_momentum} codec={args.codec}{'/' + str(args.codec_block) if args.codec_block else ''}{' qmax ' + str(args.codec_qmax) if args.codec_qmax else ''} "
          f"task={args.task}; tokens per arm = M*N*B*T; {benchlib.load_text()}", file=sys.stderr)
    inner = {"lr": args.inner_lr, "betas": [0.9, 0.95], "weight_decay": 0.1, "warmup_steps": args.warmup_steps,
             "lr_schedule": args.lr_schedule, "total_steps": N, "grad_clip": 1.0, "batch_size": B}
    results: dict[str, dict] = {}
    for arm in args.arms:
        t0 = time.monotonic()
        print(f"[{arm}] running ... ({benchlib.load_text()})", file=sys.stderr)
        if arm in EIGHT and (M * B) % 8:
            raise SystemExit(f"--arms {arm}: M*B = {M * B} must be divisible by 8")
        if arm == "dp":
            model = benchlib.train_data_parallel(task, steps=N, batch_size=M * B, inner=inner)
            results[arm] = {"arm": arm, "val_loss": benchlib.val_loss(task, model), "train_s": time.monotonic() - t0,
                            "tokens": N * M * B * task.config.block_size if hasattr(task, "config") else None}
        else:
            runs = []
            for i in range(1 if arm in DETERMINISTIC_ARMS else args.repeats):
                run_inner: dict = {}
                runs.append(run_ddiloco_arm(args, arm=arm, workdir=os.path.join(workdir, f"r{i}"), task=task,
                                            inner_out=run_inner))
                # the dp arm must use exactly the learners' optimizer settings
                assert all(run_inner[k] == inner[k] or (k == "betas" and list(run_inner[k]) == inner[k])
                           or (k == "batch_size" and arm in EIGHT) for k in inner), (run_inner, inner)
            results[arm] = mean_of_runs(runs)
        print(f"[{arm}] val loss {results[arm]['val_loss']:.4f} in {time.monotonic() - t0:.0f}s "
              f"({benchlib.load_text()})", file=sys.stderr)
    base = results.get("dp", {}).get("val_loss", args.dp_val_loss)
    rows = []
    for arm in args.arms:
        r = results[arm]
        ratio = r["val_loss"] / base if base else None
        target = TARGETS.get(arm)
        r["ratio_to_dp"] = ratio
        r["target_ratio"] = target
        r["target_met"] = None if ratio is None or target is None else ratio <= target
        ref = results.get(SYNC_REFERENCE.get(arm, "diloco"))
        r["ratio_to_diloco"] = r["val_loss"] / ref["val_loss"] if ref and arm not in ("dp", "diloco", "diloco8") else None
        lags = [v for lag in r.get("lag_steps", {}).values() for v in lag[:1] if v is not None]
        fraction = r.get("min_merged_token_fraction", r.get("merged_token_fraction"))  # the worst run
        losses = r.get("val_losses", [])
        shown = f"{r['val_loss']:.4f}" + (f" ({min(losses):.4f}-{max(losses):.4f})" if len(losses) > 1 else "")
        rows.append([arm, shown, "-" if ratio is None else f"{ratio:.4f}",
                     "-" if target is None else f"<= {target:.2f} " + ("met" if r["target_met"] else "MISSED"),
                     r.get("tokens", "-"), "-" if fraction is None else
                     f"{fraction:.4f} " + ("met" if fraction >= MIN_MERGED_TOKEN_FRACTION else "MISSED"),
                     f"{r['mean_quorum']:.2f}" if "mean_quorum" in r else "-",
                     "-" if r["ratio_to_diloco"] is None else f"{r['ratio_to_diloco']:.4f}",
                     f"{statistics.median(lags):g}" if lags else "-", r.get("kills", "-"),
                     f"{r['train_s']:.0f}"])
    table = benchlib.fmt_table(["arm", "val_loss", "ratio_to_dp", "target", "tokens", "merged_token_fraction",
                                "mean_quorum", "ratio_to_diloco", "lag_p50", "kills", "wall_s"], rows)
    print(table)
    print(f"settings: M={M} N={N} B={B} P={args.fragments} H={args.sync_every} tau={args.overlap_steps} "
          f"inner_lr={args.inner_lr} (cosine, warmup {args.warmup_steps}) outer_lr={args.outer_lr} "
          f"momentum={args.outer_momentum} codec={args.codec}; chaos mean {args.chaos_mean_s}s restart "
          f"{args.chaos_restart_s}s seed {args.seed}; {benchlib.load_text()}")
    out = {"settings": {k: v for k, v in vars(args).items() if k != "json_path"}, "results": results,
           "load_end": os.getloadavg()}
    return benchlib.write_result(out, json_path=args.json_path, workdir=workdir, keep_workdir=bool(args.workdir))


if __name__ == "__main__":
    main()
