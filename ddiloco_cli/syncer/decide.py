"""The syncer's decide room: which pending contributions may be merged (``Judge.admission``:
staleness, a readable base, the norm bound), when a fragment merges (``ready_to_merge``:
quorum and the grace window), and what the merge does (``Decider.decide``: the
``update.Decision`` that becomes the manifest's ledger: weights, increments, the outer lr,
the cycle advance, what is superseded or refused and why). Nothing here writes to the bucket
or moves a tensor."""

from __future__ import annotations

import logging

import torch

from ddiloco_cli.errors import ProtocolError
from ddiloco_cli.protocol.published import keyframe_due
from ddiloco_cli.protocol.runconfig import RunConfig
from ddiloco_cli.store.base import NotFound
from ddiloco_cli.syncer import staleness
from ddiloco_cli.syncer.intake import REFUSED, USED, Contribution
from ddiloco_cli.syncer.state import FragmentState, SyncContext
from ddiloco_cli.syncer.update import Decision

log = logging.getLogger(__name__)

Tensors = dict[str, torch.Tensor]
SHARES_KEPT = 256  # versions whose clock shares a syncer keeps in memory
MAX_SHARE = 0.5  # one learner's share of a merge's weight, when two or more others have weight
TOKEN_SLACK = 2  # a step counts at most this many times the run's max_tokens_per_step
STEP_SLACK = 4.0  # steps counted: a learner this many times faster than the live median still counts in full
BASE_CACHE_MIN = 8  # published values of recent versions kept for contributions' bases (at least)


def ready_to_merge(
    *, num_pending: int, quorum: int, now_t: float, first_pending_t: float | None, quorum_t: float | None,
    step_time_s: float | None, window_steps: int, sync_time_s: float, grace_gamma: float, grace_max_s: float,
    all_live_reported: bool,
) -> tuple[bool, float]:
    """The commit decision for one fragment. Returns (merge now?, grace window in s).

    Merge once ``quorum`` distinct learners have reported, after a grace window
    that waits only as long as the first sender can absorb the wait
    (``window_steps``, see ``grace_window_steps``):
    ``grace = min(grace_max_s, gamma * max(0, window * step_time - (time_to_quorum + time_to_sync)))``.
    If every live learner has reported there is nothing to wait for.
    """
    if num_pending < quorum or quorum_t is None:
        return False, 0.0
    if all_live_reported:
        return True, 0.0
    time_to_quorum = quorum_t - (first_pending_t if first_pending_t is not None else quorum_t)
    slack = window_steps * (step_time_s or 0.0) - (time_to_quorum + sync_time_s)
    grace = min(grace_max_s, grace_gamma * max(0.0, slack))
    return now_t - quorum_t >= grace, grace


def grace_window_steps(config: RunConfig) -> int:
    """How many of a sender's steps the grace window may fill without costing it anything.

    A learner that sent fragment p at step t folds a new version of p in from
    step t + tau. A decoupled learner holds out, training on, for the version that
    includes its send until step t + H - 1, the last before p's next send ([L8]); a
    merge that lands by then costs it nothing, so the window stretches to H - 1
    steps and a slower learner's contribution can join the same merge instead of
    making a version of its own (fewer versions per cycle: fewer downloads, and the
    outer step sees more of the cycle's work). A lock-step learner waits for the
    merge anyway: the window is tau.
    """
    tau = config.overlap_steps
    if config.mode == "decoupled":
        return max(tau, config.sync_every - 1)
    return tau


def cap_shares(contributions: list[Contribution]) -> None:
    """Cap one learner's share of a merge's weight at MAX_SHARE when at least two other
    learners with any weight take part (``Contribution.share_cap``, recorded in the ledger so
    a replay merges the same): a learner with inflated counters cannot swamp the others. With
    one other learner (or only learners of weight 0) nothing is capped: two honest learners
    can differ in weight by any factor (batch size squared times speed); the counter bounds
    of [V2] hold there."""
    by_learner: dict[str, float] = {}
    for c in contributions:
        by_learner[c.learner_id] = by_learner.get(c.learner_id, 0.0) + c.weight * c.discount
    for c in contributions:
        others = [w for lid, w in by_learner.items() if lid != c.learner_id and w > 0]
        own = by_learner[c.learner_id]
        limit = MAX_SHARE / (1.0 - MAX_SHARE) * sum(others) if len(others) >= 2 else own
        c.share_cap = limit / own if own > limit else 1.0


