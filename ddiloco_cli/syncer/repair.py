"""The syncer's ledger repair: a manifest key whose object the syncer can PROVE wrong is put
right; what it cannot prove stays an alert (PROTOCOL.md [V1], "Ledger damage").

Two cases, both only by the lease holder (every delete and create goes through the fenced
store, which checks the fence right before any write to a manifest key):

* **A, the next version's key is taken by junk.** The create of version n+1 failed, and the
  object there is not a valid manifest of (this run, this fragment, version n+1, signed by
  an admitted syncer key where signatures are required): every reader rejects it, so no
  valid n+1 exists. The syncer deletes exactly those bytes (read again just before) and
  retries its create once. A *valid* n+1 is never touched: the syncer lost the race.
* **B, the newest manifest it committed is not there any more as it wrote it.** Deleted, or
  replaced by other bytes: the syncer holds the bytes it created (proof: it wrote them
  under its epoch), so it deletes whatever is there and creates them again.

Each repair is logged, counted (``SyncStats.note_repair``: the heartbeat's ``num_repairs``
and ``repairs``, which ``status`` shows) and left for ``inspect --verify`` to find clean.
"""

from __future__ import annotations

import logging

from ddiloco_cli.errors import ProtocolError
from ddiloco_cli.protocol import layout, ledger, records
from ddiloco_cli.store.base import NotFound
from ddiloco_cli.syncer.state import SyncContext

log = logging.getLogger(__name__)


class LedgerRepair:
    def __init__(self, ctx: SyncContext):
        self.ctx = ctx

    def _read(self, key: str) -> bytes | None:
        """The object at ``key`` (None: there is none). One over the store's bound for a
        manifest key reads as b"" (no manifest is that big: not a valid one)."""
        try:
            return self.ctx.store.get(key)
        except NotFound:
            return None
        except ProtocolError:
            return b""

    def _is_valid(self, p: int, version: int, data: bytes) -> bool:
        """Whether a reader accepts ``data`` as the manifest of ``version`` of fragment ``p``
        (``ledger.parse_manifest``: schema, fragment, version, run, names, signature). A newer
        protocol's counts as valid: a newer syncer may have written it; this one cannot judge it."""
        where = f"{self.ctx.store.url}/{layout.manifest_key(p, version)}"
        try:
            ledger.parse_manifest(data, p, version, where=where, run_id=self.ctx.run_id, trust=self.ctx.trust)
        except records.NewerProtocolError:
            return True
        except ProtocolError:
            return False
        return True

    def clear_invalid(self, p: int, version: int) -> bool:
        """Case A: after a failed create of ``version``, delete the object at its key if it is
        provably not a valid manifest of it. True when the key is free for one more create
        (deleted, or gone meanwhile); False when the race is lost: a valid manifest is there,
        or the object changed under us (then the caller re-reads, as after any lost race)."""
        store = self.ctx.store
        key = layout.manifest_key(p, version)
        data = self._read(key)
        if data is None:
            return True
        if self._is_valid(p, version, data) or any(v > version for v in ledger.list_versions(store, p)):
            return False  # a valid one, or not the newest key (the middle of a ledger: nothing to prove)
        if self._read(key) != data:  # read again just before the delete
            return False
        log.warning("fragment %d: %s/%s is not a valid manifest of version %d (every reader rejects it); "
                    "deleting it and committing this syncer's own", p, store.url, key, version)
        store.delete(key)  # fenced (a manifest key: the fence is checked right before): only the lease holder
        self.ctx.stats.note_repair(f"fragment {p} version {version}: deleted an invalid object at {key} "
                                   "and committed its own manifest")
        return True

    def restore_held(self, p: int, version: int, held: bytes) -> bool:
        """Case B: ``held`` are the bytes of the manifest of ``version`` this syncer created; if
        the object at its key is gone or other bytes, put ``held`` back. True when repaired."""
        store = self.ctx.store
        key = layout.manifest_key(p, version)
        now = self._read(key)
        if now == held:
            return False
        if now is None:
            log.warning("fragment %d: manifest %s/%s is gone; putting back the one this syncer committed",
                        p, store.url, key)
            what = "put back its deleted manifest"
        else:
            log.warning("fragment %d: %s/%s is not the manifest this syncer committed there (replaced); "
                        "deleting it and putting back its own", p, store.url, key)
            store.delete(key)  # fenced: only the lease holder gets here
            what = "replaced an object that was not the manifest it committed"
        if not store.put_if_absent(key, held):
            log.error("fragment %d: could not put back %s/%s (created again meanwhile); checking again later",
                      p, store.url, key)
            return False
        self.ctx.stats.note_repair(f"fragment {p} version {version}: {what} ({key})")
        return True
