"""The training process's end of the io helper process (``iohelper``): ``IoProcess`` stands in
for ``DiLoCoSync``'s uploader and receiver (``submit``, ``want``, ``has_ready``, ``take``,
``close``), so that the send and receive paths run as they do with worker threads, while the
encoding, uploads, polls, downloads and decoding run in another process and hold none of this
process's GIL.

A send copies the fragment into a shared block (``snapshot``) and sends its number; a ready
version comes back as the block its increment was written into. The blocks are lent out and
counted here: one is free when the helper has given back every use of it (``unref``) and no
fragment in flight, held version or ready version refers to it (``in_use``, the learner's). A
send waits for a free block when ``max_outstanding`` contributions are still to be read by the
helper (the bound the upload queue puts on the threads' way); that wait counts as blocked time.
The training thread reads the helper's messages itself, at every ``step`` (``pump``): nothing
of ddiloco's runs on another thread of this process but the heartbeat. ``IoPath`` is the part of
``DiLoCoSync`` that starts the helper in place of the worker threads.

A model on a CUDA device: a send copies the fragment into pinned memory without waiting for the
device (``stage``: ``gather_fragment``'s ``non_blocking`` copy and its event), and its message
waits in an outbox, with every message after it, until the copy has landed (checked without
waiting at each step's end; a wait that blocks anyway waits for it); then the pinned values are
copied into the block and the messages go, in order. A ready version's increment is copied out
of its block into pinned memory at once (the block goes back), so the receive path adds it to
the model without a stream sync, as with the threads."""

from __future__ import annotations

import gc
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from functools import partial
from typing import Any, Callable

import torch

from ddiloco_cli.errors import DdilocoError, UsageError
from ddiloco_cli.learner import allocator
from ddiloco_cli.learner.channel import Channel
from ddiloco_cli.learner.receiver import Ready
from ddiloco_cli.learner.slots import SlotTable, copy_fragment_into
from ddiloco_cli.learner.stats import WORKER_COUNTERS, LearnerStats
from ddiloco_cli.protocol.fragments import CopyOut, FragmentPlan, gather_fragment

Tensors = dict[str, torch.Tensor]

START_TIMEOUT_S = 300.0  # the helper (spawned where it cannot be forked) imports torch and opens the bucket
BOOTSTRAP_BLOCKS = 4  # blocks the bases are handed over in at the start


class _Forked:
    """A forked child, as much of ``subprocess.Popen`` as ``IoProcess`` uses."""

    def __init__(self, pid: int):
        self.pid, self.returncode = pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"io helper {self.pid}", timeout)
            time.sleep(0.01)
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:
            os.kill(self.pid, signal.SIGKILL)


