"""The syncer's restore room: a fragment's state from the bucket (checkpoint + ledger
replay, ``replay.restore_value``), its high-water marks and each learner's last merged
contribution; re-reading a fragment another syncer advanced; putting back payloads a
replay proved and found gone."""

from __future__ import annotations

import logging

from ddiloco_cli.errors import DdilocoError, InvalidPayloadError, ProtocolError
from ddiloco_cli.protocol import ledger
from ddiloco_cli.protocol.published import keyframe_chain
from ddiloco_cli.protocol.typed_records import Manifest
from ddiloco_cli.store.base import NotFound
from ddiloco_cli.syncer.replay import restore_value
from ddiloco_cli.syncer.state import FragmentState, LedgerWindow, SyncContext

log = logging.getLogger(__name__)

RESTORE_RETRY_S = 30.0  # how often a fragment whose committed state is unreadable is tried again
TIP_WINDOW = 64  # versions searched on restore for each learner's last merged contribution


class Restorer:
    def __init__(self, ctx: SyncContext):
        self.ctx = ctx
        self.unavailable: dict[int, str] = {}  # fragments whose committed state cannot be read: why

    def try_restore(self, p: int) -> FragmentState | DdilocoError:
        """Fragment p's state; if its committed state cannot be read (a corrupt manifest or
        payload), log why and return the error, so the other fragments are still served
        (the syncer retries it every ``RESTORE_RETRY_S``)."""
        try:
            state = self.restore_fragment(p)
        except (NotFound, InvalidPayloadError, ProtocolError) as exc:
            error = exc if isinstance(exc, DdilocoError) else ProtocolError(f"fragment {p}: {exc}")
            if self.unavailable.get(p) != str(error):
                log.error("fragment %d cannot be served: %s (serving the others; retrying every %.0f s)",
                          p, error, RESTORE_RETRY_S)
            self.unavailable[p] = str(error)
            return error
        self.unavailable.pop(p, None)
        log.info("fragment %d at version %d (%d outer steps)", p, state.version, state.outer.num_steps)
        return state

    def restore_fragment(self, p: int) -> FragmentState:
        ctx = self.ctx
        reader = ctx.readers[p]
        latest = ledger.latest_version(ctx.store, p)
        if latest is None:
            raise ProtocolError(f"{ctx.store.url}: fragment {p} has no committed version (was `ddiloco init` "
                                "interrupted?)")
        value = restore_value(ctx.store, config=ctx.config, plan=ctx.plan, fragment=p, reader=reader,
                              fetch=ctx.intake.fetch_used, latest=latest, republish=self.republish_missing)
        reader.prefetch(range(latest, max(-1, latest - TIP_WINDOW), -1))  # the walks below, a batch at a time
        state = FragmentState(p, value, dict(Manifest.from_json(reader.manifest(latest)).high_water))
        if ctx.config.keyframe_rule == "size":
            state.chain = keyframe_chain(reader.manifest, latest)
        norms: list[float] = []  # newest first: the norm bound's running median, as the ledger recorded it
        named: set[str] = set()
        oldest: tuple[int, Manifest] | None = None  # the oldest manifest the walk read
        for v in range(latest, max(0, latest - TIP_WINDOW), -1):
            try:
                manifest = Manifest.from_json(reader.manifest(v))
            except (NotFound, ProtocolError):
                break
            oldest = (v, manifest)
            for e in reversed(manifest.contributions):
                named.add(e.key)
                if e.used:
                    state.tips.setdefault(e.learner_id, e)
                    if e.norm is not None:
                        norms.append(float(e.norm))
        state.norms.extend(reversed(norms[:state.norms.maxlen]))
        # its marks are the floor; none when the walk reached version 1 (it read every entry)
        floor = {} if oldest is None or oldest[0] == 1 else dict(oldest[1].high_water)
        state.ledger_window = LedgerWindow(frozenset(named), floor)
        return state

    def republish_missing(self, version: int, payloads: list[tuple[str, bytes]]) -> None:
        """Put back payloads of a replayed version that are gone from the bucket (deleted by
        hand or by a faulty tool): the replay proved the bytes are the ones the manifest
        names (sha256), so every reader can read that version again [M4]."""
        store = self.ctx.store
        for key, data in payloads:
            if not any(info.key == key for info in store.list(key)):
                log.warning("republishing %s/%s (payload of version %d, gone from the bucket)", store.url, key, version)
                if store.put_if_absent(key, data):
                    self.ctx.stats.bytes_out += len(data)

    def reload(self, state: FragmentState) -> bool:
        """Re-read a fragment someone else advanced; keep what is not in their ledger yet.
        False when its ledger cannot be read (a manifest that is not the version its key
        names, a gap, a payload gone): the fragment is then unavailable (the syncer stops
        serving it, alerts, and retries every RESTORE_RETRY_S); nothing is raised."""
        p = state.fragment
        try:
            fresh = self.restore_fragment(p)
        except (NotFound, InvalidPayloadError, ProtocolError) as exc:
            why = str(exc) if isinstance(exc, DdilocoError) else f"fragment {p}: {exc!r} is missing"
            log.error("fragment %d cannot be served: its ledger does not read back (%s); serving the others, "
                      "retrying every %.0f s; run `ddiloco inspect --verify`", p, why, RESTORE_RETRY_S)
            self.unavailable[p] = why
            return False
        hw = fresh.high_water
        state.current, state.high_water, state.chain = fresh.current, hw, fresh.chain
        state.shares, state.tips, state.ledger_window = fresh.shares, fresh.tips, fresh.ledger_window
        state.pending = {lid: kept for lid, cs in state.pending.items()
                         if (kept := [c for c in cs if c.seq > hw.get(lid, -1)])}
        state.closed = [e for e in state.closed if e.seq > hw.get(e.learner_id, -1)]
        state.listed = False  # another writer's ledger: its keys below the marks are judged by it, not as late
        return True
