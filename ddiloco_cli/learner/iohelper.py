"""The io helper process of a learner (``SyncOptions(io_process=True)``, ``ddiloco learn
--io-process``): the uploader and the receiver of ``DiLoCoSync``, run in a process of their own
so that none of their Python holds the training process's GIL.

It keeps what only they read: every fragment's base (the published value the learner's next
contribution is measured against), the codec's residual of the last upload (error feedback,
[L6]) and the values of the versions it handed over and the learner has not taken or let go of. The
training process copies a fragment into a shared block at a send and reads a ready increment
(new value minus the fragment at the send) from another; the messages between them
(``ioproc.IoProcess``) are small JSON lists on a socket pair (``channel``). The training process
starts it as a fork of itself on Linux (sharing the pages of the imports), else as ``python -m
ddiloco_cli.learner.iohelper FD``; it exits when that socket closes (the training process has
gone, even by SIGKILL), and on Linux the kernel kills it with its parent as well.

Messages in (from the training process): ``("slot", sid, path)`` map a block; ``("base", p,
version, sid)`` fragment p's starting base is in block sid; ``("send", key, sid, header)`` a
contribution of the fragment in block sid (its outer gradient computed here, against the base of
``header["base_version"]``); ``("want", p, have_version, theta_sid, inc_sid, order, pace_s)``
poll for a version of p newer than have; ``("took", p, version)`` the learner took that version:
it is p's base now; ``("close",)`` finish the uploads and leave.

Out: ``("unref", sid)`` done with one use of a block (``("unref", sid, True)`` for a
contribution's block: read, or replaced by a newer contribution); ``("ready", p, version,
theta_sid, inc_sid, high_water, refused)`` a version is ready, its increment in block inc_sid
(both blocks the learner's again from then on); ``("stats", {...}, cpu_s)`` the counters and this
process's CPU seconds; ``("started",)``, ``("closed",)``; ``("error", text)``."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import sys
import threading
import time
import traceback
from typing import Any

import torch

from ddiloco_cli.learner.channel import Channel
from ddiloco_cli.learner.receiver import Receiver
from ddiloco_cli.learner.sendpath import copied_into, outer_gradient
from ddiloco_cli.learner.slots import SlotTable
from ddiloco_cli.learner.stats import WORKER_COUNTERS, LearnerStats
from ddiloco_cli.learner.uploader import Uploader
from ddiloco_cli.protocol import signing
from ddiloco_cli.protocol.fragments import FragmentPlan
from ddiloco_cli.protocol.runconfig import RunConfig
from ddiloco_cli.protocol.published import FragmentReader
from ddiloco_cli.store import open_store

Tensors = dict[str, torch.Tensor]


class _Send:
    """A contribution whose outer gradient the upload thread computes (``Uploader.encode``) from
    the fragment in a shared block; the block goes back to the learner once it is read, or when
    a newer contribution replaced this one in the queue."""

    def __init__(self, helper: "Helper", p: int, sid: int, base: Tensors):
        self.helper, self.p, self.sid, self.base = helper, p, sid, base
        self.released = False

    def materialize(self) -> Tensors:
        try:
            return self.helper.outer_gradient(self.p, self.helper.slots.views(self.sid, self.p), self.base)
        finally:
            self.release()

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.base = None  # type: ignore[assignment]
            self.helper.post(("unref", self.sid, True))


class Helper:
    """The helper's state and its handlers (see the module docstring)."""

    def __init__(self, conn: Channel, spec: dict[str, Any]):
        self.conn = conn
        self.lock = threading.Lock()  # values, wants, residuals
        config = RunConfig.from_record(spec["config"], where="the learner's run config")
        self.plan = FragmentPlan.from_json(spec["plan"])
        self.store = open_store(spec["url"], options=spec["storage_options"])
        trust = signing.Trust(self.store, run=config)
        readers = {p: FragmentReader(self.store, run_id=config.run_id, plan=self.plan, fragment=p, trust=trust)
                   for p in range(self.plan.num_fragments)}
        signer = signing.signer_for_run(self.store, run=config, key_path=spec["key_path"],
                                        member_id=spec["learner_id"], role="learner")
        self.decay = config.error_feedback_decay
        self.stats = LearnerStats()
        self.slots = SlotTable(self.plan)
        self.values: dict[int, dict[int, Tensors]] = {p: {} for p in range(self.plan.num_fragments)}
        # a version handed over: the learner's own high-water mark in its manifest, and the refusals
        self.meta: dict[tuple[int, int], tuple[int, list[dict[str, Any]]]] = {}
        self.wants: dict[int, tuple[int, int]] = {}  # fragment -> (theta block, increment block) of its want
        self.residual: dict[int, Tensors] = {}
        self.pace_s = 0.0
        error_feedback = config.error_feedback and config.codec != "none"
        # no bound of its own: the learner bounds the contributions in flight by the blocks it lends
        self.uploader = Uploader(self.store, codec_name=config.codec, block_size=config.codec_block,
                                 qmax=config.codec_qmax, density=config.codec_density, maxsize=1 << 30,
                                 stats=self.stats, num_workers=spec["upload_workers"], newest_wins=True, signer=signer,
                                 on_residual=self.keep_residual if error_feedback else None,
                                 on_replaced=lambda d: d.release(), after=self.post_stats)
        self.receiver = Receiver(self.store, readers, learner_id=spec["learner_id"], min_poll_s=spec["min_poll_s"],
                                 stats=self.stats, pace_s=lambda: self.pace_s, on_ready=self.on_ready)

    # -------------------------------------------------------------- messages
    def post(self, msg: tuple) -> None:
        self.conn.send(msg)

    def post_stats(self) -> None:
        self.post(("stats", {k: getattr(self.stats, k) for k in WORKER_COUNTERS}, time.process_time()))

    def serve(self, msgs: list[tuple]) -> None:
        """Handle ``msgs`` (what came with the spec), then every message until ``close``."""
        self.uploader.start()
        self.receiver.start()
        self.post(("started",))
        while True:
            for msg in msgs:
                if msg[0] == "close":
                    self.uploader.close()
                    self.receiver.close()
                    self.post_stats()
                    self.post(("closed",))
                    return
                getattr(self, "on_" + msg[0])(*msg[1:])
            try:
                msgs = self.conn.receive(None)
            except (EOFError, OSError):
                os._exit(0)  # the training process is gone: nothing here is wanted any more

    def on_slot(self, sid: int, path: str) -> None:
        self.slots.attach(sid, path)

    def on_base(self, p: int, version: int, sid: int) -> None:
        value = {k: t.clone() for k, t in self.slots.views(sid, p).items()}
        with self.lock:
            self.values[p] = {version: value}
        self.post(("unref", sid))

    def on_send(self, key: str, sid: int, header: dict[str, Any]) -> None:
        p = int(header["fragment"])
        with self.lock:
            base = self.values[p][int(header["base_version"])]
        self.uploader.submit(key, _Send(self, p, sid, base), header)

    def on_want(self, p: int, have: int, theta_sid: int, inc_sid: int, order: float, pace_s: float) -> None:
        """Poll for a version of p newer than ``have``; one handed over already for an earlier send
        (the learner let it go: its increment was against that send) is handed over again at once,
        against this send, without downloading it again."""
        self.pace_s = pace_s
        with self.lock:
            old = self.wants.pop(p, None)
            newest = max(self.values[p])
            if newest <= have:
                self.wants[p] = (theta_sid, inc_sid)
            value = self.values[p][have]
        for sid in old or ():
            self.post(("unref", sid))
        if newest > have:
            self._hand_over(p, newest, theta_sid, inc_sid)
        else:
            self.receiver.want(p, (have, value), order=order)

    def on_took(self, p: int, version: int) -> None:
        with self.lock:
            self.values[p] = {v: t for v, t in self.values[p].items() if v >= version}
            for v in [v for q, v in self.meta if q == p and v < version]:
                del self.meta[p, v]

    # -------------------------------------------------------- worker threads
    def on_ready(self, p: int) -> None:
        """Receiver thread: a version of p is ready; its increment against the fragment at the
        send goes into the want's block, and the learner is told."""
        got = self.receiver.take(p)
        if got is None:
            return
        with self.lock:
            # kept even when no want waits for it (one replaced by a want answered from a kept version):
            # the next want hands it over without a download
            self.values[p][got.version] = got.value
            self.meta[p, got.version] = (got.manifest["high_water"].get(self.receiver.learner_id, -1), got.refused)
            want = self.wants.pop(p, None)
        if want is None:
            return
        self._hand_over(p, got.version, *want)
        self.post_stats()

    def _hand_over(self, p: int, version: int, theta_sid: int, inc_sid: int) -> None:
        """Write ``version``'s increment against the send in block theta_sid into block inc_sid
        and tell the learner."""
        with self.lock:
            value = self.values[p][version]
            mark, refused = self.meta.get((p, version), (-1, []))
        theta, inc = self.slots.views(theta_sid, p), self.slots.views(inc_sid, p)
        for k, t in inc.items():
            torch.sub(value[k], theta[k], out=t)
        self.post(("ready", p, version, theta_sid, inc_sid, mark, refused))

    def outer_gradient(self, p: int, theta: Tensors, base: Tensors) -> Tensors:
        with self.lock:
            return outer_gradient(theta, base, self.residual.get(p), decay=self.decay)

    def keep_residual(self, p: int, residual: Tensors) -> None:
        with self.lock:
            self.residual[p] = copied_into(self.residual.get(p), residual)


