"""``DiLoCoSync``: Decoupled DiLoCo for any training loop.

    with DiLoCoSync(url, model, learner_id="a") as sync:
        for batch in loader:
            loss = loss_fn(model, batch); loss.backward(); opt.step(); opt.zero_grad()
            sync.step(num_tokens=n)
            if sync.should_stop:
                break

On entry it claims the learner id (one live session per id), loads the latest
global version of every fragment into ``model`` and starts three worker
threads: the uploader, the receiver and the heartbeat. ``step()`` counts one
inner step; when a fragment is due it queues its outer gradient
``delta = Theta_base - theta`` (fp32, against the fp32 published base) and,
``overlap_steps`` later, folds a newer global version into the model if one has
arrived (``receive_rule``). It never waits for the network in decoupled mode:
only a full upload queue blocks. In lock-step mode it waits for the version
that merged its own contribution. On exit it finishes the uploads and marks
the learner ``finished`` (the run's ``total_steps`` reached) or ``left``.

Under torchrun every rank enters and steps together; rank 0 does all bucket
I/O and broadcasts what it received (``island.Island``). DDP, FSDP2
(``fully_shard``) and ``torch.compile`` wrappers may be passed as ``model``.
"""

from __future__ import annotations

import logging
import math
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from ddiloco_cli.clock import WALL, Clock
from ddiloco_cli.errors import UsageError
from ddiloco_cli.learner import progress
from ddiloco_cli.learner.ioproc import IoPath, IoProcess
from ddiloco_cli.learner.island import Island, unwrap
from ddiloco_cli.learner.receivepath import ReceivePath
from ddiloco_cli.learner.receiver import InFlight, Receiver
from ddiloco_cli.learner.reporting import Reporting
from ddiloco_cli.learner.schedule import FragmentCounters, fragments_due
from ddiloco_cli.learner.sendpath import PendingDelta, SendPath
from ddiloco_cli.learner.session import SessionWriter, check_id_free, jsonable, read_state
from ddiloco_cli.learner.stats import CostMeter, LearnerStats
from ddiloco_cli.learner.uploader import Uploader
from ddiloco_cli.protocol import layout, ledger, signing
from ddiloco_cli.protocol.fragments import FragmentPlan
from ddiloco_cli.protocol.published import FragmentReader
from ddiloco_cli.protocol.runconfig import RunConfig, read_run_config
from ddiloco_cli.store import open_store
from ddiloco_cli.store.base import Store

log = logging.getLogger(__name__)

Tensors = dict[str, torch.Tensor]




@dataclass(frozen=True)
class SyncOptions:
    upload_queue: int = 4  # contributions waiting for an upload worker; a full queue blocks step()
    upload_workers: int = 2
    min_poll_s: float = 0.2  # the receiver polls at the step time, never more often than this
    handle_sigterm: bool = True  # SIGTERM sets should_stop (the loop leaves cleanly) instead of killing
    stall_alert: bool = True  # warn when no new version arrived in 2*H steps
    align_schedule: bool = True  # decoupled: start the send schedule in phase with the running learners
    key_path: str | None = None  # signing key admitted for this learner id (runs that require signatures)
    clock: Clock = WALL  # every time and wait of the learner's logic (a virtual clock in the simulation)
    threads: bool = True  # False: no worker threads; a driver runs the uploader, receiver and heartbeat steps
    process: tuple[str, int] | None = None  # (host, pid) in the heartbeat; None: this machine and process
    # the uploader and receiver in a helper process (``ioproc``): none of their Python holds this process's
    # GIL. One process a learner, decoupled, on CPU, a bucket another process can open (not memory://)
    io_process: bool = False


def check_learner_id(learner_id: str) -> None:
    if not layout.valid_learner_id(learner_id):
        raise UsageError(f"--learner-id {learner_id!r}: use 1-64 letters, digits, '.', '_' or '-'")


def _check_model(plan: FragmentPlan, params: dict[str, torch.Tensor]) -> None:
    """The model must have the run's tensors and shapes; any float dtype trains (payloads are
    fp32 either way)."""
    want = plan.tensor_shapes()
    plan.check_model({n: (tuple(t.shape), want[n][1] if n in want and t.is_floating_point() else t.dtype)
                      for n, t in params.items()})


