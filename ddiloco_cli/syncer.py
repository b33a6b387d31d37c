"""The syncer: owns the global fragments and the outer optimizer.

One loop (``Syncer.serve``): claim the lease (``lease.Lease``), restore every
fragment (``replay.restore_value``: checkpoint + ledger replay), then poll the
bucket for contributions (``intake.Intake``); for each fragment whose quorum is
met and whose grace window has passed, take one outer update
(``update.outer_update``) and commit the next version's manifest.

The commit decision is ``ready_to_merge``; what a commit computes is
``outer_update``; everything here is the bookkeeping around them: the pending
set, staleness in cycles, the ledger entries, and the fence checks.
"""

from __future__ import annotations

import logging
import os
import socket
import statistics
from collections import OrderedDict, deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from ddiloco_cli import heap, layout, ledger, records, signing
from ddiloco_cli.clock import WALL, Clock
from ddiloco_cli.errors import DdilocoError, InvalidPayloadError, ProtocolError
from ddiloco_cli.intake import DECODE_THREADS, REFUSED, USED, Contribution, Intake, add_pending, staleness_discount
from ddiloco_cli.lease import Lease
from ddiloco_cli.published import FragmentReader, upload_payloads
from ddiloco_cli.replay import checkpoint_bytes, manifest_cycle, restore_value
from ddiloco_cli.runconfig import RunConfig, read_run_config
from ddiloco_cli.store.base import NotFound, ObjectInfo, Store
from ddiloco_cli.typed_records import LedgerEntry, Manifest
from ddiloco_cli.update import ApplyRules, Decision, FragmentValue, NonFiniteUpdate, apply_decision

log = logging.getLogger(__name__)

Tensors = dict[str, torch.Tensor]

RESTORE_RETRY_S = 30.0  # how often a fragment whose committed state is unreadable is tried again
NORM_BOUND_FACTOR = 100.0  # a contribution whose norm exceeds this many running medians is refused
NORM_WINDOW = 64  # accepted norms in the running median
NORM_MIN_SAMPLES = 8  # no bound before this many accepted contributions
BASE_CACHE_MIN = 8  # published values of recent versions kept for outer_gradient = current (at least)
TIP_WINDOW = 64  # versions searched on restore for each learner's last merged contribution
IDLE_POLL_FRACTION = 0.25  # an idle syncer LISTs at least every this fraction of the learners' step time


@dataclass
class SyncerOptions:
    fragments: list[int] | None = None  # None: all
    syncer_id: str = ""
    poll_s: float = 0.2
    gc: bool = True
    gc_every_s: float = 30.0
    max_versions: int | None = None  # stop after committing this many versions (tests, benchmarks)
    max_runtime_s: float | None = None
    # every time the syncer reads or waits on (grace window, lease, fence, heartbeats, record
    # times): a clock.VirtualClock in the deterministic simulation
    clock: Clock = WALL
    decode_threads: int = DECODE_THREADS  # 1: contributions decode inline (no thread pool)
    key_path: str | None = None  # signing key admitted with role syncer (runs that require signatures)


