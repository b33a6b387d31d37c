"""Store benchmark: S3 PUT latency with and without ``Expect: 100-continue``,
and how long a call to an endpoint that never answers takes to fail.

PUT latency: ``put_if_absent`` of fresh keys through the real S3 backend against
the moto server (``moto_server``, its threaded werkzeug app), on loopback and
through a netem.py link proxy with --latency-ms one-way delay (a round trip of
2x that, as to a distant region). The two arms alternate PUT by PUT (A/B
interleaved), so load on the machine hits both alike. ``Expect: 100-continue``
makes the client wait for the server's interim "100 Continue" before sending
the body: one more round trip per PUT.

Silent endpoint (--silent): a socket that accepts connections and never
replies; the time until ``open_store`` gives up, with the default timeouts
(connect 10 s, read 20 s) and retry deadline (60 s), for S3 and GCS.

    python scripts/bench_store.py                     # ~1 min
    python scripts/bench_store.py --puts 50 --sizes 1024,1048576 --json /tmp/store.json
    python scripts/bench_store.py --silent            # +2 min
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import Launcher, fmt_table, load_text, start_moto, write_result  # noqa: E402
from netem import Direction, LinkProxy  # noqa: E402

from ddiloco_cli.errors import StoreAccessError  # noqa: E402
from ddiloco_cli.store import open_store  # noqa: E402

BUCKET = "ddiloco-bench-store"
AWS_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def put_latencies(endpoint: str, *, size: int, puts: int) -> dict[str, list[float]]:
    """Seconds per put_if_absent for each arm, arms interleaved PUT by PUT."""
    prefix = f"expect-{uuid.uuid4().hex[:8]}"
    stores = {arm: open_store(f"s3://{BUCKET}/{prefix}-{arm}",
                              options={"endpoint_url": endpoint, "expect_100_continue": arm == "expect"})
              for arm in ("expect", "no-expect")}
    data = os.urandom(size)
    out: dict[str, list[float]] = {arm: [] for arm in stores}
    for i in range(puts + 1):
        order = list(stores) if i % 2 else list(reversed(stores))
        for arm in order:
            t0 = time.perf_counter()
            assert stores[arm].put_if_absent(f"obj-{i:05d}", data)
            if i:  # the first PUT of each arm also opens connections
                out[arm].append(time.perf_counter() - t0)
    return out


def silent_endpoint() -> tuple[str, callable]:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    held = []

    def accept() -> None:
        while True:
            try:
                held.append(server.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()

    def close() -> None:
        server.close()
        for c in held:
            c.close()

    return f"http://127.0.0.1:{server.getsockname()[1]}", close


def time_to_fail(scheme: str, endpoint: str) -> tuple[float, str]:
    t0 = time.monotonic()
    try:
        open_store(f"{scheme}://silent-bucket/run", options={"endpoint_url": endpoint})
    except StoreAccessError as exc:
        return time.monotonic() - t0, str(exc).split(":")[0]
    raise AssertionError("a silent endpoint was opened")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--puts", type=int, default=40, help="PUTs per arm, size and link")
    ap.add_argument("--sizes", default="1024,1048576,8388608", help="object sizes in bytes, comma-separated")
    ap.add_argument("--latency-ms", type=float, default=20.0, help="one-way delay of the far link (0: loopback only)")
    ap.add_argument("--silent", action="store_true", help="also time a never-answering endpoint (~2 min)")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--keep-workdir", action="store_true")
    args = ap.parse_args()
    os.environ.update(AWS_ENV)
    workdir = args.workdir or f"/tmp/bench_store_{uuid.uuid4().hex[:8]}"
    os.makedirs(workdir, exist_ok=True)
    sizes = [int(s) for s in args.sizes.split(",")]
    links = [0.0] + ([args.latency_ms] if args.latency_ms > 0 else [])

    launcher = Launcher(workdir)
    endpoint = start_moto(launcher, bucket=BUCKET)
    rows, results = [], []
    try:
        for latency_ms in links:
            proxy = None
            url = endpoint
            if latency_ms > 0:
                host, port = endpoint.rsplit("/", 1)[-1].split(":")
                d = Direction(latency_s=latency_ms / 1e3)
                proxy = LinkProxy((host, int(port)), up=d, down=d).start()
                url = proxy.endpoint_url
            try:
                for size in sizes:
                    lat = put_latencies(url, size=size, puts=args.puts)
                    med = {arm: statistics.median(v) * 1e3 for arm, v in lat.items()}
                    results.append({"latency_ms_one_way": latency_ms, "size_bytes": size, "puts": args.puts,
                                    "median_ms": med,
                                    "p90_ms": {arm: sorted(v)[int(0.9 * (len(v) - 1))] * 1e3 for arm, v in lat.items()},
                                    "saved_ms": med["expect"] - med["no-expect"]})
                    rows.append([f"{latency_ms:g}", size, f"{med['expect']:.1f}", f"{med['no-expect']:.1f}",
                                 f"{med['expect'] - med['no-expect']:.1f}"])
            finally:
                if proxy is not None:
                    proxy.stop()
    finally:
        launcher.close()
    print(f"S3 put_if_absent against moto_server, {args.puts} PUTs per arm, A/B interleaved ({load_text()})")
    print(fmt_table(["one-way ms", "bytes", "expect ms (median)", "no-expect ms", "saved ms"], rows))
    out = {"expect_100_continue": results}

    if args.silent:
        endpoint, close = silent_endpoint()
        try:
            silent = {scheme: time_to_fail(scheme, endpoint) for scheme in ("s3", "gs")}
        finally:
            close()
        print("\nnever-answering endpoint, default timeouts and retry deadline:")
        print(fmt_table(["backend", "s to fail", "error"], [[k, f"{t:.1f}", m] for k, (t, m) in silent.items()]))
        out["silent_endpoint_s_to_fail"] = {k: t for k, (t, _) in silent.items()}
    write_result(out, json_path=args.json, workdir=workdir, keep_workdir=args.keep_workdir)


if __name__ == "__main__":
    main()
