"""Contribution uploads: a bounded queue drained by a few worker threads.

``encode_contribution`` is the one place where a contribution's bytes are made
(and, in a run that requires signatures, signed: PROTOCOL.md, "Signatures", [A2]).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any, Callable, Protocol

import torch

from ddiloco_cli.learner.stats import LearnerStats
from ddiloco_cli.numerics import codec
from ddiloco_cli.protocol import signing
from ddiloco_cli.store.base import Store
from ddiloco_cli.store.retry import OUTAGE_POLICY, retrying

log = logging.getLogger(__name__)

Tensors = dict[str, torch.Tensor]


class Deferred(Protocol):
    """A contribution's tensors still to be computed (``sendpath.PendingDelta``)."""

    def materialize(self) -> Tensors: ...


def contribution_bytes(delta: Tensors, header: dict[str, Any], *, codec_name: str, block_size: int, key: str,
                       signer: signing.Signer | None = None, qmax: int | None = None,
                       density: float | None = None) -> bytes:
    """The object a learner creates at ``key`` (contributions/pP/LEARNER/SEQ.safetensors),
    signed by ``signer`` when the run requires signatures."""
    return encode_contribution(delta, header, codec_name=codec_name, block_size=block_size, key=key,
                               signer=signer, qmax=qmax, density=density)[0]


def encode_contribution(delta: Tensors, header: dict[str, Any], *, codec_name: str, block_size: int, key: str,
                        signer: signing.Signer | None = None, residual: bool = False,
                        qmax: int | None = None, density: float | None = None) -> tuple[bytes, Tensors | None]:
    """``contribution_bytes``, and with ``residual`` also what the encoding leaves out of
    ``delta`` (error feedback, PROTOCOL [L6]); None without."""
    if residual:
        data, left_out = codec.encode_with_residual(delta, codec=codec_name, block_size=block_size, metadata=header,
                                                    qmax=qmax, density=density)
    else:
        data = codec.encode_tensors(delta, codec=codec_name, block_size=block_size, metadata=header, qmax=qmax,
                                    density=density)
        left_out = None
    if signer is not None:
        data = signing.sign_payload(data, kind="contribution", run_id=header["run_id"], key=key, signer=signer)
    return data, left_out


class UploadQueue:
    """The uploader's bounded queue, oldest first, that hands out one fragment's
    contributions one at a time: ``get`` skips an item whose fragment another worker is
    still uploading until ``done`` releases it. So a learner's contributions of a fragment
    land in seq order (PROTOCOL [L4]); the syncer never takes in a seq at or below its
    learner's high-water mark, so a later one landing first would leave the earlier one out
    of the ledger. Fragments of their own still upload side by side."""

    def __init__(self, maxsize: int):
        self.maxsize = maxsize
        self.items: deque = deque()
        self.busy: set[int] = set()  # fragments a worker is uploading now
        self.closed = False
        self.cond = threading.Condition()

    def put(self, item: tuple[str, Tensors, dict[str, Any]]) -> None:
        """Append ``item``, waiting while ``maxsize`` items are queued."""
        with self.cond:
            while len(self.items) >= self.maxsize:
                self.cond.wait()
            self.items.append(item)
            self.cond.notify_all()

    def replace(self, item: tuple[str, Tensors, dict[str, Any]]) -> tuple[str, Tensors, dict[str, Any]] | None:
        """Put ``item`` in the place of a queued one of the same fragment and base version
        (PROTOCOL [L4]); returns the one replaced, None when there is none."""
        header = item[2]
        with self.cond:
            for i, (_, _, queued) in enumerate(self.items):
                if queued["fragment"] == header["fragment"] and queued["base_version"] == header["base_version"]:
                    replaced, self.items[i] = self.items[i], item
                    return replaced
        return None

    def get(self, *, block: bool = True) -> tuple[str, Tensors, dict[str, Any]] | None:
        """The oldest queued item whose fragment no worker is uploading, marked busy until
        ``done``. None once closed and empty, or (``block`` False) when none can go now."""
        with self.cond:
            while True:
                for i, item in enumerate(self.items):
                    fragment = int(item[2]["fragment"])
                    if fragment not in self.busy:
                        del self.items[i]
                        self.busy.add(fragment)
                        self.cond.notify_all()  # a put waiting for room
                        return item
                if not block or (self.closed and not self.items):
                    return None
                self.cond.wait()

    def done(self, fragment: int) -> None:
        """The upload of ``fragment``'s item from ``get`` is over (created or given up)."""
        with self.cond:
            self.busy.discard(fragment)
            self.cond.notify_all()

    def close(self) -> None:
        """``get`` returns None once the queued items are all taken."""
        with self.cond:
            self.closed = True
            self.cond.notify_all()

    def empty(self) -> bool:
        with self.cond:
            return not self.items

    def full(self) -> bool:
        with self.cond:
            return len(self.items) >= self.maxsize


