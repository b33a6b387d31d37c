"""A simulated learner: the real ``DiLoCoSync`` without threads, driven in turns.

What a learner's threads do in production, each is an actor here with its own
``TurnClock`` and its own connection (``SimStore``) over the learner's one link (their
transfers queue on it, ``bucket.Wire``):

* the training loop: one turn per inner step, at the step's end (``learn.train_step``,
  then ``DiLoCoSync.step``: the send rule, the receive rule, alpha mix, [L8] hold-out);
  at the end ``DiLoCoSync.close`` in one turn: the flush, the queued uploads, the final
  heartbeat, one after the other as the closing process does them;
* the upload workers: ``Uploader.take_next`` / ``encode`` / ``finish``; a full queue
  holds the training loop back until a worker takes an item, as ``submit`` blocks;
* the receiver: ``Receiver.tick``; a version it downloaded reaches ``ready`` only when
  the download would have finished;
* the heartbeat: ``SessionWriter.tick``.

A preemption drops the session (model, optimizer, queue) as a SIGKILL would; the
learner comes back after its downtime as a new session of the same id.
"""

from __future__ import annotations

import logging
import zlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ddiloco_cli.learner.learn import lr_at, resumable_batches, train_step
from ddiloco_cli.learner.schedule import fragments_due
from ddiloco_cli.learner.sync import DiLoCoSync, SyncOptions
from ddiloco_cli.simtrain.bucket import Link, SimStore, Wire
from ddiloco_cli.simtrain.loop import Timer, TurnClock

if TYPE_CHECKING:
    from ddiloco_cli.simtrain.world import World

log = logging.getLogger(__name__)

SIM_PROCESS = ("simulation", 1)  # the (host, pid) every simulated learner's heartbeat carries


@dataclass
class LearnerReport:
    steps: int = 0
    sessions: int = 0
    preemptions: int = 0
    lags: list[int] = field(default_factory=list)  # send -> receive, in inner steps
    bytes_up: int = 0
    bytes_down: int = 0
    blocked_s: float = 0.0
    held: int = 0  # receives that took a version lacking the learner's contribution in flight ([L8])
    finished_s: float | None = None


class Worker:
    """One upload worker of a learner."""

    def __init__(self, learner: "SimLearner", i: int):
        self.learner = learner
        self.clock = TurnClock(learner.world.loop)
        self.store = learner.connect(self.clock, f"up{i}")
        self.timer = Timer(learner.world.loop, self.turn)
        self.busy = False

    def poke(self) -> None:
        if not self.busy:
            self.timer.arm(self.learner.world.loop.now)

    def turn(self) -> None:
        sync = self.learner.sync
        item = sync._uploader.take_next() if sync is not None else None
        if item is None:
            self.busy = False
            return
        self.busy = True
        self.clock.begin()
        key, delta, header = item
        data, residual = sync._uploader.encode(key, delta, header)
        sync._uploader.store = self.store
        sync._uploader.finish(key, header, data, residual)
        self.learner.unblock()
        self.timer.arm(self.clock.monotonic(), earlier_only=False)  # the next item once this one is up
        self.clock.spent = 0.0


