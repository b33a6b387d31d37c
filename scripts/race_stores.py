"""Race create-only writes on every backend and print a table.

    .venv/bin/python scripts/race_stores.py                      # local, s3, gcs; 8 workers x 100 rounds
    .venv/bin/python scripts/race_stores.py --rounds 20 --backends local s3
    .venv/bin/python scripts/race_stores.py --backends s3-threaded --json race.json

Each round, 8 persistent processes wait on a barrier, then all try
``put_if_absent`` on the same key and read it back (see
tests/integration/test_store_races.py for the exact checks). ``s3`` runs against moto served
one request at a time (as the tests do); ``s3-threaded`` against moto's own
multi-threaded server, whose create-only check is not atomic. S3 and GCS run
against local emulators started here (moto, fake-gcs-server): no cloud account.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import uuid
from dataclasses import asdict

TESTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", nargs="+", default=["local", "s3", "gcs"],
                        choices=["local", "s3", "s3-threaded", "gcs"])
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--json", dest="json_path", help="also write the figures here")
    args = parser.parse_args()

    sys.path[:0] = [TESTS_DIR]
    from support import servers  # the same emulator launchers and race the tests use
    from support.races import run_race

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for backend in args.backends:
            server = None
            if backend == "local":
                url = os.path.join(tmp, "local-bucket")
            elif backend.startswith("s3"):
                import boto3

                server = servers.SerialMotoServer(threaded=backend == "s3-threaded")
                server.start()
                os.environ.update(servers.s3_env(server.endpoint_url))
                boto3.client("s3").create_bucket(Bucket="race")
                url = f"s3://race/{uuid.uuid4().hex[:8]}"
            else:
                server = servers.FakeGCSServer(os.path.join(tmp, "fake-gcs.log"))
                server.start()
                server.create_bucket("race")
                os.environ["STORAGE_EMULATOR_HOST"] = server.url
                url = f"gs://race/{uuid.uuid4().hex[:8]}"
            try:
                figs = run_race(url, backend=backend, num_workers=args.workers, num_rounds=args.rounds)
            finally:
                if server is not None:
                    server.stop()
            rows.append({**asdict(figs), "num_anomalies": figs.num_anomalies})

    cols = ["backend", "num_workers", "num_rounds", "num_winners", "num_multi_winner_rounds",
            "num_no_winner_rounds", "num_reads", "num_bad_reads", "num_anomalies", "wall_s"]
    heads = ["backend", "workers", "rounds", "winners", "multi-win rounds", "no-win rounds", "reads",
             "bad reads", "anomalies", "wall s"]
    widths = [max(len(h), *(len(str(r[c])) for r in rows)) for h, c in zip(heads, cols)]
    print("  ".join(h.rjust(w) for h, w in zip(heads, widths)))
    for r in rows:
        print("  ".join(str(r[c]).rjust(w) for c, w in zip(cols, widths)))
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
