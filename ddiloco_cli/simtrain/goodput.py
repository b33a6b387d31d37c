"""Goodput simulator: training at planet scale under hardware failures.

A discrete-event model of one training run on `chips` accelerators whose chips
fail independently (Poisson, mean time between interruptions `mtbi_years` per
chip). It compares three ways of training on the same hardware:

- ``data-parallel``: one SPMD job on a fixed mesh. Any failure in it stops the
  whole job; work since the last checkpoint is lost; the job restarts after
  ``restart_s`` on a full mesh, the failed slice swapped for a hot spare. The
  spares are chips of the same machine (idle, but counted in the goodput
  denominator); when none is healthy the job waits for a repair.
- ``elastic-data-parallel``: one job whose data-parallel replicas are slices of
  ``slice_chips`` chips. A failure drops that slice (its in-flight step is lost
  everywhere), the survivors pause ``reconfigure_s`` to re-shard, and training
  continues on the healthy slices. The failed slice is out for ``recovery_s``
  (repair / host swap / state copy; the same repair time the DP spares cover)
  and its return costs one more ``reconfigure_s`` pause.
- ``decoupled`` (Decoupled DiLoCo): ``learners`` independent islands of
  ``chips / learners`` chips, each an elastic data-parallel job on its own
  slices. A failure pauses only its own learner. The run makes progress while at
  least ``quorum`` learners compute; a learner that lost every slice reloads the
  global model (``restart_s``) when its first slice returns.

Definitions (the contract of `simulate`):

- goodput: useful chip-seconds (work of computing learners, counted only while
  the run makes progress, minus work lost to failures) over ``chips * horizon``.
- uptime: fraction of wall-clock time during which the run makes progress (for
  decoupled: at least ``quorum`` learners computing).

Failure events are drawn for the whole machine at rate chips / MTBI and land on
a uniformly chosen slice (a superposition of per-slice Poisson processes); a
failure on a slice that is already down is dropped (thinning), so the cost is
O(number of failures), independent of the chip count: 1.2M chips over weeks of
simulated time take well under a second. Failures that arrive during a pause
are folded into that pause (the reconfiguration/restart handles every member
change it sees). See docs/simulator.md for the assumptions and the calibration.
"""

from __future__ import annotations

import heapq
import math

import numpy as np

from ddiloco_cli.errors import UsageError

MODES = ("data-parallel", "elastic-data-parallel", "decoupled")
SECONDS_PER_YEAR = 365.25 * 24 * 3600.0
SECONDS_PER_DAY = 24 * 3600.0

# Calibrated ONCE against the paper's 1.2M-chip, 1-year-MTBI column (DP 27%,
# elastic DP 58%, M=2/4/8/16: 70/82/88/93%) and frozen; see docs/simulator.md.
DEFAULT_SLICE_CHIPS = 256  # one data-parallel replica = failure domain
DEFAULT_STEP_S = 5.0  # one optimizer step; a failure loses the step in flight
DEFAULT_RESTART_S = 60.0  # full-job restart: reschedule on spares + reload checkpoint
DEFAULT_RECONFIGURE_S = 8.0  # elastic pause to re-shard when a slice leaves or joins
DEFAULT_RECOVERY_S = 3600.0  # a failed slice stays out this long before it rejoins
DEFAULT_TARGET_FAILURES = 40_000  # auto horizon: long enough for this many failures
DEFAULT_MIN_HORIZON_DAYS = 7.0

class _Draws:
    """Batched random draws (numpy is slow one scalar at a time)."""

    def __init__(self, rng: np.random.Generator, *, rate_per_s: float, num_slices: int):
        self._rng = rng
        self._mean_s = 1.0 / rate_per_s
        self._num_slices = num_slices
        self._i = self._n = 0

    def next(self) -> tuple[float, int, float]:
        """Returns (seconds to the next failure, index of the slice it hits, a
        uniform in [0, 1) to decide whether a DP failure hits the job or a spare)."""
        if self._i == self._n:
            self._gaps = self._rng.exponential(self._mean_s, 8192).tolist()
            self._slices = self._rng.integers(0, self._num_slices, 8192).tolist()
            self._coins = self._rng.random(8192).tolist()
            self._i, self._n = 0, 8192
        i = self._i
        self._i += 1
        return self._gaps[i], self._slices[i], self._coins[i]


