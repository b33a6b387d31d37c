"""The run's headline figures from its learners' status rows (``observe.run_status``): goodput
(tokens trained against tokens the learners could have trained) and bytes moved against the
data-parallel equivalent. Pure functions of the rows: no bucket, no clock."""

from __future__ import annotations

from typing import Any


def goodput(learners: list[dict[str, Any]], *, run_age_s: float) -> dict[str, Any]:
    """Goodput = tokens processed / tokens that could have been processed.

    For every learner ever seen (one heartbeat object per learner id), the
    possible tokens are its observed rate (tokens per step / step time, from its
    latest heartbeat) times its window: ``run_age_s`` (from the first learner's
    start, see ``run_status``) up to now, or to its last heartbeat if it left or
    finished on purpose. A
    learner that died (state still "running", heartbeat stale) keeps losing
    goodput until it comes back. Late joins count as lost time. Learners without
    a measured rate yet are left out of both sums (``num_unrated``). The tokens
    are all tokens the learner trained on (cumulative over its sessions), not
    only those whose contributions were merged.
    """
    done = possible = 0.0
    unrated = 0
    for r in learners:
        if not r["tokens_per_s"]:
            unrated += 1
            continue
        window_s = run_age_s if r["state"] == "running" else max(0.0, run_age_s - r["heartbeat_age_s"])
        done += r["tokens"]
        possible += r["tokens_per_s"] * window_s
    return {"goodput": min(1.0, done / possible) if possible > 0 else None, "tokens": int(done),
            "possible_tokens": int(possible), "num_unrated": unrated}


def bytes_moved(learners: list[dict[str, Any]], *, num_params: int) -> dict[str, Any]:
    """Bytes learners sent and received through the bucket (their heartbeats' counters),
    against the data-parallel equivalent: an fp32 ring all-reduce of the full gradient
    every inner step moves about 2 * 4 * num_params bytes per worker, so
    ``data_parallel_bytes = 8 * num_params * sum(steps)``; ``reduction`` is their ratio."""
    up = sum(r["bytes_up"] for r in learners)
    down = sum(r["bytes_down"] for r in learners)
    dp = 8 * num_params * sum(r["step"] for r in learners)
    total = up + down
    return {"bytes_up": up, "bytes_down": down, "bytes_total": total, "data_parallel_bytes": dp,
            "reduction": dp / total if total else None}


__all__ = ["bytes_moved", "goodput"]
