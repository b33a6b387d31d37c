"""Syncer throughput: download + decode + validate + merge + outer step + encode + commit,
by one syncer process, in parameter-contributions per second (one contribution of a fragment of
n parameters = n parameter-contributions), by codec and by M (contributions per merge).

The real ``ddiloco_cli.syncer.core.Syncer`` is driven in-process, step by step
(``poll_contributions()`` then ``maybe_merge(state)``), against a real store (a local
directory by default). Before each timed round, M learners' contributions (noise-like
outer gradients, the codec's worst case) are written to the store, so a round times
exactly what a serving syncer does for one merge of one fragment. Run config:
quorum K = M, grace_gamma 0 (merge as soon as the quorum is in), RDA merge, publish
codec = codec, default keyframe_every (8) and checkpoint_every (10) so those costs are
amortised into the rate as in a real run. The split is wall time per merge of the
syncer's own stages (``Syncer.stage_s``: intake = download + decode + validate, outer
gradient, update = merge + outer step + encode, commit = upload + manifest, checkpoint),
plus "io", the store time inside them (from a timing store wrapper), and "other". A second
table splits the CPU time per merge by part of the work (decode, norms, sha256, schema, merge,
outer step, published delta, keyframes and checkpoints, store I/O, other), from the CPU time
of each thread inside the functions that do it (``CPU_PARTS``), with the kernel's part of the
CPU time ("sys ms") and the minor page faults per merge (fresh memory the process touched).

The syncer decodes contributions in a small thread pool (``--decode-threads``; 1 = in
line). Rates are given per CPU-second of the process (every thread's CPU time: the cost
per core, which depends far less on the machine's load than wall time), and per wall-second.
``--shards 1,2`` also runs K syncer processes at once, process i serving only fragment i
of one run (``ddiloco sync --fragments i``), and prints their aggregate rate: the scaling
figure (one process per core). Capacity: for a 1B-parameter model, 1 s inner steps,
P = H = 24, i.e. each fragment (1e9/24 parameters) gets M contributions every H steps:
required rate = M * 1e9 / (H * step_s), so one core keeps up with
M_max = throughput * H * step_s / 1e9 learners.

    .venv/bin/python scripts/bench_syncer.py                               # 2.1M-parameter fragment
    .venv/bin/python scripts/bench_syncer.py --json /tmp/syncer.json
    .venv/bin/python scripts/bench_syncer.py --width 256 --rounds 2 --codecs int4 --ms 1,2   # smoke
    .venv/bin/python scripts/bench_syncer.py --profile int4:8              # cProfile one config (main thread)
    .venv/bin/python scripts/bench_syncer.py --codecs int4 --ms 8 --shards 1,2   # scaling over sharded processes
    .venv/bin/python scripts/bench_syncer.py --codecs int4,sparse --ms 4,8       # sparse (Top-k 2%) against int4
    .venv/bin/python scripts/bench_syncer.py --codecs int4 --ms 16 --store s3    # on S3 (moto); s3-s3fs: s3fs alone
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import math
import os
import pstats
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402


# ------------------------------------------------------------------- profiling
class Regions:
    """Exclusive wall time per named region (a nested region's time is not counted
    in its parent's)."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}
        self._stack: list[list[float]] = []  # per open region: [child time]
        self.enabled = False

    @contextmanager
    def region(self, name: str):
        if not self.enabled:
            yield
            return
        self._stack.append([0.0])
        t0 = time.perf_counter()
        try:
            yield
        finally:
            dt = time.perf_counter() - t0
            child = self._stack.pop()[0]
            self.totals[name] = self.totals.get(name, 0.0) + dt - child
            if self._stack:
                self._stack[-1][0] += dt

    def wrap(self, name: str, fn: Callable) -> Callable:
        def wrapped(*args, **kwargs):
            with self.region(name):
                return fn(*args, **kwargs)

        wrapped.__wrapped__ = fn  # type: ignore[attr-defined]
        return wrapped

    def reset(self) -> None:
        self.totals = {}


class TimedStore:
    """Delegates to a Store; every call is the "io" region."""

    def __init__(self, inner, regions: Regions):
        self.inner, self.url, self.regions = inner, inner.url, regions

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if name in ("get", "put", "put_if_absent", "list", "delete", "now") and callable(attr):
            return CPU.wrap("io", self.regions.wrap("io", attr))
        return attr


class CpuRegions:
    """Exclusive CPU time per named region: each thread's own CPU time (time.thread_time) inside
    a wrapped function, less that of wrapped functions it calls, summed over threads (the
    syncer decodes in a pool)."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}
        self.enabled = False
        self._local = threading.local()
        self._lock = threading.Lock()

    def wrap(self, name: str, fn: Callable) -> Callable:
        def wrapped(*args, **kwargs):
            if not self.enabled:
                return fn(*args, **kwargs)
            stack = self._local.__dict__.setdefault("stack", [])
            stack.append(0.0)
            t0 = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = time.thread_time() - t0
                child = stack.pop()
                with self._lock:
                    self.totals[name] = self.totals.get(name, 0.0) + dt - child
                if stack:
                    stack[-1] += dt

        wrapped.__wrapped__ = fn  # type: ignore[attr-defined]
        return wrapped

    def reset(self) -> None:
        self.totals = {}


REGIONS = Regions()
CPU = CpuRegions()
STAGES = ("intake", "outer_grad", "update", "commit", "checkpoint")
# CPU split: (label, module, attribute) of the functions that do the syncer's work, each timed
# exclusively of the others (module attributes: the callers look them up at call time)
CPU_PARTS = (
    ("decode", "ddiloco_cli.numerics.codec", "decode_tensors"),  # parse, zstd, the scales' finiteness check
    ("norm", "ddiloco_cli.syncer.intake", "delta_norm"),  # from the codes
    ("sha256", "ddiloco_cli.protocol.records", "sha256_hex"),  # contributions and published payloads
    ("schema", "ddiloco_cli.protocol.records", "validate"),
    ("merge", "ddiloco_cli.syncer.update", "merge_gradients"),
    ("outer", "ddiloco_cli.numerics.outer", "OuterOptimizer.step"),
    ("outer", "ddiloco_cli.numerics.outer", "OuterOptimizer.stepped"),  # the step into new tensors (update.py)
    ("publish", "ddiloco_cli.numerics.codec", "encode_published_delta"),  # quantise, zstd, new published value
    ("full", "ddiloco_cli.numerics.codec", "encode_tensors"),  # keyframes and checkpoints (codec none)
)


class PayloadDigest:
    """sha256 over the kind and sha256 of every payload the syncer publishes (delta and full), in
    commit order: the published bytes of a run as one value. The contributions are made from a
    fixed seed and a delta or full payload carries no nonce or time, so two trees that publish
    the same bytes print the same digest (``--digest``; checkpoints carry a nonce: left out)."""

    def __init__(self) -> None:
        self.entries: list[str] = []

    def install(self) -> None:
        from ddiloco_cli.syncer import update

        if getattr(update.encode_version, "_digest", None) is self:
            return
        inner = getattr(update.encode_version, "__wrapped__", update.encode_version)

        def encode_version(**kwargs):
            enc = inner(**kwargs)
            self.entries.extend(f"{e['kind']}:{e['sha256']}" for _, _, e in enc.payloads)
            return enc

        encode_version.__wrapped__ = inner  # type: ignore[attr-defined]
        encode_version._digest = self  # type: ignore[attr-defined]
        update.encode_version = encode_version

    def take(self) -> tuple[int, str]:
        """(payloads, digest) since the last take."""
        import hashlib

        out = len(self.entries), hashlib.sha256(";".join(self.entries).encode()).hexdigest()
        self.entries = []
        return out


DIGEST = PayloadDigest()


def _part_labels() -> list[str]:
    """The labels of CPU_PARTS, each once, in order."""
    return list(dict.fromkeys(label for label, _, _ in CPU_PARTS))


def _instrument_cpu() -> None:
    """Wrap CPU_PARTS with CPU regions (once per process)."""
    import importlib

    if getattr(_instrument_cpu, "done", False):
        return
    for label, module, attr in CPU_PARTS:
        owner: Any = importlib.import_module(module)
        *path, name = attr.split(".")
        for part in path:
            owner = getattr(owner, part)
        if hasattr(owner, name):  # (an older tree, for an A/B run, may lack one)
            setattr(owner, name, CPU.wrap(label, getattr(owner, name)))
    _instrument_cpu.done = True  # type: ignore[attr-defined]


# ---------------------------------------------------------------------- one config
def _make_run(url: str, *, codec: str, m: int, num_fragments: int, codec_qmax: int | None = None):
    from ddiloco_cli.numerics.codec import QMAX
    from ddiloco_cli.ops.runinit import RunSpec, init_run
    from ddiloco_cli.protocol import ledger
    from ddiloco_cli.store import open_store

    store = open_store(url)
    spec = RunSpec(task=benchlib.STACK_TASK, num_fragments=num_fragments,
                   sync_every=max(24, num_fragments), overlap_steps=2, quorum=m, codec=codec, merge="rda",
                   grace_gamma=0.0, lease_s=3600.0, heartbeat_s=1.0, max_staleness=8,
                   codec_qmax=codec_qmax if codec in QMAX else None)  # None: the run's default
    run = init_run(store, spec)
    plan = ledger.read_plan(store, run_id=run["run_id"])
    return store, run, plan


def _learner_ids(m: int) -> list[str]:
    return [f"learner-{i:02d}" for i in range(m)]


def _write_heartbeats(store, run: dict, m: int) -> None:
    from ddiloco_cli.protocol import layout, records

    for lid in _learner_ids(m):
        rec = records.make("learner_heartbeat", run_id=run["run_id"], learner_id=lid, state="running", step=1,
                           tokens=64, step_time_s=1.0, time_s=time.time())
        store.put(layout.learner_heartbeat_key(lid), records.dumps(rec))


def _write_contributions(store, run: dict, plan, *, fragment: int, m: int, seq: int, base_version: int,
                         gen: torch.Generator, zstd_level: int) -> int:
    """M contributions (noise, scale 1e-3) against base_version, compressed at ``zstd_level``
    (a learner's is 1) and with codes bounded by the run's ``codec_qmax``, as its learners send
    them; returns bytes written."""
    from ddiloco_cli.numerics import codec
    from ddiloco_cli.protocol import layout, records
    from ddiloco_cli.protocol.published import expected_shapes

    shapes = expected_shapes(plan, fragment)
    nbytes = 0
    for i, lid in enumerate(_learner_ids(m)):
        delta = {k: 1e-3 * torch.randn(shape, generator=gen) for k, shape in shapes.items()}
        header = records.make("contribution", run_id=run["run_id"], fragment=fragment, learner_id=lid, seq=seq,
                              base_version=base_version, c_tokens=512 * (i + 1), c_steps=24, step=seq,
                              nonce=records.new_nonce(), created_s=time.time())
        data = codec.encode_tensors(delta, codec=run["codec"], block_size=int(run["codec_block"]), metadata=header,
                                    zstd_level=zstd_level, qmax=run.get("codec_qmax"), density=run.get("codec_density"))
        assert store.put_if_absent(layout.contribution_key(fragment, lid, seq), data)
        nbytes += len(data)
    return nbytes


S3_BUCKET = "bench-syncer"


def _run_url(*, codec: str, m: int, root: str, store_kind: str) -> str:
    if store_kind == "memory":
        return f"memory://bench-syncer-{codec}-{m}-{time.monotonic_ns()}"
    if store_kind.startswith("s3"):  # moto, started by main (--store s3 / s3-s3fs)
        return f"s3://{S3_BUCKET}/{codec}-m{m}-{time.monotonic_ns()}"
    return os.path.join(root, f"{codec}-m{m}")


def bench_config(*, codec: str, m: int, rounds: int, warmup: int, root: str, store_kind: str,
                 num_fragments: int, profile: bool = False, fragment: int = 0, url: str | None = None,
                 decode_threads: int | None = None, zstd_level: int = 1, digest: bool = False,
                 codec_qmax: int | None = None) -> dict[str, Any]:
    """Time `rounds` merges of `fragment` with M contributions each, by a syncer that owns
    only that fragment (`ddiloco sync --fragments <fragment>`). `url`: a run made by
    `_make_run` (and its heartbeats) that other shards share; None: make one here."""
    from ddiloco_cli.protocol import ledger
    from ddiloco_cli.store import open_store
    from ddiloco_cli.syncer.core import Syncer, SyncerOptions

    own_run = url is None
    if own_run:
        url = _run_url(codec=codec, m=m, root=root, store_kind=store_kind)
        store, run, plan = _make_run(url, codec=codec, m=m, num_fragments=num_fragments, codec_qmax=codec_qmax)
        _write_heartbeats(store, run, m)
    else:
        store = open_store(url)
        run = ledger.read_run(store)
        plan = ledger.read_plan(store, run_id=run["run_id"])
    _instrument_cpu()
    if digest:
        DIGEST.install()
        DIGEST.take()
    timed_store = TimedStore(open_store(url), REGIONS)
    syncer = Syncer(timed_store, options=SyncerOptions(fragments=[fragment], syncer_id=f"bench-{fragment}", gc=False))
    if decode_threads is not None:
        syncer.intake.decode_threads = decode_threads
    assert syncer.acquire()
    syncer.check_fence()
    syncer.restore()
    state = syncer.states[fragment]
    n = plan.fragment_numel(fragment)
    gen = torch.Generator().manual_seed(0)
    times, cpu_times, bytes_in = [], [], 0
    faults, sys_s = 0, 0.0  # page faults (fresh memory touched) and kernel CPU time in the timed rounds
    prof = cProfile.Profile() if profile else None
    for r in range(warmup + rounds):
        version = state.version
        nb = _write_contributions(store, run, plan, fragment=fragment, m=m, seq=r + 1, base_version=version, gen=gen,
                                  zstd_level=zstd_level)
        timed = r >= warmup
        if timed and r == warmup:
            REGIONS.reset()
            CPU.reset()
            stages_before = dict(syncer.stage_s)
        REGIONS.enabled = CPU.enabled = timed
        if prof is not None and timed:
            prof.enable()
        ru0 = resource.getrusage(resource.RUSAGE_SELF)
        t0, c0 = time.perf_counter(), time.process_time()
        syncer.poll_contributions()
        merged = syncer.maybe_merge(syncer.states[fragment])
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        ru1 = resource.getrusage(resource.RUSAGE_SELF)
        if prof is not None and timed:
            prof.disable()
        REGIONS.enabled = CPU.enabled = False
        state = syncer.states[fragment]
        assert merged and state.version == version + 1, f"round {r}: no merge (pending {len(state.pending)})"
        assert state.last_quorum_size == m
        if timed:
            times.append(dt)
            cpu_times.append(dc)
            bytes_in += nb
            faults += ru1.ru_minflt - ru0.ru_minflt
            sys_s += ru1.ru_stime - ru0.ru_stime
    total = sum(times)
    split = {k: (syncer.stage_s.get(k, 0.0) - stages_before.get(k, 0.0)) / rounds for k in STAGES}
    split["other"] = total / rounds - sum(split.values())
    split["io"] = REGIONS.totals.get("io", 0.0) / rounds  # inside the stages above
    cpu_split = {label: CPU.totals.get(label, 0.0) / rounds for label in _part_labels()}
    cpu_split["io"] = CPU.totals.get("io", 0.0) / rounds
    cpu_split["other"] = sum(cpu_times) / rounds - sum(cpu_split.values())
    if own_run and store_kind == "local":
        shutil.rmtree(url, ignore_errors=True)
    out = {
        "codec": codec, "codec_qmax": run.get("codec_qmax"), "m": m, "fragment": fragment, "fragment_numel": n,
        "rounds": rounds,
        "decode_threads": syncer.intake.decode_threads, "wall_s": total, "cpu_s": sum(cpu_times),
        "s_per_merge_median": sorted(times)[len(times) // 2], "s_per_merge_mean": total / rounds,
        "param_contribs_per_s": m * n * rounds / total,
        "cpu_s_per_merge_mean": sum(cpu_times) / rounds,
        "param_contribs_per_cpu_s": m * n * rounds / sum(cpu_times),
        "contribution_bytes": bytes_in / (rounds * m),
        "minor_faults_per_merge": faults / rounds,
        "sys_cpu_s_per_merge": sys_s / rounds,
        **(dict(zip(("published_payloads", "published_digest"), DIGEST.take())) if digest else {}),
        "split_s_per_merge": split,
        "cpu_split_s_per_merge": cpu_split,
    }
    if prof is not None:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats(os.environ.get("BENCH_SORT", "tottime")).print_stats(int(os.environ.get("BENCH_TOP", "25")))
        out["profile"] = s.getvalue()
    return out


def bench_shards(*, codec: str, m: int, shards: int, args: argparse.Namespace, root: str) -> dict[str, Any]:
    """`shards` syncer processes at once, process i owning fragment i of one run (as
    `ddiloco sync --fragments i` would), each timing its own merges as above. The aggregate
    rate is the sum of the shards' rates while they ran together."""
    if args.store != "local":
        raise SystemExit("--shards needs --store local (processes share the run through the bucket)")
    url = _run_url(codec=codec, m=m, root=root, store_kind="local") + f"-k{shards}"
    store, run, _ = _make_run(url, codec=codec, m=m, num_fragments=max(args.fragments, shards), codec_qmax=args.codec_qmax)
    _write_heartbeats(store, run, m)
    procs = []
    for i in range(shards):
        out = os.path.join(root, f"shard-{codec}-m{m}-k{shards}-{i}.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--shard-of", url, "--fragment", str(i), "--codecs", codec,
               "--ms", str(m), "--rounds", str(args.rounds), "--warmup", str(args.warmup), "--width", str(args.width),
               "--layers", str(args.layers), "--fragments", str(max(args.fragments, shards)), "--json", out]
        if args.decode_threads is not None:
            cmd += ["--decode-threads", str(args.decode_threads)]
        cmd += ["--contribution-zstd-level", str(args.contribution_zstd_level)]
        procs.append((subprocess.Popen(cmd), out))
    for proc, _ in procs:
        if proc.wait() != 0:
            raise SystemExit(f"a shard failed (exit {proc.returncode}): {' '.join(proc.args)}")
    shard_results = []
    for _, out in procs:
        with open(out) as f:
            shard_results.append(json.load(f)["results"][0])
    shutil.rmtree(url, ignore_errors=True)
    return {
        "codec": codec, "m": m, "shards": shards, "shard_results": shard_results,
        "param_contribs_per_s": sum(r["param_contribs_per_s"] for r in shard_results),
        "param_contribs_per_cpu_s": sum(r["m"] * r["fragment_numel"] * r["rounds"] for r in shard_results)
        / sum(r["cpu_s"] for r in shard_results),
    }


def machine_reference(n: int, m: int, *, reps: int = 7) -> float:
    """This machine's memory speed in the benchmark's unit, measured in the same run: the
    param-contributions per CPU-second of the least work any merge of M dense fp32 vectors of n
    values does, one ``acc.add_(v, alpha=w)`` pass per vector (12 bytes moved a value, one thread,
    no decode, no norm, no publish). Median of ``reps``. The syncer's rate divided by it says how
    far the syncer is from memory speed, i.e. how much of its cost is computation (zstd, sha256,
    quantising, Python) rather than moving values; and it tells a reader comparing figures from
    two machines whether their memory differs (the same tree measured 1.46e8 and 2.6-3.6e8 p-c
    per CPU-s on two sessions' development machines)."""
    gen = torch.Generator().manual_seed(0)
    vectors = [torch.randn(n, generator=gen) for _ in range(m)]
    acc = torch.empty(n)
    times = []
    for _ in range(reps + 1):
        t0 = time.thread_time()
        acc.zero_()
        for i, v in enumerate(vectors):
            acc.add_(v, alpha=1.0 / (i + 1))
        times.append(time.thread_time() - t0)
    times = sorted(times[1:])  # the first pass pages the accumulator in
    return n * m / times[len(times) // 2]


def capacity(rate: float, *, params: float = 1e9, sync_every: int = 24, step_s: float = 1.0) -> float:
    """Learners one syncer core keeps up with: rate * H * step_s / params."""
    return rate * sync_every * step_s / params


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--codecs", default="none,bf16,int8,int4")
    ap.add_argument("--ms", default="1,2,4,8", help="contributions per merge (M)")
    ap.add_argument("--width", type=int, default=1024, help="Linear width (params per layer = width^2)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--fragments", type=int, default=2, help="P; fragment 0 is benchmarked")
    ap.add_argument("--rounds", type=int, default=10, help="timed merges per config (>= 10 includes a keyframe and a checkpoint)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--store", choices=("local", "memory", "s3", "s3-s3fs"), default="local",
                    help="s3: a moto server on CPU 1 (the service's CPU is not the syncer's), the store's lean "
                         "GET/PUT path; s3-s3fs: the same through s3fs alone (DDILOCO_S3_FAST=0)")
    ap.add_argument("--root", default=None, help="directory for local stores (default: a temp dir)")
    ap.add_argument("--profile", default=None, help="codec:M to cProfile (prints the top functions)")
    ap.add_argument("--decode-threads", type=int, default=None,
                    help="contributions the syncer decodes at once (default: the syncer's own, min(4, cores))")
    ap.add_argument("--contribution-zstd-level", type=int, default=1,
                    help="zstd level of the contributions written (a learner's: 1; -1 stores int4 codes without "
                         "Huffman: larger, much faster to decode)")
    ap.add_argument("--codec-qmax", type=int, default=None,
                    help="the runs' bound on int4/int8 codes, for contributions and published deltas (default: "
                         "the run default, 3 for int4; 7 is int4's whole range)")
    ap.add_argument("--shards", default=None,
                    help="also run K syncer processes at once, one fragment each (e.g. 1,2): the scaling table; "
                         "K <= --fragments keeps the fragment size")
    ap.add_argument("--shard-of", default=None, help=argparse.SUPPRESS)  # internal: one shard's process
    ap.add_argument("--fragment", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--digest", action="store_true",
                    help="print a sha256 over the published payloads of each config (warm-up included): the "
                         "same for two trees that publish the same bytes (a fixed seed; run both with the same "
                         "--rounds/--warmup)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    torch.set_num_threads(1)
    os.environ[benchlib.STACK_WIDTH_ENV] = str(args.width)
    os.environ[benchlib.STACK_LAYERS_ENV] = str(args.layers)
    root = args.root or tempfile.mkdtemp(prefix="bench-syncer-")
    moto = None
    if args.store.startswith("s3"):
        moto = benchlib.moto_for_this_process(root, bucket=S3_BUCKET)
        if args.store == "s3-s3fs":
            os.environ["DDILOCO_S3_FAST"] = "0"
        if benchlib.pinned(0):
            os.sched_setaffinity(0, {0})
    load = os.getloadavg()
    results = []
    if args.shard_of:
        res = bench_config(codec=args.codecs, m=int(args.ms), rounds=args.rounds, warmup=args.warmup, root=root,
                           store_kind="local", num_fragments=args.fragments, fragment=args.fragment,
                           url=args.shard_of, decode_threads=args.decode_threads,
                           zstd_level=args.contribution_zstd_level)
        with open(args.json, "w") as f:
            json.dump({"results": [res]}, f)
        return
    shard_results = []
    try:
        if args.profile:
            c, m = args.profile.split(":")
            res = bench_config(codec=c, m=int(m), rounds=args.rounds, warmup=args.warmup, root=root,
                               store_kind=args.store, num_fragments=args.fragments, profile=True,
                               decode_threads=args.decode_threads, zstd_level=args.contribution_zstd_level,
                               digest=args.digest, codec_qmax=args.codec_qmax)
            print(res.pop("profile"))
            results.append(res)
        else:
            for c in args.codecs.split(","):
                for m in (int(x) for x in args.ms.split(",")):
                    res = bench_config(codec=c, m=m, rounds=args.rounds, warmup=args.warmup, root=root,
                                       store_kind=args.store, num_fragments=args.fragments,
                                       decode_threads=args.decode_threads, zstd_level=args.contribution_zstd_level,
                                       digest=args.digest, codec_qmax=args.codec_qmax)
                    results.append(res)
                    print(f"  {c:5s} M={m}: {res['param_contribs_per_s']:.3g} param-contribs/s "
                          f"({res['s_per_merge_mean'] * 1e3:.0f} ms/merge)", file=sys.stderr, flush=True)
                    for k in (int(x) for x in (args.shards or "").split(",") if x):
                        shard_results.append(bench_shards(codec=c, m=m, shards=k, args=args, root=root))
    finally:
        if moto is not None:
            moto.close()
        if args.root is None:
            shutil.rmtree(root, ignore_errors=True)
    load_after = os.getloadavg()

    cols = [*STAGES, "other", "io"]
    n = results[0]["fragment_numel"]
    dt = results[0]["decode_threads"]
    bounds = ", ".join(sorted({f"{r['codec']} {r['codec_qmax']}" for r in results if r.get("codec_qmax")}))
    print(f"\nSyncer throughput, one process (torch threads 1, {dt} decode threads), fragment of {n / 1e6:.2f}M params, "
          f"store {args.store}, {args.rounds} timed merges each; int4/int8 codes bounded by the run's codec_qmax "
          f"({bounds or '-'})")
    print(f"load avg before {load[0]:.2f}, after {load_after[0]:.2f} (2 cores). p-c = parameter-contributions; "
          f"per CPU-s = per second of this process's CPU time, all threads (= per core; less load-dependent than wall); "
          f"M_max = learners one core keeps up with at 1B params, P = H = 24, 1 s/step (from p-c/CPU-s); "
          f"split columns are wall time")
    head = f"{'codec':5s} {'M':>2s} {'KB/contrib':>10s} {'ms/merge':>9s} {'CPU ms':>7s} {'p-c/CPU-s':>10s} {'p-c/wall-s':>10s} {'M_max':>6s} | " + \
        " ".join(f"{c[:10]:>10s}" for c in cols) + "  (ms per merge)"
    print(head)
    print("-" * len(head))
    for r in results:
        sp = r["split_s_per_merge"]
        r["m_max_1b_h24_1s"] = capacity(r["param_contribs_per_cpu_s"])
        print(f"{r['codec']:5s} {r['m']:>2d} {r['contribution_bytes'] / 1e3:>10.0f} {r['s_per_merge_mean'] * 1e3:>9.1f} "
              f"{r['cpu_s_per_merge_mean'] * 1e3:>7.1f} {r['param_contribs_per_cpu_s']:>10.3g} "
              f"{r['param_contribs_per_s']:>10.3g} {r['m_max_1b_h24_1s']:>6.1f} | "
              + " ".join(f"{sp.get(c, 0.0) * 1e3:>10.1f}" for c in cols))
    parts = [*_part_labels(), "io", "other"]
    print("\nCPU ms per merge by part (all threads; each part without the others it calls): decode = parse + zstd + "
          "finiteness of the scales; norm = contribution norms from the codes; publish = the published delta "
          "(quantise, zstd, new value); full = keyframe and checkpoint payloads; other = the rest (bookkeeping, "
          "finiteness checks of the update, manifests); sys ms = the kernel's part of CPU ms, faults = minor page "
          "faults per merge (fresh memory touched: each costs kernel time)")
    head = f"{'codec':5s} {'M':>2s} {'CPU ms':>7s} {'sys ms':>6s} {'faults':>6s} | " + " ".join(f"{c:>8s}" for c in parts)
    print(head)
    print("-" * len(head))
    for r in results:
        cs = r["cpu_split_s_per_merge"]
        print(f"{r['codec']:5s} {r['m']:>2d} {r['cpu_s_per_merge_mean'] * 1e3:>7.1f} "
              f"{r['sys_cpu_s_per_merge'] * 1e3:>6.1f} {r['minor_faults_per_merge']:>6.0f} | "
              + " ".join(f"{cs.get(c, 0.0) * 1e3:>8.1f}" for c in parts))
    if args.digest:
        print("\nPublished payloads (delta and full, warm-up included), sha256 over their sha256s:")
        for r in results:
            print(f"{r['codec']:5s} {r['m']:>2d}: {r['published_payloads']} payloads {r['published_digest']}")
    reference = {m: machine_reference(n, m) for m in sorted({r["m"] for r in results})}
    print("\nThis machine's reference (the same run): a dense fp32 merge at memory speed, one add_ pass per "
          "vector, one thread, nothing else; the syncer's rate as a fraction of it")
    for r in results:
        r["reference_param_contribs_per_cpu_s"] = reference[r["m"]]
        r["fraction_of_reference"] = r["param_contribs_per_cpu_s"] / reference[r["m"]]
        print(f"{r['codec']:5s} M={r['m']}: reference {reference[r['m']]:.3g} p-c/CPU-s; syncer "
              f"{r['param_contribs_per_cpu_s']:.3g} = {r['fraction_of_reference']:.2f} of it")
    print("\nProjected syncer cores (sync --fragments processes, one core each) for a 1B-parameter model and 16 "
          "learners, P = H = 24, 1 s steps: 16 x 1e9 / 24 parameter-contributions a second at the rate measured "
          "with M contributions a merge")
    for r in results:
        r["cores_1b_16_learners"] = 16 / r["m_max_1b_h24_1s"] if r["m_max_1b_h24_1s"] > 0 else math.inf
        print(f"{r['codec']:5s} M={r['m']}: {r['cores_1b_16_learners']:.1f} cores")
    target = 2e8
    int4 = [r for r in results if r["codec"] == "int4"]
    if int4:
        best = max(r["param_contribs_per_cpu_s"] for r in int4)
        worst = min(r["param_contribs_per_cpu_s"] for r in int4)
        print(f"\nint4 target >= {target:.0e} param-contribs per CPU-second (one core): min {worst:.3g}, max {best:.3g} -> "
              f"{'MET' if worst >= target else 'met at some M' if best >= target else 'NOT MET'}")
    if shard_results:
        print(f"\nSharded syncers: K processes at once, process i serving fragment i only "
              f"(`ddiloco sync --fragments i`), each one torch thread; {os.cpu_count()} cores on this machine")
        head = f"{'codec':5s} {'M':>2s} {'K':>2s} {'p-c/CPU-s':>10s} {'p-c/wall-s':>10s} {'per shard (wall)':>30s} {'vs K=1':>7s}"
        print(head)
        print("-" * len(head))
        for r in shard_results:
            one = next((o for o in shard_results if o["shards"] == 1 and (o["codec"], o["m"]) == (r["codec"], r["m"])), None)
            scale = f"{r['param_contribs_per_s'] / one['param_contribs_per_s']:.2f}x" if one else "-"
            per = ", ".join(f"{s['param_contribs_per_s']:.3g}" for s in r["shard_results"])
            print(f"{r['codec']:5s} {r['m']:>2d} {r['shards']:>2d} {r['param_contribs_per_cpu_s']:>10.3g} "
                  f"{r['param_contribs_per_s']:>10.3g} {per:>30s} {scale:>7s}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"fragment_numel": n, "store": args.store, "rounds": args.rounds, "torch_threads": 1, "decode_threads": dt,
                       "load_before": load[0], "load_after": load_after[0], "target_int4": target,
                       "results": results, "shards": shard_results}, f, indent=2)


if __name__ == "__main__":
    main()
