"""What one simulated run is: the scenario (flags, a TOML file, or the ``--quick`` preset).

Top-level keys of the TOML file are ``Scenario`` fields; its ``[run]`` table overrides
``RunConfig`` fields (their Python names: ``num_fragments``, ``sync_every``, ``codec`` ...);
``[[joins]]`` and ``[[syncer_outages]]`` are lists of tables. Flags given on the command
line (``--learners``, ``--steps-per-learner``, ``--seed``) win over the file.
"""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass, field
from typing import Any

import tomllib

from ddiloco_cli.errors import UsageError
from ddiloco_cli.protocol.runconfig import RunConfig

SPEEDS = ("constant", "two", "lognormal")
# One syncer core's cost of a merge of M contributions to a fragment of n parameters, fitted to
# ``python scripts/bench_syncer.py --codecs int4,sparse --ms 4,16,64`` (two runs, 2.1M-parameter
# fragment; docs/simulation.md "Merge compute"): n / VERSION_PARAMS_PER_S for what a version costs
# whatever M (the outer step, the published delta, keyframes, manifest) plus n * M /
# MERGE_PARAMS_PER_S[codec] for what each contribution costs (download, decode, norm, merge). The
# other codecs take int4's figure.
VERSION_PARAMS_PER_S = 1.1e8
MERGE_PARAMS_PER_S = {"int4": 4.7e8, "sparse": 1.7e9}

# the run settings bench_convergence.py uses (decoupled arm); a scenario's [run] table overrides them
RUN_DEFAULTS: dict[str, Any] = dict(
    task="ddiloco_cli.tasks.gpt:tiny", num_fragments=4, sync_every=16, overlap_steps=8, inner_lr=3e-3,
    warmup_steps=20, lr_schedule="cosine", batch_size=16, codec="int4",
    grace_gamma=0.5, lease_s=6.0, heartbeat_s=1.0, max_staleness=16, quorum=1, mode="decoupled", merge="rda",
)


