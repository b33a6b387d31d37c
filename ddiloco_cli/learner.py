"""The learner: one island of compute running inner AdamW steps without waiting.

The training loop (``Learner.train``) reads top to bottom like nanoGPT's. The
bucket I/O lives beside it in three background workers:

* ``Uploader``: encodes outer gradients and creates contribution objects, from a
  bounded queue (the loop only blocks when that queue is full);
* ``Receiver``: polls for newer committed versions of the fragments the loop
  wants back and downloads them ahead of time;
* ``HeartbeatWriter``: overwrites the learner's heartbeat every heartbeat_s.

Under ``torchrun`` the whole island is one learner: rank 0 does all bucket I/O
and broadcasts what it received; every rank runs the same inner loop (DDP).
"""

from __future__ import annotations

import logging
import math
import os
import queue
import signal
import threading
import time
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from ddiloco_cli import codec, layout, ledger, records
from ddiloco_cli.errors import DdilocoError, UsageError
from ddiloco_cli.fragments import gather_fragment, scatter_fragment
from ddiloco_cli.merge import alpha_merge
from ddiloco_cli.published import FragmentReader
from ddiloco_cli.schedule import FragmentCounters, fragments_due
from ddiloco_cli.store.base import NotFound, Store
from ddiloco_cli.tasks import load_task, move_batch

log = logging.getLogger(__name__)

Tensors = dict[str, torch.Tensor]


@dataclass
class LearnerOptions:
    learner_id: str
    device: str = "cpu"
    steps: int | None = None  # inner steps in this session (None: until the run's total_steps)
    shard: int | None = None
    num_shards: int | None = None
    upload_queue: int = 4
    upload_workers: int = 2
    poll_s: float = 0.2
    log_every: int = 10


@dataclass
class LearnerStats:
    step: int = 0
    tokens: int = 0
    loss: float | None = None
    step_time_s: float = 0.0
    bytes_up: int = 0
    bytes_down: int = 0
    num_contributions: int = 0
    blocked_s: float = 0.0
    versions: dict[int, int] = field(default_factory=dict)
    state: str = "running"


@dataclass
class InFlight:
    """A fragment sent and not yet received back."""

    receive_step: int  # step + tau: from here on the learner takes a newer version
    seq: int
    theta: Tensors  # the learner's fragment at the send
    counters: tuple[int, int]  # (c_steps, c_tokens) at the send


def lr_at(step: int, inner: dict[str, Any]) -> float:
    """Inner learning rate: linear warmup, then constant or cosine decay to 10%."""
    base, warmup, total = float(inner["lr"]), int(inner["warmup_steps"]), int(inner["total_steps"])
    if warmup and step < warmup:
        return base * (step + 1) / warmup
    if inner["lr_schedule"] == "cosine" and total > warmup:
        progress = min(1.0, (step - warmup) / (total - warmup))
        return base * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
    return base


def resolve_device(name: str) -> torch.device:
    if name == "cpu":
        return torch.device("cpu")
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise UsageError("--device cuda: no CUDA device is visible to torch (check drivers / CUDA_VISIBLE_DEVICES)")
        if name == "cuda" and dist.is_initialized():
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        return torch.device(name)
    if name == "xla":
        try:
            import torch_xla.core.xla_model as xm  # noqa: PLC0415 - only when asked
        except ImportError as exc:
            raise UsageError("--device xla needs torch_xla: pip install 'ddiloco[xla]' (in an env with its matching torch)") from exc
        return xm.xla_device()
    raise UsageError(f"--device {name!r}: use cpu, cuda, cuda:N or xla")


def _xla_mark_step() -> None:
    import torch_xla.core.xla_model as xm  # noqa: PLC0415 - only on XLA devices

    xm.mark_step()


