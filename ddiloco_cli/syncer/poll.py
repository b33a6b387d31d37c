"""The syncer's poll room: one LIST of the owned fragments' contributions, the new ones
judged (name, then bytes, in ``intake``) and taken into each fragment's pending set
(``intake.add_pending``: supersede only on an unchanged base); and how long to wait
before the next poll."""

from __future__ import annotations

import logging

from ddiloco_cli.protocol.typed_records import LedgerEntry
from ddiloco_cli.store.base import ObjectInfo
from ddiloco_cli.syncer.intake import REFUSED, Contribution, add_pending
from ddiloco_cli.syncer.restore import Restorer
from ddiloco_cli.syncer.state import FragmentState, SyncContext

log = logging.getLogger(__name__)

IDLE_POLL_FRACTION = 0.25  # an idle syncer LISTs at least every this fraction of the learners' step time


class Poller:
    def __init__(self, ctx: SyncContext, restorer: Restorer, *, poll_s: float):
        self.ctx, self.restorer, self.poll_s = ctx, restorer, poll_s

    def poll(self, states: dict[int, FragmentState]) -> int:
        """One LIST of the owned fragments' contributions; takes in the new ones. Returns
        how many keys it had not seen before."""
        fresh = 0
        for p, infos in self.ctx.intake.list_new(sorted(states)).items():
            state = states[p]
            fresh += sum(1 for info in infos if info.key not in state.seen)
            self.take(state, infos)
        return fresh

    def next_poll_s(self, previous_s: float, *, idle: bool) -> float:
        """The pause before the next poll: ``poll_s`` while contributions arrive or wait for
        a merge; while idle it doubles, up to IDLE_POLL_FRACTION of the live learners'
        median step time (a contribution then waits at most that long to be seen) and
        never beyond ``heartbeat_s`` (the loop also writes the lease's heartbeat)."""
        if not idle:
            return self.poll_s
        cap_s = self.ctx.config.heartbeat_s
        step_time_s = self.ctx.learners.step_time_s
        if step_time_s is not None:
            cap_s = min(cap_s, IDLE_POLL_FRACTION * step_time_s)
        return max(self.poll_s, min(cap_s, 2 * previous_s))

    def take(self, state: FragmentState, infos: list[ObjectInfo]) -> None:
        """Load every new contribution above its learner's high-water mark, oldest first, into
        the pending set."""
        ctx = self.ctx
        fresh = []
        for info in infos:
            if info.key in state.seen:
                continue
            state.seen.add(info.key)
            verdict, learner_id, seq = ctx.judge.name(info.key, state.fragment)
            if not verdict.accepted:
                ctx.intake.quarantine(info.key, verdict.reason)
                continue
            if seq > state.high_water.get(learner_id, -1):  # else already in the ledger
                fresh.append((seq, learner_id, info))
        items = [(info, learner_id, seq) for seq, learner_id, info in sorted(fresh, key=lambda f: f[0])]
        loads = ctx.intake.load_all(state.fragment, items)  # later ones decode while we take these
        for info, learner_id, seq in items:
            if state.fragment in self.restorer.unavailable:
                break  # its ledger did not read back (``_future_base``): the syncer stops serving it
            with ctx.stage("intake"):
                got = next(loads)
            if got is not None and got.base_version > state.version:
                got = self._future_base(state, got)
            if isinstance(got, LedgerEntry):
                state.closed.append(got)
            elif got is not None:
                state.closed.extend(add_pending(state.pending.setdefault(learner_id, []), got))
                if state.first_pending_t is None:
                    state.first_pending_t = ctx.clock.monotonic()

    def _future_base(self, state: FragmentState, c: Contribution) -> Contribution | LedgerEntry | None:
        """A base newer than our version means someone else committed: check the fence (a
        higher epoch halts us), re-read the fragment, and refuse only a base that does not exist."""
        self.ctx.lease.check_fence()
        log.warning("fragment %d: %s names base version %d above ours (%d); re-reading the fragment",
                    state.fragment, c.key, c.base_version, state.version)
        if not self.restorer.reload(state):
            return None  # the fragment is unavailable now (alerted); taken again once it is restored
        if c.base_version <= state.version:
            return c
        return c.entry(REFUSED, reason=f"base version {c.base_version} does not exist (latest is {state.version})")