@dataclass
class FragmentState:
    fragment: int
    current: FragmentValue
    high_water: dict[str, int]
    cycles: dict[int, float] = field(default_factory=dict)  # cycle clock by version (for staleness)
    pending: dict[str, list[Contribution]] = field(default_factory=dict)  # per learner, seq order
    closed: list[LedgerEntry] = field(default_factory=list)  # superseded/refused entries for the next manifest
    seen: set[str] = field(default_factory=set)
    norms: deque = field(default_factory=lambda: deque(maxlen=NORM_WINDOW))
    # per learner: its last used ledger entry and (when in memory) that contribution's delta
    tips: dict[str, tuple[LedgerEntry, Tensors | None]] = field(default_factory=dict)
    # published values of recent versions, newest last (outer_gradient = current: contributions' bases)
    bases: OrderedDict[int, Tensors] = field(default_factory=OrderedDict)
    first_pending_t: float | None = None
    quorum_t: float | None = None
    last_quorum_size: int = 0
    last_grace_s: float | None = None  # the grace window of its last merge (metrics)

    @property
    def version(self) -> int:
        return self.current.version

    @property
    def value(self) -> Tensors:
        """The exact published value of ``version``."""
        return self.current.published

    @property
    def outer(self):
        return self.current.outer

    def contributions(self) -> list[Contribution]:
        return sorted((c for cs in self.pending.values() for c in cs), key=lambda c: (c.learner_id, c.seq))


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
    step t + tau. Without [L8] it takes whatever is newest then, so a merge that
    waits longer than tau steps only reaches it a cycle later: the window is tau.
    A decoupled learner with ``await_own_merge`` instead holds out, training on,
    for the version that includes its send until step t + H - 1, the last before
    p's next send ([L8]); a merge that lands by then costs it nothing, so the
    window stretches to H - 1 steps and a slower learner's contribution can join
    the same merge instead of making a version of its own (fewer versions per
    cycle: fewer downloads, and the outer step sees more of the cycle's work).
    """
    tau = config.overlap_steps
    if config.mode == "decoupled" and config.await_own_merge:
        return max(tau, config.sync_every - 1)
    return tau


class Syncer:
    def __init__(self, store: Store, *, options: SyncerOptions, on_progress: Callable[[dict], None] | None = None):
        self.opts = options
        self.clock = options.clock
        heap.keep_freed_memory()  # fragment-sized temporaries reuse the heap, not fresh page-faulting mmaps
        self.config = read_run_config(store)
        self.run_id = self.config.run_id
        self.plan = ledger.read_plan(store, run_id=self.run_id)
        all_frags = list(range(self.plan.num_fragments))
        self.fragments = sorted(options.fragments) if options.fragments is not None else all_frags
        bad = [p for p in self.fragments if p not in all_frags]
        if bad:
            raise ProtocolError(f"fragments {bad} do not exist in this run (it has {self.plan.num_fragments})")
        self.syncer_id = options.syncer_id or f"{socket.gethostname()}-{os.getpid()}"
        # signed runs [A2][A3][A5]: what this syncer accepts, and the key it signs epochs and manifests with
        self.trust = signing.Trust(store, run=self.config, clock=self.clock)
        self.signer = signing.signer_for_run(store, run=self.config, key_path=options.key_path, member_id=None, role="syncer")
        self.lease = Lease(store, config=self.config, syncer_id=self.syncer_id, fragments=self.fragments, trust=self.trust,
                           signer=self.signer, clock=self.clock)
        self.store = store  # fenced by acquire (the one place it is wrapped): every write checks the lease
        self.on_progress = on_progress
        self.states: dict[int, FragmentState] = {}
        self.readers = {p: FragmentReader(self.store, run_id=self.run_id, plan=self.plan, fragment=p, trust=self.trust)
                        for p in self.fragments}
        self.intake = Intake(self.store, config=self.config, plan=self.plan, syncer_id=self.syncer_id,
                             epoch=lambda: self.epoch.epoch if self.epoch else 0, is_known_learner=self._known,
                             trust=self.trust, decode_threads=options.decode_threads, clock=self.clock)
        self.rules = ApplyRules.of(self.config)
        self.sync_time_s = 0.0  # EMA of merge + commit time
        self.step_time_s: float | None = None
        self.live_learners: set[str] = set()
        self.known_learners: set[str] = set()
        self.num_merges = 0
        self.bytes_out = 0
        self.unavailable: dict[int, str] = {}  # fragments whose committed state cannot be read: why
        self._last_restore_t = self.clock.monotonic()
        self.stage_s: dict[str, float] = {}  # seconds per stage on the clock, cumulative (bench_syncer reads it)
        self._last_learners_t = -float("inf")
        self._last_gc_t = self.clock.monotonic()
        self.committed = 0  # versions committed by tick (max_versions)
        self._pause_s = options.poll_s  # tick's answer: the pause before the next poll

    @contextmanager
    def _stage(self, name: str) -> Iterator[None]:
        t0 = self.clock.monotonic()
        try:
            yield
        finally:
            self.stage_s[name] = self.stage_s.get(name, 0.0) + self.clock.monotonic() - t0

    # ----------------------------------------------------------------- lease
    @property
    def epoch(self) -> ledger.Epoch | None:
        return self.lease.epoch

    @property
    def num_quarantined(self) -> int:
        return self.intake.num_quarantined

    @property
    def bad_keys(self) -> set[str]:
        return self.intake.bad_keys

    @property
    def bytes_in(self) -> int:
        return self.intake.bytes_in

    def acquire(self, *, stop: Callable[[], bool] = lambda: False, wait: bool = True) -> bool:
        """Stand by until the fragments' lease is free or expired, then claim the next epoch.
        ``wait=False``: one look only (False while another syncer holds the lease)."""
        if not self.lease.acquire(stop=stop, wait=wait):
            return False
        self.store = self.lease.guard(self.store)
        self.intake.store = self.store
        for reader in self.readers.values():
            reader.store = self.store
        self.heartbeat(force=True)
        log.info("claimed epoch %d for fragments %s", self.epoch.epoch, _spec(self.fragments))
        return True

    def check_fence(self) -> None:
        self.lease.check_fence()

    def heartbeat(self, *, force: bool = False, state: str = "serving") -> None:
        if force or self.lease.beat_due():
            self.lease.write_heartbeat(
                state=state, versions={str(p): s.version for p, s in self.states.items()},
                quorum_sizes={str(p): s.last_quorum_size for p, s in self.states.items()},
                num_merges=self.num_merges, num_quarantined=self.num_quarantined)

    def _refresh_learners(self) -> None:
        """Which learners are live, and their median step time (for the grace window)."""
        self._last_learners_t = self.clock.monotonic()
        beats = [b for b in ledger.read_heartbeats(self.store, layout.LEARNER_HEARTBEAT_PREFIX, "learner_heartbeat")
                 if self.trust.admits(b.record, key=b.key, role="learner", member_id=b.record["learner_id"])]  # [A3]
        lease_s = self.config.lease_s
        self.known_learners = {b.record["learner_id"] for b in beats}
        live = [b for b in beats if b.record["state"] == "running" and b.age_s <= lease_s]
        self.live_learners = {b.record["learner_id"] for b in live}
        times = [b.record["step_time_s"] for b in live if b.record.get("step_time_s")]
        self.step_time_s = statistics.median(times) if times else None

    def _known(self, learner_id: str) -> bool:
        if learner_id not in self.known_learners:
            self._refresh_learners()
        return learner_id in self.known_learners

    # --------------------------------------------------------------- restore
    def restore(self) -> None:
        """Load every owned fragment: checkpoint + ledger replay (raw value, momentum, cycle
        clock) and the high-water marks. Quarantine reports are advisory: contributions not in
        the ledger are validated afresh."""
        errors = [exc for p in self.fragments if (exc := self._try_restore(p)) is not None]
        if not self.states and errors:
            raise errors[0]  # nothing to serve (e.g. an interrupted init): say why

    def _try_restore(self, p: int) -> DdilocoError | None:
        """Restore fragment p; if its committed state cannot be read (a corrupt manifest
        or payload), log why and leave it out, so the other fragments are still served;
        ``serve`` retries it every ``RESTORE_RETRY_S``."""
        try:
            self.states[p] = self._restore_fragment(p)
        except (NotFound, InvalidPayloadError, ProtocolError) as exc:
            error = exc if isinstance(exc, DdilocoError) else ProtocolError(f"fragment {p}: {exc}")
            if self.unavailable.get(p) != str(error):
                log.error("fragment %d cannot be served: %s (serving the others; retrying every %.0f s)",
                          p, error, RESTORE_RETRY_S)
            self.unavailable[p] = str(error)
            return error
        self.unavailable.pop(p, None)
        log.info("fragment %d at version %d (%d outer steps)", p, self.states[p].version,
                 self.states[p].outer.num_steps)
        return None

    def _restore_fragment(self, p: int) -> FragmentState:
        reader = self.readers[p]
        latest = ledger.latest_version(self.store, p)
        if latest is None:
            raise ProtocolError(f"{self.store.url}: fragment {p} has no committed version (was `ddiloco init` interrupted?)")
        value = restore_value(self.store, config=self.config, plan=self.plan, fragment=p, reader=reader,
                              fetch=self.intake.fetch_used, latest=latest, republish=self._republish_missing)
        state = FragmentState(p, value, dict(reader.manifest(latest)["high_water"]))
        state.cycles[latest] = value.cycle
        for v in range(latest, max(0, latest - TIP_WINDOW), -1):
            try:
                entries = Manifest.from_json(reader.manifest(v)).contributions
            except (NotFound, ProtocolError):
                break
            for e in reversed(entries):
                if e.used:
                    state.tips.setdefault(e.learner_id, (e, None))
        return state

    def _republish_missing(self, version: int, payloads: list[tuple[str, bytes]]) -> None:
        """Put back payloads of a replayed version that are gone from the bucket (deleted by
        hand or by a faulty tool): the replay proved the bytes are the ones the manifest
        names (sha256), so every reader can read that version again [M4]."""
        for key, data in payloads:
            if not any(info.key == key for info in self.store.list(key)):
                log.warning("republishing %s/%s (payload of version %d, gone from the bucket)",
                            self.store.url, key, version)
                if self.store.put_if_absent(key, data):
                    self.bytes_out += len(data)

    def _reload(self, state: FragmentState) -> None:
        """Re-read a fragment someone else advanced; keep what is not in their ledger yet."""
        fresh = self._restore_fragment(state.fragment)
        hw = fresh.high_water
        state.current, state.high_water = fresh.current, hw
        state.cycles, state.tips = fresh.cycles, fresh.tips
        state.pending = {lid: kept for lid, cs in state.pending.items()
                         if (kept := [c for c in cs if c.seq > hw.get(lid, -1)])}
        state.closed = [e for e in state.closed if e.seq > hw.get(e.learner_id, -1)]

    # ---------------------------------------------------------------- intake
    def poll_contributions(self) -> int:
        """One LIST of the owned fragments' contributions; takes in the new ones. Returns
        how many keys it had not seen before."""
        fresh = 0
        for p, infos in self.intake.list_new(sorted(self.states)).items():
            state = self.states[p]
            fresh += sum(1 for info in infos if info.key not in state.seen)
            self._take_contributions(state, infos)
        return fresh

    def next_poll_s(self, previous_s: float, *, idle: bool) -> float:
        """The pause before the next poll: ``poll_s`` while contributions arrive or wait for
        a merge; while idle it doubles, up to IDLE_POLL_FRACTION of the live learners'
        median step time (a contribution then waits at most that long to be seen) and
        never beyond ``heartbeat_s`` (the loop also writes the lease's heartbeat)."""
        poll_s = self.opts.poll_s
        if not idle:
            return poll_s
        cap_s = self.config.heartbeat_s
        if self.step_time_s is not None:
            cap_s = min(cap_s, IDLE_POLL_FRACTION * self.step_time_s)
        return max(poll_s, min(cap_s, 2 * previous_s))

    def _take_contributions(self, state: FragmentState, infos: list[ObjectInfo]) -> None:
        """Load every new contribution above its learner's high-water mark, oldest first, into
        the pending set (``add_pending``: supersede only on an unchanged base)."""
        fresh = []
        for info in infos:
            if info.key in state.seen:
                continue
            state.seen.add(info.key)
            parsed = layout.parse_contribution_key(info.key)
            if parsed is None or parsed[0] != state.fragment or not layout.valid_learner_id(parsed[1]):
                self.intake.quarantine(info.key, "not a valid contribution name")
                continue
            _, learner_id, seq = parsed
            if seq > state.high_water.get(learner_id, -1):  # else already in the ledger
                fresh.append((seq, learner_id, info))
        items = [(info, learner_id, seq) for seq, learner_id, info in sorted(fresh, key=lambda f: f[0])]
        loads = self.intake.load_all(state.fragment, items)  # later ones decode while we take these
        for info, learner_id, seq in items:
            with self._stage("intake"):
                got = next(loads)
            if got is not None and got.base_version > state.version:
                got = self._future_base(state, got)
            if isinstance(got, LedgerEntry):
                state.closed.append(got)
            elif got is not None:
                state.closed.extend(add_pending(state.pending.setdefault(learner_id, []), got))
                if state.first_pending_t is None:
                    state.first_pending_t = self.clock.monotonic()

    def _future_base(self, state: FragmentState, c: Contribution) -> Contribution | LedgerEntry:
        """A base newer than our version means someone else committed: check the fence (a
        higher epoch halts us), re-read the fragment, and refuse only a base that does not exist."""
        self.check_fence()
        log.warning("fragment %d: %s names base version %d above ours (%d); re-reading the fragment",
                    state.fragment, c.key, c.base_version, state.version)
        self._reload(state)
        if c.base_version <= state.version:
            return c
        return c.entry(REFUSED, reason=f"base version {c.base_version} does not exist (latest is {state.version})")

    # ---------------------------------------------------------------- commit
    def _cycle_of(self, state: FragmentState, version: int) -> float:
        if version not in state.cycles:
            state.cycles[version] = manifest_cycle(self.readers[state.fragment].manifest(version))
        return state.cycles[version]

    def _admit(self, state: FragmentState, c: Contribution) -> str | None:
        """Why ``c`` must be refused now, or None (then its staleness and discount are set)."""
        max_stale = float(self.config.max_staleness)
        try:
            staleness = state.current.cycle - self._cycle_of(state, c.base_version)
            if staleness > max_stale:
                return (f"stale: base version {c.base_version} is {staleness:.2f} cycles behind version "
                        f"{state.version} (max_staleness {max_stale:g} cycles); re-base on the latest version")
            if self.config.outer_gradient == "current":
                self._base_value(state, c.base_version)
        except (NotFound, ProtocolError, InvalidPayloadError) as exc:
            return f"base version {c.base_version} can no longer be read ({exc}); re-base on the latest version"
        norm = c.norm
        if len(state.norms) >= NORM_MIN_SAMPLES:
            median = statistics.median(state.norms)
            if median > 0 and norm > NORM_BOUND_FACTOR * median:
                return f"norm {norm:.4g} exceeds {NORM_BOUND_FACTOR:g}x the running median {median:.4g}"
        c.staleness, c.discount = staleness, staleness_discount(staleness)
        return None

    def _base_value(self, state: FragmentState, version: int) -> Tensors | None:
        """The published value of a contribution's base version for ``outer_gradient = current``
        (None: the base is the current version, or the run uses deltas). Recent versions are
        kept in memory; older ones are read (GC keeps them back to the staleness floor)."""
        if self.config.outer_gradient != "current" or version == state.version:
            return None
        value = state.bases.get(version)
        if value is None:
            value = self.readers[state.fragment].read(version)
            self._remember_base(state, version, value)
        return value

    def _remember_base(self, state: FragmentState, version: int, value: Tensors) -> None:
        state.bases[version] = value
        state.bases.move_to_end(version)
        while len(state.bases) > max(BASE_CACHE_MIN, 2 * len(self.live_learners) + 2):
            state.bases.popitem(last=False)

    def maybe_merge(self, state: FragmentState) -> bool:
        for lid, cs in list(state.pending.items()):
            kept = []
            for c in cs:
                reason = self._admit(state, c)
                if reason is None:
                    kept.append(c)
                else:
                    log.warning("fragment %d: refused %s: %s", state.fragment, c.key, reason)
                    state.closed.append(c.entry(REFUSED, reason=reason))
            if kept:
                state.pending[lid] = kept
            else:
                del state.pending[lid]
        now_t = self.clock.monotonic()
        quorum = self.config.quorum
        if len(state.pending) >= quorum and state.quorum_t is None:
            state.quorum_t = now_t
        all_live = bool(self.live_learners) and self.live_learners <= set(state.pending)
        if self.config.mode == "lockstep" and not all_live:  # K = M: Streaming DiLoCo waits for everyone
            return False
        go, grace = ready_to_merge(
            num_pending=len(state.pending), quorum=quorum, now_t=now_t, first_pending_t=state.first_pending_t,
            quorum_t=state.quorum_t, step_time_s=self.step_time_s, window_steps=grace_window_steps(self.config),
            sync_time_s=self.sync_time_s, grace_gamma=self.config.grace_gamma,
            grace_max_s=self.config.grace_max_s, all_live_reported=all_live,
        )
        if not go:
            return False
        return self.commit(state, grace_s=grace)

    def _outer_lr(self, participation: float) -> float:
        """The outer learning rate of one merge. With outer_lr_scaling = "participation",
        a merge of m (discounted) contributions out of M live learners steps with lr * m / M:
        learners out of phase (each merged on its own) then move the fragment as far per
        cycle as one merge of all of them, instead of M times as far."""
        lr = self.config.outer_lr
        if self.config.outer_lr_scaling == "participation" and self.live_learners:
            lr *= min(1.0, participation / len(self.live_learners))
        return lr

    def _cycle_advance(self, contributions: list[Contribution]) -> float:
        """How far this merge moves the fragment's cycle clock: the inner steps it merges over
        H x the learners taking part (live, or in this merge)."""
        learners = self.live_learners | {c.learner_id for c in contributions}
        return sum(max(0, c.merged_steps) for c in contributions) / (self.config.sync_every * max(1, len(learners)))

    def _outer_share(self, contributions: list[Contribution]) -> float:
        """The part of a cycle this merge is, for per-cycle momentum: each contribution one
        learner's share (less if it covers fewer than H steps), times its staleness discount.
        Not its steps: a delta over 3H steps already carries 3H steps of progress."""
        learners = self.live_learners | {c.learner_id for c in contributions}
        H = self.config.sync_every
        return sum(c.discount * min(1.0, max(0, c.merged_steps) / H) for c in contributions) / max(1, len(learners))

    def _link_increments(self, state: FragmentState, contributions: list[Contribution]) -> None:
        """A learner that sends again on the base of a contribution already merged (it had not
        received the new version yet) sends its whole progress since that base again: count only
        the increment's tokens and steps (``Contribution.increment_of``), and, under
        ``outer_gradient = delta``, merge only the increment of the delta (under ``current`` the
        merged part is already in the value the gradient is measured against)."""
        tips = dict(state.tips)
        for c in contributions:  # in seq order per learner
            tip = tips.get(c.learner_id)
            # only when its counters ran on from the tip's (a restarted session starts them again)
            if tip is not None and tip[0].base_version == c.base_version and tip[0].seq < c.seq \
                    and c.c_steps > tip[0].c_steps and c.c_tokens >= tip[0].c_tokens:
                entry, delta = tip
                c.increment_of = {"seq": entry.seq, "key": entry.key, "sha256": entry.sha256,
                                  "c_tokens": entry.c_tokens, "c_steps": entry.c_steps}
                if self.config.outer_gradient == "delta":
                    c.prior_delta = delta if delta is not None else \
                        self.intake.fetch_used(state.fragment, entry.key, entry.sha256)
            tips[c.learner_id] = (c.entry(USED), c.delta)

    def decide(self, state: FragmentState, contributions: list[Contribution], *, grace_s: float) -> Decision:
        """What merging ``contributions`` into the next version does: their weights and
        increments, the outer lr, the cycle advance, and the superseded/refused entries."""
        self._link_increments(state, contributions)
        advance = self._cycle_advance(contributions)
        used = tuple(c.entry(USED) for c in contributions)
        high_water = dict(state.high_water)
        for e in used + tuple(state.closed):
            high_water[e.learner_id] = max(high_water.get(e.learner_id, -1), e.seq)
        return Decision(state.fragment, state.version + 1, used, tuple(state.closed),
                        lr=self._outer_lr(sum(c.discount for c in contributions)),
                        cycle=state.current.cycle + advance, cycle_advance=advance,
                        share=self._outer_share(contributions), high_water=high_water,
                        quorum_size=len({c.learner_id for c in contributions}), grace_s=grace_s)

    def commit(self, state: FragmentState, *, grace_s: float) -> bool:
        """Merge the pending contributions into the next version. Returns False when nothing
        was committed: another syncer committed that version first (state reloaded), or the
        update was not finite (the culprit is refused and quarantined)."""
        t0 = self.clock.monotonic()
        p, cur = state.fragment, state.current
        contributions = state.contributions()
        try:
            decision = self.decide(state, contributions, grace_s=grace_s)
            with self._stage("update"):
                new, encoded = apply_decision(cur, decision, rules=self.rules,
                                              inputs=_HeldInputs(self, state, contributions))
        except NonFiniteUpdate as exc:
            culprit = max(contributions, key=lambda c: c.norm)
            self.intake.quarantine(culprit.key, f"{exc}; it had the largest outer gradient")
            state.pending[culprit.learner_id].remove(culprit)
            if not state.pending[culprit.learner_id]:
                del state.pending[culprit.learner_id]
            return False
        except (NotFound, ProtocolError, InvalidPayloadError) as exc:  # a base read between admit and now
            log.warning("fragment %d: a contribution's base cannot be read now (%s); merging later", p, exc)
            return False
        manifest = records.make(
            "manifest", run_id=self.run_id, epoch=self.epoch.epoch, syncer_id=self.syncer_id,
            nonce=records.new_nonce(), created_s=self.clock.time(), numel=self.plan.fragment_numel(p),
            payloads=[e for _, _, e in encoded.payloads], outer_steps=new.outer.num_steps, outer_phase=new.phase,
            **decision.manifest_fields())
        if self.signer is not None:  # [A5]
            manifest = signing.sign_record(manifest, run_id=self.run_id, key=layout.manifest_key(p, new.version),
                                           signer=self.signer)
        with self._stage("commit"):
            self.bytes_out += upload_payloads(self.store, encoded)
            self.lease.before_commit(lambda: self.heartbeat(force=True))
            won = ledger.commit_manifest(self.store, manifest)
        if not won:
            self.check_fence()
            log.warning("fragment %d: version %d was committed by another syncer; reloading", p, new.version)
            self._reload(state)
            return False
        self._committed(state, decision, new, contributions)
        dt = self.clock.monotonic() - t0
        self.sync_time_s = dt if self.sync_time_s == 0 else 0.8 * self.sync_time_s + 0.2 * dt
        log.info("fragment %d -> version %d (quorum %d, grace %.2fs, cycle %.2f, %.0f ms)", p, new.version,
                 decision.quorum_size, grace_s, new.cycle, dt * 1e3)
        return True

    def _committed(self, state: FragmentState, decision: Decision, new: FragmentValue,
                   contributions: list[Contribution]) -> None:
        """Move ``state`` to the version just committed."""
        if self.config.outer_gradient == "current":
            self._remember_base(state, state.version, state.current.published)
        state.current = new
        for c, e in zip(contributions, decision.used):
            state.tips[c.learner_id] = (e, c.delta)
        state.cycles[new.version] = new.cycle
        self._trim_cycles(state)
        state.high_water = dict(decision.high_water)
        state.norms.extend(c.norm for c in contributions)
        state.pending.clear()
        state.closed.clear()
        state.seen = {k for k in state.seen if _above_high_water(k, state.high_water)}
        state.first_pending_t = state.quorum_t = None
        state.last_quorum_size, state.last_grace_s = decision.quorum_size, decision.grace_s
        self.num_merges += 1
        if new.version % self.config.checkpoint_every == 0:
            with self._stage("checkpoint"):
                self.write_checkpoint(state)

    def _trim_cycles(self, state: FragmentState) -> None:
        """Forget the clock of versions beyond the staleness bound (re-read from the manifest
        if a contribution names one: it is refused anyway)."""
        oldest_cycle = state.current.cycle - float(self.config.max_staleness) - 1
        for v in [v for v, c in state.cycles.items() if c < oldest_cycle and v != state.version]:
            del state.cycles[v]

    def write_checkpoint(self, state: FragmentState) -> None:
        key, data = checkpoint_bytes(state.current, run_id=self.run_id, fragment=state.fragment, epoch=self.epoch.epoch)
        self.store.put_if_absent(key, data)
        self.bytes_out += len(data)

    # ------------------------------------------------------------------ loop
    def serve(self, *, stop: Callable[[], bool] = lambda: False) -> str:
        """Claim, restore and serve until stopped, fenced or a limit is reached: the production
        driver, ``tick`` then ``clock.sleep`` for as long as it says.

        Returns why it ended: "stopped", "limit". Raises FencedError when fenced.
        """
        t_start = self.clock.monotonic()

        def out_of_time() -> bool:  # --max-runtime bounds standing by too
            return self.opts.max_runtime_s is not None and self.clock.monotonic() - t_start > self.opts.max_runtime_s

        if not self.acquire(stop=lambda: stop() or out_of_time()):
            return "limit" if out_of_time() else "stopped"
        self.start()
        try:
            while not stop():
                pause_s = self.tick()
                if self.done() or out_of_time():
                    return "limit"
                self.clock.sleep(pause_s)
            return "stopped"
        finally:
            try:
                self.heartbeat(force=True, state="stopped")
            except Exception as exc:  # noqa: BLE001 - best effort on the way out
                log.debug("final heartbeat failed: %s", exc)

    def start(self) -> None:
        """After ``acquire``: check the fence, restore every fragment and announce it."""
        self.check_fence()
        self.restore()
        self.heartbeat(force=True)

    def done(self) -> bool:
        """Whether ``max_versions`` versions have been committed."""
        return self.opts.max_versions is not None and self.committed >= self.opts.max_versions

    def tick(self) -> float:
        """One round of work after ``acquire`` and ``restore``: fence and heartbeat when due, one
        poll of the bucket, a merge of every fragment that is ready, retries and GC when due.
        Returns the seconds until it next wants to run. Raises FencedError when fenced."""
        now = self.clock.monotonic()
        if self.lease.fence_due():
            self.check_fence()
        self.heartbeat()
        if now - self._last_learners_t > self.config.heartbeat_s:
            self._refresh_learners()
        fresh = self.poll_contributions()
        for state in list(self.states.values()):
            if self.maybe_merge(state):
                self.committed += 1
        if self.unavailable and self.clock.monotonic() - self._last_restore_t > RESTORE_RETRY_S:
            self._last_restore_t = self.clock.monotonic()
            for p in sorted(self.unavailable):
                self._try_restore(p)
        if self.on_progress is not None:
            self.on_progress(self.progress())
        if self.opts.gc and self.clock.monotonic() - self._last_gc_t > self.opts.gc_every_s:
            self._collect_garbage()
        idle = fresh == 0 and not any(state.pending for state in self.states.values())
        self._pause_s = self.next_poll_s(self._pause_s, idle=idle)
        return self._pause_s

    def _collect_garbage(self) -> None:
        from ddiloco_cli.gc import collect_garbage

        self._last_gc_t = self.clock.monotonic()
        try:
            collect_garbage(self.store, config=self.config, fragments=self.fragments)
        except Exception as exc:  # noqa: BLE001 - GC must never stop serving
            log.warning("garbage collection failed: %s", exc)

    def progress(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch.epoch if self.epoch else None,
            "versions": {p: s.version for p, s in self.states.items()},
            "pending": {p: len(s.pending) for p, s in self.states.items()},
            "quorum_sizes": {p: s.last_quorum_size for p, s in self.states.items()},
            "grace_s": max((s.last_grace_s for s in self.states.values() if s.last_grace_s is not None), default=None),
            "num_merges": self.num_merges, "num_quarantined": self.num_quarantined,
            "live_learners": len(self.live_learners), "bytes_in": self.bytes_in, "bytes_out": self.bytes_out,
        }


class _HeldInputs:
    """What a committing syncer's ``apply_decision`` reads: the decoded contributions it holds
    (by key), its cache of base values, and (delta runs) the priors ``_link_increments`` set."""

    def __init__(self, syncer: "Syncer", state: FragmentState, contributions: list[Contribution]):
        self.syncer, self.state = syncer, state
        self.held = {c.key: c for c in contributions}

    def delta(self, entry: LedgerEntry) -> Tensors:
        return self.held[entry.key].delta

    def base(self, version: int) -> Tensors:
        return self.syncer._base_value(self.state, version)

    def prior(self, entry: LedgerEntry) -> Tensors:
        return self.held[entry.key].prior_delta


def _above_high_water(key: str, high_water: dict[str, int]) -> bool:
    parsed = layout.parse_contribution_key(key)
    return parsed is None or parsed[2] > high_water.get(parsed[1], -1)


def _spec(frags: list[int]) -> str:
    return ",".join(str(p) for p in frags) if len(frags) <= 8 else f"{frags[0]}..{frags[-1]} ({len(frags)})"
