"""The syncer: owns the global fragments and the outer optimizer; a state machine a
driver steps.

``Syncer.tick`` does one round of work and returns the seconds until it wants the next:
fence and heartbeat when due, one poll of the bucket for contributions (``poll``: judged
by ``judge``, taken in by ``intake``), and for each fragment whose quorum is met and
whose grace window has passed (``decide``) one outer update, committed as the next
version's manifest (``commit``: ``update.apply_decision``). ``serve`` is the production
driver: claim the lease (``lease``), restore every fragment (``restore``: checkpoint +
ledger replay), then ``tick`` and ``clock.sleep`` until stopped. The deterministic
simulation drives the same object on a ``clock.VirtualClock``: ``acquire(wait=False)``,
``start()``, ``tick()``.

The rooms share one ``state.SyncContext``; every read and write goes through its one
``FencedStore``, which ``Lease.acquire`` arms.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from typing import Any, Callable

from ddiloco_cli import heap
from ddiloco_cli.clock import WALL, Clock
from ddiloco_cli.errors import ProtocolError
from ddiloco_cli.protocol import ledger, signing
from ddiloco_cli.protocol.published import FragmentReader
from ddiloco_cli.protocol.runconfig import read_run_config
from ddiloco_cli.store.base import Store
from ddiloco_cli.syncer.commit import Committer
from ddiloco_cli.syncer.decide import Decider
from ddiloco_cli.syncer.fence import FencedStore, fence_interval_s
from ddiloco_cli.syncer.intake import DECODE_THREADS, Contribution, Intake
from ddiloco_cli.syncer.judge import Judge
from ddiloco_cli.syncer.lease import Lease
from ddiloco_cli.syncer.poll import Poller
from ddiloco_cli.syncer.restore import RESTORE_RETRY_S, Restorer
from ddiloco_cli.syncer.state import FragmentState, Learners, SyncContext
from ddiloco_cli.syncer.update import ApplyRules, Decision

log = logging.getLogger(__name__)

# how often (in leases) the serving syncer re-reads the newest manifest it committed of each
# fragment, to put it back if it was deleted or replaced: a damaged one is repaired within a lease
LEDGER_CHECK_FRACTION = 0.5


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


def _context(store: Store, options: SyncerOptions) -> SyncContext:
    """The run-wide parts of a syncer over ``store``: run, plan, trust, the one fenced store,
    lease, judge, intake, learners, readers."""
    clock = options.clock
    config = read_run_config(store)
    plan = ledger.read_plan(store, run_id=config.run_id)
    all_frags = list(range(plan.num_fragments))
    fragments = sorted(options.fragments) if options.fragments is not None else all_frags
    bad = [p for p in fragments if p not in all_frags]
    if bad:
        raise ProtocolError(f"fragments {bad} do not exist in this run (it has {plan.num_fragments})")
    syncer_id = options.syncer_id or f"{socket.gethostname()}-{os.getpid()}"
    # signed runs [A2][A3][A5]: what this syncer accepts, and the key it signs epochs and manifests with
    trust = signing.Trust(store, run=config, clock=clock)
    signer = signing.signer_for_run(store, run=config, key_path=options.key_path, member_id=None, role="syncer")
    fenced = FencedStore(store, run_id=config.run_id, interval_s=fence_interval_s(config.lease_s), trust=trust,
                         clock=clock)
    lease = Lease(fenced, config=config, syncer_id=syncer_id, fragments=fragments, trust=trust, signer=signer,
                  clock=clock)
    learners = Learners(fenced, config=config, trust=trust, clock=clock)
    judge = Judge(config=config, trust=trust, is_known_learner=learners.is_known)
    intake = Intake(fenced, config=config, plan=plan, syncer_id=syncer_id,
                    epoch=lambda: lease.epoch.epoch if lease.epoch else 0, judge=judge,
                    decode_threads=options.decode_threads, clock=clock, signer=signer)
    readers = {p: FragmentReader(fenced, run_id=config.run_id, plan=plan, fragment=p, trust=trust) for p in fragments}
    return SyncContext(fenced, config, plan, syncer_id, clock, trust, signer, lease, judge, intake, learners,
                       readers, ApplyRules.of(config))


class Syncer:
    def __init__(self, store: Store, *, options: SyncerOptions, on_progress: Callable[[dict], None] | None = None):
        self.opts = options
        self.clock = options.clock
        heap.keep_freed_memory()  # fragment-sized temporaries reuse the heap, not fresh page-faulting mmaps
        self.ctx = ctx = _context(store, options)
        self.config, self.plan, self.run_id, self.syncer_id = ctx.config, ctx.plan, ctx.run_id, ctx.syncer_id
        self.store, self.lease, self.intake, self.learners = ctx.store, ctx.lease, ctx.intake, ctx.learners
        self.fragments = ctx.lease.fragments
        self.on_progress = on_progress
        self.states: dict[int, FragmentState] = {}
        self.restorer = Restorer(ctx)
        self.poller = Poller(ctx, self.restorer, poll_s=options.poll_s)
        self.decider = Decider(ctx)
        self.committer = Committer(ctx, self.decider, self.restorer, beat=lambda: self.heartbeat(force=True))
        self._last_restore_t = self.clock.monotonic()
        self._last_gc_t = self.clock.monotonic()
        self._last_ledger_check_t = self.clock.monotonic()
        self.committed = 0  # versions committed by tick (max_versions)
        self._pause_s = options.poll_s  # tick's answer: the pause before the next poll

    # ------------------------------------------------------------- read-outs
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

    @property
    def bytes_out(self) -> int:
        return self.ctx.stats.bytes_out

    @property
    def num_merges(self) -> int:
        return self.ctx.stats.num_merges

    @property
    def stage_s(self) -> dict[str, float]:
        """Seconds per stage on the clock, cumulative (bench_syncer reads it)."""
        return self.ctx.stats.stage_s

    @property
    def unavailable(self) -> dict[int, str]:
        return self.restorer.unavailable

    @property
    def live_learners(self) -> set[str]:
        return self.learners.live

    @property
    def known_learners(self) -> set[str]:
        return self.learners.known

    @property
    def step_time_s(self) -> float | None:
        return self.learners.step_time_s

    # ----------------------------------------------------------------- lease
    def acquire(self, *, stop: Callable[[], bool] = lambda: False, wait: bool = True) -> bool:
        """Stand by until the fragments' lease is free or expired, then claim the next epoch
        (which arms the fenced store). ``wait=False``: one look only (False while another
        syncer holds the lease)."""
        if not self.lease.acquire(stop=stop, wait=wait):
            return False
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
                num_merges=self.num_merges, num_quarantined=self.num_quarantined, alerts=self.alerts() or None,
                num_repairs=self.ctx.stats.num_repairs or None, repairs=tuple(self.ctx.stats.repairs) or None)

    def alerts(self) -> tuple[str, ...]:
        """What this syncer cannot repair by itself, for ``status --check`` (in its heartbeat):
        fragments it cannot serve, and why."""
        return tuple([f"fragment {p} is not served by syncer {self.syncer_id}: {why}"[:1000]
                      for p, why in sorted(self.unavailable.items())]
                     + [a[:1000] for a in self.ctx.stats.suspects()])[:64]

    def _refresh_learners(self) -> None:
        self.learners.refresh()

    # --------------------------------------------------------------- restore
    def restore(self) -> None:
        """Load every owned fragment: checkpoint + ledger replay (raw value, momentum, cycle
        clock) and the high-water marks. Quarantine reports are advisory: contributions not in
        the ledger are validated afresh."""
        errors = [exc for p in self.fragments if (exc := self._try_restore(p)) is not None]
        if not self.states and errors:
            raise errors[0]  # nothing to serve (e.g. an interrupted init): say why

    def _try_restore(self, p: int) -> Exception | None:
        got = self.restorer.try_restore(p)
        if isinstance(got, FragmentState):
            self.states[p] = got
            return None
        return got

    # ------------------------------------------------------ the rooms, by hand
    def poll_contributions(self) -> int:
        """One LIST of the owned fragments' contributions (``poll``); how many keys were new."""
        return self.poller.poll(self.states)

    def next_poll_s(self, previous_s: float, *, idle: bool) -> float:
        return self.poller.next_poll_s(previous_s, idle=idle)

    def maybe_merge(self, state: FragmentState) -> bool:
        """Judge the pending set, and commit the next version if it is time (``decide``)."""
        self.decider.admit_pending(state)
        go, grace = self.decider.ready(state)
        return go and self.commit(state, grace_s=grace)

    def decide(self, state: FragmentState, contributions: list[Contribution], *, grace_s: float) -> Decision:
        return self.decider.decide(state, contributions, grace_s=grace_s)

    def commit(self, state: FragmentState, *, grace_s: float) -> bool:
        return self.committer.commit(state, grace_s=grace_s)

    def write_checkpoint(self, state: FragmentState) -> None:
        self.committer.write_checkpoint(state)

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
        if self.lease.fence_due():
            self.check_fence()
        repairs = self.ctx.stats.num_repairs
        self.heartbeat()
        if self.learners.refresh_due():
            self.learners.refresh()
        if self.clock.monotonic() - self._last_ledger_check_t > LEDGER_CHECK_FRACTION * self.config.lease_s:
            self._check_ledger()
        fresh = self.poll_contributions()
        self._drop_unavailable()
        for state in list(self.states.values()):
            if self.maybe_merge(state):
                self.committed += 1
        self._drop_unavailable()
        if self.unavailable and self.clock.monotonic() - self._last_restore_t > RESTORE_RETRY_S:
            self._last_restore_t = self.clock.monotonic()
            for p in sorted(self.unavailable):
                self._try_restore(p)
        if self.on_progress is not None:
            self.on_progress(self.progress())
        if self.opts.gc and self.clock.monotonic() - self._last_gc_t > self.opts.gc_every_s:
            self._collect_garbage()
        if self.ctx.stats.num_repairs != repairs:
            self.heartbeat(force=True)  # status shows a repair at once
        idle = fresh == 0 and not any(state.pending for state in self.states.values())
        self._pause_s = self.next_poll_s(self._pause_s, idle=idle)
        return self._pause_s

    def _drop_unavailable(self) -> None:
        """Stop serving a fragment whose ledger could not be re-read (``Restorer.reload``):
        the others go on; it is retried every RESTORE_RETRY_S and alerted meanwhile."""
        dropped = [p for p in self.states if p in self.unavailable]
        for p in dropped:
            del self.states[p]
        if dropped:
            self.heartbeat(force=True)

    def _check_ledger(self) -> None:
        """Every LEDGER_CHECK_FRACTION of a lease: is the newest manifest of each fragment, where
        this syncer committed it, still the bytes it wrote? Put them back if not (``repair``)."""
        self._last_ledger_check_t = self.clock.monotonic()
        self.committer.check_held(self.states)

    def _collect_garbage(self) -> None:
        from ddiloco_cli.syncer.gc import collect_garbage

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
            "suspect_learners": len(self.ctx.stats.suspects()), "num_repairs": self.ctx.stats.num_repairs,
            "live_learners": len(self.live_learners), "bytes_in": self.bytes_in, "bytes_out": self.bytes_out,
        }


def _spec(frags: list[int]) -> str:
    return ",".join(str(p) for p in frags) if len(frags) <= 8 else f"{frags[0]}..{frags[-1]} ({len(frags)})"
