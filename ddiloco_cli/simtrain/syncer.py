"""The simulated syncer: the real ``Syncer`` (intake, validation, staleness, grace
window, token weights, RDA, outer step, publish with error feedback, ledger), one
``Syncer.tick`` per turn on a ``TurnClock``.

Its connection overlaps the GETs of contributions ``intake_parallel`` deep, as the
syncer's decode pool keeps them in flight (modelled in the store: the syncer decodes
inline here, ``decode_threads=1``). A merge's compute is charged before its first
write: ``Scenario.merge_cost_s`` (a part per version and a part per contribution, fitted to
bench_syncer's figures for the run's codec), not the host's time, so the result does not
depend on the host. An outage drops the
syncer; a new one claims the next epoch when it comes back (looking again every half
lease while the old epoch's lease runs) and restores from the ledger.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ddiloco_cli.simtrain.bucket import Link, SimStore
from ddiloco_cli.simtrain.loop import Timer, TurnClock
from ddiloco_cli.syncer.core import FragmentState, Syncer, SyncerOptions

if TYPE_CHECKING:
    from ddiloco_cli.simtrain.scenario import Scenario
    from ddiloco_cli.simtrain.world import World


class CostedSyncer(Syncer):
    """``Syncer`` whose commits charge the modelled merge compute to the simulated store."""

    merge_s: float = 0.0
    scenario: "Scenario"  # its merge_cost_s prices a merge

    def commit(self, state: FragmentState, *, grace_s: float) -> bool:
        sim_store: SimStore = self.sim_store
        cost_s = (self.scenario.merge_cost_s(self.plan.fragment_numel(state.fragment), len(state.contributions()),
                                             codec=self.config.codec) * sim_store.bucket.payload_scale)
        sim_store.charge_before_next_write(cost_s)
        sim_store.in_commit = True
        try:
            won = super().commit(state, grace_s=grace_s)
        finally:
            sim_store.charge_before_next_write(0.0)
            sim_store.in_commit = False
        if won:
            self.merge_s += cost_s
        return won


class SimSyncer:
    def __init__(self, world: "World", *, link: Link, parallel: int, name: str = "primary"):
        self.world, self.name = world, name
        self.clock = TurnClock(world.loop)
        self.store = SimStore(world.bucket, self.clock, link, name=f"syncer-{name}",
                              seed=f"{world.scenario.seed}-syncer-{name}",
                              parallel=parallel)
        self.timer = Timer(world.loop, self.tick)
        self.syncer: CostedSyncer | None = None
        self.starts = 0
        self.merge_s = 0.0  # modelled compute of the merges (all syncers)
        self.busy_s = 0.0  # time spent in turns (requests and merges)
        self.outage = False

    @property
    def up(self) -> bool:
        return self.syncer is not None

    def start(self) -> None:
        if self.outage or self.syncer is not None:
            return
        self.clock.begin()
        options = SyncerOptions(syncer_id=f"sim-{self.name}-{self.starts}", poll_s=self.world.scenario.syncer_poll_s,
                                gc=False, clock=self.clock, decode_threads=1)
        syncer = CostedSyncer(self.store, options=options)
        syncer.sim_store = self.store
        syncer.scenario = self.world.scenario
        if not syncer.acquire(wait=False):  # the old epoch's lease runs: look again in half a lease
            self._end_turn(syncer.config.lease_s / 2, then=self.start)
            return
        syncer.restore()
        self.store.contributions_listed_t = -1.0  # drained only after this syncer's own first poll
        self.syncer = syncer
        self.starts += 1
        self._end_turn(0.0)

    def down(self) -> None:
        """An outage begins: the syncer process is gone."""
        self.outage = True
        if self.syncer is not None:
            self.merge_s += self.syncer.merge_s
        self.syncer = None
        self.timer.cancel()

    def back(self) -> None:
        self.outage = False
        self.start()

    def tick(self) -> None:
        self.clock.begin()
        pause_s = self.syncer.tick()
        self._end_turn(pause_s)

    def _end_turn(self, pause_s: float, *, then=None) -> None:
        end_t = self.clock.monotonic()
        self.busy_s += self.clock.spent
        self.clock.spent = 0.0
        if then is not None:
            self.world.loop.at(end_t + pause_s, then)
        else:
            self.timer.arm(end_t + pause_s, earlier_only=False)

    def drained(self) -> bool:
        """Up, its last LIST of the contributions came after the newest one landed, and
        nothing waits for a merge."""
        return (self.syncer is not None and self.store.contributions_listed_t > self.world.bucket.last_contribution_t
                and not any(state.pending for state in self.syncer.states.values()))

    def total_merge_s(self) -> float:
        return self.merge_s + (self.syncer.merge_s if self.syncer is not None else 0.0)