class Uploader:
    """Encodes and uploads contributions from a bounded queue with ``num_workers``
    threads (several PUTs in flight hide round trips on long links), retrying under
    ``store.retry.OUTAGE_POLICY`` (tenacity; each attempt a whole, itself retried, store call).

    With ``newest_wins`` (decoupled mode) a contribution replaces a queued, not yet
    started one of the same fragment *with the same base version* instead of waiting
    behind it: the newer delta, taken against the same base, already carries the
    older one's progress. Across a re-base (the learner received a new version in
    between) both are uploaded: the newer delta no longer contains the older one's
    steps. Lock-step never replaces (the learner waits for the merge of exactly the
    contribution it sent)."""

    def __init__(self, store: Store, *, codec_name: str, block_size: int, maxsize: int, stats: LearnerStats,
                 num_workers: int = 2, newest_wins: bool = True, signer: signing.Signer | None = None,
                 on_residual: Callable[[int, Tensors], None] | None = None, qmax: int | None = None,
                 density: float | None = None, threads: bool = True, clock: Callable[[], float] = time.monotonic,
                 on_replaced: Callable[[Tensors | Deferred], None] | None = None,
                 after: Callable[[], None] | None = None):
        self.clock = clock  # times how long submit blocked on a full queue
        self.store, self.codec_name, self.block_size, self.stats = store, codec_name, block_size, stats
        self.qmax = qmax  # the run's codec_qmax: the largest |code| the encoder writes
        self.density = density  # the run's codec_density (sparse)
        self.signer = signer
        # error feedback: called with (fragment, what the encoded payload does not carry) once it is uploaded
        self.on_residual = on_residual
        self.newest_wins = newest_wins
        self.on_replaced = on_replaced  # called with the delta of a queued contribution a newer one replaced
        self.after = after  # called once a contribution's upload is over (created, dropped or given up)
        self.queue = UploadQueue(maxsize)
        self.lock = threading.Lock()
        self.replaced = 0
        self.threads = [threading.Thread(target=self._run, name=f"ddiloco-uploader-{i}", daemon=True)
                        for i in range(num_workers if threads else 0)]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def submit(self, key: str, delta: Tensors, header: dict[str, Any]) -> float:
        """Queue an upload; returns seconds spent blocked because the queue was full."""
        item = (key, delta, header)
        replaced = self.queue.replace(item) if self.newest_wins else None
        if replaced is not None:
            self.replaced += 1
            if self.on_replaced is not None:
                self.on_replaced(replaced[1])
            return 0.0
        t0 = self.clock()
        self.queue.put(item)
        return self.clock() - t0

    def _run(self) -> None:
        while (item := self.queue.get()) is not None:
            self._upload(*item)

    def take_next(self) -> tuple[str, Tensors, dict[str, Any]] | None:
        """The oldest queued (key, delta, header) whose fragment is not being uploaded, or
        None (driver mode); ``finish`` releases its fragment."""
        return self.queue.get(block=False)

    def encode(self, key: str, delta: Tensors | Deferred, header: dict[str, Any]) -> tuple[bytes, Tensors | None]:
        """The contribution's bytes, and what they leave out of ``delta`` (error feedback). A
        ``Deferred`` delta is computed here first, on the upload thread."""
        if not isinstance(delta, dict):
            delta = delta.materialize()
        return encode_contribution(delta, header, codec_name=self.codec_name, block_size=self.block_size,
                                   key=key, signer=self.signer, residual=self.on_residual is not None,
                                   qmax=self.qmax, density=self.density)

    def _upload(self, key: str, delta: Tensors, header: dict[str, Any]) -> None:
        """Encode and upload an item from ``queue.get``; a failure is counted and logged, and
        the fragment is released either way (a worker outlives one contribution's failure)."""
        try:
            data, residual = self.encode(key, delta, header)
        except Exception:  # noqa: BLE001
            self._count_failure()
            log.exception("could not encode %s; the next contribution of this fragment carries its progress", key)
            self.queue.done(int(header["fragment"]))
            if self.after is not None:
                self.after()
            return
        self.finish(key, header, data, residual)

    def finish(self, key: str, header: dict[str, Any], data: bytes, residual: Tensors | None) -> None:
        """Upload an encoded contribution (retried), then hand its residual back and count it;
        then the fragment's next contribution may go."""
        try:
            self._finish(key, header, data, residual)
        finally:
            self.queue.done(int(header["fragment"]))
            if self.after is not None:
                self.after()

    def _finish(self, key: str, header: dict[str, Any], data: bytes, residual: Tensors | None) -> None:
        try:  # each attempt is a whole store call (retried inside); this waits out a longer outage
            created = retrying(lambda: self.store.put_if_absent(key, data), what=f"upload of {key}",
                               policy=OUTAGE_POLICY)
        except Exception as exc:  # noqa: BLE001 - an upload must never stop the learner
            self._count_failure()
            log.error("giving up on %s (%s): the next contribution of this fragment carries its progress", key, exc)
            return
        if not created:
            log.warning("contribution %s already exists with other content; dropped", key)
            return
        if residual is not None:
            self.on_residual(int(header["fragment"]), residual)
        with self.lock:
            self.stats.bytes_up += len(data)
            self.stats.num_contributions += 1

    def _count_failure(self) -> None:
        """One contribution given up: counted in the heartbeat (``uploads_failed``) for `status`."""
        with self.lock:
            self.stats.uploads_failed += 1

    def close(self) -> None:
        """Finish every queued upload, then stop (without threads: upload them here, in turn)."""
        if not self.threads:
            while (item := self.take_next()) is not None:
                self._upload(*item)
            return
        self.queue.close()
        for t in self.threads:
            t.join()