class SimLearner:
    def __init__(self, world: "World", index: int, learner_id: str, *, link: Link, speed: tuple[float, float],
                 workers: int = 2):
        self.world, self.index, self.learner_id, self.link = world, index, learner_id, link
        self.wire = Wire()  # the link its connections share
        self.factor, self.drift = speed
        self.report = LearnerReport()
        loop = world.loop
        self.clock, self.rclock, self.hclock = TurnClock(loop), TurnClock(loop), TurnClock(loop)
        self.store = self.connect(self.clock, "main")
        self.rstore = self.connect(self.rclock, "recv")
        self.hstore = self.connect(self.hclock, "beat")
        self.step_timer = Timer(loop, self.step)
        self.recv_timer = Timer(loop, self.receive)
        self.beat_timer = Timer(loop, self.beat)
        self.workers = [Worker(self, i) for i in range(workers)]
        self.sync: DiLoCoSync | None = None
        self.session = 0  # bumped by every start and crash: stale arrivals are dropped
        self.blocked_since: float | None = None
        self.finished = False
        self._last_stats = (0, 0, 0)

    def connect(self, clock: TurnClock, part: str) -> SimStore:
        return SimStore(self.world.bucket, clock, self.link, name=f"{self.learner_id}/{part}",
                        seed=f"{self.world.scenario.seed}-{self.learner_id}-{part}", wire=self.wire)

    @property
    def up(self) -> bool:
        return self.sync is not None

    @property
    def idle(self) -> bool:
        """Finished and every upload done."""
        return self.finished and not any(w.busy for w in self.workers) and (
            self.sync is None or self.sync._uploader.queue.empty())

    # ------------------------------------------------------------ session
    def start(self) -> None:
        w = self.world
        config = w.config
        self.clock.begin()
        torch.manual_seed(config.seed)
        self.model = w.task.build_model()
        # one fixed process identity: a restarted session sees its predecessor's heartbeat as this
        # (simulated) process's, dead, whichever real process runs the simulation (a fork: crashfork.py)
        options = SyncOptions(clock=self.clock, threads=False, handle_sigterm=False, upload_queue=4, upload_workers=2,
                              process=SIM_PROCESS)
        sync = DiLoCoSync(self.store, self.model, learner_id=self.learner_id, config=config, options=options,
                          heartbeat_fields={"shard": 0, "num_shards": 1})
        sync.start()
        self.sync = sync
        self.session += 1
        self.report.sessions += 1
        sync._receiver.store, sync._receiver.clock = self.rstore, self.rclock.monotonic
        for reader in sync.readers.values():
            reader.store = self.rstore
        sync._writer.store, sync._writer.clock = self.hstore, self.hclock.monotonic
        self.optimizer = torch.optim.AdamW([t for t in self.model.parameters() if t.requires_grad],
                                           lr=config.inner_lr, betas=config.adam_betas, weight_decay=config.weight_decay)
        seed = zlib.crc32(self.learner_id.encode()) + w.scenario.seed
        self.batches, self.data_state = resumable_batches(w.task, shard=0, num_shards=1, seed=seed,
                                                          batch_size=config.batch_size, resume=sync.resume_state)
        self.drawn = 0
        self._last_stats = (sync.stats.bytes_up, sync.stats.bytes_down, sync.stats.num_held)
        start_t = self.clock.monotonic()
        self.clock.spent = 0.0
        self.beat_timer.arm(start_t + config.heartbeat_s, earlier_only=False)
        self.step_timer.arm(start_t + self.step_s(), earlier_only=False)

    def crash(self) -> None:
        """A preemption: the session is gone, nothing is flushed."""
        if self.finished:
            return
        if self.sync is not None:  # else it died while starting
            self._collect()
            self.report.preemptions += 1
        self.sync = None
        self.session += 1
        self.blocked_since = None
        for timer in (self.step_timer, self.recv_timer, self.beat_timer, *(w.timer for w in self.workers)):
            timer.cancel()
        for worker in self.workers:
            worker.busy = False

    def step_s(self) -> float:
        progress = self.sync.stats.step / max(1, self.world.config.total_steps) if self.sync else 0.0
        return self.world.scenario.step_s * self.factor * (1.0 + self.drift * progress)

    # ------------------------------------------------------------ the training loop
    def step(self) -> None:
        """The end of one inner step's compute: train it, then DiLoCoSync.step."""
        sync, w = self.sync, self.world
        if sync.should_stop:
            return self.finish()
        due = fragments_due(sync.stats.step + 1 + sync.schedule_offset, num_fragments=sync.plan.num_fragments,
                            sync_every=sync.H)
        if due and sync._uploader.queue.full():  # submit would block until a worker takes one
            self.blocked_since = w.loop.now
            return
        self.clock.begin()
        loss, n_tok = train_step(w.task, self.model, self.optimizer, self.batches, clip=w.config.grad_clip,
                                 lr=lr_at(sync.stats.step, w.inner))
        self.drawn += 1
        flights = {p: f.receive_step - sync.tau for p, f in sync.in_flight.items()}
        received = sync.step(num_tokens=n_tok, data_state=self.data_state(self.drawn))
        step = sync.stats.step
        if due and w.bucket.crash is not None:
            w.bucket.crash.on_send(self)
        self.report.lags.extend(step - flights[p] for p in received if p in flights)
        dt = self.step_s()
        sync.record_step_time(dt, loss=float(loss.detach()))
        for worker in self.workers:
            worker.poke()
        if sync._receiver.wanted:
            self.recv_timer.arm(w.loop.now)
        w.on_step(self)
        end_t = self.clock.monotonic()
        self.clock.spent = 0.0
        if sync.should_stop:
            self.step_timer.arm(end_t, earlier_only=False)
        else:
            self.step_timer.arm(end_t + dt, earlier_only=False)

    def unblock(self) -> None:
        if self.blocked_since is not None:
            self.report.blocked_s += self.world.loop.now - self.blocked_since
            self.blocked_since = None
            self.step_timer.arm(self.world.loop.now + self.step_s(), earlier_only=False)

    def finish(self) -> None:
        """The run's total_steps reached: close the session (flush, final heartbeat)."""
        sync = self.sync
        self.clock.begin()
        # as ``close`` runs in the training process: the last uploads, then the final heartbeat, in turn
        sync._uploader.store = sync._writer.store = self.store
        sync._writer.clock = self.clock.monotonic
        sync.close()
        self.clock.spent = 0.0
        self.finished = True
        self.report.finished_s = self.world.loop.now
        self.recv_timer.cancel()
        self.beat_timer.cancel()
        for worker in self.workers:
            worker.poke()

    def _collect(self) -> None:
        s = self.sync.stats
        self.report.steps = s.step
        self.report.bytes_up += s.bytes_up - self._last_stats[0]
        self.report.bytes_down += s.bytes_down - self._last_stats[1]
        self.report.held += s.num_held - self._last_stats[2]
        self._last_stats = (s.bytes_up, s.bytes_down, s.num_held)

    # ------------------------------------------------------------ receiver and heartbeat
    def receive(self) -> None:
        sync, loop = self.sync, self.world.loop
        receiver = sync._receiver
        self.rclock.begin()
        before = set(receiver.ready)
        polled, wait_s = receiver.tick()
        done_t = self.rclock.monotonic()
        self.rclock.spent = 0.0
        for p in sorted(set(receiver.ready) - before):  # in transit until the download is done
            ready = receiver.ready.pop(p)
            have = receiver.wanted.pop(p)
            loop.at(done_t, self._arrive, self.session, p, ready, have)
        if polled:
            self.recv_timer.arm(done_t, earlier_only=False)
        elif wait_s is not None:
            self.recv_timer.arm(loop.now + wait_s, earlier_only=False)

    def _arrive(self, session: int, p: int, ready: Any, have: Any) -> None:
        """A download is done: the version becomes ready, as the receiver thread makes it ready,
        unless the learner has moved past it meanwhile (a newer base, or polling from another).
        It counts even when the fragment was sent again meanwhile (a download longer than a
        cycle, on a thin link): the receive path then re-bases on it against the newest send."""
        sync = self.sync
        if session != self.session or sync is None or self.finished or ready.version <= sync.base[p][0]:
            return
        receiver = sync._receiver
        if p in receiver.ready or receiver.wanted.get(p, have) is not have:
            return
        receiver.wanted[p] = have
        receiver.ready[p] = ready

    def beat(self) -> None:
        self.hclock.begin()
        wait_s = self.sync._writer.tick()
        done_t = self.hclock.monotonic()
        self.hclock.spent = 0.0
        self.beat_timer.arm(done_t + wait_s, earlier_only=False)

    def final_report(self) -> LearnerReport:
        if self.sync is not None:
            self._collect()
        return self.report
