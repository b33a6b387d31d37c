"""The syncer's commit room: apply a decision (``update.apply_decision``, the computation a
replay repeats), publish the new version's payloads, and commit its manifest create-only
through the fenced store; then move the fragment's state on and write a checkpoint when
one is due. A lost race (another syncer committed that version) reloads the fragment; a
non-finite update commits nothing and quarantines its culprit (``Judge.non_finite``)."""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from ddiloco_cli.errors import InvalidPayloadError, ProtocolError
from ddiloco_cli.protocol import layout, ledger, records, signing
from ddiloco_cli.protocol.published import EncodedVersion, payload_sizes, upload_payloads
from ddiloco_cli.protocol.typed_records import REFUSED, LedgerEntry
from ddiloco_cli.store.base import NotFound
from ddiloco_cli.syncer.decide import Decider
from ddiloco_cli.syncer.intake import Contribution
from ddiloco_cli.syncer.repair import LedgerRepair
from ddiloco_cli.syncer.replay import checkpoint_bytes
from ddiloco_cli.syncer.restore import Restorer
from ddiloco_cli.syncer.state import FragmentState, SyncContext
from ddiloco_cli.syncer.update import Decision, FragmentValue, NonFiniteUpdate, apply_decision

log = logging.getLogger(__name__)

Tensors = dict[str, torch.Tensor]
FRAGMENTS_ROOT = "fragments/"  # every fragment's manifests (and payloads) are under it (layout.fragment_prefix)


class _HeldInputs:
    """What a committing syncer's ``apply_decision`` reads: the decoded contributions it holds
    (by key) and its cache of base values."""

    def __init__(self, decider: Decider, state: FragmentState, contributions: list[Contribution]):
        self.decider, self.state = decider, state
        self.held = {c.key: c for c in contributions}

    def delta(self, entry: LedgerEntry) -> Tensors:
        return self.held[entry.key].delta

    def base(self, version: int) -> Tensors:
        return self.decider.base_value(self.state, version)


