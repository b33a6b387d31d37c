"""Read-only observers: ``ddiloco inspect`` (``inspect_run``; ``verify_run`` is in verify.py, the one
observer that decodes payloads and so imports torch) and ``ddiloco status`` (``run_status``). Neither
imports torch: both run in monitors.

Observers never write to the bucket and never trust it: every object is read through the same
validation as the learners and syncers use, and bad content is *reported* (``errors`` in the inspect
report, one line per problem from ``verify_run``), never raised. Only a bucket that cannot be reached
(``StoreAccessError``) or, for ``run_status``, a missing/invalid run.json raises. Ages are judged by
the store's clock (``store.now()`` minus object mtimes), never by the local clock.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from ddiloco_cli.errors import ProtocolError
from ddiloco_cli.ops.metrics import latest_global_eval
from ddiloco_cli.ops.runfigures import (PILE_UP, alerts, blocked_learners, bytes_moved, cost_share, costly_learners,
                                        failed_uploads, goodput, held_versions, late_receives, refused_contributions)
from ddiloco_cli.protocol import layout, ledger, records, signing
from ddiloco_cli.protocol.fragments import FragmentPlan
from ddiloco_cli.protocol.runconfig import RunConfig
from ddiloco_cli.store.base import NotFound, ObjectInfo, Store

CATEGORIES = ("manifests", "payloads", "contributions", "checkpoints", "heartbeats", "other")
TOP_LEVEL = ("run.json", "plan.json", "fragments", "contributions", "checkpoints", "syncers", "learners",
             "quarantine", "tmp", "metrics")


def classify(key: str, *, num_fragments: int | None = None) -> str | None:
    """The category of a key (one of CATEGORIES), or None for a foreign object:
    a name the protocol does not define, or a fragment index outside the run."""
    kind = layout.key_kind(key)
    if kind is None or (kind[1] is not None and num_fragments is not None and kind[1] >= num_fragments):
        return None
    return kind[0]


# ---------------------------------------------------------------- bucket scan
@dataclass
class _Scan:
    """One LIST of the run root plus the run config and plan, read tolerantly."""

    store: Store
    now_s: float
    infos: list[ObjectInfo]
    run: RunConfig | None = None
    plan: FragmentPlan | None = None
    errors: list[str] = field(default_factory=list)

    @property
    def run_id(self) -> str | None:
        return self.run.run_id if self.run else None

    def fragment_ids(self) -> list[int]:
        if self.run is not None:
            return list(range(self.run.num_fragments))
        seen = {kind[1] for i in self.infos if (kind := layout.key_kind(i.key)) and kind[1] is not None}
        return sorted(seen)

    def under(self, prefix: str) -> list[ObjectInfo]:
        return [i for i in self.infos if i.key.startswith(prefix)]

    def record(self, key: str, record_type: str) -> dict[str, Any] | None:
        """A validated JSON record, or None with the problem added to ``errors``."""
        try:
            return records.loads(self.store.get(key), record_type, where=key)
        except NotFound:
            self.errors.append(f"{key}: listed but gone when read")
        except ProtocolError as exc:
            self.errors.append(str(exc))
        return None


def _scan(store: Store) -> _Scan:
    scan = _Scan(store, store.now(), store.list(""))
    keys = {i.key for i in scan.infos}
    if layout.RUN_CONFIG not in keys:
        scan.errors.append(f"{layout.RUN_CONFIG}: missing: no ddiloco run at {store.url}")
        return scan
    record = scan.record(layout.RUN_CONFIG, "run")
    if record is None:
        return scan
    try:
        scan.run = RunConfig.from_record(record, where=layout.RUN_CONFIG)
    except ProtocolError as exc:
        scan.errors.append(str(exc))
        return scan
    if layout.PLAN not in keys:
        scan.errors.append(f"{layout.PLAN}: missing")
        return scan
    try:
        scan.plan = ledger.read_plan(store, run_id=scan.run_id)
    except (NotFound, ProtocolError) as exc:
        msg = str(exc)
        scan.errors.append(msg if layout.PLAN in msg else f"{layout.PLAN}: {msg}")
    return scan


def _manifests(scan: _Scan, p: int) -> tuple[list[int], dict[int, dict[str, Any]]]:
    """(versions named by manifest keys, ascending; {version: manifest} of the valid ones).

    A manifest is valid when it passes its schema and names its own run, fragment
    and version; every other one is reported in ``scan.errors``."""
    versions, valid = [], {}
    for info in scan.under(layout.manifest_prefix(p)):
        v = layout.parse_num(info.key)
        if v is None or info.key != layout.manifest_key(p, v):
            continue
        versions.append(v)
        m = scan.record(info.key, "manifest")
        if m is None:
            continue
        if m["fragment"] != p or m["version"] != v:
            scan.errors.append(f"{info.key}: claims fragment {m['fragment']} version {m['version']}")
        elif scan.run_id is not None and m["run_id"] != scan.run_id:
            scan.errors.append(f"{info.key}: belongs to run {m['run_id']}, not {scan.run_id}")
        else:
            valid[v] = m
    return sorted(versions), valid


def _quarantined(scan: _Scan) -> list[dict[str, Any]]:
    out = []
    for info in scan.under(layout.QUARANTINE_PREFIX):
        rec = scan.record(info.key, "quarantine")
        original = layout.parse_quarantine_key(info.key) or info.key
        out.append({"key": original, "reason": rec["reason"] if rec else "(unreadable quarantine record)",
                    "syncer_id": rec.get("syncer_id") if rec else None, "age_s": scan.now_s - info.mtime_s})
    return out


def _contributions(scan: _Scan, p: int, high_water: dict[str, int], quarantined: set[str]) -> dict[str, Any]:
    """Pending (seq above the latest manifest's high-water mark, not quarantined) and
    merged-but-not-collected contributions of fragment p."""
    pending: dict[str, int] = defaultdict(int)
    num_merged = 0
    for info in scan.under(layout.contribution_prefix(p)):
        parsed = layout.parse_contribution_key(info.key)
        if parsed is None or info.key in quarantined:
            continue
        _, learner_id, seq = parsed
        if seq <= high_water.get(learner_id, -1):
            num_merged += 1
        else:
            pending[learner_id] += 1
    return {"num_pending": sum(pending.values()), "pending": dict(pending), "num_merged_uncollected": num_merged}


def _epochs(scan: _Scan) -> list[dict[str, Any]]:
    out = []
    for info in scan.under(layout.EPOCH_PREFIX):
        n = layout.parse_num(info.key)
        if n is None or info.key != layout.epoch_key(n):
            continue
        rec = scan.record(info.key, "epoch")
        if rec is None:
            continue
        if rec["epoch"] != n or (scan.run_id is not None and rec["run_id"] != scan.run_id):
            scan.errors.append(f"{info.key}: claims epoch {rec['epoch']} of run {rec['run_id']}")
            continue
        out.append({"epoch": n, "syncer_id": rec["syncer_id"], "fragments": sorted(rec["fragments"]),
                    "created_s": rec.get("created_s"), "age_s": scan.now_s - info.mtime_s})
    return out


def _heartbeats(scan: _Scan, prefix: str, record_type: str) -> list[tuple[dict[str, Any], float]]:
    """(record, age_s) of every valid heartbeat under prefix; a heartbeat stored under
    another learner's or epoch's name is reported and skipped."""
    out = []
    for info in scan.under(prefix):
        if classify(info.key) != "heartbeats":
            continue
        rec = scan.record(info.key, record_type)
        if rec is None:
            continue
        own_key = (layout.learner_heartbeat_key(rec["learner_id"]) if record_type == "learner_heartbeat"
                   else layout.syncer_heartbeat_key(rec["epoch"]))
        if own_key != info.key:
            scan.errors.append(f"{info.key}: holds the heartbeat of {own_key}")
            continue
        age = ledger.heartbeat_age(scan.now_s, info.mtime_s, lease_s=scan.run.lease_s if scan.run else None)
        if age == float("inf"):  # dated more than a lease ahead: invalid, not live (as the syncer sees it)
            scan.errors.append(f"{info.key}: dated {info.mtime_s - scan.now_s:.0f} s in the future: ignored")
        out.extend([(rec, age)] if age != float("inf") else [])
    return out


# -------------------------------------------------------------------- inspect
def inspect_run(store: Store) -> dict[str, Any]:
    """Everything in the bucket, by meaning. JSON-serialisable; never raises on bad
    content (it goes to ``errors``), only on an unreachable store.

    Sections: url, now_s, run (config summary or None), fragments, epochs, syncers,
    learners, quarantined, objects ({category: {count, bytes}} + total), orphans
    (payloads no manifest names; foreign keys), errors.
    """
    scan = _scan(store)
    quarantined = _quarantined(scan)
    qkeys = {q["key"] for q in quarantined}
    referenced: set[str] = set()
    fragments = [_inspect_fragment(scan, p, qkeys=qkeys, referenced=referenced) for p in scan.fragment_ids()]

    syncers = [{"epoch": r["epoch"], "syncer_id": r["syncer_id"], "state": r["state"], "fragments": r["fragments"],
                "age_s": age, "versions": r.get("versions", {})}
               for r, age in _heartbeats(scan, layout.SYNCER_HEARTBEAT_PREFIX, "syncer_heartbeat")]
    learners = [{"learner_id": r["learner_id"], "state": r["state"], "step": r["step"], "tokens": r["tokens"],
                 "age_s": age} for r, age in _heartbeats(scan, layout.LEARNER_HEARTBEAT_PREFIX, "learner_heartbeat")]

    objects, orphans = _objects_and_orphans(scan, referenced)
    run_summary, signatures = None, None
    if scan.run is not None:
        signatures = {"required": signing.requires_signatures(scan.run), "admissions": _admissions(scan)}
        keys = ("run_id", "task", "mode", "num_fragments", "sync_every", "overlap_steps", "quorum", "alpha", "merge",
                "outer_lr", "outer_momentum", "codec", "codec_block", "codec_qmax", "publish_codec", "keyframe_every",
                "keyframe_rule", "checkpoint_every", "retain_versions", "lease_s", "heartbeat_s", "gc_grace_s", "created_s")
        run_summary: dict[str, Any] = {k: getattr(scan.run, k) for k in keys}
        run_summary["num_params"] = scan.plan.total_numel() if scan.plan else None
    return {
        "url": store.url, "now_s": scan.now_s, "run": run_summary, "fragments": fragments, "epochs": _epochs(scan),
        "syncers": syncers, "learners": learners, "quarantined": quarantined, "objects": objects,
        "orphans": orphans, "signatures": signatures, "errors": scan.errors,
    }


def _inspect_fragment(scan: "_Scan", p: int, *, qkeys: set[str], referenced: set[str]) -> dict[str, Any]:
    """One fragment of ``inspect_run``; adds the payload keys its manifests name to ``referenced``."""
    versions, manifests = _manifests(scan, p)
    for m in manifests.values():
        referenced.update(e["key"] for e in m["payloads"])
    latest = manifests.get(versions[-1]) if versions else None
    payloads = scan.under(layout.payload_prefix(p))
    entry: dict[str, Any] = {
        "fragment": p,
        "num_params": scan.plan.fragment_numel(p) if scan.plan and p < scan.plan.num_fragments else None,
        "oldest_version": versions[0] if versions else None,
        "newest_version": versions[-1] if versions else None,
        "num_versions": len(versions),
        # where a reader without a value starts: the newest version with a full payload
        "newest_keyframe": max((v for v, m in manifests.items() if any(e["kind"] == "full" for e in m["payloads"])),
                               default=None),
        "payload_bytes": sum(i.size for i in payloads),
        "num_payloads": len(payloads),
        "latest": None,
    }
    if latest is not None:
        mtime = next(i.mtime_s for i in scan.infos if i.key == layout.manifest_key(p, latest["version"]))
        entry["latest"] = {"version": latest["version"], "epoch": latest["epoch"], "syncer_id": latest["syncer_id"],
                           "quorum_size": latest.get("quorum_size", len(latest["contributions"])),
                           "created_s": latest.get("created_s"), "age_s": scan.now_s - mtime}
    entry.update(_contributions(scan, p, latest["high_water"] if latest else {}, qkeys))
    return entry


def _objects_and_orphans(scan: "_Scan", referenced: set[str]) -> tuple[dict[str, dict[str, int]], list[dict[str, Any]]]:
    """Objects by category ({count, bytes}, and the total), and the orphans: foreign keys and
    payloads no valid manifest names."""
    num_frags = scan.run.num_fragments if scan.run else None
    objects = {c: {"count": 0, "bytes": 0} for c in CATEGORIES}
    orphans = []
    for info in scan.infos:
        category = classify(info.key, num_fragments=num_frags)
        age_s = scan.now_s - info.mtime_s
        if category is None:
            top = info.key.split("/", 1)[0]
            why = "unknown top-level name" if top not in TOP_LEVEL else "not a name the protocol defines"
            orphans.append({"key": info.key, "size": info.size, "age_s": age_s, "reason": why})
            category = "other"
        elif category == "payloads" and info.key not in referenced:
            orphans.append({"key": info.key, "size": info.size, "age_s": age_s,
                            "reason": "payload no valid manifest names (in flight, a lost race, or left by GC)"})
        objects[category]["count"] += 1
        objects[category]["bytes"] += info.size
    objects["total"] = {"count": len(scan.infos), "bytes": sum(i.size for i in scan.infos)}
    return objects, orphans


def _admissions(scan: _Scan) -> list[dict[str, Any]]:
    from ddiloco_cli.ops.admission import list_admissions

    try:
        return list_admissions(scan.store, run=scan.run)
    except ProtocolError as exc:  # run.json without a usable admin key
        scan.errors.append(str(exc))
        return []




def run_status(store: Store) -> dict[str, Any]:
    """Live state of a run, for ``ddiloco status``. Raises RunNotFoundError /
    ProtocolError when there is no valid run.json or plan.json.

    * ``fragments``: [{fragment, version, quorum_size, epoch, syncer_id, age_s, pending,
      max_pending_per_learner}] (age_s: since the newest manifest was written; pending:
      contributions above its high-water mark, not quarantined).
    * ``learners``: [{learner_id, alive, state, step, tokens, tokens_per_s, loss,
      last_contribution_age_s, versions_behind, eta_s, bytes_up, bytes_down, blocked_s,
      heartbeat_age_s}]; alive = state "running" and heartbeat age <= the run's lease_s;
      versions_behind = the most versions any fragment it holds is behind the newest
      (from its heartbeat); eta_s = its remaining steps to total_steps at its step time.
    * ``syncers``: the epochs that own a fragment or still beat: [{epoch, syncer_id,
      alive, state, fragments (owned), heartbeat_age_s, lag_versions, backlog}];
      lag_versions = how many versions the newest committed ones are ahead of what
      its last heartbeat reported (0 for a healthy owner); backlog = pending
      contributions on its fragments.
    * ``throughput``: {tokens_per_s of the live learners together, eta_s: until every
      live learner reaches total_steps (None when unlimited or none is live)}.
    * ``training_age_s``: since the first learner started (store clock), the window of
      ``goodput`` (see ``goodput``); ``bytes`` (see ``bytes_moved``).
    * ``alerts``: one line per condition a monitor should page on (``alerts``).
    * ``global_eval``: the newest validation loss of the global model a syncer wrote
      to the metrics history ({val_loss, t, step}; ``sync --eval-every``), or None.
    """
    now_s = store.now()
    run = RunConfig.from_record(ledger.read_run(store), where=f"{store.url}/{layout.RUN_CONFIG}")
    plan = ledger.read_plan(store, run_id=run.run_id)
    infos = store.list("")
    scan = _Scan(store, now_s, infos, run=run, plan=plan)
    lease_s = run.lease_s
    qkeys = {layout.parse_quarantine_key(i.key) for i in scan.under(layout.QUARANTINE_PREFIX)}
    mtime = {i.key: i.mtime_s for i in infos}

    fragments = [_fragment_status(scan, p, now_s=now_s, mtime=mtime, qkeys=qkeys) for p in range(plan.num_fragments)]
    newest = {f["fragment"]: f["version"] for f in fragments if f["version"] is not None}
    learners, starts = _learners_status(store, scan, run, newest=newest, now_s=now_s)
    live = [r for r in learners if r["alive"]]
    etas = [r["eta_s"] for r in live if r["eta_s"] is not None]
    throughput = {"tokens_per_s": sum(r["tokens_per_s"] or 0.0 for r in live) if live else None,
                  "eta_s": max(etas) if etas and len(etas) == len(live) else None}

    # goodput's window opens when the first learner started, not at init (a run may wait for its fleet)
    training_start_s = min(starts, default=mtime.get(layout.RUN_CONFIG, now_s))
    syncers = _syncer_status(scan, fragments, lease_s)
    return {
        "url": store.url, "run_id": run.run_id, "task": run.task, "mode": run.mode, "now_s": now_s,
        "run_age_s": now_s - mtime.get(layout.RUN_CONFIG, now_s), "training_age_s": now_s - training_start_s,
        "num_params": plan.total_numel(), "num_fragments": plan.num_fragments,
        "quorum": run.quorum, "lease_s": lease_s, "total_steps": run.total_steps,
        "fragments": fragments, "learners": learners, "syncers": syncers, "throughput": throughput,
        "goodput": goodput(learners, run_age_s=now_s - training_start_s),
        "bytes": bytes_moved(learners, num_params=plan.total_numel()),
        "alerts": alerts(fragments=fragments, syncers=syncers, learners=learners),
        "notes": (late_receives(learners, tau=run.overlap_steps) + blocked_learners(learners, codec=run.codec)
                  + held_versions(learners, held_alpha=run.held_alpha) + failed_uploads(learners) + refused_contributions(learners)
                  + costly_learners(learners)),
        "global_eval": latest_global_eval(store, infos=infos),  # from `sync --eval-every`
        "errors": scan.errors,
    }


def _fragment_status(scan: "_Scan", p: int, *, now_s: float, mtime: dict[str, float],
                     qkeys: set[Any]) -> dict[str, Any]:
    """One row of ``run_status``'s fragments (see there)."""
    versions = [v for i in scan.under(layout.manifest_prefix(p))
                if (v := layout.parse_num(i.key)) is not None and i.key == layout.manifest_key(p, v)]
    entry: dict[str, Any] = {"fragment": p, "version": None, "quorum_size": None, "epoch": None,
                             "syncer_id": None, "age_s": None, "pending": 0, "max_pending_per_learner": 0}
    if versions:
        v = max(versions)
        m = scan.record(layout.manifest_key(p, v), "manifest")
        entry.update(version=v, age_s=now_s - mtime[layout.manifest_key(p, v)])
        if m is not None:
            entry.update(quorum_size=m.get("quorum_size", len(m["contributions"])), epoch=m["epoch"],
                         syncer_id=m["syncer_id"])
            pending = _contributions(scan, p, m["high_water"], qkeys)
            entry.update(pending=pending["num_pending"],
                         max_pending_per_learner=max(pending["pending"].values(), default=0))
    return entry


def _learners_status(store: Store, scan: "_Scan", run: RunConfig, *, newest: dict[int, int],
                     now_s: float) -> tuple[list[dict[str, Any]], list[float]]:
    """``run_status``'s learner rows (see there), sorted by id, and their sessions' first starts."""
    last_contribution: dict[str, float] = {}
    for info in scan.under(layout.CONTRIBUTION_ROOT):
        parsed = layout.parse_contribution_key(info.key)
        if parsed is not None:
            last_contribution[parsed[1]] = max(last_contribution.get(parsed[1], 0.0), info.mtime_s)
    learners, starts = [], []
    trust = signing.Trust(store, run=run)
    for rec, age in _heartbeats(scan, layout.LEARNER_HEARTBEAT_PREFIX, "learner_heartbeat"):
        lid = rec["learner_id"]
        if not trust.admits(rec, key=layout.learner_heartbeat_key(lid), role="learner", member_id=lid):
            scan.errors.append(f"learner {lid}: heartbeat not signed by its admitted key; the syncer ignores it")
            continue
        learners.append(_learner_row(rec, age, run, newest=newest, now_s=now_s,
                                     last_contribution_s=last_contribution.get(lid)))
        start = _session_start_store_clock(rec, now_s=now_s, age_s=age)
        if start is not None:
            starts.append(start)
    learners.sort(key=lambda r: r["learner_id"])
    return learners, starts


def _cost(rec: dict[str, Any], step_time_s: float) -> dict[str, Any]:
    """ddiloco's own time per step as the learner measured it (its heartbeat's cost fields,
    bounded numbers: the schema checked them) and its share of the step (``cost_share``)."""
    fields = {k: rec.get(k) for k in ("sync_step_ms", "sync_step_cpu_ms", "sync_worker_cpu_ms")}
    return {**fields, "sync_share": cost_share(*fields.values(), step_time_s)}


def _learner_row(rec: dict[str, Any], age: float, run: RunConfig, *, newest: dict[int, int], now_s: float,
                 last_contribution_s: float | None) -> dict[str, Any]:
    step, tokens = int(rec["step"]), int(rec["tokens"])
    step_time_s = float(rec.get("step_time_s") or 0.0)
    alive = rec["state"] == "running" and age <= run.lease_s
    held = {int(p): int(v) for p, v in (rec.get("versions") or {}).items() if str(p).isdigit()}
    behind = [newest[p] - v for p, v in held.items() if p in newest]
    remaining = max(0, run.total_steps - step) if run.total_steps else None
    return {
        "learner_id": rec["learner_id"], "alive": alive, "state": rec["state"],
        "step": step, "tokens": tokens,
        "tokens_per_s": tokens / step / step_time_s if step and step_time_s > 0 else None,
        "step_time_s": step_time_s or None, "loss": rec.get("loss"),
        "last_contribution_age_s": now_s - last_contribution_s if last_contribution_s is not None else None,
        "versions_behind": max(0, max(behind)) if behind else None,
        "eta_s": remaining * step_time_s if alive and remaining is not None and step_time_s > 0 else None,
        "bytes_up": int(rec.get("bytes_up", 0)), "bytes_down": int(rec.get("bytes_down", 0)),
        "blocked_s": float(rec.get("blocked_s", 0.0)), "heartbeat_age_s": age,
        "lag_p50": rec.get("lag_p50"), "lag_p95": rec.get("lag_p95"),  # bounded ints: the schema checked them
        **_cost(rec, step_time_s),
        "receives": rec.get("receives"), "held_receives": rec.get("held_receives"),
        "uploads_failed": rec.get("uploads_failed"),
        "refused": rec.get("refused"), "last_refusal": rec.get("last_refusal"),
    }


def _session_start_store_clock(rec: dict[str, Any], *, now_s: float, age_s: float) -> float | None:
    """When a learner started, by the store's clock: its heartbeat's ``first_started_s``
    (its first session) or ``started_s`` (this session), written by its own clock, moved
    by the offset between that clock and the store's (``time_s`` was written at the
    heartbeat's mtime, ``now_s - age_s``)."""
    started = rec.get("first_started_s", rec.get("started_s"))
    written = rec.get("time_s")
    if not isinstance(started, (int, float)) or not isinstance(written, (int, float)) or started > written:
        return None
    return (now_s - age_s) - (written - started)




def _syncer_status(scan: _Scan, fragments: list[dict[str, Any]], lease_s: float) -> list[dict[str, Any]]:
    epochs = _epochs(scan)
    beats = {r["epoch"]: (r, age) for r, age in _heartbeats(scan, layout.SYNCER_HEARTBEAT_PREFIX, "syncer_heartbeat")}
    owner = {}
    for e in epochs:  # ascending: the highest epoch claiming a fragment owns it
        for p in e["fragments"]:
            owner[p] = e["epoch"]
    by_fragment = {f["fragment"]: f for f in fragments}
    out = []
    for e in reversed(epochs):
        owned = [p for p in e["fragments"] if owner.get(p) == e["epoch"]]
        rec, age = beats.get(e["epoch"], (None, None))
        beating = rec is not None and age <= lease_s and rec["state"] == "serving"
        if not owned and not beating:
            continue  # fenced long ago
        reported = rec.get("versions", {}) if rec else {}
        lags = [by_fragment[p]["version"] - int(reported[str(p)]) for p in owned
                if str(p) in reported and p in by_fragment and by_fragment[p]["version"] is not None]
        out.append({
            "epoch": e["epoch"], "syncer_id": e["syncer_id"], "alive": beating and bool(owned),
            "state": rec["state"] if rec else "unknown", "fragments": owned, "heartbeat_age_s": age,
            "lag_versions": max(lags) if lags else None,
            "backlog": sum(by_fragment[p]["pending"] for p in owned if p in by_fragment),
            "num_merges": rec.get("num_merges") if rec else None,
            "num_quarantined": rec.get("num_quarantined") if rec else None,
            "alerts": list(rec.get("alerts") or []) if rec and beating else [],
            "num_repairs": rec.get("num_repairs", 0) if rec else None,  # ledger repairs (syncer/repair.py)
            "repairs": list(rec.get("repairs") or []) if rec else [],
        })
    return out


def __getattr__(name: str) -> Any:
    if name == "verify_run":  # its home is verify.py (torch); imported on first use
        from ddiloco_cli.ops.verify import verify_run

        return verify_run
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["CATEGORIES", "PILE_UP", "alerts", "classify", "inspect_run", "verify_run", "run_status", "goodput",
           "bytes_moved"]
