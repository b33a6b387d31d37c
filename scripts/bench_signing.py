"""Cost of signatures (PROTOCOL.md, "Signatures"): what signing a contribution on the
learner and verifying it on the syncer add, next to encoding and decoding it.

Rows are int4 contributions of 0.1M, 1M and 10M parameters (a fragment of a small,
a medium and a large model) and a learner heartbeat. Times are the best of --repeat
runs on one core; "share" is sign + verify over encode + decode.

    .venv/bin/python scripts/bench_signing.py
    .venv/bin/python scripts/bench_signing.py --repeat 3 --json /tmp/signing.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey  # noqa: E402

from ddiloco_cli.numerics import codec  # noqa: E402
from ddiloco_cli.protocol import layout, records, signing

from benchlib import fmt_table  # noqa: E402

RUN_ID = "e" * 32


def _best_s(fn: Callable[[], object], *, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", dest="json_path", default=None, help="write the results here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    signer = signing.Signer.from_private(Ed25519PrivateKey.generate())
    allowed = {signer.public_key}
    rows, out = [], []
    for numel in (100_000, 1_000_000, 10_000_000):
        key = layout.contribution_key(0, "learner-0001", 1796032843559141)
        header = records.make("contribution", run_id=RUN_ID, fragment=0, learner_id="learner-0001",
                              seq=1796032843559141, base_version=3, c_tokens=4096, c_steps=4, nonce="n" * 32)
        delta = {"w": torch.randn(numel) * 1e-3}
        plain = codec.encode_tensors(delta, codec="int4", metadata=header)
        signed = signing.sign_payload(plain, kind="contribution", run_id=RUN_ID, key=key, signer=signer)
        encode = _best_s(lambda: codec.encode_tensors(delta, codec="int4", metadata=header), repeat=args.repeat)
        decode = _best_s(lambda: codec.decode_tensors(signed, expected={"w": (numel,)}), repeat=args.repeat)
        sign = _best_s(lambda: signing.sign_payload(plain, kind="contribution", run_id=RUN_ID, key=key, signer=signer),
                       repeat=args.repeat)
        verify = _best_s(lambda: signing.verify_payload(signed, kind="contribution", run_id=RUN_ID, key=key,
                                                        allowed=allowed), repeat=args.repeat)
        share = (sign + verify) / (encode + decode)
        rows.append([f"contribution, {numel / 1e6:g}M int4", f"{len(signed) / 1e6:.2f}", encode * 1e3, decode * 1e3,
                     sign * 1e3, verify * 1e3, f"{share:.1%}"])
        out.append({"object": "contribution", "numel": numel, "bytes": len(signed), "encode_ms": encode * 1e3,
                    "decode_ms": decode * 1e3, "sign_ms": sign * 1e3, "verify_ms": verify * 1e3, "share": share})
    beat = records.make("learner_heartbeat", run_id=RUN_ID, learner_id="learner-0001", state="running", step=1200,
                        tokens=4915200, step_time_s=0.41, loss=2.31, time_s=1796032843.5)
    hb_key = layout.learner_heartbeat_key("learner-0001")
    signed_beat = signing.sign_record(beat, run_id=RUN_ID, key=hb_key, signer=signer)
    sign = _best_s(lambda: signing.sign_record(beat, run_id=RUN_ID, key=hb_key, signer=signer), repeat=args.repeat)
    verify = _best_s(lambda: signing.verify_record(signed_beat, run_id=RUN_ID, key=hb_key, allowed=allowed),
                     repeat=args.repeat)
    rows.append(["learner heartbeat", f"{len(records.dumps(signed_beat)) / 1e6:.4f}", "", "", sign * 1e3,
                 verify * 1e3, ""])
    out.append({"object": "learner_heartbeat", "sign_ms": sign * 1e3, "verify_ms": verify * 1e3})
    print(fmt_table(["object", "MB", "encode ms", "decode ms", "sign ms", "verify ms", "share"], rows))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