class Uploader:
    """Encodes and uploads contributions from a bounded queue with ``num_workers``
    threads (several PUTs in flight hide round trips on long links), retrying with
    backoff.

    With ``newest_wins`` (decoupled mode) a contribution replaces a queued, not yet
    started one of the same fragment instead of waiting behind it: the newer delta
    already carries that fragment's progress. Lock-step never replaces (the learner
    waits for the merge of exactly the contribution it sent)."""

    def __init__(self, store: Store, *, codec_name: str, block_size: int, maxsize: int, stats: LearnerStats,
                 num_workers: int = 2, newest_wins: bool = True):
        self.store, self.codec_name, self.block_size, self.stats = store, codec_name, block_size, stats
        self.newest_wins = newest_wins
        self.queue: queue.Queue = queue.Queue(maxsize=maxsize)
        self.lock = threading.Lock()
        self.failed = 0
        self.replaced = 0
        self.threads = [threading.Thread(target=self._run, name=f"ddiloco-uploader-{i}", daemon=True)
                        for i in range(num_workers)]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def submit(self, key: str, delta: Tensors, header: dict[str, Any]) -> float:
        """Queue an upload; returns seconds spent blocked because the queue was full."""
        item = (key, delta, header)
        if self.newest_wins:
            with self.queue.mutex:  # the queue's own lock: replace in place, nobody sees a gap
                for i, queued in enumerate(self.queue.queue):
                    if queued is not None and queued[2]["fragment"] == header["fragment"]:
                        self.queue.queue[i] = item
                        self.replaced += 1
                        return 0.0
        t0 = time.monotonic()
        self.queue.put(item)
        return time.monotonic() - t0

    def _run(self) -> None:
        while True:
            item = self.queue.get()
            try:
                if item is None:
                    return
                self._upload(*item)
            finally:
                self.queue.task_done()

    def _upload(self, key: str, delta: Tensors, header: dict[str, Any]) -> None:
        data = codec.encode_tensors(delta, codec=self.codec_name, block_size=self.block_size, metadata=header)
        for attempt in range(8):
            try:
                if not self.store.put_if_absent(key, data):
                    log.warning("contribution %s already exists with other content; dropped", key)
                    return
                with self.lock:
                    self.stats.bytes_up += len(data)
                    self.stats.num_contributions += 1
                return
            except Exception as exc:  # noqa: BLE001 - the network may be down for a while
                delay = min(30.0, 0.5 * 2**attempt)
                log.warning("upload of %s failed (%s); retry in %.1fs", key, exc, delay)
                time.sleep(delay)
        self.failed += 1
        log.error("giving up on %s: the next contribution of this fragment carries its progress", key)

    def close(self) -> None:
        """Finish every queued upload, then stop."""
        for _ in self.threads:
            self.queue.put(None)
        for t in self.threads:
            t.join()


class Receiver(threading.Thread):
    """Polls for newer committed versions of wanted fragments and downloads them."""

    def __init__(self, store: Store, readers: dict[int, FragmentReader], *, poll_s: float, stats: LearnerStats):
        super().__init__(name="ddiloco-receiver", daemon=True)
        self.store, self.readers, self.poll_s, self.stats = store, readers, poll_s, stats
        self.lock = threading.Lock()
        self.wanted: dict[int, tuple[int, Tensors]] = {}  # fragment -> (have version, have value)
        self.ready: dict[int, tuple[int, Tensors, dict[str, Any]]] = {}
        self.stopping = threading.Event()
        self.wake = threading.Event()
        self._polls = 0

    def want(self, p: int, have: tuple[int, Tensors]) -> None:
        with self.lock:
            self.wanted[p] = have
        self.wake.set()

    def take(self, p: int) -> tuple[int, Tensors, dict[str, Any]] | None:
        with self.lock:
            got = self.ready.pop(p, None)
            if got is not None:
                self.wanted.pop(p, None)
            return got

    def run(self) -> None:
        while not self.stopping.is_set():
            with self.lock:
                wanted = dict(self.wanted)
            for p, have in wanted.items():
                try:
                    self._fetch(p, have)
                except Exception as exc:  # noqa: BLE001 - never stop training over a bad download
                    log.warning("fragment %d: download failed: %s", p, exc)
            self.wake.wait(self.poll_s)
            self.wake.clear()

    def _fetch(self, p: int, have: tuple[int, Tensors]) -> None:
        # the hint costs a GET; every 8th poll LISTs, in case the hint is stale or lost
        self._polls += 1
        latest = ledger.read_latest_hint(self.store, p) if self._polls % 8 else None
        if latest is None:
            latest = ledger.latest_version(self.store, p)
        with self.lock:
            ready = self.ready.get(p)
        if latest is None or latest <= have[0] or (ready is not None and ready[0] >= latest):
            return
        reader = self.readers[p]
        before = reader.bytes_down
        value = reader.read(latest, have=have)
        manifest = reader.manifest(latest)
        self.stats.bytes_down += reader.bytes_down - before
        with self.lock:
            if p in self.wanted:
                self.ready[p] = (latest, value, manifest)

    def close(self) -> None:
        self.stopping.set()
        self.wake.set()
        self.join(timeout=10)


