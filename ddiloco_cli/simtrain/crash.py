"""Crash points in the simulation: the syncer killed at every point of a commit, a
learner at every point of a send; after each, the ledger audit of ``inspect --verify``
and a bit-exact replay.

A point is (target, index, phase). ``syncer``: the index-th write the primary syncer
makes inside ``Syncer.commit`` (payloads, checkpoint, the pre-commit heartbeat, the
manifest), ``before`` or ``after`` it lands. ``learner``: the index-th contribution PUT of
learner 0 (before / after), or ``queued``: right after its index-th sending step queued
the contribution, before any upload. A killed syncer's process is gone (its successor
claims the next epoch once the lease runs out); a killed learner comes back after
``downtime_s`` as a new session.

After the run: ``audit_ledger`` finds no problem and nothing pending (nothing lost or
applied twice); a fresh syncer restored from checkpoints + ledger, and one from the
ledger alone (checkpoints removed), hold exactly the live syncer's state (value,
published value, momentum, residual, cycle) for every fragment.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch

from ddiloco_cli.protocol import layout
from ddiloco_cli.simtrain.bucket import Link, SimBucket, SimStore
from ddiloco_cli.simtrain.loop import SimCrash, TurnClock
from ddiloco_cli.simtrain.scenario import Scenario
from ddiloco_cli.simtrain.world import World
from ddiloco_cli.syncer.audit import audit_ledger
from ddiloco_cli.syncer.core import Syncer, SyncerOptions
from ddiloco_cli.syncer.update import FragmentValue

PHASES = {"syncer": ("before", "after"), "learner": ("before", "after", "queued")}
RESTART_S = 1.0  # a killed syncer's process is started again this much later


@dataclass(frozen=True)
class Point:
    target: str  # syncer | learner
    index: int
    phase: str  # before | after | queued


class CrashPlan:
    """Counts the writes (and sends) a point can land on; kills at ``point`` (None: count only)."""

    def __init__(self, world: World, point: Point | None, *, forker: Any = None):
        self.world, self.point = world, point
        self.forker = forker  # a crashfork.Forker: fork a crashed copy of the run at every point
        self.counts = {"syncer": 0, "learner": 0, "queued": 0}
        self.fired = False
        self._current: dict[str, int] = {}

    def _kind(self, store: SimStore, key: str) -> str | None:
        if store.name == "syncer-primary" and store.in_commit:
            return "syncer"
        if store.name.startswith(f"{self.world.learners[0].learner_id}/") and key.startswith(layout.CONTRIBUTION_ROOT):
            return "learner"
        return None

    def on_write(self, store: SimStore, key: str, phase: str) -> None:
        kind = self._kind(store, key)
        if kind is None:
            return
        if phase == "before":
            self._current[kind] = self.counts[kind]
            self.counts[kind] += 1
        self._maybe_fire(kind, self._current[kind], phase)

    def on_send(self, learner: Any) -> None:
        if learner is self.world.learners[0]:
            self.counts["queued"] += 1
            self._maybe_fire("learner", self.counts["queued"] - 1, "queued")

    def _maybe_fire(self, kind: str, index: int, phase: str) -> None:
        if self.forker is not None and not self.fired and self.forker.split(Point(kind, index, phase)):
            self.point = Point(kind, index, phase)  # the forked child: crash here
        p = self.point
        if self.fired or p is None or (p.target, p.index, p.phase) != (kind, index, phase):
            return
        self.fired = True
        raise SimCrash(f"{kind} {phase} write {index}", self._kill_syncer if kind == "syncer" else self._kill_learner)

    def _kill_syncer(self) -> None:
        syncer, loop = self.world.syncer, self.world.loop
        syncer.down()
        loop.at(loop.now + RESTART_S, syncer.back)

    def _kill_learner(self) -> None:
        w = self.world
        learner = w.learners[0]
        learner.crash()
        w.loop.at(w.loop.now + w.scenario.downtime_s, w._start_learner, learner)


NANO, MICRO = "ddiloco_cli.simtrain.crash:nano", "ddiloco_cli.simtrain.crash:micro"


def crash_scenario(seed: int, *, steps: int = 24, task: str = NANO) -> Scenario:
    """A small, fast run: the nano MLP (or ``task``), M = 2, P = 2, H = 4, checkpoints every 2 versions."""
    return Scenario(learners=2, steps_per_learner=steps, seed=seed, step_s=0.5, eval_points=0, eval_batches=1,
                    arms=("decoupled",), downtime_s=2.0, jitter_ms=5.0,
                    run={"task": task, "num_fragments": 2, "sync_every": 4,
                         "overlap_steps": 2, "checkpoint_every": 2, "batch_size": 4})


def micro():
    """A one-layer GPT small enough that a crash point's whole run takes a fraction of a second."""
    from ddiloco_cli.tasks.gpt import GPTConfig, GPTTask

    return GPTTask(GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=32), default_batch_size=4)


