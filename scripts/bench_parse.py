"""Cost of bounded parsing (PROTOCOL.md [R7]): what reading bucket JSON through
``records.parse_json`` costs over a plain ``json.loads``, and how fast a parser bomb
is refused.

Rows are the records a run reads most (a latest hint, a learner heartbeat, manifests
with 16 and 4000 ledger entries, the plan of a 2-layer GPT): the plain and the bounded parse,
the schema check (``records.validate``: a record's first read) and ``records.loads`` of bytes
it has checked before; then bombs: 100k-deep
nesting, a 5000-digit integer, 1e999. Times are the best of --repeat runs on one core.

    .venv/bin/python scripts/bench_parse.py
    .venv/bin/python scripts/bench_parse.py --repeat 3 --json /tmp/parse.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ddiloco_cli.errors import ProtocolError  # noqa: E402
from ddiloco_cli.protocol import records  # noqa: E402

from benchlib import fmt_table  # noqa: E402


def _entry(i: int) -> dict[str, Any]:
    seq = 1796032843559141 + i
    return {"learner_id": f"learner-{i:04d}", "seq": seq, "sha256": "0" * 64, "size": 123456,
            "key": f"contributions/p00000/learner-{i:04d}/{seq:020d}.safetensors", "base_version": 41,
            "c_tokens": 65536, "c_steps": 32, "weight": 1.34e8, "used": True}


def _manifest(num_contributions: int) -> bytes:
    return records.dumps(records.make(
        "manifest", run_id="e" * 32, fragment=0, version=42, epoch=3, syncer_id="host-123", nonce="n" * 32,
        created_s=1796032843.5, numel=10**6, outer_steps=42, outer_lr=0.7, quorum_size=num_contributions,
        payloads=[{"key": "fragments/p00000/payloads/x.safetensors", "kind": "delta", "size": 1, "sha256": "0" * 64}],
        contributions=[_entry(i) for i in range(num_contributions)],
        high_water={f"learner-{i:04d}": 1796032843559141 + i for i in range(num_contributions)}))


def _plan() -> bytes:
    tensors = [{"name": f"h.{layer}.{name}", "shape": [768, 768], "dtype": "float32", "row_start": 0, "row_end": 768}
               for layer in range(2) for name in ("attn.q", "attn.k", "attn.v", "attn.o", "mlp.up", "mlp.down")]
    return records.dumps(records.make("plan", run_id="e" * 32, num_fragments=len(tensors),
                                      fragments=[[t] for t in tensors]))


def _best_s(fn: Callable[[], Any], *, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        n, t0 = 0, time.perf_counter()
        while True:  # at least 50 ms per measurement
            fn()
            n += 1
            if time.perf_counter() - t0 > 0.05:
                break
        best = min(best, (time.perf_counter() - t0) / n)
    return best


def _refused(data: bytes) -> Callable[[], None]:
    def run() -> None:
        try:
            records.parse_json(data, where="bomb")
        except ProtocolError:
            return
        raise AssertionError("the bomb parsed")
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", dest="json_path", default=None, help="write the results here")
    args = ap.parse_args()

    hint = records.dumps(records.make("latest", fragment=0, version=42))
    heartbeat = records.dumps(records.make("learner_heartbeat", run_id="e" * 32, learner_id="learner-0001",
                                           state="running", step=1200, tokens=4915200, step_time_s=0.41,
                                           loss=2.31, bytes_up=10**9, bytes_down=10**9, time_s=1796032843.5))
    rows, out = [], {"records": [], "bombs": []}
    for name, data, record_type in [("latest hint", hint, "latest"), ("learner heartbeat", heartbeat, "learner_heartbeat"),
                                    ("manifest, 16 entries", _manifest(16), "manifest"),
                                    ("manifest, 4000 entries", _manifest(4000), "manifest"),
                                    ("plan, 12 tensors", _plan(), "plan")]:
        plain = _best_s(lambda: json.loads(data), repeat=args.repeat)
        bounded = _best_s(lambda: records.parse_json(data, where=name), repeat=args.repeat)
        validated = _best_s(lambda: records.loads(data, record_type, where=name), repeat=args.repeat)
        parsed = records.parse_json(data, where=name)
        checked = _best_s(lambda: records.validate(parsed, record_type, where=name), repeat=args.repeat)
        rows.append([name, f"{len(data) / 1e3:.1f}", plain * 1e6, bounded * 1e6, bounded / plain, checked * 1e6,
                     validated * 1e6])
        out["records"].append({"record": name, "bytes": len(data), "json_loads_us": plain * 1e6,
                               "parse_json_us": bounded * 1e6, "schema_check_us": checked * 1e6,
                               "loads_with_schema_us": validated * 1e6})
    # the schema check is what a record's first read costs on top of the parse; ``records.loads`` checks the
    # same bytes once a process (a digest), so its column is the parse and that lookup
    print(fmt_table(["record", "kB", "json.loads us", "parse_json us", "ratio", "schema check us",
                     "loads again us"], rows))
    bomb_rows = []
    for name, data in [("100k-deep nesting", b"[" * 100_000 + b"]" * 100_000),
                       ("5000-digit integer", b'{"c_tokens":' + b"9" * 5000 + b"}"),
                       ("1e999", b'{"created_s":1e999}')]:
        refused = _best_s(_refused(data), repeat=args.repeat)
        bomb_rows.append([name, f"{len(data) / 1e3:.1f}", refused * 1e3])
        out["bombs"].append({"bomb": name, "bytes": len(data), "refused_ms": refused * 1e3})
    print()
    print(fmt_table(["bomb", "kB", "refused in ms"], bomb_rows))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
