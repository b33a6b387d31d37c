"""Garbage collection (PROTOCOL.md, "Garbage collection").

For each fragment, with ``latest`` its newest version and ``ckpt`` the newest
outer-optimizer checkpoint at or below it, everything from

    keep_from = keyframe_floor(min(latest - retain_versions + 1, ckpt, staleness_floor))

on is kept (keyframe_floor: the newest version at or below with a full payload, found by the
run's keyframe rule): the manifests and payloads a reader needs for any recent version
(a keyframe plus the deltas after it), and the ledger plus contributions a
restarting syncer needs to replay from its checkpoint, and the manifests of
the versions a pending contribution may still name as its base (their cycle
clock is within max_staleness cycles of the latest: replay.staleness_floor), and the bases of
the contributions a replay from ``ckpt`` merges again (replay.replay_base_floor). Older manifests and
payloads go; contributions go once merged (or superseded) at or before
``ckpt``; orphans (payloads no manifest names, quarantined inputs, older
checkpoints, clock probes, temp files of writes that died midway) go only
after ``gc_grace_s`` so that a writer still in flight never loses its object;
a grace that is not positive never reaches GC (``RunConfig`` refuses it). Manifests are deleted before their payloads,
oldest first, so every remaining manifest stays readable.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from ddiloco_cli.errors import InvalidPayloadError, ProtocolError
from ddiloco_cli.protocol import layout, ledger
from ddiloco_cli.protocol.fragments import FragmentPlan
from ddiloco_cli.protocol.published import keyframe_chain
from ddiloco_cli.protocol.runconfig import RunConfig
from ddiloco_cli.store.base import NotFound, ObjectInfo, Store
from ddiloco_cli.syncer.replay import decode_checkpoint, replay_base_floor, staleness_floor

log = logging.getLogger(__name__)


@dataclass
class GCReport:
    deleted: list[str] = field(default_factory=list)
    bytes_freed: int = 0
    keep_from: dict[int, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"num_deleted": len(self.deleted), "bytes_freed": self.bytes_freed,
                "keep_from": {str(p): v for p, v in self.keep_from.items()}}


_VALID_CHECKPOINTS: set[tuple[str, str]] = set()  # (store url, key): checked once per process
# (store url, run id, fragment, version): its manifest's payload entries (manifests are create-only,
# so read once per process; bounded)
_PAYLOADS: dict[tuple[str, str, int, int], list[dict[str, Any]]] = {}
_PAYLOADS_MAX = 1 << 16


def _checkpoint_ok(store: Store, key: str, *, run_id: str, plan: FragmentPlan, fragment: int) -> bool:
    if (store.url, key) in _VALID_CHECKPOINTS:
        return True
    try:  # the plan's shapes bound what is decoded: a checkpoint declaring terabytes is just invalid
        _, meta = decode_checkpoint(store.get(key), plan=plan, fragment=fragment, where=key)
    except (NotFound, InvalidPayloadError, ProtocolError) as exc:
        log.warning("gc: ignoring checkpoint %s: %s", key, exc)
        return False
    if meta["run_id"] != run_id:
        return False
    _VALID_CHECKPOINTS.add((store.url, key))
    return True


def keep_from_version(*, latest: int, newest_checkpoint: int, retain_versions: int, floor: int,
                      keyframe_floor: Callable[[int], int] | None) -> int:
    """The oldest version GC keeps for a fragment (see the module docstring); ``floor`` is the
    oldest version a pending contribution or a replay may still read as a base;
    ``keyframe_floor(v)`` the newest keyframe at or below v (None: every version is one)."""
    keep = max(0, min(latest - retain_versions + 1, newest_checkpoint, floor))
    return keep if keyframe_floor is None else keyframe_floor(keep)  # where the retained delta chain starts


def collect_garbage(store: Store, *, config: RunConfig, fragments: Iterable[int] | None = None,
                    dry_run: bool = False) -> GCReport:
    """Delete what run ``config`` no longer needs in ``fragments`` (default: all); with
    ``dry_run`` only report it. ``config.gc_grace_s`` is positive: RunConfig refuses
    anything else, since with no grace GC deletes the objects of commits still in flight."""
    frags = list(fragments) if fragments is not None else list(range(config.num_fragments))
    gc = _Collector(store, config=config, dry_run=dry_run)
    for p in frags:
        gc.fragment(p)
    gc.quarantined_inputs(frags)
    for info in store.list(layout.CLOCK_PREFIX):
        if gc.old(info):
            gc.drop(info)
    for info in store.remove_stale_temp(older_than_s=config.gc_grace_s, dry_run=dry_run):
        gc.report.deleted.append(info.key)
        gc.report.bytes_freed += info.size
    return gc.report


class _Collector:
    """One pass of ``collect_garbage``: what it deletes (or, dry, would) goes in ``report``."""

    def __init__(self, store: Store, *, config: RunConfig, dry_run: bool):
        self.store, self.config, self.dry_run = store, config, dry_run
        self.run_id = config.run_id
        self.report = GCReport()
        self.now_s = store.now()
        self.plan = ledger.read_plan(store, run_id=self.run_id)

    def drop(self, info: ObjectInfo) -> None:
        self.report.deleted.append(info.key)
        self.report.bytes_freed += info.size
        if not self.dry_run:
            self.store.delete(info.key)

    def old(self, info: ObjectInfo) -> bool:
        return self.now_s - info.mtime_s > self.config.gc_grace_s

    def fragment(self, p: int) -> None:
        store, config, run_id = self.store, self.config, self.run_id
        versions = ledger.list_versions(store, p)
        if not versions:
            return
        latest = versions[-1]
        checkpoints = [(layout.parse_num(i.key), i) for i in store.list(layout.checkpoint_prefix(p))]
        checkpoints = [(v, i) for v, i in checkpoints if v is not None and v <= latest]
        # only a checkpoint that decodes counts: a corrupt one must not license deleting the ledger behind it
        newest_ckpt = max((v for v, i in checkpoints if _checkpoint_ok(store, i.key, run_id=run_id,
                                                                      plan=self.plan, fragment=p)), default=0)
        floor = staleness_floor(store, run_id=run_id, fragment=p, latest=latest,
                                max_staleness=float(config.max_staleness))
        # a replay reads the bases of what it merges again
        floor = min(floor, replay_base_floor(store, run_id=run_id, fragment=p, checkpoint=newest_ckpt, latest=latest))
        keep = keep_from_version(latest=latest, newest_checkpoint=newest_ckpt,
                                 retain_versions=config.retain_versions, floor=floor,
                                 keyframe_floor=self._keyframe_floor(p, versions))
        self.report.keep_from[p] = keep
        referenced, high_water = self._retained(p, versions, keep=keep, newest_ckpt=newest_ckpt)
        for info in store.list(layout.manifest_prefix(p)):
            v = layout.parse_num(info.key)
            if v is not None and v < keep:
                self.drop(info)
        for info in store.list(layout.payload_prefix(p)):
            v = layout.parse_num(info.key)
            if v is None:
                continue
            if v < keep or (referenced is not None and info.key not in referenced and self.old(info)):
                self.drop(info)
        newest_key = max((i.key for v, i in checkpoints if v == newest_ckpt), default=None)
        for v, info in checkpoints:
            if info.key != newest_key and self.old(info):
                self.drop(info)
        for info in store.list(layout.contribution_prefix(p)):
            parsed = layout.parse_contribution_key(info.key)
            if parsed is None:
                continue
            _, learner_id, seq = parsed
            if seq <= high_water.get(learner_id, -1) and self.old(info):
                self.drop(info)

    def _keyframe_floor(self, p: int, versions: list[int]) -> Callable[[int], int] | None:
        """The newest keyframe at or below a version: by its number under the rule ``every``,
        from the manifests under ``size`` (down to the oldest version there; when one of them
        cannot be read, that oldest version, so nothing of the chain is deleted)."""
        config = self.config
        if config.publish_codec == "none":
            return None
        if config.keyframe_rule != "size":
            return lambda v: v - v % config.keyframe_every

        def payloads_of(u: int) -> dict[str, Any]:
            key = (self.store.url, self.run_id, p, u)
            if key not in _PAYLOADS:
                if len(_PAYLOADS) >= _PAYLOADS_MAX:
                    _PAYLOADS.clear()
                _PAYLOADS[key] = ledger.read_manifest(self.store, p, u, run_id=self.run_id)["payloads"]
            return {"fragment": p, "payloads": _PAYLOADS[key]}

        def floor(v: int) -> int:
            if v <= versions[0]:
                return versions[0]
            try:
                return keyframe_chain(payloads_of, v).keyframe
            except (NotFound, ProtocolError) as exc:
                log.warning("gc: fragment %d has no readable keyframe chain at or below version %d (%s); keeping "
                            "every version from %d", p, v, exc, versions[0])
                return versions[0]
        return floor

    def _retained(self, p: int, versions: list[int], *, keep: int,
                  newest_ckpt: int) -> tuple[set[str] | None, dict[str, int]]:
        """(the payload keys the kept manifests name, or None when one cannot be read: keep every
        payload from it; the high-water marks at the newest checkpoint)."""
        referenced: set[str] = set()
        high_water: dict[str, int] = {}
        for v in versions:
            if v < keep:
                continue
            try:
                m = ledger.read_manifest(self.store, p, v, run_id=self.run_id)
            except (NotFound, ProtocolError) as exc:
                log.warning("gc: fragment %d version %d unreadable (%s); keeping everything from it", p, v, exc)
                return None, high_water
            referenced.update(e["key"] for e in m["payloads"])
            if v == newest_ckpt:
                high_water = m["high_water"]
        return referenced, high_water

    def quarantined_inputs(self, frags: list[int]) -> None:
        """Contributions to ``frags`` with a quarantine report, once older than the grace."""
        prefixes = tuple(layout.contribution_prefix(p) for p in frags)
        for info in self.store.list(layout.QUARANTINE_PREFIX):
            original = layout.parse_quarantine_key(info.key)
            if original is not None and original.startswith(prefixes) and self.old(info):
                try:
                    for o in self.store.list(original):
                        if o.key == original:
                            self.drop(o)
                except NotFound:
                    pass
