"""Learner memory: where a learner's peak over the plain loop's goes (glibc's heap, step by step).

Each arm is a fresh process on the same task as ``bench_overhead.py`` (``mid``: the 3.2M-param
GPT, 1 torch thread, P = H = 24, int4, a real ``ddiloco sync`` serving the learner on a local
directory). Every step it records the process's VmRSS / VmHWM and glibc's ``mallinfo2``: the
bytes the heap holds from the system, the bytes in use by live allocations, and the free bytes
the heap keeps. The ddiloco arm runs once per variant, an environment given as NAME:VAR=VALUE
(a malloc setting, ``DDILOCO_MALLOC_TUNING=0``, ...); the plain loop is the reference.

    .venv/bin/python scripts/bench_learner_memory.py
    .venv/bin/python scripts/bench_learner_memory.py --variants 'tuned,untuned:DDILOCO_MALLOC_TUNING=0,one-arena:MALLOC_ARENA_MAX=1' --reps 2 --json /tmp/mem.json

What it shows (docs/results.md, "Learner overhead"): the peak over the plain loop's is the
learner's live state (the fp32 base and error-feedback residual of every fragment, 2 x 4 bytes a
parameter) plus heap the allocator keeps free, which grows for the first few H cycles and then
levels off.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "scripts"))


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                 "fsmblks", "uordblks", "fordblks", "keepcost")]


def _mallinfo():
    """() -> {heap_mb, in_use_mb, free_mb} from glibc's mallinfo2 (all arenas; mmapped blocks
    count as heap and in use), or {} where there is none (not glibc, or glibc < 2.33)."""
    try:
        libc = ctypes.CDLL(None)
        fn = libc.mallinfo2
    except (OSError, AttributeError):
        return lambda: {}
    fn.restype = _MallInfo2

    def read() -> dict:
        m = fn()
        mb = 1 / 2**20
        return {"heap_mb": (m.arena + m.hblkhd) * mb, "in_use_mb": (m.uordblks + m.hblkhd) * mb,
                "free_mb": m.fordblks * mb}
    return read


def _status() -> dict:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                name, value = line.split(":")
                out[name.lower() + "_mb"] = int(value.split()[0]) / 1024
    return out


def worker(arm: str, url: str, steps: int, out: str) -> None:
    import torch

    import bench_overhead as bo

    torch.set_num_threads(1)
    mallinfo = _mallinfo()
    series: list[dict] = []

    def record() -> None:
        series.append({**_status(), **mallinfo()})

    if arm == "plain":
        bo.plain_loop(steps, on_step=record)
        series.pop(0)  # the one before the first step
    else:
        from ddiloco_cli.learner import Learner, LearnerOptions
        from ddiloco_cli.store import open_store

        learner = Learner(open_store(url), options=LearnerOptions(learner_id="mem", steps=steps, log_every=10**9,
                                                                  task=bo.TASKS["mid"][0]),
                          on_progress=lambda _: record())
        learner.train()
    with open(out, "w") as f:
        json.dump(series, f)


def run_arm(arm: str, env: dict[str, str], steps: int, workdir: str, name: str) -> list[dict]:
    import benchlib
    import bench_overhead as bo

    url = os.path.join(workdir, f"run-{name}")
    bo.init_bench_run(url)
    launcher = benchlib.Launcher(workdir, cwd=REPO)
    try:
        if arm != "plain":
            launcher.start(f"syncer-{name}", "sync", url)
        out = os.path.join(workdir, f"{name}.json")
        subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", arm, "--url", url, "--steps",
                        str(steps), "--out", out], check=True, cwd=REPO,
                       env={**os.environ, "OMP_NUM_THREADS": "1", **env})
        with open(out) as f:
            return json.load(f)
    finally:
        launcher.close()


def summary(series: list[dict]) -> dict:
    last = series[-1]
    return {"peak_mb": max(s["vmhwm_mb"] for s in series), **{k: last.get(k) for k in ("heap_mb", "in_use_mb",
                                                                                         "free_mb")},
            "peak_by_step": {str(i + 1): series[i]["vmhwm_mb"] for i in (0, 23, 47, 95, len(series) - 1)
                             if i < len(series)}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--variants", default="tuned",
                    help="comma-separated NAME or NAME:VAR=VALUE[;VAR=VALUE] for the ddiloco arm")
    ap.add_argument("--json", default=None)
    ap.add_argument("--worker", choices=("plain", "ddiloco"), help=argparse.SUPPRESS)
    ap.add_argument("--url", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker, args.url, args.steps, args.out)
    variants = []
    for item in args.variants.split(","):
        name, _, env = item.partition(":")
        variants.append((name, dict(kv.split("=", 1) for kv in env.split(";") if kv)))
    arms = [("plain", "plain", {})] + [("ddiloco", name, env) for name, env in variants]
    results: dict[str, list[dict]] = {name: [] for _, name, _ in arms}
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory(prefix="ddiloco-mem-") as workdir:
        for rep in range(args.reps):
            for arm, name, env in arms:
                results[name].append(summary(run_arm(arm, env, args.steps, workdir, f"{name}-{rep}")))
                print(f"  rep {rep} {name:<12} peak {results[name][-1]['peak_mb']:6.0f} MB", flush=True)
    load.append(os.getloadavg()[0])
    plain_peak = statistics.median(r["peak_mb"] for r in results["plain"])
    print(f"\nLearner memory, task mid (3.2M params), {args.steps} steps, median of {args.reps} runs, "
          f"load {load[0]:.2f}->{load[1]:.2f}; heap / in use / free: glibc's mallinfo2 at the last step")
    print(f"{'arm':<14}{'peak MB':>9}{'/ plain':>9}{'heap MB':>9}{'in use':>9}{'free':>9}   peak by step")
    table = {}
    for _, name, env in arms:
        rs = results[name]
        med = {k: statistics.median(r[k] for r in rs if r[k] is not None) if any(r[k] is not None for r in rs)
               else float("nan") for k in ("peak_mb", "heap_mb", "in_use_mb", "free_mb")}
        table[name] = {**med, "ratio": med["peak_mb"] / plain_peak, "env": env, "runs": rs}
        by_step = ", ".join(f"{k}: {v:.0f}" for k, v in rs[0]["peak_by_step"].items())
        print(f"{name:<14}{med['peak_mb']:>9.0f}{table[name]['ratio']:>8.3f}x{med['heap_mb']:>9.0f}"
              f"{med['in_use_mb']:>9.0f}{med['free_mb']:>9.0f}   {by_step}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"steps": args.steps, "reps": args.reps, "load": load, "arms": table}, f, indent=1)


if __name__ == "__main__":
    main()
