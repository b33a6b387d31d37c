"""What the S3 client costs a learner: client CPU per request of the S3 store, with its lean
request path (store/s3fast.py: our SigV4 signer and a urllib3 pool on the calling thread) and
through s3fs alone (``-o fast_requests=false``: aiobotocore on the store's event-loop thread);
and, with --learner, a real `ddiloco learn` on that bucket, either way, reporting what the
learner says ddiloco costs its steps (its heartbeat's fields, which count the thread that makes
the bucket's requests).

Requests: moto's S3 server in its own process, on CPU 1 where there are two (it stands for the
service: its CPU is not the client's); this process on CPU 0. The two arms alternate in blocks
of --block requests of each kind (A/B interleaved); CPU is this process's (all threads: the
s3fs arm's requests run on its loop thread), wall the caller's. The kinds are a learner's per
step: a manifest GET (1.3 kB), the GET of the next, missing one, a bounded GET, a
contribution's create-only PUT (21 kB), a heartbeat PUT (1 kB). First, the signer alone: CPU per
signature of ours (store/sigv4.py) against botocore's S3SigV4Auth, which the path used before.

Learner (--learner): P = H = 24, int4, the 3.2M-parameter GPT, 1 torch thread on CPU 0, a
`ddiloco sync` and moto on CPU 1; one learner process per arm and round, alternating.

    python scripts/bench_s3_client.py                         # ~1 min
    python scripts/bench_s3_client.py --learner --rounds 2    # + ~4 min
    python scripts/bench_s3_client.py --requests 400 --json /tmp/s3client.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import Launcher, moto_for_this_process, pinned, write_result  # noqa: E402

BUCKET = "bench-s3-client"
ARMS = ("fast", "s3fs")


def request_costs(n: int, block: int) -> dict:
    """Client CPU and wall per request, each kind, each arm (interleaved blocks)."""
    from ddiloco_cli.store import open_store
    from ddiloco_cli.store.base import NotFound

    prefix = f"req{time.time_ns()}"
    stores = {arm: open_store(f"s3://{BUCKET}/{prefix}", options={"fast_requests": arm == "fast"}) for arm in ARMS}
    manifest, contribution, beat = os.urandom(1300), os.urandom(21000), os.urandom(1000)
    stores["fast"].put("m/1.json", manifest)

    def missing(s, i):
        try:
            s.get("m/2.json")
        except NotFound:
            return
        raise AssertionError("m/2.json exists")

    kinds = {
        "GET manifest 1.3 kB": lambda s, i: s.get("m/1.json"),
        "GET missing": missing,
        "GET bounded": lambda s, i: s.get("m/1.json", max_bytes=1 << 20),
        "create-only PUT 21 kB": lambda s, i: s.put_if_absent(f"c/{i}-{time.time_ns()}", contribution),
        "PUT 1 kB": lambda s, i: s.put("hb.json", beat),
    }
    out = {}
    for kind, call in kinds.items():
        cpu = {arm: [] for arm in ARMS}
        wall = {arm: [] for arm in ARMS}
        for arm in ARMS:
            call(stores[arm], -1)  # connections up
        for b in range(0, n, block):
            for arm in (ARMS if (b // block) % 2 == 0 else ARMS[::-1]):
                c0, t0 = time.process_time(), time.perf_counter()
                for i in range(b, min(n, b + block)):
                    call(stores[arm], i)
                m = min(n, b + block) - b
                cpu[arm].append((time.process_time() - c0) / m)
                wall[arm].append((time.perf_counter() - t0) / m)
        out[kind] = {arm: {"cpu_ms": 1e3 * statistics.median(cpu[arm]), "wall_ms": 1e3 * statistics.median(wall[arm])}
                     for arm in ARMS}
    return out


def signer_costs(n: int) -> dict:
    """CPU per signature of a GET and a 21 kB PUT: the lean path's signer (store/sigv4.py) against
    botocore's S3SigV4Auth as the path used it before (a request object, ``add_auth``), alternating
    in blocks of 50."""
    from botocore.auth import S3SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    from ddiloco_cli.store.sigv4 import Signer

    creds = Credentials("AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY", "token")
    base, path = "http://127.0.0.1:5000", "/bucket/run/fragments/p00003/manifests/00000000000000000012.json"
    ours = Signer(creds.get_frozen_credentials, "us-east-1")
    bodies = {"GET": None, "PUT 21 kB": os.urandom(21000)}

    def botocore_sign(method: str, body: bytes | None) -> None:
        request = AWSRequest(method=method, url=base + path, data=body, headers={"User-Agent": "bench"})
        S3SigV4Auth(creds.get_frozen_credentials(), "s3", "us-east-1").add_auth(request)
        dict(request.headers.items())

    arms = {"ours": lambda m, b: ours.sign(m, "127.0.0.1:5000", path, {"User-Agent": "bench"}, b),
            "botocore": botocore_sign}
    out = {}
    for kind, body in bodies.items():
        method = kind.split()[0]
        cpu: dict[str, list[float]] = {a: [] for a in arms}
        for b in range(0, n, 50):
            for arm, sign in (arms.items() if (b // 50) % 2 == 0 else reversed(arms.items())):
                c0 = time.process_time()
                for _ in range(50):
                    sign(method, body)
                cpu[arm].append((time.process_time() - c0) / 50)
        out[kind] = {arm: 1e3 * statistics.median(v) for arm, v in cpu.items()}
    return out


def learner_costs(workdir: str, rounds: int, steps: int) -> list[dict]:
    """One `ddiloco learn` process per arm and round on one run, the syncer serving it (the
    bucket's endpoint and credentials from the environment)."""
    from bench_overhead import init_bench_run

    from ddiloco_cli.ops.observe import run_status
    from ddiloco_cli.store import open_store

    url = f"s3://{BUCKET}/learn{time.time_ns()}"
    init_bench_run(url)
    env = {**os.environ}
    os.makedirs(os.path.join(workdir, "logs"), exist_ok=True)
    launcher = Launcher(os.path.join(workdir, "logs"), env=env, cwd=str(Path(__file__).resolve().parent.parent))
    syncer = launcher.spawn("syncer", [*pinned(1), str(Path(sys.executable).with_name("ddiloco")), "sync", url])
    out = []
    try:
        for r in range(rounds):
            for arm in (ARMS if r % 2 == 0 else ARMS[::-1]):
                learner_id = f"{arm}-{r}"
                cmd = [*pinned(0), str(Path(sys.executable).with_name("ddiloco")), "learn", url, "--steps", str(steps),
                       "--learner-id", learner_id, "--task", "scripts/benchtasks.py:mid", "--threads", "1"]
                if arm == "s3fs":
                    cmd += ["-o", "fast_requests=false"]
                load = os.getloadavg()[0]
                subprocess.run(cmd, env=env, cwd=launcher.cwd, check=True, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, timeout=1200)
                rows = {row["learner_id"]: row for row in run_status(open_store(url))["learners"]}
                row = rows[learner_id]
                rec = {"arm": arm, "round": r, "load": load, "step_time_ms": 1e3 * row["step_time_s"]}
                rec.update({k: row.get(k) for k in ("sync_step_ms", "sync_step_cpu_ms", "sync_worker_cpu_ms",
                                                    "sync_share")})
                out.append(rec)
                print(f"  round {r} {arm:5s}: step {rec['step_time_ms']:.1f} ms, ddiloco {rec['sync_share']:.1%} "
                      f"(workers' CPU {rec['sync_worker_cpu_ms']:.2f} ms a step)", file=sys.stderr, flush=True)
    finally:
        syncer.terminate()
        syncer.wait(timeout=60)
        launcher.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=200, help="requests of each kind per arm")
    ap.add_argument("--block", type=int, default=20, help="requests of one arm in a row")
    ap.add_argument("--learner", action="store_true", help="also a real learner on the bucket, each arm")
    ap.add_argument("--rounds", type=int, default=2, help="learner processes per arm (--learner)")
    ap.add_argument("--steps", type=int, default=150, help="inner steps of each learner (--learner)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    workdir = tempfile.mkdtemp(prefix="bench_s3_client_")
    launcher = moto_for_this_process(workdir, bucket=BUCKET)
    if pinned(0):
        os.sched_setaffinity(0, {0})
    load0 = os.getloadavg()[0]
    result: dict = {"load_before": load0}
    try:
        signers = signer_costs(max(100, 5 * args.requests))
        result["signers"] = signers
        print("SigV4 signing, CPU per request (ms): " + "; ".join(
            f"{kind} ours {v['ours']:.3f} botocore {v['botocore']:.3f} ({v['botocore'] / v['ours']:.1f}x)"
            for kind, v in signers.items()))
        costs = request_costs(args.requests, args.block)
        result["requests"] = costs
        print(f"\nS3 client CPU per request (this process, all threads; moto on its own CPU), median of blocks of "
              f"{args.block}, {args.requests} a kind and arm; load {load0:.2f} -> {os.getloadavg()[0]:.2f}")
        print(f"{'request':24s} {'fast CPU ms':>11s} {'s3fs CPU ms':>11s} {'ratio':>6s} | {'fast wall':>9s} {'s3fs wall':>9s}")
        for kind, arms in costs.items():
            f, s = arms["fast"], arms["s3fs"]
            print(f"{kind:24s} {f['cpu_ms']:>11.3f} {s['cpu_ms']:>11.3f} {s['cpu_ms'] / f['cpu_ms']:>5.2f}x | "
                  f"{f['wall_ms']:>9.3f} {s['wall_ms']:>9.3f}")
        if args.learner:
            os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))
            runs = learner_costs(workdir, args.rounds, args.steps)
            result["learner"] = runs
            print("\nA learner on this S3 bucket (its own report, the last heartbeat), median over rounds:")
            for arm in ARMS:
                rs = [r for r in runs if r["arm"] == arm]
                print(f"  {arm:5s}: ddiloco {statistics.median(r['sync_share'] for r in rs):.1%} of a step; workers' "
                      f"CPU {statistics.median(r['sync_worker_cpu_ms'] for r in rs):.2f} ms a step; step "
                      f"{statistics.median(r['step_time_ms'] for r in rs):.1f} ms")
    finally:
        launcher.close()
        write_result(result, json_path=args.json, workdir=workdir, keep_workdir=False)


if __name__ == "__main__":
    main()
