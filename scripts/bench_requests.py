"""Request-rate benchmark: S3 requests a learner makes per step and a syncer per second.

Every request costs money and a round trip on S3/GCS. This runs real processes
(`ddiloco init`, one `ddiloco sync`, one `ddiloco learn` on benchlib's paced tiny
GPT) against the tests' moto S3 server (tests/support/moto_proc.py), which logs every
request with the process that made it (DDILOCO_TEST_MOTO_LOG; each process names
itself by AWS_SDK_UA_APP_ID, the README's "S3 request log"). Counts are taken as
differences of the log between two moments, so start-up is left out:

1. idle syncer: the syncer alone (no learner has started), --idle-s seconds after
   --settle-s; requests per second by kind;
2. learner: from a heartbeat at step >= --skip-steps to the first one --window-s
   seconds later (each taken as it appears, so its step is current); its
   requests per step by kind (method and key family: the latest
   hint, manifests, payloads, contributions, its heartbeat and data state,
   metrics, ...), and the serving syncer's requests per second.

    python scripts/bench_requests.py                      # ~1.5 min
    python scripts/bench_requests.py --json /tmp/requests.json
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

import torch

SCRIPTS = Path(__file__).resolve().parent
sys.path.insert(0, str(SCRIPTS))
from ddiloco_cli.protocol import layout, ledger  # noqa: E402
from ddiloco_cli.store import open_store  # noqa: E402

import benchlib  # noqa: E402

MOTO_PROC = SCRIPTS.parent / "tests" / "support" / "moto_proc.py"
BUCKET = "ddiloco-bench-requests"
AWS_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
APP_ENV = "AWS_SDK_UA_APP_ID"

# key families, first match wins (substrings of the key)
FAMILIES = [("/latest.json", "latest hint"), ("/manifests/", "manifest"), ("/payloads/", "payload"),
            ("contributions/", "contribution"), ("/heartbeat.json", "learner heartbeat"),
            ("/state.json", "learner state"), ("syncers/heartbeats/", "syncer heartbeat"),
            ("syncers/epochs/", "epoch"), ("metrics/", "metrics"), ("tmp/clock/", "clock probe"),
            ("learners/", "learners"), ("quarantine/", "quarantine"), ("checkpoints/", "checkpoint"),
            ("admissions/", "admissions")]


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fragments", "-P", type=int, default=24)
    ap.add_argument("--sync-every", "-H", type=int, default=24)
    ap.add_argument("--overlap-steps", type=int, default=2, help="tau")
    ap.add_argument("--heartbeat", type=float, default=2.0, help="the run's heartbeat_s")
    ap.add_argument("--lease", type=float, default=10.0, help="the run's lease_s")
    ap.add_argument("--pace-ms", type=float, default=200.0, help="sleep per learner step (stands in for compute)")
    ap.add_argument("--settle-s", type=float, default=5.0, help="idle syncer: left out after its first heartbeat")
    ap.add_argument("--idle-s", type=float, default=20.0, help="idle syncer: the counted window")
    ap.add_argument("--skip-steps", type=int, default=24, help="learner: the window starts at this step")
    ap.add_argument("--window-s", type=float, default=30.0, help="learner: the counted window")
    ap.add_argument("--timeout-s", type=float, default=300.0)
    ap.add_argument("--workdir", default=None, help="logs and the request log go here (default: a temp dir, removed)")
    ap.add_argument("--json", dest="json_path", default=None)
    return ap.parse_args(argv)


def request_kind(method: str, target: str) -> str:
    """'METHOD family' of one logged request (a GET with list-type= is a LIST of its prefix)."""
    parts = urlsplit(target)
    query = parse_qs(parts.query)
    if method == "GET" and "list-type" in query:
        method, key = "LIST", query.get("prefix", [""])[0]
    else:
        key = unquote(parts.path)
    family = next((name for needle, name in FAMILIES if needle in key), "other")
    return f"{method} {family}"


def count_requests(log_path: str) -> Counter:
    """(app, kind) -> requests in the log so far."""
    counts: Counter = Counter()
    try:
        with open(log_path) as f:
            for line in f:
                fields = line.rstrip("\n").split("\t")
                if len(fields) >= 3:
                    counts[(fields[0], request_kind(fields[1], fields[2]))] += 1
    except FileNotFoundError:
        pass
    return counts


def by_kind(counts: Counter, app: str) -> dict[str, int]:
    return {kind: n for (a, kind), n in sorted(counts.items()) if a == app and n}


def wait_until(cond, *, timeout_s: float, what: str, launcher: benchlib.Launcher) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            logs = "".join(f"\n--- {n} ---\n{launcher.log(n)[-2000:]}" for n in ("syncer", "learner"))
            raise RuntimeError(f"timed out waiting for {what}{logs}")
        time.sleep(0.25)


def start_logging_moto(launcher: benchlib.Launcher, *, log_path: str, timeout_s: float = 60) -> str:
    """tests/support/moto_proc.py (one request at a time, every request logged to ``log_path``) as
    process "moto"; returns its endpoint URL once bucket BUCKET exists."""
    import boto3

    proc = launcher.spawn("moto", [sys.executable, str(MOTO_PROC)], env={"DDILOCO_TEST_MOTO_LOG": log_path})
    deadline = time.monotonic() + timeout_s
    while not launcher.log("moto").startswith("http://"):
        if time.monotonic() > deadline or proc.poll() is not None:
            raise RuntimeError(f"the moto server did not start: {launcher.log('moto')[-2000:]}")
        time.sleep(0.1)
    endpoint = launcher.log("moto").split()[0]
    boto3.client("s3", endpoint_url=endpoint, **{k.lower(): v for k, v in AWS_ENV.items() if k != "AWS_DEFAULT_REGION"},
                 region_name=AWS_ENV["AWS_DEFAULT_REGION"]).create_bucket(Bucket=BUCKET)
    return endpoint


def run_requests(args, *, workdir: str) -> dict:
    log_path = os.path.join(workdir, "requests.tsv")
    launcher = benchlib.Launcher(workdir, env={**os.environ, **AWS_ENV})
    try:
        endpoint = start_logging_moto(launcher, log_path=log_path)
        env = {"AWS_ENDPOINT_URL": endpoint}
        os.environ.update({**AWS_ENV, **env, APP_ENV: "bench"})  # this process's own reads count as "bench"
        launcher.env.update(env)
        url = f"s3://{BUCKET}/run"
        init = launcher.run("init", url, "--task", benchlib.PACED_TASK, "--fragments", str(args.fragments),
                            "--sync-every", str(args.sync_every), "--overlap-steps", str(args.overlap_steps),
                            "--codec", "int4", "--heartbeat", str(args.heartbeat), "--lease", str(args.lease),
                            "--batch-size", "16", "--no-require-signatures", env={APP_ENV: "init"}, timeout_s=300)
        if init.returncode != 0:
            raise RuntimeError(f"ddiloco init failed:\n{init.stdout}\n{init.stderr}")
        store = open_store(url)

        launcher.start("syncer", "sync", url, "--no-gc", env={APP_ENV: "syncer"})
        wait_until(lambda: ledger.read_heartbeats(store, layout.SYNCER_HEARTBEAT_PREFIX, "syncer_heartbeat"),
                   timeout_s=args.timeout_s, what="the syncer's heartbeat", launcher=launcher)
        time.sleep(args.settle_s)
        c0, t0 = count_requests(log_path), time.monotonic()
        time.sleep(args.idle_s)
        c1, t1 = count_requests(log_path), time.monotonic()
        idle = {k: n / (t1 - t0) for k, n in by_kind(c1 - c0, "syncer").items()}

        launcher.start("learner", "learn", url, "--learner-id", "a", "--threads", "1", "--task", benchlib.PACED_TASK,
                       env={APP_ENV: "learner", benchlib.PACE_ENV: str(args.pace_ms)})

        def step() -> int:
            beats = ledger.read_heartbeats(store, layout.LEARNER_HEARTBEAT_PREFIX, "learner_heartbeat")
            return max((b.record["step"] for b in beats), default=0)

        def fresh() -> tuple[Counter, int, float]:
            """The counts as a new heartbeat appears: its step is then current (to within a
            poll, not a heartbeat interval)."""
            before = step()
            wait_until(lambda: step() != before, timeout_s=args.timeout_s, what="a learner heartbeat",
                       launcher=launcher)
            return count_requests(log_path), step(), time.monotonic()

        wait_until(lambda: step() >= args.skip_steps, timeout_s=args.timeout_s, what="the learner's steps",
                   launcher=launcher)
        c2, s2, t2 = fresh()
        time.sleep(args.window_s)
        c3, s3, t3 = fresh()
        if s3 <= s2:
            raise RuntimeError("the learner made no step in the window; raise --window-s")
        steps, seconds = s3 - s2, t3 - t2
        learner = {k: n / steps for k, n in by_kind(c3 - c2, "learner").items()}
        serving = {k: n / seconds for k, n in by_kind(c3 - c2, "syncer").items()}
    finally:
        launcher.close()
    return {"settings": {k: v for k, v in vars(args).items() if k != "json_path"},
            "idle_syncer_per_s": idle, "idle_syncer_total_per_s": sum(idle.values()),
            "learner_per_step": learner, "learner_total_per_step": sum(learner.values()),
            "learner_steps": steps, "learner_step_s": seconds / steps,
            "learner_total_per_s": sum(learner.values()) * steps / seconds,
            "serving_syncer_per_s": serving, "serving_syncer_total_per_s": sum(serving.values()),
            "load_end": os.getloadavg()}


def print_report(out: dict) -> None:
    kinds = sorted(set(out["learner_per_step"]) | set(out["idle_syncer_per_s"]) | set(out["serving_syncer_per_s"]))
    rows = [[k, out["learner_per_step"].get(k, 0.0), out["idle_syncer_per_s"].get(k, 0.0),
             out["serving_syncer_per_s"].get(k, 0.0)] for k in kinds]
    rows.append(["total", out["learner_total_per_step"], out["idle_syncer_total_per_s"],
                 out["serving_syncer_total_per_s"]])
    print(benchlib.fmt_table(["request", "learner /step", "idle syncer /s", "serving syncer /s"], rows))
    s = out["settings"]
    print(f"\nlearner: {out['learner_total_per_step']:.2f} requests per step ({out['learner_total_per_s']:.2f}/s at "
          f"{out['learner_step_s'] * 1e3:.0f} ms/step, {out['learner_steps']} steps); idle syncer: "
          f"{out['idle_syncer_total_per_s']:.2f} requests/s; P={s['fragments']} H={s['sync_every']} "
          f"tau={s['overlap_steps']} heartbeat {s['heartbeat']:g} s lease {s['lease']:g} s; {benchlib.load_text()}")


def main(argv=None) -> dict:
    args = parse_args(argv)
    benchlib.exit_on_sigterm()  # so the launcher's finally kills its processes
    torch.set_num_threads(1)
    workdir = args.workdir or tempfile.mkdtemp(prefix="bench_requests_")
    os.makedirs(workdir, exist_ok=True)
    out = run_requests(args, workdir=workdir)
    print_report(out)
    return benchlib.write_result(out, json_path=args.json_path, workdir=workdir, keep_workdir=bool(args.workdir))


if __name__ == "__main__":
    main()
