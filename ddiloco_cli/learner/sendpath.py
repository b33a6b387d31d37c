"""The learner's send path ([L5], [L6]): the base every contribution is measured against
(loaded at start), a fragment's outer gradient ``Theta_base - theta`` with the codec's
residual of the last one added (error feedback), the send schedule's phase, and the flush
of unsent progress before leaving. ``DiLoCoSync`` is built on it; the state it reads (the
uploader, the island, the plan, the counters, the readers) is DiLoCoSync's."""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Callable

import torch

from ddiloco_cli.errors import DdilocoError
from ddiloco_cli.learner import allocator
from ddiloco_cli.learner.island import _is_dtensor
from ddiloco_cli.learner.schedule import aligned_offset
from ddiloco_cli.learner.session import running_phases
from ddiloco_cli.numerics import native
from ddiloco_cli.protocol import layout, ledger, records, signing
from ddiloco_cli.protocol.fragments import landed
from ddiloco_cli.protocol.published import FragmentReader, reads_concurrently
from ddiloco_cli.store.base import Store

log = logging.getLogger("ddiloco_cli.learner.sync")  # the learner's lines keep their logger name

Tensors = dict[str, torch.Tensor]


BOOTSTRAP_THREADS = 8  # fragments a starting learner reads at once


def copied_into(kept: Tensors | None, new: Tensors) -> Tensors:
    """``new``'s values in ``kept``'s tensors (copied in; returns ``kept``), or ``new`` itself
    when there are none yet: a fragment's base and residual live in one set of tensors for the
    session (a new block every H steps, freed H steps later among a worker thread's short-lived
    ones, grew that thread's heap by fragmentation: docs/results.md, "Learner overhead")."""
    if kept is None or kept is new or kept.keys() != new.keys():
        return new
    torch._foreach_copy_(list(kept.values()), [new[k] for k in kept])
    return kept


def _plain_fp32(t: torch.Tensor | None, shape: torch.Size | None = None) -> bool:
    """A contiguous fp32 CPU tensor (of ``shape`` when given): one the compiled kernels read."""
    return (t is not None and t.dtype is torch.float32 and t.device.type == "cpu" and t.is_contiguous()
            and (shape is None or t.shape == shape) and not _is_dtensor(t))


def outer_gradient(theta: Tensors, base: Tensors, residual: Tensors | None, *, decay: float = 1.0) -> Tensors:
    """delta = (base - theta) + decay * residual (without the residual when None), per key of
    theta: a contribution's outer gradient with error feedback [L6]. One pass of the compiled
    kernel a tensor (``outer_delta``, the GIL released) where it applies (decay 1, plain fp32 CPU
    tensors), else two ``_foreach`` ops; the same fp32 operations, so the same bits."""
    theta = landed(theta)  # a send's device-to-host copies (CUDA) are over
    keys = list(theta)
    kernels = native.kernels
    if kernels is not None and (residual is None or decay == 1.0) and all(
            _plain_fp32(theta[k]) and _plain_fp32(base.get(k), theta[k].shape)
            and (residual is None or _plain_fp32(residual.get(k), theta[k].shape)) for k in keys):
        out = {}
        for k in keys:
            d = out[k] = torch.empty(theta[k].shape, dtype=torch.float32)
            kernels.outer_delta(theta[k].numpy(), base[k].numpy(), None if residual is None else residual[k].numpy(),
                                d.numpy())
        return out
    delta = dict(zip(keys, torch._foreach_sub([base[k] for k in keys], [theta[k] for k in keys])))
    if residual is not None:
        torch._foreach_add_([delta[k] for k in keys], [residual[k] for k in keys], alpha=decay)
    return delta


class PendingDelta:
    """A contribution's outer gradient, computed by the upload thread when it encodes the
    contribution (``materialize``) rather than by the training thread at the send: the send
    only copies the fragment out (theta). ``compute(theta, base)`` makes it, with the residual
    of the fragment's last uploaded contribution ([L6]: that upload is over by then, the
    uploader handing out one fragment's contributions in order). ``done`` once made (its
    tensors then let go): until then a receive must not write the base's tensors in place
    (``SendPath._lent``)."""

    def __init__(self, theta: Tensors, base: Tensors, compute: Callable[[Tensors, Tensors], Tensors]):
        self.theta, self.base, self._compute = theta, base, compute
        self.done = False

    def materialize(self) -> Tensors:
        try:
            return self._compute(self.theta, self.base)
        finally:
            # kept (``SendPath._pending``) until the fragment's next send: without its tensors, or
            # every fragment's theta would stay alive a cycle longer than its receive needs it
            self.theta = self.base = None  # type: ignore[assignment]
            self.done = True


def read_newest(store: Store, readers: dict[int, FragmentReader]) -> list[tuple[int, Tensors]]:
    """(the newest committed version, its published value) of fragments 0.. of ``readers``, read
    concurrently (each by its own reader) unless the store asks for one read at a time: on a
    distant bucket a joining learner waits for the slowest fragment's chain of round trips, not
    for the sum of them."""
    def newest(p: int) -> tuple[int, Tensors]:
        v = ledger.latest_version(store, p)
        if v is None:
            raise DdilocoError(f"fragment {p} has no committed version at {store.url}")
        return v, readers[p].read(v)

    if reads_concurrently(store) and len(readers) > 1:
        with ThreadPoolExecutor(max_workers=min(len(readers), BOOTSTRAP_THREADS),
                                thread_name_prefix="ddiloco-bootstrap") as pool:
            return list(pool.map(newest, range(len(readers))))
    return [newest(p) for p in range(len(readers))]