class Committer:
    def __init__(self, ctx: SyncContext, decider: Decider, restorer: Restorer, *, beat: Callable[[], None]):
        self.ctx, self.decider, self.restorer = ctx, decider, restorer
        self.beat = beat  # write the lease's heartbeat now
        self.committed_manifests: dict[int, tuple[int, bytes]] = {}  # per fragment: the last one we created
        self.repair = LedgerRepair(ctx)
        self._intact: dict[int, tuple[int, tuple[int, float]]] = {}  # per fragment: (version, (size, mtime)) read back

    def commit(self, state: FragmentState, *, grace_s: float) -> bool:
        """Merge the pending contributions into the next version. Returns False when nothing
        was committed: another syncer committed that version first (state reloaded), the
        update was not finite (the culprit is quarantined), or a base cannot be read now."""
        ctx = self.ctx
        t0 = ctx.clock.monotonic()
        contributions = state.contributions()
        try:
            decision = self.decider.decide(state, contributions, grace_s=grace_s)
            with ctx.stage("update"):
                new, encoded = apply_decision(state.current, decision, rules=ctx.rules,
                                              inputs=_HeldInputs(self.decider, state, contributions))
        except NonFiniteUpdate as exc:
            i, verdict = ctx.judge.non_finite([c.norm for c in contributions], exc)
            ctx.intake.quarantine(contributions[i].key, verdict.reason)
            state.drop(contributions[i])
            return False
        except (NotFound, ProtocolError, InvalidPayloadError) as exc:  # a base read between admit and now
            log.warning("fragment %d: a contribution's base cannot be read now (%s); merging later",
                        state.fragment, exc)
            return False
        if not self._publish(state, decision, new, encoded):
            return False
        self._committed(state, decision, new, encoded, contributions)
        dt = ctx.clock.monotonic() - t0
        stats = ctx.stats
        stats.sync_time_s = dt if stats.sync_time_s == 0 else 0.8 * stats.sync_time_s + 0.2 * dt
        log.info("fragment %d -> version %d (quorum %d, grace %.2fs, cycle %.2f, %.0f ms)", state.fragment,
                 new.version, decision.quorum_size, grace_s, new.cycle, dt * 1e3)
        return True

    def manifest(self, decision: Decision, new: FragmentValue, encoded: EncodedVersion) -> dict[str, Any]:
        """The manifest that commits ``decision``: the decision's fields, who commits, the payloads."""
        ctx = self.ctx
        p = decision.fragment
        manifest = records.make(
            "manifest", run_id=ctx.run_id, epoch=ctx.lease.epoch.epoch, syncer_id=ctx.syncer_id,
            nonce=records.new_nonce(), created_s=ctx.clock.time(), numel=ctx.plan.fragment_numel(p),
            payloads=[e for _, _, e in encoded.payloads], outer_steps=new.outer.num_steps,
            **decision.manifest_fields())
        if ctx.signer is not None:  # [A5]
            manifest = signing.sign_record(manifest, run_id=ctx.run_id, key=layout.manifest_key(p, new.version),
                                           signer=ctx.signer)
        return manifest

    def _publish(self, state: FragmentState, decision: Decision, new: FragmentValue,
                 encoded: EncodedVersion) -> bool:
        """Upload the payloads, then create the manifest; False (state reloaded) when another
        syncer committed that version first."""
        ctx = self.ctx
        manifest = self.manifest(decision, new, encoded)
        self._put_back_previous(state)
        with ctx.stage("commit"):
            ctx.stats.bytes_out += upload_payloads(ctx.store, encoded)
            ctx.lease.before_commit(self.beat)
            won = ledger.commit_manifest(ctx.store, manifest)
            if not won and self.repair.clear_invalid(state.fragment, new.version):  # case A: junk at the key
                won = ledger.commit_manifest(ctx.store, manifest)  # once: a second loss is an ordinary one
        if won:
            self.committed_manifests[state.fragment] = (new.version, records.dumps(manifest))
        if not won:
            ctx.lease.check_fence()
            log.warning("fragment %d: version %d was committed by another syncer; reloading", state.fragment,
                        new.version)
            self.restorer.reload(state)
        return won

    def _put_back_previous(self, state: FragmentState) -> None:
        """Case B of ``repair``: a newest manifest gone from the bucket (deleted by hand or a
        faulty tool) or replaced by other bytes would leave a gap or junk under the version
        about to be committed, and learners could not read past it. The syncer holds the
        bytes of the last manifest it created: it puts them back (proof enough: it wrote them,
        under its epoch). One GET per commit (and per ``check_held``)."""
        held = self.committed_manifests.get(state.fragment)
        if held is not None and held[0] == state.version:
            self.repair.restore_held(state.fragment, held[0], held[1])

    def check_held(self, states: dict[int, FragmentState]) -> None:
        """``_put_back_previous`` for every fragment served (the syncer's periodic ledger check:
        a damaged newest manifest is repaired even while no contribution arrives). One LIST of
        the fragments' objects; a GET only for a manifest whose size or mtime is not the one
        seen when it was last read back intact (so an idle fragment costs no request)."""
        held = {p: h for p, h in self.committed_manifests.items() if p in states and h[0] == states[p].version}
        if not held:
            return
        prefix = layout.manifest_prefix(next(iter(held))) if len(held) == 1 else FRAGMENTS_ROOT
        listed = {info.key: (info.size, info.mtime_s) for info in self.ctx.store.list(prefix)}
        for p, (v, data) in sorted(held.items()):
            seen = listed.get(layout.manifest_key(p, v))
            if seen is not None and self._intact.get(p) == (v, seen):
                continue
            if not self.repair.restore_held(p, v, data) and seen is not None:
                self._intact[p] = (v, seen)

    def _committed(self, state: FragmentState, decision: Decision, new: FragmentValue, encoded: EncodedVersion,
                   contributions: list[Contribution]) -> None:
        """Move ``state`` to the version just committed."""
        ctx = self.ctx
        self.decider.remember_base(state, state.version, state.current.published)
        state.current = new
        if state.chain is not None:
            state.chain = state.chain.after(new.version, payload_sizes([e for _, _, e in encoded.payloads]))
        for e in decision.used:
            state.tips[e.learner_id] = e
        self.decider.remember_shares(state, decision)
        state.high_water = dict(decision.high_water)
        state.norms.extend(c.norm * c.clip for c in contributions)  # as merged: a clipped one counts at the bound
        for c in contributions:
            why = [f"norm clipped to {c.clip:.2g}x" if c.clip < 1.0 else "",
                   f"share capped to {c.share_cap:.2g}x" if c.share_cap < 1.0 else ""]
            ctx.stats.note_bounded(c.learner_id, ", ".join(w for w in why if w) or None)
        for e in decision.closed:
            if e.status == REFUSED:
                ctx.stats.note_bounded(e.learner_id, f"refused: {e.reason}"[:300])
        state.pending.clear()
        state.closed.clear()
        state.merged_since_poll = True
        state.first_pending_t = state.quorum_t = None
        state.last_quorum_size, state.last_grace_s = decision.quorum_size, decision.grace_s
        ctx.stats.num_merges += 1
        if new.version % ctx.config.checkpoint_every == 0:
            with ctx.stage("checkpoint"):
                self.write_checkpoint(state)

    def write_checkpoint(self, state: FragmentState) -> None:
        ctx = self.ctx
        key, data = checkpoint_bytes(state.current, run_id=ctx.run_id, fragment=state.fragment,
                                     epoch=ctx.lease.epoch.epoch)
        ctx.store.put_if_absent(key, data)
        ctx.stats.bytes_out += len(data)
