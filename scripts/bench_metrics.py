"""Metrics history benchmark: what the training loop pays, what the bucket stores, how
fast it reads back.

For each backend: the learner's progress hook is called --records x --every times
(one record per --every steps, like `ddiloco learn`), timing each call on the loop's
thread; the writer's background flush is timed separately; then the records are read
back with the untrusted-input reader. Figures: loop cost per step and per record
(median, p99), bytes per record in the bucket, flush time per 1000 records, reader
records/s, and the most a writer keeps (records_per_segment x max_segments lines).

    .venv/bin/python scripts/bench_metrics.py
    .venv/bin/python scripts/bench_metrics.py --records 20000 --backends local memory --json /tmp/metrics.json
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from ddiloco_cli.ops import metrics
from ddiloco_cli.store import open_store

from benchlib import fmt_table, write_result


def bench(url: str, *, records: int, every: int) -> dict:
    store = open_store(url)
    writer = metrics.MetricsWriter(store, role="learner", writer_id="bench", flush_every_s=3600)
    hook = metrics.learner_progress_hook(writer, every_steps=every)
    step_ns, record_ns = [], []
    for step in range(1, records * every + 1):
        progress = {"step": step, "loss": 3.0 - step * 1e-6, "lr": 1e-3, "step_time_s": 0.1, "tokens": step * 4096,
                    "bytes_up": step * 1000, "bytes_down": step * 3000, "versions": {p: step // 24 for p in range(24)},
                    "blocked_s": 0.01}
        t0 = time.perf_counter_ns()
        hook(progress)
        dt = time.perf_counter_ns() - t0
        (record_ns if step % every == 0 else step_ns).append(dt)
    t0 = time.perf_counter()
    writer.flush()
    flush_s = time.perf_counter() - t0
    writer.close()
    stored = sum(i.size for i in store.list("metrics/"))
    t0 = time.perf_counter()
    got = metrics.read_metrics(store)
    read_s = time.perf_counter() - t0
    assert len(got) == min(records, writer.records_per_segment * writer.max_segments), len(got)
    return {
        "loop_us_per_step": statistics.median(step_ns) / 1e3,
        "loop_us_per_record_median": statistics.median(record_ns) / 1e3,
        "loop_us_per_record_p99": sorted(record_ns)[int(0.99 * (len(record_ns) - 1))] / 1e3,
        "bytes_per_record": stored / len(got),
        "flush_ms_per_1000_records": flush_s * 1e3 / records * 1000,
        "read_records_per_s": len(got) / read_s,
        "max_records_kept": writer.records_per_segment * writer.max_segments,
        "max_bytes_kept": writer.segment_bytes * writer.max_segments,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=5000)
    parser.add_argument("--every", type=int, default=10, help="steps per record (learn logs every 10)")
    parser.add_argument("--backends", nargs="+", default=["local", "memory"], choices=["local", "memory"])
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args()
    workdir = tempfile.mkdtemp(prefix="bench-metrics-")
    results = {}
    for backend in args.backends:
        url = f"{workdir}/{backend}" if backend == "local" else f"memory://bench-metrics-{time.time_ns()}"
        results[backend] = bench(url, records=args.records, every=args.every)
    keys = list(next(iter(results.values())))
    print(fmt_table(["backend", *keys], [[b, *(r[k] for k in keys)] for b, r in results.items()]))
    write_result({"records": args.records, "every": args.every, "results": results}, json_path=args.json_path,
                 workdir=workdir, keep_workdir=False)


if __name__ == "__main__":
    main()