class Decider:
    def __init__(self, ctx: SyncContext):
        self.ctx = ctx
        self.config = ctx.config

    # ------------------------------------------------------------ admission
    def admit_pending(self, state: FragmentState) -> None:
        """Judge every pending contribution against the fragment as it is now: the refused
        leave the pending set for the next manifest's ledger; the accepted get their
        staleness and discount."""
        for lid, cs in list(state.pending.items()):
            kept = []
            for c in cs:
                verdict = self.ctx.judge.admission(
                    base_version=c.base_version, version=state.version,
                    staleness=lambda c=c: self.staleness(state, c),
                    read_base=lambda c=c: self.base_value(state, c.base_version),
                    norm=c.norm, norms=self.norm_sample(state, c), floors=self.peer_norms(state, c))
                if verdict.accepted:
                    c.staleness, c.discount, c.clip = verdict.staleness, verdict.discount, verdict.clip
                    self.bound_counters(state, c)
                    kept.append(c)
                else:
                    log.warning("fragment %d: refused %s: %s", state.fragment, c.key, verdict.reason)
                    state.closed.append(c.entry(REFUSED, reason=verdict.reason))
            if kept:
                state.pending[lid] = kept
            else:
                del state.pending[lid]

    @staticmethod
    def norm_sample(state: FragmentState, c: Contribution) -> list[float]:
        """The norms ``c``'s is bounded against: the fragment's running window (as merged) and
        the other learners' pending ones, so a run's first merges (or a fragment with few
        merges yet) are bounded as soon as two norms are known, and one learner cannot move
        the median by itself."""
        others = [o.norm for lid, cs in state.pending.items() if lid != c.learner_id for o in cs]
        return [*state.norms, *others]

    @staticmethod
    def peer_norms(state: FragmentState, c: Contribution) -> tuple[list[float], list[float]]:
        """The other learners' pending norms, and each other learner's newest norm (pending,
        else its last merged one, as merged): their medians floor the bound
        (``judge.norm_clip``), so a trend every learner follows (a warmup) is not cut by an
        older window, even for a learner that arrives with few others; ``c``'s learner is
        never its own peer."""
        pending = [o.norm for lid, cs in state.pending.items() if lid != c.learner_id for o in cs]
        newest = pending + [float(e.norm) for lid, e in state.tips.items()
                            if lid != c.learner_id and lid not in state.pending and e.norm is not None]
        return pending, newest

    def bound_counters(self, state: FragmentState, c: Contribution) -> None:
        """What ``c``'s weight may count ([V2], PROTOCOL "What an admitted learner can and cannot
        do"): at most TOKEN_SLACK x the run's ``max_tokens_per_step`` tokens per step, and at
        most H + STEP_SLACK x (the time since its base version was committed / the live
        learners' median step time) steps. Each bound is off when its figure is unknown."""
        if self.config.max_tokens_per_step is not None:
            c.max_tokens = TOKEN_SLACK * self.config.max_tokens_per_step
        step_s = self.ctx.learners.step_time_s
        if not step_s or step_s <= 0:
            return
        try:
            since = self.ctx.readers[state.fragment].manifest(c.base_version).get("created_s")
        except (NotFound, ProtocolError):
            return
        if isinstance(since, (int, float)):
            elapsed = max(0.0, self.ctx.clock.time() - float(since))
            c.max_steps = self.config.sync_every + int(STEP_SLACK * elapsed / step_s)

    def staleness(self, state: FragmentState, c: Contribution) -> float:
        """The cycles other learners merged since ``c``'s base ([M5], ``staleness.others_work``)."""
        return staleness.others_work(c.learner_id, base_version=c.base_version, version=state.version,
                                     shares_of=lambda v: self.shares_of(state, v),
                                     limit=float(self.config.max_staleness))

    def shares_of(self, state: FragmentState, version: int) -> tuple[float, dict[str, float]]:
        """``staleness.version_shares`` of ``version``: remembered, else from its manifest."""
        if version not in state.shares:
            manifest = self.ctx.readers[state.fragment].manifest(version)
            state.shares[version] = staleness.version_shares(manifest, sync_every=self.config.sync_every)
        return state.shares[version]

    def remember_shares(self, state: FragmentState, decision: Decision) -> None:
        """The shares of the version ``decision`` just committed; only the newest SHARES_KEPT
        versions are kept (older ones are re-read from their manifests when a base names them)."""
        state.shares[decision.version] = staleness.version_shares(decision.manifest_fields(),
                                                                  sync_every=self.config.sync_every)
        for v in [v for v in state.shares if v <= decision.version - SHARES_KEPT]:
            del state.shares[v]

    def base_value(self, state: FragmentState, version: int) -> Tensors | None:
        """The published value of a contribution's base version (None: the base is the current
        version). Recent versions are kept in memory; older ones are read (GC keeps them back to
        the staleness floor)."""
        if version == state.version:
            return None
        value = state.bases.get(version)
        if value is None:
            value = self.ctx.readers[state.fragment].read(version)
            self.remember_base(state, version, value)
        return value

    def remember_base(self, state: FragmentState, version: int, value: Tensors) -> None:
        state.bases[version] = value
        state.bases.move_to_end(version)
        while len(state.bases) > max(BASE_CACHE_MIN, 2 * len(self.ctx.learners.live) + 2):
            state.bases.popitem(last=False)

    # ---------------------------------------------------------------- when
    def ready(self, state: FragmentState) -> tuple[bool, float]:
        """(merge now?, grace window in s) for the fragment's pending set, now."""
        now_t = self.ctx.clock.monotonic()
        quorum = self.config.quorum
        if len(state.pending) >= quorum and state.quorum_t is None:
            state.quorum_t = now_t
        live = self.ctx.learners.live
        all_live = bool(live) and live <= set(state.pending)
        if self.config.mode == "lockstep" and not all_live:  # K = M: Streaming DiLoCo waits for everyone
            return False, 0.0
        return ready_to_merge(
            num_pending=len(state.pending), quorum=quorum, now_t=now_t, first_pending_t=state.first_pending_t,
            quorum_t=state.quorum_t, step_time_s=self.ctx.learners.step_time_s,
            window_steps=grace_window_steps(self.config), sync_time_s=self.ctx.stats.sync_time_s,
            grace_gamma=self.config.grace_gamma, grace_max_s=self.config.grace_max_s, all_live_reported=all_live,
        )

    # ---------------------------------------------------------------- what
    def decide(self, state: FragmentState, contributions: list[Contribution], *, grace_s: float) -> Decision:
        """What merging ``contributions`` into the next version does: their weights and
        increments, the outer lr, the cycle advance, and the superseded/refused entries."""
        self.link_increments(state, contributions)
        cap_shares(contributions)
        advance = self.cycle_advance(contributions)
        used = tuple(c.entry(USED) for c in contributions)
        high_water = dict(state.high_water)
        for e in used + tuple(state.closed):
            high_water[e.learner_id] = max(high_water.get(e.learner_id, -1), e.seq)
        return Decision(state.fragment, state.version + 1, used, tuple(state.closed),
                        lr=self.outer_lr(sum(c.discount for c in contributions)),
                        cycle=state.current.cycle + advance, cycle_advance=advance,
                        intake=self.catch_up_intake(contributions), high_water=high_water,
                        quorum_size=len({c.learner_id for c in contributions}), grace_s=grace_s,
                        keyframe=keyframe_due(state.version + 1, publish_codec=self.config.publish_codec,
                                              keyframe_every=self.config.keyframe_every,
                                              rule=self.config.keyframe_rule, chain=state.chain))

    def outer_lr(self, participation: float) -> float:
        """The outer learning rate of one merge. With outer_lr_scaling = "participation",
        a merge of m (discounted) contributions out of M live learners steps with lr * m / M:
        learners out of phase (each merged on its own) then move the fragment as far per
        cycle as one merge of all of them, instead of M times as far."""
        lr = self.config.outer_lr
        if self.config.outer_lr_scaling == "participation" and self.ctx.learners.live:
            lr *= min(1.0, participation / len(self.ctx.learners.live))
        return lr

    def catch_up_intake(self, contributions: list[Contribution]) -> float:
        """The part of the merged gradient the momentum buffer takes in: 1/k when the merged
        contributions cover k > 1 cycles each on average (H steps a cycle; a catch-up after a
        syncer outage or a late start), else 1. The step applies the catch-up once; the buffer
        does not carry k cycles of it into the next merges (Nesterov would apply them again)."""
        steps = sum(max(0, c.merged_steps) for c in contributions)
        k = steps / (self.config.sync_every * max(1, len(contributions)))
        return 1.0 / k if k > 1.0 else 1.0

    def cycle_advance(self, contributions: list[Contribution]) -> float:
        """How far this merge moves the fragment's cycle clock: the inner steps it merges, each
        contribution's capped at H, over H x the learners taking part (live, or in this merge)."""
        learners = self.ctx.learners.live | {c.learner_id for c in contributions}
        return staleness.cycle_advance(((c.learner_id, c.merged_steps) for c in contributions),
                                       sync_every=self.config.sync_every, num_learners=len(learners))

    def link_increments(self, state: FragmentState, contributions: list[Contribution]) -> None:
        """A learner that sends again on the base of a contribution already merged (it had not
        received the new version yet) sends its whole progress since that base again: count only
        the increment's tokens and steps (``Contribution.increment_of``); the merged part is
        already in the value its outer gradient is measured against."""
        tips = dict(state.tips)
        for c in contributions:  # in seq order per learner
            tip = tips.get(c.learner_id)
            # only when its counters ran on from the tip's (a restarted session starts them again)
            if tip is not None and tip.base_version == c.base_version and tip.seq < c.seq \
                    and c.c_steps > tip.c_steps and c.c_tokens >= tip.c_tokens:
                c.increment_of = {"seq": tip.seq, "key": tip.key, "sha256": tip.sha256,
                                  "c_tokens": tip.c_tokens, "c_steps": tip.c_steps}
            tips[c.learner_id] = c.entry(USED)
