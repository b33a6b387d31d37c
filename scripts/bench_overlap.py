"""Overlap benchmark: how much learner time a thin link costs.

A moto S3 server (own process) holds the bucket; the syncer talks to it
directly (it sits next to the bucket); each learner reaches it through its own
throttling proxy (scripts/netem.py: token-bucket bandwidth per direction,
added one-way latency). One run, one syncer; learner sessions one after
another, each with a fresh learner id and its own link:

``--repeats`` times: first a session on an unlimited link (same latency)
measures what the run needs, per direction, in wire bytes per second (the
proxy's counters: payload plus HTTP, polls of hints, LISTs, heartbeats); then
one session on a link of k x that need for each k in ``--multiples`` (each
direction gets k x its own need; order alternates between repeats).

The need follows the step rate, and on a shared machine the step rate follows
the load, so each throttled session also reports k_eff_up: the uplink's
capacity over its unblocked time divided by the bytes it had to send (carried
+ growth of the upload backlog), i.e. the margin it really had.

From the learner's heartbeats (written every second) over a steady window
(steps > --skip-steps, until the last heartbeat before it leaves):
blocked = d(blocked_s) / d(wall) (seconds the loop waited because the upload
queue was full), utilisation = 1 - blocked, speed = steps/s relative to the
unlimited session of the same repeat, and the upload backlog (contributions
queued or in flight = sends due so far - contributions uploaded) at the start
and end of the window: a backlog that grows means the link cannot keep up, and
blocking follows once it passes the queue size (4) + 1.

Measured 2026-11-30 (2 shared cores, load 4-19 from other jobs, P=4 H=16 tau=2
int4, one learner, ~33 kB per contribution): at 20 ms one-way, 1.25x blocked
0.15% when steps took ~115 ms but 1.28% at ~100 ms/step; at 100 ms one-way,
1.25x blocked 7.8% and 2x 23.8% with the link half idle. The uplink is
latency-bound, not bandwidth-bound: one uploader thread sends one PUT at a
time, and each PUT costs two round trips (botocore sends "Expect:
100-continue") on top of its transfer.

    .venv/bin/python scripts/bench_overlap.py --json /tmp/overlap.json
    .venv/bin/python scripts/bench_overlap.py --latency-ms 100 --multiples 1.25,2 --repeats 1 --json /tmp/overlap100.json
    .venv/bin/python scripts/bench_overlap.py --steps 240 --repeats 1 --multiples 1.25   # quick look
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from netem import Direction, LinkProxy  # noqa: E402

from ddiloco_cli.learner.schedule import fragments_due  # noqa: E402
from ddiloco_cli.protocol import layout, records  # noqa: E402
from ddiloco_cli.store import open_store  # noqa: E402

from benchlib import Launcher, start_moto  # noqa: E402

BUCKET = "ddiloco-bench"


class Bench:
    def __init__(self, args: argparse.Namespace, log_dir: str):
        self.args, self.log_dir = args, log_dir
        self.launcher = Launcher(log_dir)
        self.url = f"s3://{BUCKET}/overlap-{uuid.uuid4().hex[:8]}"

    def start(self) -> None:
        self.endpoint = start_moto(self.launcher, bucket=BUCKET)
        self.port = int(self.endpoint.rsplit(":", 1)[1])
        aws = {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": "testing",
               "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
        os.environ.update(aws)  # this process reads the bucket too
        self.launcher.env.update(aws)
        a = self.args
        init = self.launcher.run("init", self.url, "--task", "ddiloco_cli.tasks.gpt:tiny", "-P", str(a.fragments),
                                 "-H", str(a.sync_every), "--overlap-steps", str(a.tau), "-K", "1",
                                 "--codec", a.codec, "--lr-schedule", "constant", "--total-steps", "0",
                                 "--heartbeat", "1", "--lease", "6", "--no-require-signatures")
        if init.returncode != 0:
            raise RuntimeError(f"ddiloco init failed ({init.returncode}):\n{init.stdout}\n{init.stderr}")
        self.launcher.start("syncer", "sync", self.url, "--poll", "0.2")
        self.store = open_store(self.url)

    def close(self) -> None:
        self.launcher.close()

    def heartbeat(self, learner_id: str) -> dict | None:
        try:
            return records.loads(self.store.get(layout.learner_heartbeat_key(learner_id)), "learner_heartbeat",
                                 where=learner_id)
        except Exception:  # noqa: BLE001 - not written yet
            return None

    def session(self, name: str, *, up_Bps: float | None, down_Bps: float | None) -> dict:
        """One learner session behind its own link; returns the steady-window figures."""
        a = self.args
        lat = a.latency_ms / 1e3
        burst = int(a.burst_kib * 1024)
        proxy = LinkProxy(("127.0.0.1", self.port), up=Direction(rate_Bps=up_Bps, latency_s=lat, burst_bytes=burst),
                          down=Direction(rate_Bps=down_Bps, latency_s=lat, burst_bytes=burst)).start()
        learner_id = f"{name}-{uuid.uuid4().hex[:4]}"
        load_before = os.getloadavg()[0]
        proc = self.launcher.start(learner_id, "learn", self.url, "--learner-id", learner_id, "--steps",
                                   str(a.steps), "--threads", "1", "-o", f"endpoint_url={proxy.endpoint_url}")
        beats: dict[float, dict] = {}
        wire: list[tuple[float, int, int]] = []
        deadline = time.monotonic() + a.timeout_s
        while proc.poll() is None:
            if time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"{learner_id} did not finish in {a.timeout_s}s; see {self.log_dir}")
            wire.append((time.time(), proxy.bytes_up, proxy.bytes_down))
            hb = self.heartbeat(learner_id)
            if hb is not None:
                beats[hb["time_s"]] = hb
            time.sleep(0.5)
        load_after = os.getloadavg()[0]
        proxy.stop()
        if proc.returncode != 0:
            raise RuntimeError(f"{learner_id} exited with {proc.returncode}; see {self.log_dir}/{learner_id}.log")
        window = [b for b in sorted(beats.values(), key=lambda b: b["time_s"])
                  if b["state"] == "running" and b["step"] > a.skip_steps]
        if len(window) < 2:
            raise RuntimeError(f"{learner_id}: fewer than 2 heartbeats in the steady window; raise --steps")
        first, last = window[0], window[-1]
        wall_s = last["time_s"] - first["time_s"]
        d = lambda k: last[k] - first[k]  # noqa: E731
        up0, down0 = wire_at(wire, first["time_s"])
        up1, down1 = wire_at(wire, last["time_s"])
        backlog = lambda b: sends_due(b["step"], a) - b["num_contributions"]  # noqa: E731
        return {
            "name": name, "learner_id": learner_id,
            "link_up_Bps": up_Bps, "link_down_Bps": down_Bps, "latency_ms": a.latency_ms,
            "window_s": wall_s, "steps": d("step"), "steps_per_s": d("step") / wall_s,
            "blocked_s": d("blocked_s"), "blocked_frac": d("blocked_s") / wall_s,
            "utilisation": 1 - d("blocked_s") / wall_s,
            "compute_ms_per_step": 1e3 * (wall_s - d("blocked_s")) / d("step"),
            "payload_up_Bps": d("bytes_up") / wall_s, "payload_down_Bps": d("bytes_down") / wall_s,
            "wire_up_Bps": (up1 - up0) / wall_s, "wire_down_Bps": (down1 - down0) / wall_s,
            "wire_up_bytes_per_step": (up1 - up0) / d("step"), "wire_down_bytes_per_step": (down1 - down0) / d("step"),
            "backlog_start": backlog(first), "backlog_end": backlog(last),
            # the uplink's real margin in this session: its capacity over the unblocked time / bytes the
            # session produced (carried + growth of the upload backlog); load changes the step rate, so
            # this can differ from the nominal multiple
            "k_eff_up": None if up_Bps is None else up_Bps * (wall_s - d("blocked_s")) / max(1.0, (up1 - up0) + max(
                0, backlog(last) - backlog(first)) * (up1 - up0) / max(1, d("num_contributions"))),
            "link_busy_up": None if up_Bps is None else (up1 - up0) / (up_Bps * wall_s),
            "link_busy_down": None if down_Bps is None else (down1 - down0) / (down_Bps * wall_s),
            "versions_received": last["versions"], "load_1min": [load_before, load_after],
        }


def sends_due(step: int, args: argparse.Namespace) -> int:
    """Contributions a learner that started at step 0 has queued after `step` steps."""
    return sum(len(fragments_due(t, num_fragments=args.fragments, sync_every=args.sync_every)) for t in range(1, step + 1))


def wire_at(samples: list[tuple[float, int, int]], t: float) -> tuple[float, float]:
    """Proxy byte counters at time t, linearly interpolated between samples."""
    for (t0, u0, d0), (t1, u1, d1) in zip(samples, samples[1:]):
        if t0 <= t <= t1:
            f = (t - t0) / (t1 - t0) if t1 > t0 else 0.0
            return u0 + f * (u1 - u0), d0 + f * (d1 - d0)
    _, u, d = samples[-1] if t > samples[-1][0] else samples[0]
    return u, d


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=600, help="inner steps per learner session")
    ap.add_argument("--skip-steps", type=int, default=40, help="steps before the steady window starts")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--multiples", default="1,1.25,2", help="link = k x the measured need, per direction")
    ap.add_argument("--latency-ms", type=float, default=20.0, help="one-way latency added each way")
    ap.add_argument("--burst-kib", type=float, default=16.0, help="token-bucket depth of the link")
    ap.add_argument("--fragments", "-P", type=int, default=4)
    ap.add_argument("--sync-every", "-H", type=int, default=16)
    ap.add_argument("--tau", type=int, default=2)
    ap.add_argument("--codec", default="int4")
    ap.add_argument("--timeout-s", type=float, default=600)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    multiples = [float(k) for k in args.multiples.split(",")]

    log_dir = tempfile.mkdtemp(prefix="bench_overlap-")
    bench = Bench(args, log_dir)
    sessions: list[dict] = []
    try:
        bench.start()
        for r in range(args.repeats):
            # each repeat calibrates on an unlimited link first: the need follows the step rate,
            # which follows the machine's load
            ref = bench.session(f"r{r}-unlimited", up_Bps=None, down_Bps=None)
            ref.update(repeat=r, multiple=None, speed=1.0, need_up_Bps=ref["wire_up_Bps"],
                       need_down_Bps=ref["wire_down_Bps"])
            sessions.append(ref)
            print(f"need (unlimited link, {args.latency_ms:g} ms): up {ref['wire_up_Bps'] / 1e3:.1f} kB/s, down "
                  f"{ref['wire_down_Bps'] / 1e3:.1f} kB/s, up+down {(ref['wire_up_Bps'] + ref['wire_down_Bps']) * 8 / 1e6:.2f} "
                  f"Mbit/s at {ref['steps_per_s']:.1f} steps/s (payload up {ref['payload_up_Bps'] / 1e3:.1f}, down "
                  f"{ref['payload_down_Bps'] / 1e3:.1f} kB/s)", flush=True)
            print(row(ref), flush=True)
            for k in (multiples if r % 2 == 0 else multiples[::-1]):
                s = bench.session(f"r{r}-x{k:g}", up_Bps=k * ref["wire_up_Bps"], down_Bps=k * ref["wire_down_Bps"])
                s.update(repeat=r, multiple=k, speed=s["steps_per_s"] / ref["steps_per_s"],
                         need_up_Bps=ref["wire_up_Bps"], need_down_Bps=ref["wire_down_Bps"])
                sessions.append(s)
                print(row(s), flush=True)
    finally:
        bench.close()

    print()
    print(f"{'link':>10} {'k_eff_up':>9} {'blocked %':>10} {'util %':>7} {'speed':>6} {'ms/step':>8} {'backlog':>8} "
          f"{'wire up/down kB/s':>18} {'payload up/down kB/s':>21}")
    summary = []
    for k in [None, *multiples]:
        group = [s for s in sessions if s["multiple"] == k]
        mean = lambda key: sum(s[key] for s in group) / len(group)  # noqa: E731
        entry = {"multiple": k, "blocked_frac": mean("blocked_frac"), "max_blocked_frac": max(s["blocked_frac"] for s in group),
                 "utilisation": mean("utilisation"), "speed": mean("speed"), "compute_ms_per_step": mean("compute_ms_per_step"),
                 "backlog_end_max": max(s["backlog_end"] for s in group), "wire_up_Bps": mean("wire_up_Bps"),
                 "wire_down_Bps": mean("wire_down_Bps"), "payload_up_Bps": mean("payload_up_Bps"),
                 "payload_down_Bps": mean("payload_down_Bps"),
                 "k_eff_up": [s["k_eff_up"] for s in group], "blocked_fracs": [s["blocked_frac"] for s in group]}
        summary.append(entry)
        keff = "-" if k is None else f"{min(entry['k_eff_up']):.2f}-{max(entry['k_eff_up']):.2f}"
        print(f"{'unlimited' if k is None else f'{k:g}x':>10} {keff:>9} {100 * entry['blocked_frac']:>10.2f} "
              f"{100 * entry['utilisation']:>7.1f} {entry['speed']:>6.2f} {entry['compute_ms_per_step']:>8.1f} "
              f"{entry['backlog_end_max']:>8d} {entry['wire_up_Bps'] / 1e3:>8.1f}/{entry['wire_down_Bps'] / 1e3:<9.1f} "
              f"{entry['payload_up_Bps'] / 1e3:>10.1f}/{entry['payload_down_Bps'] / 1e3:<10.1f}")
    target = next((e for e in summary if e["multiple"] == 1.25), None)
    if target is not None:
        met = target["max_blocked_frac"] <= 0.01
        print(f"\ntarget blocked <= 1% at 1.25x: {'met' if met else 'NOT met'} "
              f"(mean {100 * target['blocked_frac']:.2f}%, worst {100 * target['max_blocked_frac']:.2f}%, "
              f"k_eff_up {', '.join(f'{x:.2f}' for x in target['k_eff_up'])})")
    tight = [s for s in sessions if s["k_eff_up"] is not None and s["k_eff_up"] <= 1.3]
    if tight:
        print("sessions whose uplink margin was really <= 1.3x: " + ", ".join(
            f"{s['name']} k_eff {s['k_eff_up']:.2f} blocked {100 * s['blocked_frac']:.2f}%" for s in tight))
    print(f"load average (1, 5, 15 min) at the end: {os.getloadavg()}; logs in {log_dir}")
    if args.json:
        out = {"args": vars(args) | {"json": str(args.json)}, "sessions": sessions, "summary": summary,
               "log_dir": log_dir}
        args.json.write_text(json.dumps(out, indent=2))


def fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def row(s: dict) -> str:
    link = "unlimited" if s["link_up_Bps"] is None else f"{s['link_up_Bps'] / 1e3:.0f}/{s['link_down_Bps'] / 1e3:.0f} kB/s"
    return (f"{s['name']:>14} link {link:>16}: {s['steps']} steps in {s['window_s']:.1f} s, "
            f"blocked {100 * s['blocked_frac']:.2f}%, {s['steps_per_s']:.1f} steps/s (x{s.get('speed', 1):.2f}), "
            f"backlog {s['backlog_start']}->{s['backlog_end']}, k_eff_up {fmt(s['k_eff_up'])}, busy "
            f"{fmt(s['link_busy_up'])}/{fmt(s['link_busy_down'])}, wire {s['wire_up_Bps'] / 1e3:.1f}/"
            f"{s['wire_down_Bps'] / 1e3:.1f} kB/s, load {s['load_1min'][1]:.1f}")


if __name__ == "__main__":
    main()