def _best_spare_slices(*, num_slices: int, mean_in_repair: float) -> int:
    """Hot spares an operator would hold for a DP job: the count s that
    maximises (slices training) x P(slices under repair <= s), with the number
    under repair ~ Poisson(mean_in_repair) (normal approximation above 100)."""

    def cdf(s: int) -> float:
        if mean_in_repair > 100:
            return 0.5 * (1 + math.erf((s + 0.5 - mean_in_repair) / math.sqrt(2 * mean_in_repair)))
        term = total = math.exp(-mean_in_repair)
        for k in range(1, s + 1):
            term *= mean_in_repair / k
            total += term
        return total

    # the optimum lies within a few standard deviations above the mean
    hi = min(num_slices - 1, math.ceil(mean_in_repair + 10 * math.sqrt(mean_in_repair) + 10))
    return max(range(hi + 1), key=lambda s: (num_slices - s) / num_slices * cdf(s))


def _check(name: str, ok: bool, what: str) -> None:
    if not ok:
        raise UsageError(f"--{name.replace('_', '-')} {what}")


def simulate(
    *,
    mode: str,
    chips: int,
    learners: int = 1,
    mtbi_years: float,
    quorum: int = 1,
    restart_s: float = DEFAULT_RESTART_S,
    recovery_s: float = DEFAULT_RECOVERY_S,
    reconfigure_s: float = DEFAULT_RECONFIGURE_S,
    step_s: float = DEFAULT_STEP_S,
    checkpoint_interval_s: float | None = None,
    slice_chips: int = DEFAULT_SLICE_CHIPS,
    spare_fraction: float | None = None,
    horizon_days: float | None = None,
    seed: int = 0,
) -> dict:
    """Simulates one run and returns its goodput and uptime.

    Args (keyword-only): `mode` one of MODES; `chips` total accelerators;
    `learners` M (must be 1 unless mode is "decoupled"); `mtbi_years` mean time
    between interruptions of ONE chip; `quorum` K, learners that must compute
    for the run to progress (decoupled only); `restart_s` full restart of a job
    (DP after any failure, a learner that lost all its slices); `recovery_s`
    time a failed slice is under repair (all modes); `reconfigure_s` elastic
    re-shard pause per slice leaving or joining; `step_s` optimizer step (a
    failure loses the step in flight); `checkpoint_interval_s` DP checkpoint
    period (default: every step, i.e. in-memory checkpoints; work since the last
    one is lost); `slice_chips` chips per data-parallel replica (the failure
    domain); `spare_fraction` DP hot spares as a fraction of the slices
    (default: the count that maximises training slices x P(the pool covers the
    slices under repair)); `horizon_days` simulated time (default: long
    enough for ~40k failures, at least 7 days); `seed` makes the result
    deterministic.

    Returns a JSON-ready dict with at least "goodput" and "uptime" (both in
    [0, 1]) plus "mode", "chips", "learners", "quorum", "mtbi_years",
    "horizon_days", "num_failures", "num_pauses", "mean_learners_up",
    "mean_healthy_fraction", "lost_work_fraction" and "params".

    Raises UsageError for invalid flags (the message names the flag).
    """
    _check("mode", mode in MODES, f"must be one of {', '.join(MODES)}; got {mode!r}")
    _check("chips", chips >= 1, f"must be >= 1; got {chips}")
    _check("learners", learners >= 1, f"must be >= 1; got {learners}")
    _check("learners", mode == "decoupled" or learners == 1,
           f"applies to --mode decoupled only; use --learners 1 with --mode {mode}")
    _check("learners", learners <= chips, f"({learners}) cannot exceed --chips ({chips})")
    _check("quorum", 1 <= quorum <= learners, f"must be in 1..--learners ({learners}); got {quorum}")
    _check("mtbi_years", mtbi_years > 0, f"must be > 0; got {mtbi_years}")
    _check("step_s", step_s > 0, f"must be > 0; got {step_s}")
    _check("slice_chips", slice_chips >= 1, f"must be >= 1; got {slice_chips}")
    for name, value in (("restart_s", restart_s), ("recovery_s", recovery_s),
                        ("reconfigure_s", reconfigure_s)):
        _check(name, value >= 0, f"must be >= 0; got {value}")
    if checkpoint_interval_s is None:
        checkpoint_interval_s = step_s
    _check("checkpoint_interval_s", checkpoint_interval_s > 0, f"must be > 0; got {checkpoint_interval_s}")
    _check("spare_fraction", spare_fraction is None or 0 <= spare_fraction < 1,
           f"must be in [0, 1); got {spare_fraction}")
    _check("horizon_days", horizon_days is None or horizon_days > 0, f"must be > 0; got {horizon_days}")

    mtbi_s = mtbi_years * SECONDS_PER_YEAR
    fail_rate_per_s = chips / mtbi_s
    if horizon_days is None:
        horizon_s = max(DEFAULT_MIN_HORIZON_DAYS * SECONDS_PER_DAY, DEFAULT_TARGET_FAILURES / fail_rate_per_s)
    else:
        horizon_s = horizon_days * SECONDS_PER_DAY

    # Geometry: M learners, each split into equal slices of ~slice_chips chips.
    chips_per_learner = chips / learners
    slices_per_learner = max(1, round(chips_per_learner / slice_chips))
    chips_per_slice = chips_per_learner / slices_per_learner
    num_slices = learners * slices_per_learner
    elastic = mode != "data-parallel"
    # Every mode runs on the same hardware: a failed slice is under repair for
    # recovery_s. Elastic modes simply train without it; a DP job needs a full
    # mesh, so it trains on num_slices - spare_slices and keeps the rest as hot
    # spares (idle, but part of the chips the goodput is measured against).
    mean_slices_in_repair = fail_rate_per_s * recovery_s  # each failure takes one slice
    if elastic:
        spare_slices = 0
    elif spare_fraction is None:
        spare_slices = _best_spare_slices(num_slices=num_slices, mean_in_repair=mean_slices_in_repair)
    else:
        spare_slices = round(spare_fraction * num_slices)
    _check("spare_fraction", spare_slices < num_slices,
           f"leaves no slice to train on ({spare_slices} of {num_slices} slices are spares)")
    job_slices = slices_per_learner - spare_slices  # DP: M == 1
    # DP loses work since its last checkpoint; elastic survivors keep their
    # state and lose only the step in flight.
    lost_period_s = checkpoint_interval_s if not elastic else step_s

    draws = _Draws(np.random.default_rng(seed), rate_per_s=fail_rate_per_s, num_slices=num_slices)
    slice_down = [False] * num_slices
    # slices a learner trains on (DP: the job's mesh, refilled from the spares)
    live = [slices_per_learner if elastic else job_slices] * learners
    pause_end = [0.0] * learners  # a learner computes iff up[m]; it resumes at pause_end
    up = [True] * learners
    segment_start = [0.0] * learners  # last (re)start, on a step boundary
    n_up, up_chips = learners, live[0] * chips_per_slice * learners
    healthy_slices = num_slices
    events: list[tuple[float, int, int]] = []  # (time, kind, index)
    RECOVER, RESUME = 0, 1  # a slice is repaired; a learner's pause ends

    t = 0.0
    useful = lost = progress_s = learners_up_s = healthy_s = 0.0
    num_failures = num_pauses = 0
    gap, fail_slice, coin = draws.next()
    next_fail = gap

    def pause(m: int, now: float, *, pause_s: float) -> None:
        """Learner m stops computing; it resumes after pause_s (inf: when repaired)."""
        nonlocal n_up, up_chips, num_pauses
        up[m] = False
        n_up -= 1
        up_chips -= live[m] * chips_per_slice
        pause_end[m] = now + pause_s
        num_pauses += 1
        if pause_s != math.inf:
            heapq.heappush(events, (pause_end[m], RESUME, m))

    while True:
        is_fail = not events or next_fail <= events[0][0]
        t_next = min(next_fail if is_fail else events[0][0], horizon_s)
        # integrate the (constant) state over [t, t_next)
        dt = t_next - t
        if n_up >= quorum:
            useful += up_chips * dt
            progress_s += dt
        learners_up_s += n_up * dt
        healthy_s += healthy_slices * dt
        t = t_next
        if t >= horizon_s:
            break

        if is_fail:
            s, c = fail_slice, coin
            gap, fail_slice, coin = draws.next()
            next_fail = t + gap
            if slice_down[s]:
                continue  # thinning: a slice under repair cannot fail again
            num_failures += 1
            slice_down[s] = True
            healthy_slices -= 1
            heapq.heappush(events, (t + recovery_s, RECOVER, s))
            m = s // slices_per_learner
            # DP: the job holds job_slices of the healthy slices; the rest are spares
            hits_job = elastic or c * (healthy_slices + 1) < job_slices
            if up[m] and hits_job:
                # the work since the last step boundary (DP: checkpoint) is lost
                if n_up >= quorum:
                    w = live[m] * chips_per_slice * ((t - segment_start[m]) % lost_period_s)
                    useful -= w
                    lost += w
                if elastic:
                    pause(m, t, pause_s=reconfigure_s if live[m] > 1 else math.inf)
                    live[m] -= 1
                else:  # restart on a full mesh, if the spares can fill it
                    pause(m, t, pause_s=restart_s if healthy_slices >= job_slices else math.inf)
            elif not up[m]:
                # folded into the pause already under way
                if elastic:
                    live[m] -= 1
                    if live[m] == 0:
                        pause_end[m] = math.inf
                elif healthy_slices < job_slices:
                    pause_end[m] = math.inf  # the restart cannot fill its mesh
            continue

        _, kind, i = heapq.heappop(events)
        if kind == RECOVER:
            slice_down[i] = False
            healthy_slices += 1
            m = i // slices_per_learner
            if not elastic:
                if not up[m] and pause_end[m] == math.inf and healthy_slices >= job_slices:
                    pause_end[m] = t + restart_s
                    heapq.heappush(events, (pause_end[m], RESUME, m))
                continue
            live[m] += 1
            if live[m] == 1:
                # the learner had lost every slice: it reloads the global model
                pause_end[m] = t + restart_s
                heapq.heappush(events, (pause_end[m], RESUME, m))
            elif up[m]:
                up_chips += chips_per_slice  # pause() subtracts the grown size
                pause(m, t, pause_s=reconfigure_s)
            # else: joins the re-shard already under way
        else:  # RESUME
            m = i
            if up[m] or pause_end[m] != t:
                continue  # stale: superseded by a later pause
            up[m] = True
            n_up += 1
            up_chips += live[m] * chips_per_slice
            segment_start[m] = t

    ideal = chips * horizon_s
    return {
        "mode": mode,
        "chips": chips,
        "learners": learners,
        "quorum": quorum,
        "mtbi_years": mtbi_years,
        "goodput": min(1.0, max(0.0, useful / ideal)),
        "uptime": progress_s / horizon_s,
        "horizon_days": horizon_s / SECONDS_PER_DAY,
        "num_failures": num_failures,
        "num_pauses": num_pauses,
        "mean_learners_up": learners_up_s / horizon_s,
        "mean_healthy_fraction": healthy_s / (num_slices * horizon_s),
        "lost_work_fraction": lost / ideal,
        "seed": seed,
        "params": {
            "slice_chips": chips_per_slice,
            "slices_per_learner": slices_per_learner,
            "step_s": step_s,
            "checkpoint_interval_s": checkpoint_interval_s,
            "restart_s": restart_s,
            "reconfigure_s": reconfigure_s,
            "recovery_s": recovery_s,
            "spare_slices": spare_slices,
        },
    }
