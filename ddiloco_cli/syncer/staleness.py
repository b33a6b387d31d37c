"""Staleness as other learners' work (PROTOCOL.md [M5]).

Each merge advances a fragment's cycle clock by the work it merges, ``Σ min(merged steps, H) /
(H · N)`` (``cycle_advance``): every used contribution counts for at most one cycle's send
(``H`` inner steps), so a catch-up that covers k cycles moves the clock as far as one honest
contribution, and no learner moves it further by claiming more steps. Each learner's part of
that advance is its *share* of the version (``version_shares``, derived from the manifest's
``used`` entries and ``cycle_advance`` alone, so a restarted syncer recomputes it).

A contribution of learner L on base b, judged at version c, is as stale as the work the
*other* learners merged since its base: ``Σ_{v = b+1..c} (advance(v) − share_L(v))``. A learner's
own earlier merges never make its next contribution stale (a single learner is never stale),
and after a syncer outage each learner's catch-up counts once for the others.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping

Shares = dict[str, float]  # learner id -> cycles of the clock its used contributions advanced a version by


def capped_steps(merged_steps: int, sync_every: int) -> int:
    """The steps of one used contribution that count for the clock: at most one cycle's send."""
    return min(max(0, int(merged_steps)), int(sync_every))


def cycle_advance(steps_by_learner: Iterable[tuple[str, int]], *, sync_every: int, num_learners: int) -> float:
    """How far a merge moves the clock: ``Σ capped_steps / (H · N)`` over its used contributions
    (``(learner id, merged steps)``), with N the learners taking part."""
    total = sum(capped_steps(s, sync_every) for _, s in steps_by_learner)
    return total / (sync_every * max(1, num_learners))


def entry_merged_steps(entry: Mapping[str, Any] | Any) -> int:
    """The merged steps of a used ledger entry (a dict or a ``LedgerEntry``): its ``c_steps`` less
    the ``c_steps`` of the contribution its ``increment_of`` names."""
    get = entry.get if isinstance(entry, Mapping) else (lambda k: getattr(entry, k))
    inc = get("increment_of")
    return int(get("c_steps") or 0) - (int(inc["c_steps"]) if inc else 0)


def version_shares(manifest: Mapping[str, Any], *, sync_every: int) -> tuple[float, Shares]:
    """(the version's clock advance, each learner's share of it) from its manifest, shared out
    by capped steps. Manifests without ``cycle_advance`` (older writers) count one cycle per
    version, as their clock does."""
    recorded = manifest.get("cycle_advance")
    advance = 1.0 if recorded is None else float(recorded)
    steps: Shares = {}
    for e in manifest.get("contributions", ()):
        if e.get("used"):
            steps[e["learner_id"]] = steps.get(e["learner_id"], 0) + capped_steps(entry_merged_steps(e), sync_every)
    total = sum(steps.values())
    if advance <= 0 or total <= 0:
        return advance, {}
    return advance, {lid: advance * s / total for lid, s in steps.items()}


def others_work(learner_id: str, *, base_version: int, version: int,
                shares_of: Callable[[int], tuple[float, Shares]], limit: float) -> float:
    """The cycles that learners other than ``learner_id`` merged into versions ``base_version + 1
    .. version`` (``shares_of(v)``: ``version_shares`` of v), newest first; stops once past
    ``limit`` (the contribution is refused anyway), so an old base reads few manifests."""
    behind = 0.0
    for v in range(version, base_version, -1):
        advance, shares = shares_of(v)
        behind += max(0.0, advance - shares.get(learner_id, 0.0))
        if behind > limit:
            break
    return behind
