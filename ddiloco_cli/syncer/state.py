"""What the syncer's rooms share: the state of each fragment it serves (``FragmentState``),
the learners it knows (``Learners``), its counters (``SyncStats``) and the run-wide
context every room reads (``SyncContext``: store, run, plan, clock, lease, readers).

The rooms themselves: ``restore`` (checkpoint + ledger replay), ``poll`` (list and take in
contributions), ``decide`` (admit, when to merge, the ``update.Decision``), ``commit``
(apply, publish, commit the manifest); ``syncer`` drives them.
"""

from __future__ import annotations

import statistics
from collections import OrderedDict, deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Mapping

import torch

from ddiloco_cli.clock import Clock
from ddiloco_cli.protocol import layout, ledger
from ddiloco_cli.protocol.fragments import FragmentPlan
from ddiloco_cli.protocol.published import FragmentReader, KeyframeChain
from ddiloco_cli.protocol.runconfig import RunConfig
from ddiloco_cli.protocol.signing import Signer, Trust
from ddiloco_cli.protocol.typed_records import LearnerHeartbeat, LedgerEntry
from ddiloco_cli.syncer.fence import FencedStore
from ddiloco_cli.syncer.intake import Contribution, Intake
from ddiloco_cli.syncer.judge import NORM_WINDOW, Judge
from ddiloco_cli.syncer.lease import Lease
from ddiloco_cli.syncer.update import ApplyRules, FragmentValue

Tensors = dict[str, torch.Tensor]


@dataclass(frozen=True)
class LedgerWindow:
    """The part of a fragment's ledger a syncer read when it restored the fragment: the keys its
    manifests name (any status) and ``floor``, the high-water marks of the oldest one read (empty
    when the walk reached the start of the ledger).

    A contribution at or below its learner's mark is in the ledger when a manifest read names it
    or its seq is at or below the floor; otherwise it was never recorded (marks only rise, and a
    late arrival is recorded below the mark of the version before its own, so one above the floor
    cannot be in an older manifest): it was lost before this syncer read the ledger. The audit
    (``syncer.audit``) reads the whole retained ledger with the same rule."""

    named: frozenset[str] = frozenset()
    floor: Mapping[str, int] = field(default_factory=dict)

    def records(self, key: str, learner_id: str, seq: int) -> bool:
        return key in self.named or seq <= self.floor.get(learner_id, -1)


@dataclass
class FragmentState:
    fragment: int
    current: FragmentValue
    high_water: dict[str, int]
    # by version: (its clock advance, each learner's share of it), for staleness (staleness.py)
    shares: dict[int, tuple[float, dict[str, float]]] = field(default_factory=dict)
    pending: dict[str, list[Contribution]] = field(default_factory=dict)  # per learner, seq order
    closed: list[LedgerEntry] = field(default_factory=list)  # superseded/refused entries for the next manifest
    seen: set[str] = field(default_factory=set)  # the listed keys already handled (pruned to each LIST's)
    # whether a LIST has been taken since this state was read from the ledger: the keys at or below
    # the marks in that first one are in the ledger (``ledger_window.records``) or were lost before this
    # syncer read it; in a later one such a key is a late arrival. Either way, one not in the ledger
    # is refused as late ([W9])
    listed: bool = False
    ledger_window: LedgerWindow = field(default_factory=LedgerWindow)
    merged_since_poll: bool = False  # a version was committed since the last LIST (``Poller.take``)
    norms: deque = field(default_factory=lambda: deque(maxlen=NORM_WINDOW))
    tips: dict[str, LedgerEntry] = field(default_factory=dict)  # per learner: its last used ledger entry
    # published values of recent versions, newest last (contributions' bases)
    bases: OrderedDict[int, Tensors] = field(default_factory=OrderedDict)
    first_pending_t: float | None = None
    quorum_t: float | None = None
    last_quorum_size: int = 0
    last_grace_s: float | None = None  # the grace window of its last merge (metrics)
    chain: KeyframeChain | None = None  # its newest keyframe and the deltas since (keyframe rule "size")

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

    def drop(self, c: Contribution) -> None:
        """Take ``c`` out of the pending set."""
        self.pending[c.learner_id].remove(c)
        if not self.pending[c.learner_id]:
            del self.pending[c.learner_id]


