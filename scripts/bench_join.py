"""Join benchmark: how long a starting learner takes to read the global model from a distant
S3 bucket, reading its fragments and their delta chains one object at a time (as before 0.2.4)
against concurrently (fragments in parallel, each cold read fetching its manifests and payloads
in batches).

A run is built on a local directory by a real syncer in this process: P fragments, sparse
published deltas with keyframes by size (the 0.2.4 default), ``--versions`` merges per
fragment, so each fragment's newest version sits at the end of a delta chain that long (the
64-version cap is the longest). Its objects are copied to moto's S3 server, and the bootstrap
(`DiLoCoSync`'s: the newest version of every fragment, through ``FragmentReader``) runs against
it through a netem.py link proxy with ``--latency-ms`` one-way delay. The arms alternate, so
load on the machine hits both alike; the values read are checked equal.

    python scripts/bench_join.py                                   # ~1 min
    python scripts/bench_join.py --versions 8,64 --latency-ms 40 --repeats 3 --json /tmp/join.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from benchlib import Launcher, fmt_table, load_text, start_moto, write_result  # noqa: E402
from netem import Direction, LinkProxy  # noqa: E402

from ddiloco_cli.learner.sendpath import read_newest  # noqa: E402
from ddiloco_cli.numerics import codec  # noqa: E402
from ddiloco_cli.ops.runinit import RunSpec, init_run  # noqa: E402
from ddiloco_cli.protocol import layout, ledger, records  # noqa: E402
from ddiloco_cli.protocol.published import FragmentReader, expected_shapes  # noqa: E402
from ddiloco_cli.store import open_store  # noqa: E402
from ddiloco_cli.store.base import StoreWrapper  # noqa: E402
from ddiloco_cli.syncer.core import Syncer, SyncerOptions  # noqa: E402

BUCKET = "ddiloco-bench-join"
AWS_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def build_run(root: str, *, fragments: int, versions: int, task: str) -> None:
    """A run at ``root`` whose every fragment has ``versions`` merged versions of one learner."""
    store = open_store(root)
    init_run(store, RunSpec(task=task, num_fragments=fragments, sync_every=max(fragments, 4), overlap_steps=1,
                            codec="none", publish_codec="sparse", lease_s=30.0, heartbeat_s=5.0))
    run = ledger.read_run(store)
    plan = ledger.read_plan(store, run_id=run["run_id"])
    beat = records.make("learner_heartbeat", run_id=run["run_id"], learner_id="a", state="running", step=1,
                        tokens=1, step_time_s=0.1)
    store.put(layout.learner_heartbeat_key("a"), records.dumps(beat))
    syncer = Syncer(store, options=SyncerOptions(syncer_id="bench", poll_s=0.01, gc=False))
    assert syncer.acquire()
    syncer.check_fence()
    syncer.restore()
    g = torch.Generator().manual_seed(0)
    seq = 0
    for _ in range(versions):
        for p in range(fragments):
            seq += 1
            tensors = {k: 0.01 * torch.randn(s, generator=g) for k, s in expected_shapes(plan, p).items()}
            header = records.make("contribution", run_id=run["run_id"], fragment=p, learner_id="a", seq=seq,
                                  base_version=syncer.states[p].version, c_tokens=64, c_steps=4, step=seq,
                                  nonce=records.new_nonce(), created_s=time.time())
            store.put_if_absent(layout.contribution_key(p, "a", seq),
                                codec.encode_tensors(tensors, codec="none", metadata=header))
            syncer.poll_contributions()
            assert syncer.maybe_merge(syncer.states[p]), "the merge did not happen"


def copy_run(src: str, dst) -> int:
    """Every object of the run at ``src`` into store ``dst`` (the run files readers need)."""
    local = open_store(src)
    n = 0
    for info in local.list(""):
        dst.put(info.key, local.get(info.key))
        n += 1
    return n


class OneAtATime(StoreWrapper):
    """The read path as before 0.2.4: every object fetched after the one before it."""

    concurrent_reads = False


def bootstrap(store, *, run_id: str, plan) -> tuple[float, dict[int, dict[str, torch.Tensor]], int]:
    """(seconds, {fragment: value}, bytes) of reading the newest version of every fragment as a
    starting learner does (``sendpath.read_newest``: concurrently unless the store says otherwise)."""
    readers = {p: FragmentReader(store, run_id=run_id, plan=plan, fragment=p) for p in range(plan.num_fragments)}
    t0 = time.perf_counter()
    values = {p: value for p, (_, value) in enumerate(read_newest(store, readers))}
    return time.perf_counter() - t0, values, sum(r.bytes_down for r in readers.values())


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fragments", "-P", type=int, default=8)
    ap.add_argument("--versions", default="8,32,64", help="comma-separated: merged versions per fragment (chain length)")
    ap.add_argument("--latency-ms", type=float, default=40.0, help="one-way delay of the link to the bucket")
    ap.add_argument("--repeats", type=int, default=3, help="bootstraps per arm and chain length, interleaved")
    ap.add_argument("--task", default="ddiloco_cli.tasks.gpt:tiny")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    os.environ.update(AWS_ENV)  # moto's
    workdir = tempfile.mkdtemp(prefix="bench_join_")
    launcher = Launcher(workdir)
    rows, out = [], {"settings": vars(args), "results": []}
    try:
        endpoint = start_moto(launcher, bucket=BUCKET)
        host, port = endpoint.removeprefix("http://").split(":")
        d = Direction(rate_Bps=None, latency_s=args.latency_ms / 1e3)
        proxy = LinkProxy((host, int(port)), up=d, down=d).start()
        try:
            for n in (int(v) for v in args.versions.split(",")):
                root = os.path.join(workdir, f"run{n}")
                build_run(root, fragments=args.fragments, versions=n, task=args.task)
                s3 = open_store(f"s3://{BUCKET}/run{n}", options={"endpoint_url": endpoint})
                objects = copy_run(root, s3)
                far = open_store(f"s3://{BUCKET}/run{n}", options={"endpoint_url": proxy.endpoint_url})
                run = ledger.read_run(far)
                plan = ledger.read_plan(far, run_id=run["run_id"])
                times: dict[str, list[float]] = {"one at a time": [], "concurrent": []}
                ref = None
                for i in range(args.repeats):
                    arms = [("one at a time", OneAtATime(far)), ("concurrent", far)]
                    for name, store in arms if i % 2 == 0 else arms[::-1]:
                        dt, values, nbytes = bootstrap(store, run_id=run["run_id"], plan=plan)
                        times[name].append(dt)
                        if ref is None:
                            ref = (values, nbytes)
                        assert nbytes == ref[1] and all(torch.equal(values[p][k], ref[0][p][k])
                                                        for p in values for k in values[p]), "the arms read different values"
                seq, con = statistics.median(times["one at a time"]), statistics.median(times["concurrent"])
                rows.append([n, objects, f"{ref[1] / 1e6:.2f}", f"{seq:.2f}", f"{con:.2f}", f"{seq / con:.1f}x"])
                out["results"].append({"versions": n, "objects": objects, "bytes": ref[1], "one_at_a_time_s": times["one at a time"],
                                       "concurrent_s": times["concurrent"], "speedup": seq / con})
        finally:
            proxy.stop()
    finally:
        launcher.close()
    print(fmt_table(["versions per fragment", "bucket objects", "MB read", "one at a time s", "concurrent s",
                     "speedup"], rows))
    print(f"\nP = {args.fragments}, sparse published deltas (keyframes by size), a starting learner's read of the "
          f"newest version of every fragment over a {args.latency_ms:g} ms one-way link to moto S3; median of "
          f"{args.repeats}; {load_text()}")
    return write_result(out, json_path=args.json, workdir=workdir, keep_workdir=False)


if __name__ == "__main__":
    main()
