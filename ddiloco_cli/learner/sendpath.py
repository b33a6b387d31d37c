"""The learner's send path ([L5], [L6]): the base every contribution is measured against
(loaded at start), a fragment's outer gradient ``Theta_base - theta`` with the codec's
residual of the last one added (error feedback), the send schedule's phase, and the flush
of unsent progress before leaving. ``DiLoCoSync`` is built on it; the state it reads (the
uploader, the island, the plan, the counters, the readers) is DiLoCoSync's."""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

import torch

from ddiloco_cli.errors import DdilocoError
from ddiloco_cli.learner import allocator
from ddiloco_cli.learner.island import _is_dtensor
from ddiloco_cli.learner.schedule import aligned_offset
from ddiloco_cli.learner.session import running_phases
from ddiloco_cli.numerics import native
from ddiloco_cli.protocol import layout, ledger, records, signing
from ddiloco_cli.protocol.fragments import FragmentPlan
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


def _plain_fp32(t: torch.Tensor | None, shape: torch.Size) -> bool:
    return (t is not None and t.dtype is torch.float32 and t.device.type == "cpu" and t.is_contiguous()
            and t.shape == shape and not _is_dtensor(t))


def fused_outer_gradient(plan: FragmentPlan, p: int, params: dict[str, torch.Tensor], base: Tensors,
                         residual: Tensors | None) -> tuple[Tensors, Tensors] | None:
    """(theta, delta) of fragment p as the send makes them, in one pass of the compiled kernel
    a slice (``outer_delta``, the GIL released) rather than a gather and two ``_foreach`` passes:
    theta a copy of the fragment, delta = (base - theta) + residual. The same fp32 operations,
    so the same bits. None (the caller then takes the general way) without the kernels or when a
    slice is not a plain fp32 CPU tensor (bf16 models, devices, DTensors) or the base or the
    residual does not match it."""
    kernels = native.kernels
    if kernels is None:
        return None
    parts = []
    for s in plan.fragments[p]:
        view = s.view_of(params[s.name]).detach()
        b = base.get(s.key)
        r = None if residual is None else residual.get(s.key)
        if not (_plain_fp32(view, view.shape) and _plain_fp32(b, view.shape)
                and (residual is None or _plain_fp32(r, view.shape))):
            return None
        parts.append((s.key, view, b, r))
    theta, delta = {}, {}
    for key, view, b, r in parts:
        t, d = torch.empty(view.shape, dtype=torch.float32), torch.empty(view.shape, dtype=torch.float32)
        kernels.outer_delta(view.numpy(), b.numpy(), None if r is None else r.numpy(), t.numpy(), d.numpy())
        theta[key], delta[key] = t, d
    return theta, delta


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
        learner received, not its bf16 rounding."""
        if not self.island.io:
            return self.island.gather(self.plan, p, self.params)
        base_version, base_value = self.base[p]
        with self._residual_lock:  # held while read: the upload thread updates a residual in place
            # the part of the last contribution the codec did not carry [L6]
            residual = self._residual.get(p)
            decay = self.config.error_feedback_decay  # < 1: a decayed accumulator (SparseLoCo, docs/sparse.md)
            fused = None
            if self.island.world == 1 and (residual is None or decay == 1.0):
                fused = fused_outer_gradient(self.plan, p, self.params, base_value, residual)
            if fused is not None:
                theta, delta = fused
            else:
                theta = self.island.gather(self.plan, p, self.params)
                delta = dict(zip(theta, torch._foreach_sub([base_value[k] for k in theta], list(theta.values()))))
                if residual is not None and decay == 1.0:
                    torch._foreach_add_([delta[k] for k in theta], [residual[k] for k in theta])
                elif residual is not None:
                    torch._foreach_add_([delta[k] for k in theta], [residual[k] for k in theta], alpha=decay)
        c_steps, c_tokens = self.counters.snapshot(p)
        header = records.make(
            "contribution", run_id=self.run_id, fragment=p, learner_id=self.learner_id, seq=seq,
            base_version=base_version, c_tokens=c_tokens, c_steps=max(1, c_steps), step=step,
            nonce=records.new_nonce(), created_s=self.clock.time(),
        )
        self.stats.blocked_s += self._uploader.submit(layout.contribution_key(p, self.learner_id, seq), delta, header)
        return theta

    def _keep_residual(self, fragment: int, residual: Tensors) -> None:
        """Upload thread: the residual of fragment's newest uploaded contribution replaces the last
        one (that contribution carried the last one in its delta). Copied into the fragment's
        first one, which lives for the whole session: a new block a fragment every H steps,
        freed H steps later among the thread's short-lived ones, grew the thread's heap by
        fragmentation (docs/results.md, "Learner overhead")."""
        with self._residual_lock:
            self._residual[fragment] = copied_into(self._residual.get(fragment), residual)
