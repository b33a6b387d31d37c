"""An honest merge with a junk flood in the bucket (issue 25, attack 6).

A signed run (``--require-signatures``) on a local-directory bucket; one admitted
learner ``a`` with a live heartbeat; ``--junk`` unsigned contributions under fake
learner ids (``--junk-kb`` KB each: 2000 x 57 KB is the issue's 115 MB), all to
fragment 0. A real ``Syncer`` serves in a thread. Three phases, each timing how long
``a``'s signed contribution takes from its upload to the manifest that merges it:

* ``flood``: the syncer is serving; the junk and then ``a``'s contribution are
  written at once (the syncer meets all of them in its next polls);
* ``cold``: a fresh syncer starts on a bucket where the junk and ``a``'s next
  contribution already lie, none of them reported (the reports of ``flood`` are
  removed first): from the moment it is serving (restored) to the manifest;
* ``restart``: a fresh syncer starts again on the same bucket, now with the reports
  the ``cold`` one left (it believes them instead of validating the junk again).

Per phase it prints one JSON line: the seconds, objects quarantined / reports
believed, contributions whose signature was checked and payloads decoded by then,
and when the syncer had dealt with all the junk (``junk_done_s``, the junk's bytes it read). Target:
each merge <= 2 s after its upload (the issue's bar). ``--json PATH`` writes them all.

    python scripts/bench_junk.py --junk 2000 --junk-kb 57 --json /tmp/junk.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

import benchlib
from ddiloco_cli.numerics import codec
from ddiloco_cli.protocol import layout, ledger, records, signing
from ddiloco_cli.protocol.published import expected_shapes
from ddiloco_cli.store import open_store
from ddiloco_cli.syncer.core import Syncer, SyncerOptions

TASK = "ddiloco_cli.tasks.gpt:tiny"
WAIT_CEILING_S = 600.0  # a phase that does not merge by then is reported as failed


class _Counts:
    """Signature checks and payload decodes of contributions, counted around the real functions."""

    def __init__(self) -> None:
        self.verify = self.decode = 0
        verify, decode = signing.verify_payload, codec.decode_tensors

        def counted_verify(*a, **kw):
            self.verify += 1
            return verify(*a, **kw)

        def counted_decode(*a, **kw):
            self.decode += 1
            return decode(*a, **kw)

        signing.verify_payload, codec.decode_tensors = counted_verify, counted_decode

    def take(self) -> dict[str, int]:
        out = {"verified": self.verify, "decoded": self.decode}
        self.verify = self.decode = 0
        return out


def _setup(root: Path):
    keys = {n: signing.new_key(root / f"{n}.pem") for n in ("admin", "a", "syncer")}
    store = open_store(str(root / "run"))
    return store, benchlib.signed_run(store, keys, task=TASK, lease_s=600.0), keys


def _payload(store, run, learner_id: str, seq: int, base: int, *, numel: int | None, signer) -> tuple[str, bytes]:
    """A contribution to fragment 0: the plan's shapes (``numel`` None) or one tensor of ``numel`` floats."""
    plan = ledger.read_plan(store, run_id=run["run_id"])
    g = torch.Generator().manual_seed(seq)
    shapes = expected_shapes(plan, 0) if numel is None else {"junk": (numel,)}
    tensors = {k: 1e-3 * torch.randn(s, generator=g) for k, s in shapes.items()}
    header = records.make("contribution", run_id=run["run_id"], fragment=0, learner_id=learner_id, seq=seq,
                          base_version=base, c_tokens=64, c_steps=2, nonce=records.new_nonce())
    data = codec.encode_tensors(tensors, codec="none", metadata=header)
    key = layout.contribution_key(0, learner_id, seq)
    if signer is not None:
        data = signing.sign_payload(data, kind="contribution", run_id=run["run_id"], key=key, signer=signer)
    return key, data


