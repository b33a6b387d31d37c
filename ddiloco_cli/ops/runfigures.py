"""The run's headline figures from its learners' status rows (``observe.run_status``): goodput
(tokens trained against tokens the learners could have trained) and bytes moved against the
data-parallel equivalent; the alerts a monitor pages on, and notes on late receives. Pure
functions of the rows: no bucket, no clock."""

from __future__ import annotations

from typing import Any

from ddiloco_cli.protocol.fragspec import format_fragment_spec

PILE_UP = 3  # pending contributions of one learner on one fragment that mean nothing is merging them


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


def alerts(*, fragments: list[dict[str, Any]], syncers: list[dict[str, Any]],
           learners: list[dict[str, Any]]) -> list[str]:
    """Conditions that stop a run from making progress, one line each ([] when healthy):

    * no syncer is alive (nothing is merged; learners train on stale fragments), or
      some fragments have no live owner;
    * contributions piling up: one learner has ``PILE_UP`` or more pending
      contributions on a fragment, which a merging syncer never lets happen (it
      merges or supersedes them every sync period).
    """
    out = []
    alive = [s for s in syncers if s["alive"]]
    if not alive:
        beats = [s["heartbeat_age_s"] for s in syncers if s["heartbeat_age_s"] is not None]
        last = f"last heartbeat {min(beats):.0f} s ago" if beats else "none has ever served"
        out.append(f"no syncer alive ({last}): nothing is merged; start `ddiloco sync`")
    else:
        served = {p for s in alive for p in s["fragments"]}
        orphaned = [f["fragment"] for f in fragments if f["fragment"] not in served]
        if orphaned:
            spec = format_fragment_spec(orphaned)
            out.append(f"fragments {spec} have no live syncer: start `ddiloco sync --fragments {spec}`")
    out.extend(a for s in alive for a in s.get("alerts", []))  # what a serving syncer cannot repair
    piled = [f for f in fragments if f["max_pending_per_learner"] >= PILE_UP]
    if piled:
        worst = max(f["max_pending_per_learner"] for f in piled)
        live = sum(1 for r in learners if r["alive"])
        spec = format_fragment_spec([f["fragment"] for f in piled])
        out.append(f"contributions piling up on fragments {spec} (up to {worst} pending from one learner; "
                   f"{live} learner(s) alive): no syncer is merging them, or the quorum cannot be reached")
    return out


def late_receives(learners: list[dict[str, Any]], *, tau: int) -> list[str]:
    """One line per live learner whose versions come back later than the overlap window:
    its median send -> receive lag (steps, from its heartbeat) is over ``tau``. Its merges
    then land after the step it expected them, and it trains on from an older base for the
    difference; the remedy is a larger ``--overlap-steps`` or a faster syncer poll."""
    out = []
    for r in learners:
        if r["alive"] and r.get("lag_p50") is not None and r["lag_p50"] > tau:
            out.append(f"learner {r['learner_id']}: versions come back a median {r['lag_p50']} steps after its sends "
                       f"(p95 {r['lag_p95']}), over the overlap window tau = {tau}: size --overlap-steps to about "
                       f"{r['lag_p50']} at the next init, or poll faster (`sync --poll`)")
    return out


# Bytes per parameter of one contribution (up) and one published delta (down), compressed, as
# measured on real outer gradients of the 3.2M-param GPT at P = H = 24 (docs/results.md "Codec",
# "Real-run traffic"; docs/sparse.md): int4 at codec_qmax 3 (the default; 7: 0.479 up), sparse at
# density 0.02 up and 0.04 down (scaled by the run's densities).
MEASURED_B_PER_PARAM = {"none": (4.0, 4.0), "bf16": (1.59, 1.59), "int8": (0.94, 0.94), "int4": (0.348, 0.344),
                        "sparse": (0.030, 0.047)}
_MEASURED_DENSITY = (0.02, 0.04)


def traffic_per_cycle(*, codec: str, publish_codec: str, codec_qmax: int | None, codec_density: float | None,
                      publish_density: float | None, num_params: int, sync_every: int) -> dict[str, float]:
    """About what one learner moves per cycle of H steps: every fragment sent once (up) and one
    version of each received (down; the runs measured 1.0-1.4), at the measured bytes per
    parameter of the run's codecs. ``mbps_at_1s``: the link that carries it in H one-second
    steps, each way (scale by 1 / the step time)."""
    up_bpp = MEASURED_B_PER_PARAM[codec][0]
    down_bpp = MEASURED_B_PER_PARAM[publish_codec][1]
    if codec == "int4" and codec_qmax is not None and codec_qmax > 3:
        up_bpp = 0.479
    if codec == "sparse" and codec_density:
        up_bpp *= codec_density / _MEASURED_DENSITY[0]
    if publish_codec == "sparse" and publish_density:
        down_bpp *= publish_density / _MEASURED_DENSITY[1]
    up, down = up_bpp * num_params, down_bpp * num_params
    return {"up_bytes": up, "down_bytes": down, "up_b_per_param": up_bpp, "down_b_per_param": down_bpp,
            "mbps_at_1s": max(up, down) * 8 / sync_every / 1e6}


BLOCKED_NOTE = 0.1  # a live learner blocked on the bucket more than this share of its time gets a note