class SendPath:
    """The send half of ``DiLoCoSync`` (a base class: the methods use its attributes)."""

    def flush(self) -> list[int]:
        """Send every fragment's progress not sent yet (the steps since its last send): a
        learner that finishes, reaches --steps or leaves on SIGTERM loses no trained step.
        ``close`` calls it (not in lock-step mode, where a partial contribution would be a
        merge of its own). Returns the fragments sent."""
        sent = []
        for p in range(self.plan.num_fragments):
            steps, _ = self.counters.snapshot(p)
            flight = self.in_flight.get(p)
            if steps - (flight.counters[0] if flight is not None else 0) <= 0:
                continue
            self.seq += 1
            self._send(p, self.seq, self.stats.step)  # on the same base as the one in flight: supersedes it
            sent.append(p)
        if sent:
            log.info("sent the unsent progress of fragments %s before leaving (step %d)", sent, self.stats.step)
        return sent

    def _aligned_offset(self, trust: signing.Trust) -> int:
        """The schedule offset that puts this learner's sends in phase with the live learners'
        (``session.running_phases``), so that learners of one speed send each fragment together
        and are merged at once; 0 when the heartbeats cannot be read."""
        phases = running_phases(self.store, learner_id=self.learner_id, config=self.config, trust=trust)
        if phases is None:
            return 0
        offset = aligned_offset(self.stats.step, phases, sync_every=self.H)
        if phases:
            log.info("schedule offset %d: in phase with %d running learner(s)", offset, len(phases))
        return offset

    def _bootstrap(self) -> None:
        """Load the latest committed version of every fragment into the model (``read_newest``)."""
        P = self.plan.num_fragments
        latest: list[tuple[int, Tensors]] = [(-1, {})] * P
        if self.island.io:
            before = sum(r.bytes_down for r in self.readers.values())
            latest = read_newest(self.store, self.readers)
            self.stats.bytes_down += sum(r.bytes_down for r in self.readers.values()) - before
        for p in range(P):
            v, value = self.island.broadcast(self.plan, p, *latest[p])
            self.island.scatter(self.plan, p, self.params, value)
            self.base[p] = (v, value)
            self.stats.versions[p] = v
        if self.opts.threads:  # a learner process (a driver without threads, the simulation, runs many)
            allocator.release_free()  # what the cold read's threads fetched, before the first step

    def _send(self, p: int, seq: int, step: int) -> Tensors:
        """Queue the outer gradient delta = Theta_base - theta of fragment p; returns
        theta. Both are fp32: for a bf16 model the base is the fp32 published value the
        learner received, not its bf16 rounding. In one process (no torchrun) the upload
        thread computes delta (``PendingDelta``); this thread only copies theta out, and on
        CUDA does not wait for that copy (``gather_fragment``'s ``non_blocking``: its readers
        wait, ``landed``), so a send does not stall the host until the device has run the step."""
        if self._io is not None:  # the io helper computes delta: the fragment is copied into a shared block
            theta, waited = self._io.snapshot(p, self.params)
            self.stats.blocked_s += waited
        else:
            theta = self.island.gather(self.plan, p, self.params, non_blocking=True)
        if not self.island.io:
            return theta
        base_version, base_value = self.base[p]
        delta: Tensors | PendingDelta
        if self._io is not None:
            delta = theta
        elif self._deferred:  # the upload thread computes it: only the copy-out above on the training thread
            delta = self._pending[p] = PendingDelta(theta, base_value, partial(self._outer_gradient, p))
        else:
            delta = self._outer_gradient(p, theta, base_value)
        c_steps, c_tokens = self.counters.snapshot(p)
        header = records.make(
            "contribution", run_id=self.run_id, fragment=p, learner_id=self.learner_id, seq=seq,
            base_version=base_version, c_tokens=c_tokens, c_steps=max(1, c_steps), step=step,
            nonce=records.new_nonce(), created_s=self.clock.time(),
        )
        self.stats.blocked_s += self._uploader.submit(layout.contribution_key(p, self.learner_id, seq), delta, header)
        return theta

    def _outer_gradient(self, p: int, theta: Tensors, base: Tensors) -> Tensors:
        """Fragment p's outer gradient against ``base`` with the part of its last uploaded
        contribution that the codec did not carry [L6], read under the lock the upload thread
        holds while it updates that residual in place."""
        with self._residual_lock:
            # decay < 1: a decayed accumulator (SparseLoCo, docs/sparse.md)
            return outer_gradient(theta, base, self._residual.get(p), decay=self.config.error_feedback_decay)

    def _lent(self, p: int) -> bool:
        """Whether an upload still has to compute an outer gradient of p from the base's tensors
        (the newest of p's sends: the uploader takes them in order)."""
        pending = self._pending.get(p)
        return pending is not None and not pending.done

    def _keep_residual(self, fragment: int, residual: Tensors) -> None:
        """Upload thread: the residual of fragment's newest uploaded contribution replaces the last
        one (that contribution carried the last one in its delta). Copied into the fragment's
        first one, which lives for the whole session: a new block a fragment every H steps,
        freed H steps later among the thread's short-lived ones, grew the thread's heap by
        fragmentation (docs/results.md, "Learner overhead")."""
        with self._residual_lock:
            self._residual[fragment] = copied_into(self._residual.get(fragment), residual)