class Learners:
    """Which learners the syncer knows (a heartbeat admitted by the run's trust [A3]), which
    are live (running, heartbeat within the lease), and their median step time (the grace
    window, the idle poll)."""

    def __init__(self, store: FencedStore, *, config: RunConfig, trust: Trust, clock: Clock):
        self.store, self.config, self.trust, self.clock = store, config, trust, clock
        self.known: set[str] = set()
        self.live: set[str] = set()
        self.step_time_s: float | None = None
        self.refreshed_t = -float("inf")

    def refresh(self) -> None:
        self.refreshed_t = self.clock.monotonic()
        beats = []
        for b in ledger.read_heartbeats(self.store, layout.LEARNER_HEARTBEAT_PREFIX, "learner_heartbeat",
                                        lease_s=self.config.lease_s):
            hb = LearnerHeartbeat.from_json(b.record)
            if self.trust.admits(b.record, key=b.key, role="learner", member_id=hb.learner_id):  # [A3]
                beats.append((hb, b.age_s))
        self.known = {hb.learner_id for hb, _ in beats}
        live = [hb for hb, age_s in beats if hb.state == "running" and age_s <= self.config.lease_s]
        self.live = {hb.learner_id for hb in live}
        times = [hb.step_time_s for hb in live if hb.step_time_s]
        self.step_time_s = statistics.median(times) if times else None

    def refresh_due(self, *, min_s: float | None = None) -> bool:
        """Whether the last refresh is older than ``min_s`` (default: the heartbeat period)."""
        return self.clock.monotonic() - self.refreshed_t > (self.config.heartbeat_s if min_s is None else min_s)

    def is_known(self, learner_id: str) -> bool:
        if learner_id not in self.known:
            self.refresh()
        return learner_id in self.known


REPAIRS_KEPT = 8  # the last ledger repairs a syncer's heartbeat lists
SUSPECT_AFTER = 3  # contributions in a row cut by a bound (or refused) before status alerts on the learner


@dataclass
class SyncStats:
    num_merges: int = 0
    bytes_out: int = 0
    sync_time_s: float = 0.0  # EMA of merge + commit time
    stage_s: dict[str, float] = field(default_factory=dict)  # seconds per stage on the clock, cumulative
    # per learner: (its contributions clipped, capped or refused in a row, the last reason); ``suspects``
    bounded: dict[str, tuple[int, str]] = field(default_factory=dict)
    num_repairs: int = 0  # ledger repairs (``repair``): manifests put back or junk deleted
    repairs: deque = field(default_factory=lambda: deque(maxlen=REPAIRS_KEPT))  # the last ones, one line each

    def note_repair(self, what: str) -> None:
        """Count one ledger repair (``repair.LedgerRepair``); its heartbeat and ``status`` show it."""
        self.num_repairs += 1
        self.repairs.append(what[:1000])

    def note_bounded(self, learner_id: str, why: str | None) -> None:
        """Count a contribution of ``learner_id`` that a bound cut (``why``) or, None, one that
        was merged as sent (which clears the count)."""
        if why is None:
            self.bounded.pop(learner_id, None)
        else:
            self.bounded[learner_id] = (self.bounded.get(learner_id, (0, ""))[0] + 1, why)

    def suspects(self, *, after: int = SUSPECT_AFTER) -> list[str]:
        """One alert per learner whose last ``after`` or more contributions were all clipped,
        capped or refused: a faulty or hostile learner an operator may revoke."""
        return [f"learner {lid}: its last {n} contributions were cut or refused ({why}); if it is faulty, "
                f"revoke it (re-admit it with a new key, or delete its admission)"
                for lid, (n, why) in sorted(self.bounded.items()) if n >= after]


@dataclass
class SyncContext:
    """The run-wide parts every room of one syncer reads. ``store`` is the one FencedStore
    every read and write goes through: ``lease.acquire`` arms it with the claimed epoch."""

    store: FencedStore
    config: RunConfig
    plan: FragmentPlan
    syncer_id: str
    clock: Clock
    trust: Trust
    signer: Signer | None
    lease: Lease
    judge: Judge
    intake: Intake
    learners: Learners
    readers: dict[int, FragmentReader]
    rules: ApplyRules
    stats: SyncStats = field(default_factory=SyncStats)

    @property
    def run_id(self) -> str:
        return self.config.run_id

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Time a stage on the clock (``bench_syncer`` reads ``stats.stage_s``)."""
        t0 = self.clock.monotonic()
        try:
            yield
        finally:
            self.stats.stage_s[name] = self.stats.stage_s.get(name, 0.0) + self.clock.monotonic() - t0
