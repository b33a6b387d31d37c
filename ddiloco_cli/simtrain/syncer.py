"""The simulated syncer: the real ``Syncer`` (intake, validation, staleness, grace
window, token weights, RDA, outer step, publish with error feedback, ledger), one
``tick`` per turn on a ``TurnClock``.

A turn: the lease heartbeat and the learners' heartbeats when due, the fence check,
one poll of the contributions (its GETs overlapped ``intake_parallel`` deep, as the
syncer's decode pool keeps them in flight), then each fragment's merge decision. A
merge's compute is charged before its first write: parameters x contributions /
``merge_params_per_s`` (bench_syncer's figure), not the host's time, so the result
does not depend on the host. An outage drops the syncer; a new one claims the next
epoch when it comes back and restores from the ledger.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ddiloco_cli import ledger
from ddiloco_cli.simtrain.bucket import Link, SimStore
from ddiloco_cli.simtrain.loop import Timer, TurnClock
from ddiloco_cli.syncer import Syncer, SyncerOptions

if TYPE_CHECKING:
    from ddiloco_cli.simtrain.world import World


class SimSyncer:
    def __init__(self, world: "World", *, link: Link, parallel: int):
        self.world = world
        self.clock = TurnClock(world.loop)
        self.store = SimStore(world.bucket, self.clock, link, name="syncer", seed=f"{world.scenario.seed}-syncer",
                              parallel=parallel)
        self.timer = Timer(world.loop, self.tick)
        self.syncer: Syncer | None = None
        self.starts = 0
        self.merge_s = 0.0  # modelled compute of the merges
        self.busy_s = 0.0  # time spent in turns (requests and merges)
        self.idle = False  # the last poll found nothing new and nothing pending
        self.polled_t = -1.0  # when the last poll LISTed the contributions
        self._pause_s = 0.0
        self._due = {"beat": 0.0, "learners": 0.0}

    @property
    def up(self) -> bool:
        return self.syncer is not None

    def start(self) -> None:
        self.clock.begin()
        options = SyncerOptions(syncer_id=f"sim-syncer-{self.starts}", poll_s=self.world.scenario.syncer_poll_s,
                                gc=False, clock=self.clock.monotonic)
        syncer = Syncer(self.store, options=options)
        syncer.intake.decode_threads = 1  # decoded in the turn: the parallel downloads are modelled by the store
        if self._lease_held(syncer):  # stand by: look again in half a lease (Lease.acquire would sleep)
            end_t = self.clock.monotonic()
            self.clock.spent = 0.0
            self.world.loop.at(end_t + syncer.config.lease_s / 2, self.start)
            return
        syncer.acquire()
        syncer.restore()
        self.syncer = syncer
        self.starts += 1
        self.syncer.heartbeat(force=True)
        self._due = {"beat": self.world.loop.now, "learners": self.world.loop.now}
        self._end_turn()

    @staticmethod
    def _lease_held(syncer: Syncer) -> bool:
        """What ``Lease.acquire`` waits for: a serving owner whose heartbeat is within the lease."""
        lease = syncer.lease
        owner = ledger.current_owner(lease.store, run_id=lease.run_id, fragments=lease.fragments, trust=lease.trust)
        if owner is None:
            return False
        age = ledger.syncer_heartbeat_age(lease.store, owner.epoch)
        return age is not None and age <= lease.lease_s and lease._owner_state(owner.epoch) in ("serving", None)

    def drained(self) -> bool:
        """Up, and its last poll came after the newest contribution and found nothing to merge."""
        return self.up and self.idle and self.polled_t > self.world.bucket.last_contribution_t

    def crash(self) -> None:
        self.syncer = None
        self.timer.cancel()

    def tick(self) -> None:
        syncer, now = self.syncer, self.world.loop.now
        config = syncer.config
        self.clock.begin()
        syncer.check_fence()
        if now >= self._due["beat"]:
            syncer.heartbeat(force=True)
            self._due["beat"] = now + config.heartbeat_s
        if now >= self._due["learners"]:
            syncer._refresh_learners()
            self._due["learners"] = now + config.heartbeat_s
        self.polled_t = self.clock.monotonic()
        fresh = syncer.poll_contributions()
        for state in list(syncer.states.values()):
            cost_s = syncer.plan.fragment_numel(state.fragment) * len(state.contributions()) / \
                self.world.scenario.merge_params_per_s
            self.store.charge_before_next_write(cost_s)
            if syncer.maybe_merge(state):
                self.merge_s += cost_s
            self.store.charge_before_next_write(0.0)
        self.idle = fresh == 0 and not any(state.pending for state in syncer.states.values())
        self._pause_s = syncer.next_poll_s(self._pause_s or syncer.opts.poll_s, idle=self.idle)
        self._end_turn()

    def _end_turn(self) -> None:
        end_t = self.clock.monotonic()
        self.busy_s += self.clock.spent
        self.clock.spent = 0.0
        self.timer.arm(end_t + self._pause_s, earlier_only=False)