class NanoTask:
    """A two-layer MLP fitting a fixed random linear map: the cheapest model the crash
    points can run (what they check does not depend on the model's size, and a step of
    this one costs a tenth of the micro GPT's)."""

    dim_in, hidden, dim_out = 8, 16, 4

    def build_model(self) -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(self.dim_in, self.hidden), torch.nn.Tanh(),
                                   torch.nn.Linear(self.hidden, self.dim_out))

    def _target(self) -> torch.Tensor:
        return torch.randn(self.dim_in, self.dim_out, generator=torch.Generator().manual_seed(1))

    def batches(self, *, shard: int, num_shards: int, seed: int, batch_size: int, start_step: int = 0):
        g = torch.Generator().manual_seed(seed * 1009 + shard)
        target = self._target()
        for _ in range(start_step):
            torch.randn(batch_size, self.dim_in, generator=g)
        while True:
            x = torch.randn(batch_size, self.dim_in, generator=g)
            yield x, x @ target

    def val_batches(self, *, batch_size: int):
        x = torch.randn(64, self.dim_in, generator=torch.Generator().manual_seed(2))
        yield x, x @ self._target()

    def loss(self, model: torch.nn.Module, batch: tuple) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(model(x), y)

    def num_tokens(self, batch: tuple) -> int:
        return int(batch[0].shape[0])


def nano() -> NanoTask:
    return NanoTask()


def run_point(scenario: Scenario, point: Point | None) -> tuple[World, CrashPlan]:
    torch.set_num_threads(1)
    world = World(scenario)
    plan = CrashPlan(world, point)
    world.bucket.crash = plan
    world.run(final_eval=False)  # the checks read the bucket, not the loss
    return world, plan


def points_of(plan: CrashPlan) -> list[Point]:
    """Every point the uncrashed run passed."""
    out = [Point("syncer", i, ph) for i in range(plan.counts["syncer"]) for ph in PHASES["syncer"]]
    out += [Point("learner", i, ph) for i in range(plan.counts["learner"]) for ph in ("before", "after")]
    out += [Point("learner", i, "queued") for i in range(plan.counts["queued"])]
    return out


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def same_value(a: FragmentValue, b: FragmentValue) -> bool:
    return ((a.version, a.outer.num_steps, a.cycle) == (b.version, b.outer.num_steps, b.cycle)
            and _same(a.outer.state_tensors(), b.outer.state_tensors()) and _same(a.raw, b.raw)
            and _same(a.published, b.published))


def _restored(world: World, bucket: SimBucket) -> Syncer:
    clock = TurnClock(world.loop)
    store = SimStore(bucket, clock, Link(1.0, 1.0, 0.0), name="verify", seed="verify", free=True)
    syncer = Syncer(store, options=SyncerOptions(syncer_id="verify", gc=False, clock=clock, decode_threads=1))
    syncer.restore()
    return syncer


def verify(world: World) -> list[str]:
    """What is wrong with the bucket and the live syncer after the run (empty: nothing)."""
    problems: list[str] = []
    if not world.done():
        problems.append("the run did not drain (cut off)")
    audit = audit_ledger(world.admin, run_id=world.run_id, fragments=range(world.plan.num_fragments))
    problems += audit.problems
    if audit.counts["pending"] or audit.counts["quarantined"]:
        problems.append(f"audit: {audit.counts['pending']} pending, {audit.counts['quarantined']} quarantined")
    live = world.syncer.syncer
    if live is None:
        return problems + ["no live syncer at the end"]
    bare = world.bucket.without(layout.CHECKPOINT_ROOT)
    for name, restored in (("checkpoints + ledger", _restored(world, copy.copy(world.bucket))),
                           ("ledger alone", _restored(world, bare))):
        for p, state in live.states.items():
            if not same_value(state.current, restored.states[p].current):
                problems.append(f"fragment {p}: the restore from {name} differs from the live syncer's state")
    return problems
