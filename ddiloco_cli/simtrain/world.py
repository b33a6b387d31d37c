"""One simulated Decoupled DiLoCo run: the bucket, the run's init, M learners and the
syncer on one event loop, the faults of the scenario, and the global model's val loss
along the way."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from ddiloco_cli.ops.runinit import init_run
from ddiloco_cli.protocol import layout, ledger
from ddiloco_cli.protocol.published import load_global_model
from ddiloco_cli.protocol.runconfig import RunConfig
from ddiloco_cli.simtrain.bucket import Link, SimBucket, SimStore
from ddiloco_cli.simtrain.learners import SimLearner
from ddiloco_cli.simtrain.loop import EventLoop, TurnClock
from ddiloco_cli.simtrain.scenario import Scenario
from ddiloco_cli.simtrain.syncer import SimSyncer
from ddiloco_cli.tasks import evaluate, load_task

log = logging.getLogger(__name__)

VAL_BATCH = 64  # every arm is scored on the same val batches (benchlib.val_loss's batch size)
HORIZON_FACTOR = 20.0  # the run is cut off at this many times its no-fault duration (a stuck run)


@dataclass
class Point:
    t_s: float  # virtual time
    tokens: int  # tokens the learners trained so far
    val_loss: float


class World:
    def __init__(self, scenario: Scenario):
        self.scenario = sc = scenario
        self.loop = EventLoop()
        self.bucket = SimBucket()
        admin_clock = TurnClock(self.loop)
        self.admin = SimStore(self.bucket, admin_clock, Link(1.0, 1.0, 0.0), name="admin", seed="admin", free=True)
        init_run(self.admin, sc.run_config(), clock=admin_clock)
        run = ledger.read_run(self.admin)
        self.config = RunConfig.from_record(run, where=f"{self.admin.url}/{layout.RUN_CONFIG}")
        self.inner = run["inner"]
        self.run_id = run["run_id"]
        self.plan = ledger.read_plan(self.admin, run_id=self.run_id)
        self.task = load_task(self.config.task)
        self.eval_model = self.task.build_model()
        self.num_params = sum(t.numel() for t in self.eval_model.parameters())
        # the times of a model of sc.model_params parameters (the bucket's objects stay this one's)
        self.bucket.payload_scale = sc.model_params / self.num_params if sc.model_params > 0 else 1.0
        self.learners = [
            SimLearner(self, i, lid, speed=speed, link=Link.of(**sc.link(i), store_latency_ms=sc.store_latency_ms))
            for i, (lid, speed) in enumerate(zip(sc.learner_ids(), sc.speed_factors()))]
        syncer_link = Link.of(up_mbps=sc.syncer_gbps * 1e3, down_mbps=sc.syncer_gbps * 1e3, rtt_ms=sc.syncer_rtt_ms,
                              jitter_ms=0.0, store_latency_ms=sc.store_latency_ms)
        # the primary (the outages hit it) and, with ``standby``, a second one waiting for its lease
        self.syncers = [SimSyncer(self, link=syncer_link, parallel=sc.intake_parallel, name=name)
                        for name in (["primary", "standby"] if sc.standby else ["primary"])]
        self.syncer = self.syncers[0]
        self.tokens = 0
        self.total_steps = 0
        self.curve: list[Point] = []
        self._eval_every = max(1, sc.learners * sc.steps_per_learner // max(1, sc.eval_points))
        self._next_eval = self._eval_every if sc.eval_points > 0 else float("inf")
        self.wall_s = 0.0

    # ------------------------------------------------------------ schedule
    def nominal_s(self) -> float:
        """How long the run would take without faults: the slowest learner's steps."""
        slowest = max(f * (1 + max(0.0, d)) for f, d in self.scenario.speed_factors())
        return self.scenario.steps_per_learner * self.scenario.step_s * slowest

    def schedule(self) -> float:
        sc, loop = self.scenario, self.loop
        horizon_s = HORIZON_FACTOR * self.nominal_s() + sum(o["duration_s"] for o in sc.syncer_outages) + \
            max([float(j["at_s"]) for j in sc.joins] or [0.0])
        for i, syncer in enumerate(self.syncers):
            loop.at(0.0 if i == 0 else self.config.heartbeat_s, syncer.start)
        for learner in self.learners:
            loop.at(sc.join_s(learner.index), self._start_learner, learner)
            for down_t, back_t in sc.preemptions(learner.index, horizon_s):
                loop.at(down_t, learner.crash)
                loop.at(back_t, self._start_learner, learner)
        for outage in sc.syncer_outages:
            loop.at(float(outage["at_s"]), self.syncer.down)
            loop.at(float(outage["at_s"]) + float(outage["duration_s"]), self.syncer.back)
        return horizon_s

    def _start_learner(self, learner: SimLearner) -> None:
        if not learner.finished and not learner.up:
            learner.start()

    def done(self) -> bool:
        return all(learner.idle for learner in self.learners) and any(syncer.drained() for syncer in self.syncers)

    def run(self, *, final_eval: bool = True) -> None:
        t0 = time.process_time()
        horizon_s = self.schedule()
        self.loop.run(done=self.done, limit_s=horizon_s)
        self.loop.now = max(self.loop.now, self.bucket.last_write_t)  # the last merge lands
        if not self.done():
            log.warning("simulation cut off at %.0f s of virtual time (learners idle: %s)", self.loop.now,
                        [learner.idle for learner in self.learners])
        self.final_val = self.evaluate(final=True) if final_eval else float("nan")
        self.wall_s = time.process_time() - t0

    # ------------------------------------------------------------ evaluation
    def on_step(self, learner: SimLearner) -> None:
        self.total_steps += 1
        self.tokens += self.config.batch_size * getattr(getattr(self.task, "config", None), "block_size", 1)
        if self.total_steps >= self._next_eval:
            self._next_eval += self._eval_every
            self.curve.append(Point(self.loop.now, self.tokens, self.evaluate()))

    def evaluate(self, *, final: bool = False) -> float:
        load_global_model(self.admin, run_id=self.run_id, plan=self.plan, model=self.eval_model)
        with torch.no_grad():
            return evaluate(self.task, self.eval_model, batch_size=VAL_BATCH,
                            max_batches=None if final else self.scenario.eval_batches)

    # ------------------------------------------------------------ ledger
    def ledger_summary(self) -> dict[str, Any]:
        """Used / superseded / refused entries, merged token fraction, quorum sizes and
        versions per fragment per cycle, from the manifests in the bucket."""
        counts = {"used": 0, "superseded": 0, "refused": 0}
        quorums: list[int] = []
        merged_tokens, versions = [], []
        for p in range(self.plan.num_fragments):
            latest = ledger.latest_version(self.admin, p) or 0
            tokens = 0
            for v in range(1, latest + 1):
                m = ledger.read_manifest(self.admin, p, v, run_id=self.run_id)
                quorums.append(int(m["quorum_size"]))
                for e in m["contributions"]:
                    status = e.get("status", "used" if e.get("used") else "superseded")
                    counts[status] = counts.get(status, 0) + 1
                    if e.get("used"):
                        inc = e.get("increment_of") or {}
                        tokens += int(e["c_tokens"]) - int(inc.get("c_tokens", 0))
            merged_tokens.append(tokens)
            versions.append(latest)
        cycles = self.scenario.steps_per_learner / self.config.sync_every
        trained = max(1, self.tokens)
        return {**counts, "merged_token_fraction": sum(merged_tokens) / len(merged_tokens) / trained,
                "mean_quorum": sum(quorums) / max(1, len(quorums)), "max_quorum": max(quorums, default=0),
                "versions_per_fragment_per_cycle": sum(versions) / len(versions) / max(1e-9, cycles)}
