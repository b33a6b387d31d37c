"""The syncer's poll room: one LIST of the owned fragments' contributions, the new ones
judged (name, then bytes, in ``intake``) and taken into each fragment's pending set
(``intake.add_pending``: supersede only on an unchanged base); and how long to wait
before the next poll."""

from __future__ import annotations

import logging

from ddiloco_cli.protocol import layout
from ddiloco_cli.protocol.typed_records import LedgerEntry
from ddiloco_cli.store.base import ObjectInfo
from ddiloco_cli.syncer.intake import REFUSED, Contribution, add_pending
from ddiloco_cli.syncer.restore import Restorer
from ddiloco_cli.syncer.state import FragmentState, SyncContext

log = logging.getLogger(__name__)

IDLE_POLL_FRACTION = 0.25  # an idle syncer LISTs at least every this fraction of the learners' step time
# Contributions of learner ids with no valid heartbeat loaded per poll (the rest wait for the next
# polls): a flood of junk under fake ids costs each poll a bounded amount, and the known learners'
# contributions, taken first, are merged in the same tick as they are seen.
UNKNOWN_PER_POLL = 32


def late_reason(seq: int, high_water: int) -> str:
    """Why a contribution that arrived after a later one of its learner was merged is refused:
    no seq at or below the learner's high-water mark is merged ([W9]); a learner before 0.2.8
    could create one fragment's contributions out of seq order ([L4])."""
    return (f"arrived late: seq {seq} is at or below the learner's high-water mark {high_water} (a later "
            "contribution of this fragment was merged first; its steps are in no merge)")


def _above_high_water(key: str, high_water: dict[str, int]) -> bool:
    parsed = layout.parse_contribution_key(key)
    return parsed is None or parsed[2] > high_water.get(parsed[1], -1)


class Poller:
    def __init__(self, ctx: SyncContext, restorer: Restorer, *, poll_s: float):
        self.ctx, self.restorer, self.poll_s = ctx, restorer, poll_s

    def poll(self, states: dict[int, FragmentState]) -> int:
        """One LIST of the owned fragments' contributions; takes in the new ones. Returns
        how many keys count as new (``take``: those not seen before, and after a merge the
        ones it moved below the marks, once)."""
        return sum(self.take(states[p], infos) for p, infos in self.ctx.intake.list_new(sorted(states)).items())

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

    def take(self, state: FragmentState, infos: list[ObjectInfo]) -> int:
        """Load every new contribution above its learner's high-water mark, oldest first, into
        the pending set: the known learners' ones first, then at most UNKNOWN_PER_POLL of
        other ids (``_order``); the rest stay unseen until the next poll. A key at or below
        the mark is refused as late when it was not listed before, or when the first LIST after
        reading the ledger finds it in no manifest read (``FragmentState.ledger_window``: lost
        before this syncer started, e.g. by one that restarted). Returns how many keys count
        as new: those not seen before and, at the first LIST after a merge, the listed keys at
        or below the marks (a merge keeps the syncer polling at ``poll_s`` for one more round,
        as it did when ``seen`` was pruned at each commit: the same cadence, the same bits)."""
        ctx = self.ctx
        first, state.listed = not state.listed, True
        merged, state.merged_since_poll = state.merged_since_poll, False
        fresh, late, new = [], set(), 0
        for info in infos:
            if info.key in state.seen:
                if merged and not _above_high_water(info.key, state.high_water):
                    new += 1
                continue
            new += 1
            verdict, learner_id, seq = ctx.judge.name(info.key, state.fragment)
            if not verdict.accepted:
                state.seen.add(info.key)
                ctx.intake.quarantine(info.key, verdict.reason)
                continue
            if seq > state.high_water.get(learner_id, -1):
                fresh.append((seq, learner_id, info))
            elif first and state.ledger_window.records(info.key, learner_id, seq):
                state.seen.add(info.key)  # in the ledger already
            else:  # after a later one of its learner was merged, or lost before this syncer read the ledger
                fresh.append((seq, learner_id, info))
                late.add(info.key)
        state.seen.intersection_update(info.key for info in infos)  # keys GC deleted are forgotten
        items = self._order(fresh)
        state.seen.update(info.key for info, _, _ in items)
        loads = ctx.intake.load_all(state.fragment, items)  # later ones decode while we take these
        for info, learner_id, seq in items:
            if state.fragment in self.restorer.unavailable:
                break  # its ledger did not read back (``_future_base``): the syncer stops serving it
            with ctx.stage("intake"):
                got = next(loads)
            if got is not None and not isinstance(got, LedgerEntry) and info.key in late:
                got = got.entry(REFUSED, reason=late_reason(seq, state.high_water.get(learner_id, -1)))
            elif got is not None and got.base_version > state.version:
                got = self._future_base(state, got)
            if isinstance(got, LedgerEntry):
                state.closed.append(got)
            elif got is not None:
                state.closed.extend(add_pending(state.pending.setdefault(learner_id, []), got))
                if state.first_pending_t is None:
                    state.first_pending_t = ctx.clock.monotonic()
        return new

    def _order(self, fresh: list[tuple[int, str, ObjectInfo]]) -> list[tuple[ObjectInfo, str, int]]:
        """The (info, learner id, seq) to load this poll: the known learners' (a valid
        heartbeat) first, then at most UNKNOWN_PER_POLL of the others, each learner's in seq
        order (a deferred one always has a higher seq than its learner's loaded ones, so it
        stays above the high-water mark)."""
        learners = self.ctx.learners
        if any(lid not in learners.known for _, lid, _ in fresh) and learners.refresh_due(min_s=1.0):
            learners.refresh()  # a learner that has just started is known, not deferred
        known = [(seq, lid, info) for seq, lid, info in fresh if lid in learners.known]
        other = [(seq, lid, info) for seq, lid, info in fresh if lid not in learners.known]
        chosen = sorted(known, key=lambda f: f[0]) + sorted(other, key=lambda f: (f[0], f[1]))[:UNKNOWN_PER_POLL]
        return [(info, lid, seq) for seq, lid, info in chosen]

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