def blocked_learners(learners: list[dict[str, Any]], *, codec: str) -> list[str]:
    """One line per live learner blocked on the bucket more than ``BLOCKED_NOTE`` of its time
    (its heartbeat's ``blocked_s`` over steps x step time, both counted over all its sessions):
    its uploads or downloads do not fit its link within a cycle, or the versions it holds out
    for come late (a syncer that is behind). The sweep in docs/sparse.md measured both: int4
    contributions outgrow 100 Mbps above about 5.7e8 parameters at H = 16 and 1 s steps, and a
    3e9-parameter sparse run needed 16 syncer processes."""
    out = []
    for r in learners:
        wall_s = (r["step"] or 0) * (r["step_time_s"] or 0.0)
        if not r["alive"] or wall_s <= 0 or r["blocked_s"] <= BLOCKED_NOTE * wall_s:
            continue
        fewer = ("`--codec sparse` at the next init (about 10x fewer bytes than int4), or a longer --sync-every"
                 if codec != "sparse" else "a longer --sync-every or a lower --codec-density")
        out.append(f"learner {r['learner_id']}: blocked on the bucket {min(1.0, r['blocked_s'] / wall_s):.0%} of its "
                   f"time ({r['blocked_s']:.0f} s over {r['step']} steps): its transfers do not fit its link "
                   f"within a cycle, or the syncer is behind; send fewer bytes per cycle ({fewer}; docs/sparse.md), "
                   "give it a faster link, or run more syncer processes (`sync --fragments`)")
    return out


def cost_share(step_ms: float | None, step_cpu_ms: float | None, worker_cpu_ms: float | None,
               step_time_s: float) -> float | None:
    """ddiloco's share of a learner's step from its heartbeat's cost fields (``learner.stats.
    CostMeter``): the larger of the training thread's wait in ddiloco's step call and the CPU
    ddiloco's threads spend (that thread's in the call and the workers'), over the step time.
    Where the worker threads share the training's only core the CPU is what a step pays; where
    they have cores of their own it is an upper bound. None without the fields or a step time."""
    if step_ms is None or step_time_s <= 0:
        return None
    return max(step_ms, (step_cpu_ms or 0.0) + (worker_cpu_ms or 0.0)) / (1e3 * step_time_s)


COST_NOTE = 0.1  # a live learner whose steps ddiloco takes more than this share of gets a note


def costly_learners(learners: list[dict[str, Any]]) -> list[str]:
    """One line per live learner whose steps ddiloco itself takes more than ``COST_NOTE`` of (its
    heartbeat's ``cost_share``): its work a step is a fragment's send and receive every H / P
    steps, a fixed cost each (about 3 ms for a 131k-value int4 fragment on one core, docs/results.md
    "Learner overhead"), so short steps pay the most."""
    out = []
    for r in learners:
        share = r.get("sync_share")
        if not r["alive"] or share is None or share <= COST_NOTE:
            continue
        out.append(f"learner {r['learner_id']}: ddiloco takes {share:.0%} of its steps (of "
                   f"{1e3 * (r['step_time_s'] or 0.0):.0f} ms a step): it sends and receives fragments more often "
                   "than the step can carry; a longer --sync-every or fewer --fragments at the next init sends "
                   "fewer a step, and a core to spare for its worker threads takes their CPU off the step")
    return out


HELD_NOTE = 0.5  # a live learner for which more than this share of receives were held versions gets a note
HELD_NOTE_AFTER = 8  # ... once it has folded in at least this many


def held_versions(learners: list[dict[str, Any]], *, held_alpha: float) -> list[str]:
    """One line per live learner for which most versions folded in lacked its contribution in
    flight ([L8]'s held version, taken at the step before the fragment's next send): the merge
    of its contributions does not come back within a cycle, because its link cannot carry a
    cycle or the syncer is behind. It re-bases every cycle on a version a cycle old; the
    simulated M = 16 int4 run over 100 Mbps was there (docs/sparse.md)."""
    out = []
    for r in learners:
        n, held = r.get("receives"), r.get("held_receives")
        if not r["alive"] or not n or n < HELD_NOTE_AFTER or held is None or held <= HELD_NOTE * n:
            continue
        out.append(f"learner {r['learner_id']}: {held} of its {n} receives were versions without its contribution "
                   f"in flight (mixed in with held_alpha = {held_alpha:g}): its merges do not come back within a "
                   "cycle; if it is also blocked on the bucket, send fewer bytes per cycle (`--codec sparse`, a "
                   "longer --sync-every), else run more syncer processes (`sync --fragments`) or poll faster")
    return out


def failed_uploads(learners: list[dict[str, Any]]) -> list[str]:
    """One line per learner whose session gave contributions up (not encodable, or the store's
    retries ran out: created nowhere, so in no ledger): their steps reach the global model only
    through a later contribution of the fragment on the same base. Its log names each one."""
    return [f"learner {r['learner_id']}: gave up {r['uploads_failed']} contribution(s) this session (the store's "
            "retries ran out, or one could not be encoded; its log names them): their progress reaches the global "
            "model only through its next contribution of the fragment on the same base; check the bucket's health"
            for r in learners if r.get("uploads_failed")]


def refused_contributions(learners: list[dict[str, Any]]) -> list[str]:
    """One line per learner whose contributions a ledger refused this session (stale, a base
    gone, a bound, arrived late: the ledger's reason, PROTOCOL [L5]): their progress is in no
    merge; the learner re-based on the version that said so."""
    return [f"learner {r['learner_id']}: {r['refused']} of its contributions were refused this session (newest: "
            f"{r.get('last_refusal') or 'no reason recorded'}); their progress is in no merge"
            for r in learners if r.get("refused")]


__all__ = ["COST_NOTE", "cost_share", "costly_learners", "BLOCKED_NOTE", "HELD_NOTE", "failed_uploads", "held_versions", "refused_contributions", "MEASURED_B_PER_PARAM", "PILE_UP", "traffic_per_cycle", "alerts", "blocked_learners", "bytes_moved", "goodput", "late_receives"]