class HeartbeatWriter(threading.Thread):
    def __init__(self, store: Store, key: str, make_record: Callable[[], dict], *, every_s: float):
        super().__init__(name="ddiloco-heartbeat", daemon=True)
        self.store, self.key, self.make_record, self.every_s = store, key, make_record, every_s
        self.stopping = threading.Event()

    def beat(self) -> None:
        try:
            self.store.put(self.key, records.dumps(self.make_record()))
        except Exception as exc:  # noqa: BLE001 - a missed heartbeat is not fatal
            log.warning("heartbeat failed: %s", exc)

    def run(self) -> None:
        while not self.stopping.wait(self.every_s):
            self.beat()

    def close(self) -> None:
        self.stopping.set()
        self.join(timeout=10)
        self.beat()


class Learner:
    def __init__(self, store: Store, *, options: LearnerOptions, on_progress: Callable[[dict], None] | None = None):
        if not layout.valid_learner_id(options.learner_id):
            raise UsageError(f"--learner-id {options.learner_id!r}: use 1-64 letters, digits, '.', '_' or '-'")
        self.store, self.opts, self.on_progress = store, options, on_progress
        self.run = ledger.read_run(store)
        self.run_id = self.run["run_id"]
        self.plan = ledger.read_plan(store, run_id=self.run_id)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.io = self.rank == 0  # only rank 0 touches the bucket
        self.device = resolve_device(options.device)
        self.task = load_task(self.run["task"])
        self.stats = LearnerStats()
        self.stop_reason: str | None = None
        self.session = 0
        self.hb_key = layout.learner_heartbeat_key(options.learner_id)

    # --------------------------------------------------------------- set-up
    def _heartbeat_record(self) -> dict[str, Any]:
        s = self.stats
        return records.make(
            "learner_heartbeat", run_id=self.run_id, learner_id=self.opts.learner_id, state=s.state, step=s.step,
            tokens=s.tokens, step_time_s=s.step_time_s, loss=s.loss, bytes_up=s.bytes_up, bytes_down=s.bytes_down,
            num_contributions=s.num_contributions, blocked_s=s.blocked_s,
            versions={str(p): v for p, v in s.versions.items()}, shard=self.shard, num_shards=self.num_shards,
            device=str(self.device), session=self.session, started_s=self.started_s, time_s=time.time(),
        )

    def _resume(self) -> None:
        """Carry step, tokens and byte counters over from this learner's previous
        heartbeat (a hint: it keeps the LR schedule and the totals continuous)."""
        try:
            rec = records.loads(self.store.get(self.hb_key), "learner_heartbeat", where=self.hb_key)
        except (NotFound, DdilocoError):
            return
        s = self.stats
        s.step, s.tokens = int(rec["step"]), int(rec["tokens"])
        s.bytes_up, s.bytes_down = int(rec.get("bytes_up", 0)), int(rec.get("bytes_down", 0))
        s.num_contributions, s.blocked_s = int(rec.get("num_contributions", 0)), float(rec.get("blocked_s", 0.0))

    def _bootstrap(self, params: dict[str, torch.Tensor]) -> dict[int, tuple[int, Tensors]]:
        """Load the latest committed version of every fragment into the model."""
        base: dict[int, tuple[int, Tensors]] = {}
        for p in range(self.plan.num_fragments):
            if self.io:
                v = ledger.latest_version(self.store, p)
                if v is None:
                    raise DdilocoError(f"fragment {p} has no committed version at {self.store.url}")
                reader = self.readers[p]
                before = reader.bytes_down
                value = reader.read(v)
                self.stats.bytes_down += reader.bytes_down - before
            else:
                v, value = -1, {}
            v, value = self._broadcast(v, value, p)
            scatter_fragment(self.plan, p, params, value)
            base[p] = (v, value)
            self.stats.versions[p] = v
        return base

    def _agree(self, values: list) -> list:
        """Rank 0's small values on every rank (no-op on a single process)."""
        if self.world == 1:
            return values
        box = list(values)
        dist.broadcast_object_list(box, src=0)
        return box

    def _broadcast(self, version: int, value: Tensors, p: int) -> tuple[int, Tensors]:
        """Rank 0's (version, value) of fragment p on every rank."""
        if self.world == 1:
            return version, value
        box = [version]
        dist.broadcast_object_list(box, src=0)
        if self.rank != 0:
            value = {s.key: torch.empty((s.row_end - s.row_start, *s.shape[1:]) if s.shape else ())
                     for s in self.plan.fragments[p]}
        for key in sorted(value):
            t = value[key].to(self.device) if self.device.type != "cpu" else value[key]
            dist.broadcast(t, src=0)
            value[key] = t.cpu()
        return box[0], value

    # ---------------------------------------------------------------- train
    def train(self) -> str:
        """Run inner steps until --steps, the run's total_steps, or SIGTERM.

        Returns "finished", "left" (SIGTERM) or "steps" (session limit reached).
        """
        run, inner, opts = self.run, self.run["inner"], self.opts
        torch.manual_seed(int(run["seed"]))
        model = self.task.build_model().to(self.device)
        params = dict(model.named_parameters())
        self.plan.check_model({k: v for k, v in params.items()})
        self.readers = {p: FragmentReader(self.store, run_id=self.run_id, plan=self.plan, fragment=p)
                        for p in range(self.plan.num_fragments)}
        self.session = int(self.store.now() * 1e6) if self.io else 0
        self.started_s = time.time()
        if self.io:
            self._resume()
        step, tokens = self._agree([self.stats.step, self.stats.tokens])
        seq = self.session
        base = self._bootstrap(params)
        if self.world > 1:
            model = torch.nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.AdamW(
            [t for t in params.values() if t.requires_grad], lr=float(inner["lr"]),
            betas=tuple(inner["betas"]), weight_decay=float(inner["weight_decay"]),
        )
        # distinct learners get distinct data without coordination: shard by --shard, else by id
        self.num_shards = (opts.num_shards or 1) * self.world
        self.shard = (opts.shard or 0) * self.world + self.rank
        data_seed = int(run["seed"]) if opts.shard is not None else zlib.crc32(f"{opts.learner_id}:{self.session}".encode())
        batches = self.task.batches(shard=self.shard, num_shards=self.num_shards, seed=data_seed,
                                    batch_size=int(inner["batch_size"]))
        counters = FragmentCounters(self.plan.num_fragments)
        P, H, tau = self.plan.num_fragments, int(run["sync_every"]), int(run["overlap_steps"])
        lockstep = run["mode"] == "lockstep"
        receive_at: dict[int, InFlight] = {}  # fragments sent and not yet received back
        total = int(inner["total_steps"])
        end_step = step + opts.steps if opts.steps is not None else (total or None)
        uploader = receiver = heartbeat = None
        if self.io:
            uploader = Uploader(self.store, codec_name=run["codec"], block_size=int(run["codec_block"]),
                                maxsize=opts.upload_queue, stats=self.stats, num_workers=opts.upload_workers,
                                newest_wins=not lockstep)
            receiver = Receiver(self.store, self.readers, poll_s=opts.poll_s, stats=self.stats)
            heartbeat = HeartbeatWriter(self.store, self.hb_key, self._heartbeat_record, every_s=float(run["heartbeat_s"]))
            heartbeat.beat()  # announce ourselves before any contribution
            for worker in (uploader, receiver, heartbeat):
                worker.start()
        previous = signal.signal(signal.SIGTERM, self._on_sigterm) if threading.current_thread() is threading.main_thread() else None
        reason = "error"  # until the loop ends normally
        try:
            while True:
                if self._agree([self.stop_reason is not None])[0]:  # every rank stops at the same step
                    reason = self.stop_reason or "left"
                    break
                if end_step is not None and step >= end_step:
                    reason = "finished" if total and step >= total else "steps"
                    break
                t0 = time.perf_counter()
                # determine the lr
                lr = lr_at(step, inner)
                for group in optimizer.param_groups:
                    group["lr"] = lr
                # forward / backward / update
                batch = move_batch(self.task, next(batches), self.device)
                loss = self.task.loss(model, batch)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                if float(inner["grad_clip"]) > 0:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), float(inner["grad_clip"]))
                optimizer.step()
                if self.device.type == "xla":
                    _xla_mark_step()
                step += 1
                n_tok = int(self.task.num_tokens(batch)) * self.world
                tokens += n_tok
                counters.on_step(n_tok)
                # send the fragments that are due, receive the ones whose overlap window has passed
                due = fragments_due(step, num_fragments=P, sync_every=H)
                for p in due:
                    seq += 1
                    theta = self._send(p, seq, base[p], params, counters, step, uploader)
                    receive_at[p] = InFlight(step + tau, seq, theta, counters.snapshot(p))
                    if self.io:
                        receiver.want(p, base[p])
                if due and lockstep and self.io:
                    # a restart must resume past every fragment it already sent, or it would
                    # send one again and wait for a merge the other learners never join
                    self.stats.step, self.stats.tokens = step, tokens
                    heartbeat.beat()
                for p, flight in list(receive_at.items()):
                    if step >= flight.receive_step and self._receive(p, flight, base, params, counters, receiver,
                                                                     block=lockstep):
                        del receive_at[p]
                # timing and logging
                dt = time.perf_counter() - t0
                s = self.stats
                s.step, s.tokens = step, tokens
                if step % opts.log_every == 0 or s.loss is None:  # .item() syncs an accelerator: not every step
                    s.loss = float(loss.detach())
                s.step_time_s = dt if s.step_time_s == 0 else 0.9 * s.step_time_s + 0.1 * dt
                if self.on_progress is not None and self.io:
                    self.on_progress({"step": step, "loss": s.loss, "lr": lr, "step_time_s": s.step_time_s,
                                      "tokens": tokens, "bytes_up": s.bytes_up, "bytes_down": s.bytes_down,
                                      "versions": dict(s.versions), "blocked_s": s.blocked_s})
                if step % opts.log_every == 0 and self.io:
                    log.info("step %d loss %.4f lr %.2e %.1f ms/step up %.1f MB down %.1f MB", step, s.loss, lr,
                             s.step_time_s * 1e3, s.bytes_up / 1e6, s.bytes_down / 1e6)
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
            self.stats.state = "finished" if reason == "finished" else "left"
            if self.io:
                receiver.close()
                uploader.close()  # finish the uploads in flight
                heartbeat.close()
        self.model = model
        return reason

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        log.info("SIGTERM: finishing the upload in flight, then leaving")
        self.stop_reason = "left"

    def _send(self, p: int, seq: int, base: tuple[int, Tensors], params: dict[str, torch.Tensor],
              counters: FragmentCounters, step: int, uploader: Uploader | None) -> Tensors:
        """Queue the outer gradient delta = Theta_base - theta of fragment p; returns theta."""
        theta = gather_fragment(self.plan, p, params)
        if not self.io:
            return theta
        base_version, base_value = base
        delta = {k: base_value[k] - theta[k] for k in theta}
        c_steps, c_tokens = counters.snapshot(p)
        header = records.make(
            "contribution", run_id=self.run_id, fragment=p, learner_id=self.opts.learner_id, seq=seq,
            base_version=base_version, c_tokens=c_tokens, c_steps=max(1, c_steps), step=step,
            nonce=records.new_nonce(), created_s=time.time(),
        )
        self.stats.blocked_s += uploader.submit(layout.contribution_key(p, self.opts.learner_id, seq), delta, header)
        return theta

    def _receive(self, p: int, flight: InFlight, base: dict[int, tuple[int, Tensors]], params: dict[str, torch.Tensor],
                 counters: FragmentCounters, receiver: Receiver | None, *, block: bool) -> bool:
        """Merge a newer committed version of p if one is ready (lock-step: wait for the
        version that includes our contribution). Returns True when p was received.

        theta <- alpha * theta + (1 - alpha) * (Theta_new + progress), where progress =
        theta - theta_at_send is what the overlap window trained after the send (zero
        when tau = 0, or when the run discards it: keep_overlap_progress = false). The
        next contribution then covers exactly the steps since this send."""
        sent_seq = flight.seq
        got = None
        if self.io:
            t0 = time.monotonic()
            while True:
                got = receiver.take(p)
                if got is not None and block and got[2]["high_water"].get(self.opts.learner_id, -1) < sent_seq:
                    receiver.want(p, (got[0], got[1]))  # not ours yet: keep waiting for a later version
                    got = None
                if got is not None or not block or self.stop_reason is not None:
                    break
                time.sleep(0.005)
            if block:
                self.stats.blocked_s += time.monotonic() - t0
        if self.world > 1:
            box = [got[0] if got is not None else -1]
            dist.broadcast_object_list(box, src=0)
            if box[0] < 0:
                return False
            version, value = self._broadcast(box[0], got[1] if got is not None else {}, p)
        else:
            if got is None:
                return False
            version, value = got[0], got[1]
        alpha = float(self.run["alpha"])
        keep = bool(self.run.get("keep_overlap_progress", False)) and int(self.run["overlap_steps"]) > 0
        if alpha == 0.0 and not keep:
            scatter_fragment(self.plan, p, params, value)
        else:
            local = gather_fragment(self.plan, p, params)
            target = {k: value[k] + (local[k] - flight.theta[k]) for k in local} if keep else value
            for k in local:
                alpha_merge(local[k], target[k], alpha)
            scatter_fragment(self.plan, p, params, local)
        base[p] = (version, value)
        counters.reset(p, since=flight.counters if keep else None)
        self.stats.versions[p] = version
        return True