def _die_with_parent() -> None:
    """Linux: the kernel sends SIGKILL to this process when the training process ends."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass


def run(conn: Channel) -> int:
    """Read the spec, then serve until ``close``; an error is told to the training process. The
    exit code."""
    torch.set_num_threads(1)
    # a Ctrl-C or a SIGTERM sent to the whole group is the training process's to handle: it leaves
    # cleanly (its flush goes through this process) and closes the helper, or dies and the helper with it
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        msgs: list[tuple] = []
        while not msgs:
            msgs = conn.receive(None)
        _, spec = msgs.pop(0)
        helper = Helper(conn, spec)
    except BaseException:  # noqa: BLE001 - told to the training process, which raises it
        conn.send(("error", traceback.format_exc()))
        return 1
    try:
        helper.serve(msgs)
    except BaseException:  # noqa: BLE001
        helper.post(("error", traceback.format_exc()))
        return 1
    return 0


def forked(sock: socket.socket, *, die_with_parent: bool) -> int:
    """The helper in a child the training process forked (Linux): it shares the pages of the
    imports (torch's are 150 MB) with the training process instead of loading its own."""
    if die_with_parent:  # the kernel's signal follows the forking thread: the main thread's only
        _die_with_parent()
    return run(Channel(sock))


def main(argv: list[str]) -> int:
    """``python -m ddiloco_cli.learner.iohelper FD`` (where the training process cannot fork)."""
    _die_with_parent()
    conn = Channel(socket.socket(fileno=int(argv[0])))
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s io-helper %(levelname)s %(name)s: %(message)s")
    return run(conn)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