def _serve(store, keys, name: str, counts: _Counts) -> tuple[Syncer, threading.Event, threading.Thread, float]:
    """A syncer serving in a thread; returns when it has restored, with the moment it had.

    The counts are reset on the syncer's own thread between its restore and its first poll:
    reset from here instead, a first poll that ran before this thread woke would be lost."""
    s = Syncer(store, options=SyncerOptions(syncer_id=name, fragments=[0], poll_s=0.02, gc=False,
                                            key_path=str(keys["syncer"].path)))
    serving = threading.Event()
    start = s.start
    t_serving: list[float] = []

    def started() -> None:
        start()
        counts.take()
        t_serving.append(time.monotonic())
        serving.set()

    s.start = started
    stop = threading.Event()
    thread = threading.Thread(target=s.serve, kwargs={"stop": stop.is_set}, daemon=True)
    thread.start()
    if not serving.wait(WAIT_CEILING_S):
        raise SystemExit(f"syncer {name} did not start within {WAIT_CEILING_S} s")
    return s, stop, thread, t_serving[0]


def _wait_version(store, version: int) -> float:
    deadline = time.monotonic() + WAIT_CEILING_S
    while time.monotonic() < deadline:
        if (ledger.latest_version(store, 0) or 0) >= version:
            return time.monotonic()
        time.sleep(0.005)
    raise SystemExit(f"version {version} was not committed within {WAIT_CEILING_S} s")


def _phase(name: str, s: Syncer, t_upload: float, store, version: int, counts: _Counts, junk: int,
           honest_bytes: int) -> dict:
    """Wait for ``version``, then for the syncer to have dealt with every junk object."""
    landed = _wait_version(store, version)
    at_merge = {"quarantined_at_merge": s.intake.num_quarantined + s.intake.reports_believed, **counts.take()}
    deadline = time.monotonic() + WAIT_CEILING_S
    while s.intake.num_quarantined + s.intake.reports_believed < junk and time.monotonic() < deadline:
        time.sleep(0.01)
    return {"phase": name, "merge_after_upload_s": round(landed - t_upload, 3), **at_merge,
            "junk_done_s": round(time.monotonic() - t_upload, 2), "quarantined": s.intake.num_quarantined,
            "reports_believed": s.intake.reports_believed, "junk_bytes_read": s.intake.bytes_in - honest_bytes}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--junk", type=int, default=2000)
    ap.add_argument("--junk-kb", type=float, default=57.0, help="size of each junk object")
    ap.add_argument("--dir", default=None, help="work directory (default: a temporary one)")
    ap.add_argument("--json", default=None, help="write the phases here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    root = Path(args.dir or tempfile.mkdtemp(prefix="bench_junk_"))
    store, run, keys = _setup(root)
    numel = max(1, int(args.junk_kb * 1024 / 4))
    junk = [_payload(store, run, f"junk{i:05d}", 1, 0, numel=numel, signer=None) for i in range(args.junk)]
    counts = _Counts()
    out = []

    s, stop, thread, _ = _serve(store, keys, "flood", counts)
    for key, data in junk:
        store.put_if_absent(key, data)
    key, data = _payload(store, run, "a", 1, 0, numel=None, signer=keys["a"])
    t = time.monotonic()
    store.put_if_absent(key, data)
    out.append(_phase("flood", s, t, store, 1, counts, args.junk, len(data)))
    stop.set()
    thread.join()

    for info in store.list(layout.QUARANTINE_PREFIX):  # the cold syncer meets the junk unreported
        store.delete(info.key)
    for seq, phase in ((2, "cold"), (3, "restart")):
        key, data = _payload(store, run, "a", seq, seq - 1, numel=None, signer=keys["a"])
        store.put_if_absent(key, data)
        s, stop, thread, t = _serve(store, keys, phase, counts)  # t: restored, the junk not yet seen
        out.append(_phase(phase, s, t, store, seq, counts, args.junk, len(data)))
        stop.set()
        thread.join()

    for row in out:
        print(json.dumps(row))
    ok = all(r["merge_after_upload_s"] <= 2.0 for r in out)
    mb = sum(len(d) for _, d in junk) / 1e6
    print(f"{args.junk} junk objects ({mb:.0f} MB): " + ", ".join(f"{r['phase']} {r['merge_after_upload_s']} s"
                                                                  for r in out) + f" (target <= 2 s: {ok})")
    if args.json:
        Path(args.json).write_text(json.dumps({"junk": args.junk, "junk_mb": mb, "load": os.getloadavg(),
                                               "phases": out}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