@dataclass
class Scenario:
    learners: int = 4
    steps_per_learner: int = 600
    seed: int = 0
    # learner i's id; a learner's data order is seeded by its id (+ seed): "l{i}" gives
    # bench_convergence.py's learners l0, l1, ... the same batches as its real processes
    learner_id_format: str = "L{i:03d}"
    run: dict[str, Any] = field(default_factory=dict)  # RunConfig overrides
    # compute: a learner's step takes step_s x its speed factor x (1 + its drift x progress)
    step_s: float = 1.0
    speeds: str = "constant"  # constant | two (every other learner slow_factor x slower) | lognormal
    slow_factor: float = 1.5
    sigma: float = 0.5  # lognormal: the speed factors are exp(N(0, sigma))
    drift: float = 0.0  # each learner's speed drifts by up to +-drift (fraction) over the run
    # links (every learner's; [[links]] tables {learner, up_mbps, ...} override one learner's)
    up_mbps: float = 100.0
    down_mbps: float = 100.0
    rtt_ms: float = 50.0
    jitter_ms: float = 0.0  # uniform extra delay per request, 0..jitter
    store_latency_ms: float = 20.0  # the object store's own time per request
    links: list[dict[str, Any]] = field(default_factory=list)
    # the syncer
    syncer_poll_s: float = 0.2
    syncer_gbps: float = 10.0
    syncer_rtt_ms: float = 1.0
    intake_parallel: int = 4  # contribution downloads the syncer keeps in flight
    # one core's rates (None: the run's codec's figures above); a syncer of ``syncer_cores``
    # processes (sync --fragments, one core each) merges that many fragments at once
    merge_params_per_s: float | None = None
    version_params_per_s: float | None = None
    syncer_cores: int = 1
    # faults
    mtbf_s: float = 0.0  # per learner, mean time between preemptions (0: none)
    downtime_s: float = 60.0  # a preempted learner is back after this long
    joins: list[dict[str, Any]] = field(default_factory=list)  # {learner = i, at_s = t}: starts late
    syncer_outages: list[dict[str, Any]] = field(default_factory=list)  # {at_s, duration_s} of the primary
    standby: bool = False  # a standby syncer takes the lease over when the primary's runs out
    # report
    eval_points: int = 8  # global val loss this many times along the run
    # time to a loss: every arm's time to data-parallel's final loss, data-parallel trained for
    # dp_steps (0: steps_per_learner); give the other arms more steps to reach it
    dp_steps: int = 0
    # the times of a model of this many parameters (0: the simulated model's own): tensor payloads'
    # transfer times, the syncer's merge time and the references' all-reduces scale with it, the
    # loss per step stays the simulated model's
    model_params: float = 0.0
    arms: tuple[str, ...] = ("decoupled", "sync", "dp")
    eval_batches: int | None = None  # val batches per evaluation (None: the whole val split)

    def check(self) -> None:
        if self.learners < 1 or self.steps_per_learner < 1:
            raise UsageError("--learners and --steps-per-learner must be >= 1")
        if self.speeds not in SPEEDS:
            raise UsageError(f"speeds = {self.speeds!r}: use one of {', '.join(SPEEDS)}")
        if self.step_s <= 0 or min(self.up_mbps, self.down_mbps, self.syncer_gbps) <= 0:
            raise UsageError("step_s and link bandwidths must be > 0")
        try:
            ids = self.learner_ids()
        except (KeyError, IndexError, ValueError) as exc:
            raise UsageError(f"learner_id_format = {self.learner_id_format!r}: {exc!r}; use {{i}}") from None
        if len(set(ids)) != len(ids):
            raise UsageError(f"learner_id_format = {self.learner_id_format!r} gives equal ids: use {{i}}")
        if self.dp_steps < 0 or self.model_params < 0:
            raise UsageError("dp_steps and model_params must be >= 0")
        if self.syncer_cores < 1 or any(r is not None and r <= 0 for r in (self.merge_params_per_s,
                                                                            self.version_params_per_s)):
            raise UsageError("syncer_cores must be >= 1 and the syncer's rates > 0")
        bad = [a for a in self.arms if a not in ("decoupled", "sync", "dp")]
        if bad or "decoupled" not in self.arms:
            raise UsageError(f"arms {list(self.arms)}: a subset of decoupled, sync, dp with decoupled")
        self.run_config()  # validates the [run] table

    def run_config(self, **over: Any) -> RunConfig:
        """The decoupled arm's RunConfig: bench_convergence's settings, the scenario's [run]
        table, total_steps = steps_per_learner and the seed."""
        fields = {**RUN_DEFAULTS, **self.run, "total_steps": self.steps_per_learner, "seed": self.seed, **over}
        known = {f.name for f in dataclasses.fields(RunConfig)}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise UsageError(f"[run] table: unknown RunConfig fields {unknown}")
        return RunConfig(**fields)

    def merge_cost_s(self, numel: int, contributions: int, *, codec: str | None = None) -> float:
        """The syncer's compute for one merge of ``contributions`` to a fragment of ``numel``
        parameters (at the simulated size: the caller scales it to ``model_params``), for
        ``codec`` (None: the [run] table's, from a RunConfig built for it)."""
        codec = codec or self.run_config().codec
        per_contribution = self.merge_params_per_s or MERGE_PARAMS_PER_S.get(codec, MERGE_PARAMS_PER_S["int4"])
        per_version = self.version_params_per_s or VERSION_PARAMS_PER_S
        return numel * (1.0 / per_version + contributions / per_contribution) / self.syncer_cores

    # ------------------------------------------------------------ per learner
    def learner_ids(self) -> list[str]:
        return [self.learner_id_format.format(i=i) for i in range(self.learners)]

    def speed_factors(self) -> list[tuple[float, float]]:
        """Per learner (speed factor, drift): seeded, independent of everything else drawn."""
        rng = random.Random(f"speeds-{self.seed}")
        out = []
        for i in range(self.learners):
            if self.speeds == "two":
                factor = self.slow_factor if i % 2 else 1.0
            elif self.speeds == "lognormal":
                factor = math.exp(rng.gauss(0.0, self.sigma))
            else:
                factor = 1.0
            out.append((factor, self.drift * (2 * rng.random() - 1)))
        return out

    def slowest(self) -> float:
        """The slowest learner's speed factor (its drift aside): a synchronous arm's steps wait for it."""
        return max(f for f, _ in self.speed_factors())

    def link(self, i: int) -> dict[str, float]:
        base = dict(up_mbps=self.up_mbps, down_mbps=self.down_mbps, rtt_ms=self.rtt_ms, jitter_ms=self.jitter_ms)
        for over in self.links:
            if int(over.get("learner", -1)) == i:
                base.update({k: float(v) for k, v in over.items() if k in base})
        return base

    def join_s(self, i: int) -> float:
        return max([float(j["at_s"]) for j in self.joins if int(j["learner"]) == i] or [0.0])

    def preemptions(self, i: int, horizon_s: float) -> list[tuple[float, float]]:
        """Learner i's (down at, back at) pairs: exponential gaps of mean mtbf_s counted from
        each return, seeded per learner."""
        if self.mtbf_s <= 0:
            return []
        rng = random.Random(f"preempt-{self.seed}-{i}")
        out, t = [], self.join_s(i)
        while True:
            t += rng.expovariate(1.0 / self.mtbf_s)
            if t >= horizon_s:
                return out
            out.append((t, t + self.downtime_s))
            t += self.downtime_s


QUICK = dict(learners=2, steps_per_learner=96, step_s=0.5, eval_points=3, eval_batches=8)


def load_scenario(path: str | None, *, quick: bool = False, **flags: Any) -> Scenario:
    """The scenario from ``path`` (TOML) or the defaults, the ``--quick`` preset over it, then
    the flags that are not None."""
    data: dict[str, Any] = {}
    if path:
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise UsageError(f"--scenario {path}: {exc}") from None
    if quick:
        data = {**data, **QUICK}
    data.update({k: v for k, v in flags.items() if v is not None})
    known = {f.name for f in dataclasses.fields(Scenario)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise UsageError(f"scenario: unknown keys {unknown}; known: {', '.join(sorted(known))}")
    if "arms" in data:
        data["arms"] = tuple(data["arms"])
    scenario = Scenario(**data)
    scenario.check()
    return scenario