class DiLoCoSync(SendPath, ReceivePath, IoPath, Reporting):
    """Attach a model to a Decoupled DiLoCo run. See the module docstring.

    ``num_tokens`` given to ``step`` is what this process trained in that step;
    under torchrun the island counts ``world_size`` times it (every rank trains an
    equal batch). ``config`` (the run's config, if already read) and ``heartbeat_fields``
    (more fields of the learner heartbeat) are optional. ``data_state`` (JSON-able) is saved
    in ``learners/ID/state.json`` after the sends (at most once per lease_s / 2); the
    next session of the same id reads it back as ``resume_state`` to continue its data
    stream."""

    def __init__(self, url: str | Store, model: nn.Module, *, learner_id: str,
                 storage_options: dict[str, Any] | None = None, options: SyncOptions = SyncOptions(),
                 config: RunConfig | None = None, heartbeat_fields: dict[str, Any] | None = None):
        check_learner_id(learner_id)
        self.store = url if not isinstance(url, str) else open_store(url, options=storage_options)
        # how the io helper process opens the same bucket (SyncOptions.io_process)
        self._open_args = getattr(self.store, "open_args", (self.store.url, storage_options))
        self.learner_id, self.opts = learner_id, options
        self.clock = options.clock
        self.config = config if config is not None else read_run_config(self.store)
        self.run_id = self.config.run_id
        self.plan = ledger.read_plan(self.store, run_id=self.run_id)
        self.model = unwrap(model)
        self.params = dict(self.model.named_parameters())
        _check_model(self.plan, self.params)
        self.island = Island(next(iter(self.params.values())).device)
        self.lockstep = self.config.mode == "lockstep"
        self.H, self.tau = self.config.sync_every, self.config.overlap_steps
        self.alpha, self.held_alpha = self.config.alpha, self.config.held_alpha
        # lock-step is Streaming DiLoCo: a learner restarts each fragment from the merged version
        self.keep_progress = self.config.keep_overlap_progress and self.tau > 0 and not self.lockstep
        # [L8] take the version that merged this learner's contribution, not one merged without it
        # (whose own merge would come later, against a base the learner has already left); always,
        # in decoupled mode, since --take-newest was retired (PROTOCOL.md "Retired settings")
        self.await_own = not self.lockstep
        self.total_steps = self.config.total_steps
        # receive in place: theta += (1 - alpha) * (Theta_new - theta_at_send) (receive_rule with
        # progress kept, summed in another order; the receiver computes the increment)
        self._in_place = self.keep_progress and self.alpha < 1.0 and self.island.world == 1
        self.stats = LearnerStats()
        self.counters = FragmentCounters(self.plan.num_fragments)
        self.base: dict[int, tuple[int, Tensors]] = {}  # fragment -> (version, fp32 published value)
        # error feedback: per fragment, what the codec dropped from the last contribution uploaded
        # (set by an upload thread, added to the next delta of that fragment), in both modes: without
        # it a lock-step int4 run would drop every |x| < absmax/6 of a block on every send. Codec
        # none has no residual, so its lock-step contributions stay Streaming DiLoCo's outer
        # gradients exactly (tests/unit/test_lockstep_equivalence.py)
        self.error_feedback = self.config.error_feedback and self.config.codec != "none"
        self._residual: dict[int, Tensors] = {}
        self._residual_lock = threading.Lock()
        # one process a learner: the upload thread computes each outer gradient (sendpath.PendingDelta)
        self._deferred = self.island.world == 1
        self._pending: dict[int, PendingDelta] = {}  # fragment -> its newest deferred outer gradient
        self.in_flight: dict[int, InFlight] = {}
        self.schedule_offset = 0  # this session's shift of the send schedule (schedule.aligned_offset)
        self.session = 0
        self.seq = 0
        self.resume_state: dict[str, Any] | None = None
        self.stop_reason: str | None = None
        self._data_state: dict[str, Any] | None = None
        self._last_arrival_step = 0
        self._last_alert_step = 0
        self._last_alert_t = -math.inf  # monotonic time of the last stall alert
        self._uploader: Uploader | IoProcess | None = None
        self._receiver: Receiver | IoProcess | None = None
        self._io: IoProcess | None = None  # the io helper process (options.io_process)
        self._writer: SessionWriter | None = None
        self._previous_sigterm: Any = None
        self._started = False
        self.started_s = self.first_started_s = 0.0
        self.heartbeat_fields = dict(heartbeat_fields or {})  # e.g. the loop's data shard
        self._cost = CostMeter()  # ddiloco's own time per step, for the heartbeat

    # ------------------------------------------------------------- public API
    @property
    def step_count(self) -> int:
        """Inner steps this learner id has completed (over all its sessions)."""
        return self.stats.step

    @property
    def should_stop(self) -> bool:
        """True once the loop should end: SIGTERM, the run's total_steps reached, or a
        newer session took the learner id over. Every rank agrees."""
        return self.stop_reason is not None

    def __enter__(self) -> "DiLoCoSync":
        self.start()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.close(crashed=exc_type is not None)

    def start(self) -> None:
        """Claim the id, load the global model, start the workers."""
        io = self.island.io
        # a run that requires signatures: refuse a key not admitted for this id now, not at the first merge
        signer = signing.signer_for_run(self.store, run=self.config, key_path=self.opts.key_path,
                                        member_id=self.learner_id, role="learner") if io else None
        self.session = int(self.store.now() * 1e6) if io else 0
        self.started_s = self.clock.time()
        held = check_id_free(self.store, self.learner_id, lease_s=self.config.lease_s,
                             sleep=self.clock.sleep, me=self.opts.process) if io else None
        self.first_started_s = progress.first_started(held, now_s=self.started_s)  # goodput spans restarts
        if held is not None:
            # carry step, tokens and byte counters over (a hint: keeps the LR schedule and totals continuous)
            rec, s = held.record, self.stats
            s.step, s.tokens = int(rec["step"]), int(rec["tokens"])
            s.bytes_up, s.bytes_down = int(rec.get("bytes_up", 0)), int(rec.get("bytes_down", 0))
            s.num_contributions, s.blocked_s = int(rec.get("num_contributions", 0)), float(rec.get("blocked_s", 0.0))
        state = read_state(self.store, self.learner_id) if io else None
        self.stats.step, self.stats.tokens, self.resume_state = self.island.agree(
            [self.stats.step, self.stats.tokens, state])
        self._last_arrival_step = self._last_alert_step = self.stats.step
        self.seq = self.session
        trust = signing.Trust(self.store, run=self.config)  # checks manifest signatures in signed runs [A5]
        self.readers = {p: FragmentReader(self.store, run_id=self.run_id, plan=self.plan, fragment=p, trust=trust)
                        for p in range(self.plan.num_fragments)}
        self._bootstrap()
        if not self.lockstep and self.opts.align_schedule:  # lock-step learners share one schedule
            self.schedule_offset = self.island.agree([self._aligned_offset(trust) if io else 0])[0]
        if io and self.opts.io_process:
            self._start_io_process()
        elif io:
            self._uploader = Uploader(self.store, codec_name=self.config.codec, block_size=self.config.codec_block,
                                      qmax=self.config.codec_qmax, density=self.config.codec_density,
                                      maxsize=self.opts.upload_queue, stats=self.stats,
                                      num_workers=self.opts.upload_workers, newest_wins=not self.lockstep,
                                      signer=signer, on_residual=self._keep_residual if self.error_feedback else None,
                                      threads=self.opts.threads, clock=self.clock.monotonic)
            self._receiver = Receiver(self.store, self.readers, learner_id=self.learner_id,
                                      min_poll_s=self.opts.min_poll_s, stats=self.stats,
                                      pace_s=lambda: self.stats.step_time_s, clock=self.clock.monotonic,
                                      pin=self.island.device.type == "cuda")
        if io:
            self._writer = SessionWriter(self.store, learner_id=self.learner_id, session=self.session,
                                         make_record=self._heartbeat_record, run_id=self.run_id,
                                         lease_s=self.config.lease_s, every_s=self.config.heartbeat_s,
                                         signer=signer, clock=None if self.opts.threads else self.clock.monotonic)
            self._writer.beat()  # announce ourselves before any contribution
            workers = (self._writer,) if self._io else (self._uploader, self._receiver, self._writer)
            for worker in workers if self.opts.threads else ():
                worker.start()
        if self.opts.handle_sigterm and threading.current_thread() is threading.main_thread():
            self._previous_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)
        self._started = True
        self._update_stop()

    def step(self, *, num_tokens: int, data_state: dict[str, Any] | None = None) -> list[int]:
        """Count one inner step (call it after ``optimizer.step()``); send the fragments
        that are due and fold in the ones whose overlap window has passed. Returns the
        fragments received at this step."""
        if not self._started:
            raise UsageError("DiLoCoSync.step() before start(): use it as a context manager")
        t0, c0 = time.perf_counter(), time.thread_time()  # the host's clocks, whatever self.clock is
        try:
            if self._io is not None:
                self._io.pump()  # what the io helper sent since the last step (one non-blocking read)
            return self._step(num_tokens, data_state)
        finally:
            if self._io is not None:
                self._io.flush()  # this step's messages to the io helper (one write)
            self._cost.in_step_s += time.perf_counter() - t0
            self._cost.in_step_cpu_s += time.thread_time() - c0

    def _step(self, num_tokens: int, data_state: dict[str, Any] | None) -> list[int]:
        if data_state is not None:
            self._data_state = jsonable(data_state)
        s = self.stats
        step = s.step + 1
        n_tok = int(num_tokens) * self.island.world
        self.counters.on_step(n_tok)
        s.step, s.tokens = step, s.tokens + n_tok
        due = fragments_due(step + self.schedule_offset, num_fragments=self.plan.num_fragments, sync_every=self.H)
        for p in due:
            self.seq += 1
            theta = self._send(p, self.seq, step)
            self.in_flight[p] = InFlight(step + self.tau, self.seq, theta, self.counters.snapshot(p))
        if due and self._writer is not None:
            if self._data_state is not None:
                self._writer.save_state(self._data_state)
            if self.lockstep:
                # a restart must resume past every fragment it already sent, or it would
                # send one again and wait for a merge the other learners never join
                self._writer.beat()
        received = []
        for p, flight in sorted(self.in_flight.items()):
            if step >= flight.receive_step - 1 and not flight.wanted:
                flight.wanted = True  # one step ahead: the download overlaps the last step of the window
                if self._receiver is not None:
                    self._receiver.want(p, self.base[p], subtract=flight.theta if self._in_place else None,
                                        order=flight.seq)
            if step >= flight.receive_step and self._receive(p, flight):
                del self.in_flight[p]
                received.append(p)
        if received:
            self._last_arrival_step = step
        elif self.opts.stall_alert and self._writer is not None:
            quiet = step - max(self._last_arrival_step, self._last_alert_step)
            # every 2*H quiet steps, and never more often than alert_every_s: with short steps
            # (12 ms, H = 4) 2*H steps are 100 ms, and every alert reads the syncers' heartbeats
            if quiet >= 2 * self.H and self.clock.monotonic() - self._last_alert_t >= self.alert_every_s():
                self._last_alert_step, self._last_alert_t = step, self.clock.monotonic()
                self._writer.alert_stalled(step=step, since_step=self._last_arrival_step)
        self._update_stop()
        return received

    def record_step_time(self, step_time_s: float, *, loss: float | None = None) -> None:
        """Tell the heartbeat (and the syncer's grace window) how long a step takes."""
        s = self.stats
        s.step_time_s = step_time_s if s.step_time_s == 0 else 0.9 * s.step_time_s + 0.1 * step_time_s
        if loss is not None:
            s.loss = loss

    def close(self, *, crashed: bool = False) -> None:
        """Finish the uploads in flight, stop the workers, write the final heartbeat
        (``finished`` when the run's total_steps is reached, else ``left``)."""
        if not self._started:
            return
        self._started = False
        if self._previous_sigterm is not None:
            signal.signal(signal.SIGTERM, self._previous_sigterm)
            self._previous_sigterm = None
        finished = not crashed and self.total_steps > 0 and self.stats.step >= self.total_steps
        self.stats.state = "finished" if finished else "left"
        # lock-step sends whole cycles only: the unsent steps and the error-feedback residual of
        # the last contribution (what the codec dropped from it) leave with the learner
        if not crashed and self.stop_reason != "taken over" and not self.lockstep:
            self.flush()
        if self._receiver is not None:
            self._receiver.close()
            self._uploader.close()
            if self._data_state is not None:
                self._writer.save_state(self._data_state)
            self._writer.close(final_beat=True)

    # -------------------------------------------------------------- internals
    def _update_stop(self) -> None:
        reason = self.stop_reason
        if reason is None and self.total_steps and self.stats.step >= self.total_steps:
            reason = "finished"
        if reason is None and self._writer is not None and self._writer.taken_over_by is not None:
            reason = "taken over"
        self.stop_reason = self.island.agree([reason])[0]  # every rank stops at the same step

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        log.info("SIGTERM: finishing the upload in flight, then leaving")
        if self.stop_reason is None:
            self.stop_reason = "left"
