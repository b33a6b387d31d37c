"""The create-only race (shared by tests/integration/test_store_races.py and
scripts/race_stores.py): 8 processes, one key per round.

Each round, every worker (a persistent spawned process) waits on a barrier,
reads the round's key (expects NotFound or the complete winning object),
tries ``put_if_absent("race/<round>.json", <its own nonce + 64 KiB padding>)``,
then reads the key again. The parent checks that exactly one worker won each
round and that every read returned NotFound (before the write only) or exactly
the winner's bytes: never a torn, partial or losing object.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import queue
import time
import traceback
import uuid
from dataclasses import dataclass

NUM_WORKERS = 8
NUM_ROUNDS = 100
PAD_BYTES = 16 * 1024  # several pages: a torn local write would show


@dataclass
class RaceFigures:
    backend: str
    num_workers: int
    num_rounds: int
    num_winners: int  # total successful creates over all rounds
    num_multi_winner_rounds: int
    num_no_winner_rounds: int
    num_reads: int
    num_bad_reads: int  # torn/partial/unparseable or not the winner's bytes
    wall_s: float

    @property
    def num_anomalies(self) -> int:
        return self.num_multi_winner_rounds + self.num_no_winner_rounds + self.num_bad_reads


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _check_body(data: bytes, round_idx: int) -> bool:
    """A complete race object: valid JSON for this round whose padding matches its nonce."""
    try:
        obj = json.loads(data)
    except ValueError:
        return False
    return obj.get("round") == round_idx and obj.get("pad") == obj.get("nonce", "") * (PAD_BYTES // 32)


def _race_worker(url: str, worker_id: int, num_rounds: int, barrier, out_queue) -> None:
    """One contender. Sends ``("ok", worker_id, records)`` or ``("error", worker_id, text)``."""
    try:
        from ddiloco_cli.store import NotFound, open_store

        store = open_store(url)
        records = []
        for r in range(num_rounds):
            key = f"race/{r:020d}.json"
            nonce = uuid.uuid4().hex
            body = json.dumps({"round": r, "worker": worker_id, "nonce": nonce, "pad": nonce * (PAD_BYTES // 32)})
            body = body.encode()
            barrier.wait(timeout=120)
            try:
                before = store.get(key)
            except NotFound:
                before = None
            won = store.put_if_absent(key, body)
            after = store.get(key)
            records.append(
                {
                    "round": r,
                    "won": won,
                    "mine": _sha(body),
                    "before": None if before is None else _sha(before),
                    "before_ok": before is None or _check_body(before, r),
                    "after": _sha(after),
                    "after_ok": _check_body(after, r),
                }
            )
        out_queue.put(("ok", worker_id, records))
    except BaseException:  # report anything, and free the others from the barrier
        barrier.abort()
        out_queue.put(("error", worker_id, traceback.format_exc()))


def run_race(url: str, *, backend: str, num_workers: int = NUM_WORKERS, num_rounds: int = NUM_ROUNDS) -> RaceFigures:
    """Race ``num_workers`` spawned processes for ``num_rounds`` keys under ``url``."""
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(num_workers)
    out_queue = ctx.Queue()
    procs = [
        ctx.Process(target=_race_worker, args=(url, i, num_rounds, barrier, out_queue), daemon=True)
        for i in range(num_workers)
    ]
    t0 = time.perf_counter()
    for p in procs:
        p.start()
    results, errors = {}, []
    while len(results) + len(errors) < num_workers:
        try:
            status, worker_id, payload = out_queue.get(timeout=1.0)
        except queue.Empty:
            # a worker that died without reporting (killed, crashed on import) ends the race
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead:
                errors.append(f"{len(dead)} worker(s) died with exit codes {dead}")
                break
            continue
        if status == "ok":
            results[worker_id] = payload
        else:
            errors.append(f"worker {worker_id}:\n{payload}")
    wall_s = time.perf_counter() - t0
    for p in procs:
        p.join(timeout=30)
    assert not errors, "\n".join(errors)

    multi = none = bad = reads = winners = 0
    for r in range(num_rounds):
        recs = [results[w][r] for w in range(num_workers)]
        won = [rec for rec in recs if rec["won"]]
        winners += len(won)
        multi += len(won) > 1
        none += not won
        winning = won[0]["mine"] if len(won) == 1 else None
        for rec in recs:
            reads += 2
            bad += rec["before"] is not None and (not rec["before_ok"] or rec["before"] != winning)
            bad += not rec["after_ok"] or rec["after"] != winning
    return RaceFigures(
        backend=backend,
        num_workers=num_workers,
        num_rounds=num_rounds,
        num_winners=winners,
        num_multi_winner_rounds=multi,
        num_no_winner_rounds=none,
        num_reads=reads,
        num_bad_reads=bad,
        wall_s=round(wall_s, 2),
    )


def format_figures(figs: RaceFigures) -> str:
    return (
        f"race {figs.backend:6s} workers={figs.num_workers} rounds={figs.num_rounds} "
        f"winners={figs.num_winners} multi_winner_rounds={figs.num_multi_winner_rounds} "
        f"no_winner_rounds={figs.num_no_winner_rounds} reads={figs.num_reads} "
        f"bad_reads={figs.num_bad_reads} wall_s={figs.wall_s}"
    )