def _forget(tensors: list[torch.Tensor]) -> None:
    """In a forked child: give back the pages of ``tensors`` (whole pages inside each storage)
    that the child never reads, so that the parent's writes to them (every training step) copy
    nothing. Best effort: nothing happens where ``madvise`` is missing."""
    import ctypes

    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page = os.sysconf("SC_PAGE_SIZE")
    for t in tensors:
        storage = t.untyped_storage()
        start, end = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
        first, last = -(-start // page) * page, end // page * page
        if last > first:
            madvise(first, last - first, 4)  # MADV_DONTNEED


def _fork_helper(ours: socket.socket, theirs: socket.socket, forget: list[torch.Tensor]) -> _Forked:
    """Fork the io helper (``iohelper.forked``): the child never returns into the caller's code;
    it gives back the pages of ``forget`` (the model's parameters) first."""
    from ddiloco_cli.learner import iohelper

    main_thread = threading.current_thread() is threading.main_thread()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            ours.close()
            gc.freeze()  # the child's collections leave the parent's objects (and their pages) alone
            _forget(forget)
            # the heap's free pages, which the parent goes on reusing: each one it writes would be copied
            allocator.release_free()
            code = iohelper.forked(theirs, die_with_parent=main_thread)
        finally:
            os._exit(code)
    return _Forked(pid)


class IoProcess:
    """See the module docstring. ``in_use()`` returns the blocks the learner still reads."""

    def __init__(self, spec: dict[str, Any], plan: FragmentPlan, *, stats: LearnerStats, max_outstanding: int,
                 in_use: Callable[[], set[int]], device: torch.device = torch.device("cpu")):
        self.spec, self.plan, self.stats = spec, plan, stats
        self.pin = device.type == "cuda"
        # a send's copy of the fragment: None, straight into its block (CPU); else staged (CUDA), and
        # then a ready increment is copied out of its block too (pinned: added without a sync)
        self.stage: Callable[[int, dict[str, torch.Tensor]], CopyOut] | None = (
            partial(gather_fragment, plan, non_blocking=True) if self.pin else None)
        self._staged: dict[int, tuple[CopyOut, int]] = {}  # block -> (the send's staged copy, fragment)
        # messages behind a staged copy that has not landed: (None, msg), or ((copy, block, fragment), msg)
        self._outbox: deque[tuple[tuple[CopyOut, int, int] | None, tuple]] = deque()
        self.max_outstanding = max_outstanding
        self.in_use = in_use
        self.slots = SlotTable(plan)
        self.refs: dict[int, int] = {}  # block -> uses lent to the helper not given back yet
        self.sending: dict[int, int] = {}  # block -> contributions in it the helper has not read yet
        self.ready: dict[int, Ready] = {}
        self.wants: dict[int, tuple[int, int]] = {}  # fragment -> (theta block, increment block) of its last want
        self._offsets = {k: getattr(stats, k) for k in WORKER_COUNTERS}  # counters carried over from earlier sessions
        self._cpu_s: float | None = None
        self.proc: subprocess.Popen | None = None
        self.conn: Channel | None = None
        self._closed = False

    # ------------------------------------------------------------- lifecycle
    def start(self, bases: dict[int, tuple[int, Tensors]], *, forget: list[torch.Tensor] = ()) -> None:
        """Start the helper, hand it every fragment's base and wait until it is serving. On Linux
        the helper is a fork of this process, which lets go of the pages of ``forget`` (the
        model's CPU tensors: this process writes them, the helper never reads them)."""
        ours, theirs = socket.socketpair()
        if sys.platform.startswith("linux"):
            self.proc = _fork_helper(ours, theirs, list(forget))
        else:
            self.proc = subprocess.Popen([sys.executable, "-m", "ddiloco_cli.learner.iohelper", str(theirs.fileno())],
                                         pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        theirs.close()
        self.conn = Channel(ours)
        self.conn.post(("spec", self.spec))
        for p, (version, value) in sorted(bases.items()):
            if len(self.slots.flat) >= BOOTSTRAP_BLOCKS:  # reuse a few blocks: not a copy of the model in each
                self._wait_for(lambda: any(self.refs.get(b, 0) == 0 for b in self.slots.flat), START_TIMEOUT_S,
                               "take the bases")
            sid = self._free_block()
            views = self.slots.views(sid, p)
            for k, t in views.items():
                t.copy_(value[k])
            self._lend(sid)
            self._post(("base", p, version, sid))
        self._wait_for(lambda: self._started, START_TIMEOUT_S, "start")

    _started = False

    def close(self) -> None:
        """Let the helper finish the uploads queued, then stop it (idempotent)."""
        if self._closed or self.conn is None:
            return
        self._closed = True
        try:
            self._post(("close",))  # after the messages still waiting for their copies
            self._wait_for(lambda: self._done, None, "close")
        finally:
            self.conn.close()
            if self.proc is not None:
                try:
                    self.proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
            self.slots.unlink_all()

    _done = False

    def abort(self) -> None:
        """Kill the helper (a start that failed): its queued uploads are lost."""
        self._closed = True
        if self.conn is not None:
            self.conn.close()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.slots.unlink_all()

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def cpu_s(self) -> float | None:
        """The helper's CPU seconds (all its threads) at its latest report: it reports with every
        upload and every version it hands over. None before the first."""
        return self._cpu_s

    # ---------------------------------------------------- the uploader's face
    def snapshot(self, p: int, params: dict[str, torch.Tensor]) -> tuple[Tensors, float]:
        """Fragment p of ``params`` copied into a free block; and the seconds waited for one."""
        t0 = time.monotonic()
        self.pump()
        if sum(self.sending.values()) >= self.max_outstanding:
            self._wait_for(lambda: sum(self.sending.values()) < self.max_outstanding, None, "an upload")
        waited = time.monotonic() - t0
        sid = self._free_block()
        views = self.slots.views(sid, p)
        if self.stage is None:
            return copy_fragment_into(self.plan, p, params, views), waited
        self._staged[sid] = (self.stage(p, params), p)  # its message (``submit``) waits for the copy
        return views, waited

    def submit(self, key: str, theta: Tensors, header: dict[str, Any]) -> float:
        """Queue the contribution of the fragment ``snapshot`` copied into ``theta``."""
        sid = self.slots.slot_of(theta)
        self._lend(sid)
        self.sending[sid] = self.sending.get(sid, 0) + 1
        staged = self._staged.pop(sid, None)
        if staged is None:
            self._post(("send", key, sid, header))
        else:
            self._outbox.append(((staged[0], sid, staged[1]), ("send", key, sid, header)))
        return 0.0

    # ---------------------------------------------------- the receiver's face
    def want(self, p: int, have: tuple[int, Any], *, subtract: Tensors | None = None, blocking: bool = False,
             order: float | None = None) -> None:
        theta_sid = self.slots.slot_of(subtract)
        if theta_sid is None or blocking:
            raise DdilocoError("the io helper computes increments against a send's block only (decoupled, in place)")
        stale = self.ready.get(p)
        if stale is not None and stale.subtracted is not subtract:
            del self.ready[p]  # computed against an earlier send: the helper reads it again for this one
        inc_sid = self._free_block(also_busy={theta_sid})
        self._lend(theta_sid)
        self._lend(inc_sid)
        self.wants[p] = (theta_sid, inc_sid)
        self._post(("want", p, have[0], theta_sid, inc_sid, 0.0 if order is None else order,
                    self.stats.step_time_s))  # the learner's step time: the helper polls no faster

    def has_ready(self, p: int) -> bool:
        """Whether a version of p came by the last ``pump``."""
        return p in self.ready

    def take(self, p: int) -> Ready | None:
        return self.ready.pop(p, None)

    def took(self, p: int, version: int) -> None:
        """The learner took ``version`` of p: the helper's base of p from now on."""
        self._post(("took", p, version))

    # -------------------------------------------------------------- internals
    def _post(self, msg: tuple) -> None:
        """Queue ``msg`` for the helper, behind the messages still waiting for their copies."""
        if self._outbox:
            self._outbox.append((None, msg))
        else:
            self.conn.post(msg)

    def _drain(self, *, wait: bool = False) -> None:
        """Post the outbox's messages whose copies have landed, in order, up to the first that has
        not (``wait``: wait for each); a landed send's values go into its block first."""
        while self._outbox:
            landing, msg = self._outbox[0]
            if landing is not None:
                staged, sid, p = landing
                if not (wait or staged.done()):
                    return
                views = self.slots.views(sid, p)
                for k, t in staged.landed().items():
                    views[k].copy_(t)
            self.conn.post(msg)
            self._outbox.popleft()

    def flush(self, *, wait: bool = False) -> None:
        """Send the messages of this step (one write); ``wait``: the outbox's too, once their
        copies have landed."""
        if self.conn is not None:
            self._drain(wait=wait)
            try:
                self.conn.flush()
            except OSError as exc:  # the helper is gone: say so, not "broken pipe"
                raise self._gone(exc) from None

    def _gone(self, exc: BaseException) -> DdilocoError:
        code = None if self.proc is None else self.proc.poll()
        return DdilocoError(f"the learner's io helper process ended (exit code {code}): {exc}")

    def pump(self, timeout: float | None = 0.0) -> bool:
        """Handle the helper's messages that have come (waiting up to ``timeout`` for one, None:
        for ever); False when none came."""
        if self.conn is None or self._done:
            return False
        try:
            msgs = self.conn.receive(timeout)
        except (EOFError, OSError) as exc:
            raise self._gone(exc) from None
        for msg in msgs:
            self._handle(msg)
        return bool(msgs)

    def _handle(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "unref":
            self.refs[msg[1]] -= 1
            if len(msg) > 2:  # a contribution's block: the helper has read it (or a newer one replaced it)
                self.sending[msg[1]] -= 1
        elif kind == "ready":
            _, p, version, theta_sid, inc_sid, mark, refused = msg
            self.refs[theta_sid] -= 1
            self.refs[inc_sid] -= 1
            if self.wants.get(p) == (theta_sid, inc_sid):  # else a want since replaced it
                del self.wants[p]
                increment = self.slots.views(inc_sid, p)
                if self.stage is not None:  # out of the block (which goes back): pinned, added without a sync
                    increment = {k: torch.empty(t.shape, dtype=t.dtype, pin_memory=self.pin).copy_(t)
                                 for k, t in increment.items()}
                self.ready[p] = Ready(version, None, {"high_water": {self.spec["learner_id"]: mark}}, refused,
                                      increment, self.slots.views(theta_sid, p))
        elif kind == "stats":
            counters, self._cpu_s = msg[1], msg[2]
            for k, v in counters.items():
                setattr(self.stats, k, self._offsets[k] + v)
        elif kind == "started":
            self._started = True
        elif kind == "closed":
            self._done = True
        elif kind == "error":
            raise DdilocoError(f"the learner's io helper process failed:\n{msg[1]}")

    def _lend(self, sid: int) -> None:
        self.refs[sid] = self.refs.get(sid, 0) + 1

    def _free_block(self, also_busy: set[int] = frozenset()) -> int:
        """A block nobody uses (a new one when there is none)."""
        busy = self.in_use() | set(also_busy) | {s for r in self.ready.values() for s in
                                                (self.slots.slot_of(r.increment), self.slots.slot_of(r.subtracted))}
        for sid in self.slots.flat:
            if self.refs.get(sid, 0) == 0 and sid not in busy:
                return sid
        sid, path = self.slots.create()
        self._post(("slot", sid, path))
        return sid

    def _wait_for(self, done: Callable[[], bool], timeout_s: float | None, what: str) -> None:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self.flush(wait=True)  # a wait blocks anyway: the copies' messages go too
        while not done():
            if self.proc is not None and self.proc.poll() is not None and not self.pump():
                raise DdilocoError(f"the learner's io helper process exited (code {self.proc.returncode}) "
                                   f"while the learner waited for {what}")
            if deadline is not None and time.monotonic() > deadline:
                raise DdilocoError(f"the learner's io helper process did not {what} in {timeout_s:.0f} s")
            self.pump(timeout=0.5)


class IoPath:
    """The io helper half of ``DiLoCoSync`` (a base class: the methods use its attributes):
    starting the helper in place of the worker threads, and the blocks the learner still reads."""

    def _start_io_process(self) -> None:
        """Start the io helper process (``SyncOptions.io_process``) and hand it the bases."""
        why = ("torchrun islands" if self.island.world > 1 else "lock-step runs" if self.lockstep
               else f"a model on {self.island.device}" if self.island.device.type not in ("cpu", "cuda")
               else "runs without an in-place receive (alpha 1 or no overlap progress)" if not self._in_place
               else "a driver without threads" if not self.opts.threads
               else "an in-memory bucket" if self._open_args[0].startswith("memory://") else None)
        if why is not None:
            raise UsageError(f"--io-process: not for {why}; leave it off")
        spec = {"url": self._open_args[0], "storage_options": self._open_args[1], "learner_id": self.learner_id,
                "key_path": None if self.opts.key_path is None else str(self.opts.key_path),
                "config": self.config.to_record(run_id=self.run_id, created_s=self.config.created_s),
                "plan": self.plan.to_json(),
                "upload_workers": self.opts.upload_workers, "min_poll_s": self.opts.min_poll_s}
        try:
            json.dumps(spec)
        except (TypeError, ValueError) as exc:
            raise UsageError(f"--io-process: the storage options must be JSON values for the helper ({exc})") from None
        self._io = IoProcess(spec, self.plan, stats=self.stats, in_use=self._blocks_in_use,
                             max_outstanding=self.opts.upload_queue + self.opts.upload_workers,
                             device=self.island.device)
        try:
            state = [*self.model.state_dict().values(), *(p.grad for p in self.params.values() if p.grad is not None)]
            self._io.start(self.base, forget=[t for t in state if t.device.type == "cpu"])
        except BaseException:
            self._io.abort()
            raise
        self.base = {p: (v, None) for p, (v, _) in self.base.items()}  # the helper keeps the values
        allocator.release_free()  # their pages
        self._uploader = self._receiver = self._io

    def _blocks_in_use(self) -> set[int]:
        """The io helper's shared blocks this learner still reads: the fragments in flight and
        the increments of the versions it holds back ([L8])."""
        slot_of = self._io.slots.slot_of
        used = set()
        for flight in self.in_flight.values():
            used.add(slot_of(flight.theta))
            if flight.held is not None:
                used.update((slot_of(flight.held.increment), slot_of(flight.held.subtracted)))
        used.discard(None)
        return used
