"""Traffic benchmark: bytes a real run's learners move, against data-parallel.

Real processes (`ddiloco init`, one `ddiloco sync`, M `ddiloco learn`) on a
local-directory bucket, a paced GPT from benchlib (--task tiny, 237k parameters, or
mid, 3.2M parameters, whose bigger fragments amortise the payload headers). Half of the
learners (odd indices) are paced --slowdown times slower, as in
bench_convergence.py's mixed arm, so they drift out of phase and the syncer
commits several versions of a fragment per cycle.

Per learner, from its own heartbeats (bytes_up / bytes_down count payload bytes
it uploaded and downloaded; manifests, hints and LISTs are not counted) over a
steady window (its first heartbeat at step >= --skip-steps, so the bootstrap
download of the whole model is left out, to its last heartbeat before the run's
total_steps, so the stop's flush of every fragment's unsent progress [L7] is
left out too):

  bytes up / down per step, and the data-parallel equivalent for the same model
  and M: a ring all-reduce of fp32 gradients every step, both directions
  (bench_bandwidth.dp_bytes_per_step, sent and again received); ratio = DP / ours;
  versions per fragment per cycle: how far its fragments' versions advanced
  (sum over fragments of the versions received / P) per H of its steps. Every
  version beyond one per cycle is one more delta (or a keyframe) downloaded.

From the manifests: versions the syncer committed, mean delta and keyframe
payload sizes, and bytes per parameter of the contributions and deltas (int4's
0.5 plus scales and the safetensors header, which matters for small fragments).
The whole-run totals (bootstrap included) are in the JSON too.

    .venv/bin/python scripts/bench_traffic.py --json /tmp/traffic.json      # M=4, P=H=24, 240 steps
    .venv/bin/python scripts/bench_traffic.py --steps 480 --grace-gamma 0.9
    .venv/bin/python scripts/bench_traffic.py --task mid --steps 144 --skip-steps 48
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_bandwidth import dp_bytes_per_step  # noqa: E402

from ddiloco_cli.protocol import ledger  # noqa: E402

import benchlib  # noqa: E402

TARGET_RATIO = 300.0  # issue 12: >= 300x less than data-parallel at P = H = 24, M = 4


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", choices=sorted(benchlib.PACED_TASKS), default="tiny")
    ap.add_argument("--learners", "-M", type=int, default=4)
    ap.add_argument("--slowdown", type=float, default=1.5, help="step time of the odd learners / the others'")
    ap.add_argument("--steps", type=int, default=240, help="inner steps per learner (the run's total_steps)")
    ap.add_argument("--skip-steps", type=int, default=48, help="the steady window starts at this step")
    ap.add_argument("--fragments", "-P", type=int, default=24)
    ap.add_argument("--sync-every", "-H", type=int, default=24)
    ap.add_argument("--overlap-steps", type=int, default=2, help="tau")
    ap.add_argument("--codec", default="int4", help="upload codec")
    ap.add_argument("--codec-block", type=int, default=None, help="default: the run's (64 for int4)")
    ap.add_argument("--codec-qmax", type=int, default=None, help="default: the run's (3 for int4)")
    ap.add_argument("--codec-density", type=float, default=None, help="sparse: default the run's (0.02)")
    ap.add_argument("--publish-codec", default=None, help="default: the run's (= --codec)")
    ap.add_argument("--publish-density", type=float, default=None,
                    help="sparse published deltas: default the run's (= --codec-density)")
    ap.add_argument("--keyframe-every", type=int, default=None, help="default: the run's")
    ap.add_argument("--keyframe-rule", choices=["every", "size"], default=None, help="default: the run's")
    ap.add_argument("--grace-gamma", type=float, default=None, help="default: the run's")
    ap.add_argument("--grace-max", type=float, default=None, help="default: the run's")
    ap.add_argument("--batch-size", type=int, default=None, help="default: the task's")
    ap.add_argument("--syncer-poll", type=float, default=None, help="`sync --poll` (default: its own)")
    ap.add_argument("--workdir", default=None, help="the run goes here (default: a temp dir, removed after)")
    ap.add_argument("--timeout-s", type=float, default=1800)
    ap.add_argument("--json", dest="json_path", default=None)
    args = ap.parse_args(argv)
    if args.learners < 2 or args.steps <= args.skip_steps or args.slowdown < 1:
        ap.error("need --learners >= 2, --steps > --skip-steps and --slowdown >= 1")
    return args


def steady_window(beats: list[dict], *, skip_steps: int, total_steps: int) -> tuple[dict, dict]:
    """(first, last) heartbeats of a learner's window: from its first heartbeat at a step
    >= skip_steps (or, in a run too short for that, its earliest one: a learner writes
    its first heartbeat after the bootstrap download) to its latest one before step
    total_steps, where it stops and flushes every fragment's unsent progress ([L7]):
    P partial contributions at once, which a longer run would amortise."""
    ordered = sorted(beats, key=lambda b: b["time_s"])
    last = next((b for b in reversed(ordered) if b["step"] < total_steps), ordered[-1])
    first = next((b for b in ordered if b["step"] >= skip_steps and b["step"] < last["step"]), ordered[0])
    return first, last


def measured_window(beats: list[dict], *, skip_steps: int, total_steps: int) -> tuple[dict, dict, bool]:
    """(first, last, steady): the steady window, or, when a run is too short for two heartbeats
    in it (a fast learner writes one a second), the whole run from the earliest heartbeat to the
    final one (steady False). Raises RuntimeError when even that has no steps."""
    first, last = steady_window(beats, skip_steps=skip_steps, total_steps=total_steps)
    if last["step"] > first["step"]:
        return first, last, True
    first, last = min(beats, key=lambda b: b["time_s"]), max(beats, key=lambda b: b["time_s"])
    if last["step"] <= first["step"]:
        raise RuntimeError("a learner made no steps between its heartbeats; raise --steps")
    return first, last, False


def learner_figures(first: dict, last: dict, *, num_fragments: int, sync_every: int, dp_Bps: float) -> dict:
    """Bytes per step and versions per fragment per cycle between two heartbeats of one learner."""
    steps = last["step"] - first["step"]
    up = (last["bytes_up"] - first["bytes_up"]) / steps
    down = (last["bytes_down"] - first["bytes_down"]) / steps
    advanced = sum(last["versions"].get(p, 0) - v for p, v in first["versions"].items())
    return {"steps": steps, "bytes_up_per_step": up, "bytes_down_per_step": down,
            "dp_bytes_per_step": dp_Bps, "ratio_vs_dp": dp_Bps / (up + down) if up + down else math.inf,
            "down_over_up": down / up if up else None,
            "versions_per_fragment_per_cycle": advanced / num_fragments / (steps / sync_every)}


def manifest_figures(manifests: list[dict], *, fragment_numel: list[int]) -> dict:
    """Committed versions and payload sizes (version 0, written by init, left out)."""
    deltas = [(m["fragment"], e["size"]) for m in manifests if m["version"] > 0
              for e in m["payloads"] if e["kind"] == "delta"]
    fulls = [(m["fragment"], e["size"]) for m in manifests if m["version"] > 0
             for e in m["payloads"] if e["kind"] == "full"]
    per_param = lambda xs: sum(s / fragment_numel[p] for p, s in xs) / len(xs) if xs else None  # noqa: E731
    versions = sum(1 for m in manifests if m["version"] > 0)
    return {"versions": versions, "delta_payloads": len(deltas),
            # what the syncer uploads per version, keyframes included (B per parameter of its fragment)
            "published_bytes_per_param_per_version": (sum(s / fragment_numel[p] for p, s in deltas + fulls) / versions
                                                      if versions else None),
            "keyframe_payloads": len(fulls), "mean_delta_bytes": sum(s for _, s in deltas) / max(1, len(deltas)),
            "mean_keyframe_bytes": sum(s for _, s in fulls) / max(1, len(fulls)),
            "delta_bytes_per_param": per_param(deltas), "keyframe_bytes_per_param": per_param(fulls)}


def run_traffic(args, *, workdir: str) -> dict:
    ids = [f"l{i}" for i in range(args.learners)]
    cluster = benchlib.Cluster(os.path.join(workdir, "run"))
    task_path, task = benchlib.PACED_TASKS[args.task]
    batch_size = args.batch_size or task.default_batch_size
    step_s = benchlib.measure_step_s(task, batch_size=batch_size)
    flags = dict(task=task_path, fragments=args.fragments, sync_every=args.sync_every,
                 overlap_steps=args.overlap_steps, codec=args.codec, codec_block=args.codec_block,
                 codec_qmax=args.codec_qmax, codec_density=args.codec_density, publish_codec=args.publish_codec,
                 publish_density=args.publish_density, keyframe_every=args.keyframe_every,
                 keyframe_rule=args.keyframe_rule, grace_gamma=args.grace_gamma, grace_max=args.grace_max,
                 total_steps=args.steps, batch_size=batch_size, heartbeat=1, lease=6)
    samples: dict[str, dict[float, dict]] = {lid: {} for lid in ids}
    t0 = time.monotonic()
    try:
        run = cluster.init(**flags)
        cluster.start_syncer(*(["--poll", str(args.syncer_poll)] if args.syncer_poll else []))
        for i, lid in enumerate(ids):
            cluster.start_learner(lid, env=benchlib.slow_env(step_s, args.slowdown) if i % 2 else None)

        def sample(c: benchlib.Cluster) -> None:
            for lid, hb in c.heartbeats().items():
                if lid in samples:
                    samples[lid][hb["time_s"]] = hb

        cluster.wait_learners_finished(ids, timeout_s=args.timeout_s, on_tick=sample)
        train_s = time.monotonic() - t0
        sample(cluster)
        cluster.stop_syncer()
        manifests = cluster.manifests()
        plan = ledger.read_plan(cluster.store, run_id=run["run_id"])
    finally:
        cluster.close()
    num_params = plan.total_numel()
    dp_Bps = 2 * dp_bytes_per_step(num_params, args.learners)  # sent and received
    P, H = int(run["num_fragments"]), int(run["sync_every"])
    learners = {}
    for i, lid in enumerate(ids):
        beats = list(samples[lid].values())
        final = max(beats, key=lambda b: b["time_s"])
        *window, steady = measured_window(beats, skip_steps=args.skip_steps, total_steps=args.steps)
        if not steady:
            print(f"learner {lid}: no steps between two heartbeats of the steady window; its figures are "
                  f"the whole run's (bootstrap and stop flush included): raise --steps", file=sys.stderr)
        fig = learner_figures(*window, num_fragments=P, sync_every=H, dp_Bps=dp_Bps)
        total = final["bytes_up"] + final["bytes_down"]
        learners[lid] = {**fig, "paced": args.slowdown if i % 2 else 1.0, "window_steps": [window[0]["step"], window[1]["step"]],
                         "steady_window": steady,
                         "total_bytes_up": final["bytes_up"], "total_bytes_down": final["bytes_down"],
                         "total_steps": final["step"], "num_contributions": final["num_contributions"],
                         "contribution_bytes": final["bytes_up"] / max(1, final["num_contributions"]),
                         "total_ratio_vs_dp": dp_Bps * final["step"] / total if total else math.inf}
    steps = sum(r["steps"] for r in learners.values())
    moved = sum((r["bytes_up_per_step"] + r["bytes_down_per_step"]) * r["steps"] for r in learners.values())
    numel = [plan.fragment_numel(p) for p in range(P)]
    mf = manifest_figures(manifests, fragment_numel=numel)
    mean_steps = sum(r["total_steps"] for r in learners.values()) / len(learners)
    mf["versions_per_fragment_per_cycle"] = mf["versions"] / P / (mean_steps / H)
    mf["contribution_bytes_per_param"] = (sum(r["contribution_bytes"] for r in learners.values()) / len(learners)
                                          / (num_params / P))
    return {
        "settings": {k: v for k, v in vars(args).items() if k != "json_path"},
        "run": {k: run.get(k) for k in ("num_fragments", "sync_every", "overlap_steps", "codec", "codec_block", "codec_qmax", "codec_density", "publish_codec",
                                    "publish_density", "keyframe_every", "keyframe_rule", "quorum", "grace_gamma", "grace_max_s")},
        "num_params": num_params, "step_s_unpaced": step_s, "train_s": train_s,
        "dp_bytes_per_step": dp_Bps, "learners": learners,
        "ratio_vs_dp": dp_Bps * steps / moved, "target_ratio": TARGET_RATIO,
        "target_met": dp_Bps * steps / moved >= TARGET_RATIO, "manifests": mf, "load_end": os.getloadavg(),
    }


def print_report(out: dict) -> None:
    rows = [[lid, f"{r['paced']:g}x", r["steps"], r["bytes_up_per_step"], r["bytes_down_per_step"],
             r["dp_bytes_per_step"], f"{r['ratio_vs_dp']:.0f}x", f"{r['versions_per_fragment_per_cycle']:.2f}",
             f"{r['total_ratio_vs_dp']:.0f}x"] for lid, r in out["learners"].items()]
    print(benchlib.fmt_table(["learner", "pace", "steps", "up B/step", "down B/step", "DP B/step", "vs DP",
                              "versions/frag/cycle", "whole run vs DP"], rows))
    s, m = out["settings"], out["manifests"]
    print(f"\nall learners, steady window: {out['ratio_vs_dp']:.0f}x less than data-parallel "
          f"(target >= {TARGET_RATIO:.0f}x: {'met' if out['target_met'] else 'NOT met'})")
    print(f"syncer: {m['versions']} versions = {m['versions_per_fragment_per_cycle']:.2f} per fragment per cycle; "
          f"delta {m['mean_delta_bytes']:.0f} B ({m['delta_bytes_per_param']:.3f} B/param), "
          f"{m['keyframe_payloads']} keyframes of {m['mean_keyframe_bytes']:.0f} B "
          f"({m['published_bytes_per_param_per_version'] or 0:.3f} B/param published per version); contributions "
          f"{m['contribution_bytes_per_param']:.3f} B/param")
    print(f"settings: M={s['learners']} (odd ones {s['slowdown']:g}x slower) P={out['run']['num_fragments']} "
          f"H={out['run']['sync_every']} tau={out['run']['overlap_steps']} codec={out['run']['codec']}/{out['run']['codec_block']} qmax={out['run']['codec_qmax']} "
          f"publish={out['run']['publish_codec']} keyframe_every={out['run']['keyframe_every']} "
          f"keyframe_rule={out['run'].get('keyframe_rule', 'every')} "
          f"steps={s['steps']} (window from {s['skip_steps']}); {s['task']} GPT {out['num_params']:,} params, "
          f"{out['step_s_unpaced'] * 1e3:.0f} ms/step unpaced; {out['train_s']:.0f} s; {benchlib.load_text()}")


def main(argv=None) -> dict:
    args = parse_args(argv)
    benchlib.exit_on_sigterm()  # so the Cluster's finally kills its processes
    torch.set_num_threads(1)
    workdir = args.workdir or tempfile.mkdtemp(prefix="bench_traffic_")
    out = run_traffic(args, workdir=workdir)
    print_report(out)
    return benchlib.write_result(out, json_path=args.json_path, workdir=workdir, keep_workdir=bool(args.workdir))


if __name__ == "__main__":
    main()
