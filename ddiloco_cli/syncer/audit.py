"""The ledger audit: every contribution ends in exactly one ledger entry.

``audit_ledger`` reads the retained manifests and the contribution listing of
each fragment and checks the no-silent-loss rule (PROTOCOL.md [W9]):

* no contribution is in more than one ledger entry;
* every entry has a status: ``used``, ``superseded`` with ``carried_by`` naming
  a newer contribution of the same learner that is in the ledger too (or still
  pending), or ``refused`` with a ``reason``;
* every contribution in the bucket is in the ledger, or quarantined (invalid: the
  report is its record), or still pending (above its learner's high-water mark),
  or retired (accounted for before the oldest retained manifest). One that its
  learner's high-water mark passed without any of these was lost.
* every used contribution (and the earlier one an increment is taken from) of the
  versions after the fragment's newest checkpoint is still in the bucket: a
  restarting syncer replays those merges from the ledger [M4].

It also totals the tokens of used entries (``merged_token_fraction`` in the
convergence benchmark). Used by ``ddiloco inspect --verify``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

from ddiloco_cli.errors import ProtocolError
from ddiloco_cli.protocol import layout, ledger
from ddiloco_cli.protocol.typed_records import REFUSED, SUPERSEDED, USED, LedgerEntry, Manifest
from ddiloco_cli.store.base import NotFound, Store
from ddiloco_cli.syncer.update import Decision


@dataclass
class LedgerAudit:
    counts: dict[str, int] = field(default_factory=lambda: {USED: 0, SUPERSEDED: 0, REFUSED: 0, "quarantined": 0,
                                                            "pending": 0, "retired": 0})
    used_tokens: dict[int, int] = field(default_factory=dict)  # fragment -> sum of c_tokens of used entries
    problems: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"counts": self.counts, "used_tokens": {str(p): t for p, t in self.used_tokens.items()},
                "problems": self.problems}


def audit_ledger(store: Store, *, run_id: str, fragments: Iterable[int]) -> LedgerAudit:
    out = LedgerAudit()
    reports = {i.key for i in store.list("quarantine/")}  # compared with layout.quarantine_key(key)
    for p in fragments:
        _audit_fragment(store, run_id=run_id, p=p, out=out, reports=reports)
    return out


@dataclass
class _Ledger:
    """One fragment's retained ledger, as the audit reads it."""

    entries: dict[str, list[int]] = field(default_factory=dict)  # contribution key -> versions naming it
    by_seq: set[tuple[str, int]] = field(default_factory=set)
    supersedes: list[tuple[int, LedgerEntry]] = field(default_factory=list)
    used_by_version: dict[int, tuple[LedgerEntry, ...]] = field(default_factory=dict)
    first_hw: dict[str, int] = field(default_factory=dict)
    last_hw: dict[str, int] = field(default_factory=dict)


def _audit_fragment(store: Store, *, run_id: str, p: int, out: LedgerAudit, reports: set[str]) -> None:
    versions = ledger.list_versions(store, p)
    if not versions:
        return
    out.used_tokens.setdefault(p, 0)
    book = _read_ledger(store, run_id=run_id, p=p, versions=versions, out=out)
    if book is None:
        return
    listed = {}
    for info in store.list(layout.contribution_prefix(p)):
        parsed = layout.parse_contribution_key(info.key)
        if parsed is not None:
            listed[info.key] = parsed
    _check_replay_inputs(store, p=p, versions=versions, book=book, listed=listed, out=out)
    for key, vs in book.entries.items():
        if len(vs) > 1:
            out.problems.append(f"{key}: in {len(vs)} ledger entries (versions {vs}) of fragment {p}")
    for v, e in book.supersedes:
        carrier = (e.learner_id, e.carried_by)
        pending = e.carried_by > book.last_hw.get(e.learner_id, -1)
        if carrier not in book.by_seq and not pending:
            out.problems.append(f"{layout.manifest_key(p, v)}: {e.key} is superseded by seq {e.carried_by}, "
                                f"which is not in the ledger")
    for key, (_, learner_id, seq) in sorted(listed.items()):
        if key in book.entries:
            continue
        if layout.quarantine_key(key) in reports:
            out.counts["quarantined"] += 1
        elif seq > book.last_hw.get(learner_id, -1):
            out.counts["pending"] += 1
        elif seq <= book.first_hw.get(learner_id, -1):
            out.counts["retired"] += 1
        else:
            out.problems.append(f"{key}: lost: no ledger entry, but learner {learner_id}'s high-water mark "
                                f"({book.last_hw.get(learner_id)}) has passed it")


def _read_ledger(store: Store, *, run_id: str, p: int, versions: list[int], out: LedgerAudit) -> _Ledger | None:
    """Every retained manifest's decision (the same reading a replay applies), counted into
    ``out``; None (a problem reported) when one cannot be read."""
    book = _Ledger()
    for v in versions:
        try:
            decision = Decision.from_manifest(Manifest.from_json(ledger.read_manifest(store, p, v, run_id=run_id)),
                                              default_lr=0.0)
        except (NotFound, ProtocolError) as exc:
            out.problems.append(f"{layout.manifest_key(p, v)}: cannot audit its ledger ({exc})")
            return None
        if v == versions[0]:
            book.first_hw = dict(decision.high_water) if v > 0 else {}
        book.last_hw = dict(decision.high_water)
        if decision.used:
            book.used_by_version[v] = decision.used
        for e in decision.used + decision.closed:
            status = e.final_status
            book.entries.setdefault(e.key, []).append(v)
            book.by_seq.add((e.learner_id, e.seq))
            if status in out.counts:
                out.counts[status] += 1
            if status == USED:
                out.used_tokens[p] += e.tokens_merged
            elif status == REFUSED and not e.reason:
                out.problems.append(f"{layout.manifest_key(p, v)}: {e.key} is refused without a reason")
            elif status == SUPERSEDED and e.carried_by is not None:
                book.supersedes.append((v, e))
    return book


def _check_replay_inputs(store: Store, *, p: int, versions: list[int], book: _Ledger,
                         listed: dict[str, tuple[int, str, int]], out: LedgerAudit) -> None:
    """Every contribution a replay from the newest checkpoint merges again, and each one's base
    version, must still be in the bucket [M4]."""
    checkpoints = [parsed[1] for info in store.list(layout.checkpoint_prefix(p))
                   if (parsed := layout.parse_checkpoint_key(info.key)) is not None and parsed[1] <= versions[-1]]
    replay_from = max(checkpoints, default=0)
    present = set(versions)
    needed: list[tuple[int, str]] = []  # (version, key) a replay from the newest checkpoint reads
    for v, used in sorted(book.used_by_version.items()):
        if v <= replay_from:
            continue
        needed += [(v, e.key) for e in used]
        for b in sorted({int(e.base_version) for e in used} - present):
            out.problems.append(f"{layout.manifest_key(p, b)}: the base of a contribution used by version {v} "
                                f"and gone, but a restarting syncer replays that merge from checkpoint "
                                f"{replay_from} against it")
    for v, key in needed:
        if key not in listed:
            out.problems.append(f"{key}: used by version {v} of fragment {p} and gone, but a restarting syncer "
                                f"replays that merge from checkpoint {replay_from}: its momentum and residual "
                                f"would be lost")
