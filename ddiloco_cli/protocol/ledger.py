"""Protocol operations on a store: the run config, version manifests (the quorum
ledger), syncer epochs (fencing) and heartbeats (leases).

Invariants (PROTOCOL.md sections in brackets):

* A version of a fragment exists iff its manifest exists [Commit]. Manifests
  are created with ``put_if_absent`` only after every payload they name, so a
  reader that sees a manifest can always fetch its payloads.
* Versions are contiguous: version v+1 is only ever written by a syncer that
  has read version v [Commit]. Two syncers racing for v+1: exactly one wins
  (create-only); the loser re-reads.
* Epochs are claimed with ``put_if_absent`` of the next epoch number; a syncer
  halts as soon as it sees a higher epoch whose fragments overlap its own
  [Fencing]. Leases are judged by the store's clock, never by local clocks.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable

from ddiloco_cli.errors import DdilocoError, ProtocolError, UsageError
from ddiloco_cli.protocol import layout, records
from ddiloco_cli.store.base import NotFound, Store

if TYPE_CHECKING:
    from ddiloco_cli.protocol.fragments import FragmentPlan
    from ddiloco_cli.protocol.signing import Signer, Trust

log = logging.getLogger(__name__)


class RunNotFoundError(DdilocoError):
    exit_code = 3


# ---------------------------------------------------------------- run config
def run_exists(store: Store) -> bool:
    return _exists(store, layout.RUN_CONFIG)


def create_run(
    store: Store, *, config: dict[str, Any], plan: dict[str, Any], before_commit: Callable[[], None] = lambda: None
) -> None:
    """Create a run: the plan first (create-only: at most one init proceeds), then
    ``before_commit`` (version 0 of every fragment), then run.json, the commit point.

    Raises UsageError when a run already exists there; nothing is changed then.
    """
    records.validate(config, "run", where="run config")
    records.validate(plan, "plan", where="fragment plan")
    if _exists(store, layout.RUN_CONFIG):  # made since the caller looked: runinit looks again
        raise InitRaceLost(f"a run already exists at {store.url}; nothing was changed (use another URL)")
    if not store.put_if_absent(layout.PLAN, records.dumps(plan)):
        existing = store.get(layout.PLAN)
        if records.loads(existing, "plan", where=layout.PLAN).get("run_id") != plan["run_id"]:
            raise InitRaceLost(f"another run is being created at {store.url}; nothing was changed")
    before_commit()
    if not store.put_if_absent(layout.RUN_CONFIG, records.dumps(config)):
        raise InitRaceLost(f"a run already exists at {store.url}; nothing was changed (use another URL)")


class InitRaceLost(UsageError):
    """Another init wrote plan.json or run.json first (``create_run``); the caller may look
    again at what it wrote (runinit joins an identical one)."""


def read_run(store: Store) -> dict[str, Any]:
    try:
        data = store.get(layout.RUN_CONFIG)
    except NotFound:
        raise RunNotFoundError(f"no ddiloco run at {store.url} (create one with `ddiloco init {store.url}`; "
                               f"`learn --wait-for-run SECONDS` waits for it)") from None
    return records.loads(data, "run", where=f"{store.url}/{layout.RUN_CONFIG}")


def read_plan_record(store: Store, *, run_id: str) -> dict[str, Any]:
    where = f"{store.url}/{layout.PLAN}"
    plan = records.loads(store.get(layout.PLAN), "plan", where=where)
    if plan["run_id"] != run_id:
        raise ProtocolError(f"{where} belongs to run {plan['run_id']}, not {run_id}")
    return plan


def read_plan(store: Store, *, run_id: str) -> "FragmentPlan":
    """The run's fragment plan (validated against the schema and the plan's own rules)."""
    from ddiloco_cli.protocol.fragments import FragmentPlan

    record = read_plan_record(store, run_id=run_id)
    return FragmentPlan.from_json({k: v for k, v in record.items() if k not in ("format", "protocol_version", "run_id")})


def plan_record(plan: "FragmentPlan", *, run_id: str) -> dict[str, Any]:
    body = {k: v for k, v in plan.to_json().items() if k != "format"}
    return records.make("plan", run_id=run_id, **body)


def _exists(store: Store, key: str) -> bool:
    return any(info.key == key for info in store.list(key))


# ------------------------------------------------------------------ manifests
def list_versions(store: Store, fragment: int) -> list[int]:
    """Committed versions of a fragment, ascending (from LIST; the hint is not trusted)."""
    versions = []
    for info in store.list(layout.manifest_prefix(fragment)):
        v = layout.parse_num(info.key)
        if v is not None and info.key == layout.manifest_key(fragment, v):
            versions.append(v)
    return versions


def latest_version(store: Store, fragment: int) -> int | None:
    versions = list_versions(store, fragment)
    return versions[-1] if versions else None


def read_manifest(store: Store, fragment: int, version: int, *, run_id: str | None = None,
                  trust: "Trust | None" = None) -> dict[str, Any]:
    """A committed manifest, validated (and its signature checked by ``trust``, [A5]).
    Raises NotFound or ProtocolError."""
    key = layout.manifest_key(fragment, version)
    return parse_manifest(store.get(key), fragment, version, where=f"{store.url}/{key}", run_id=run_id, trust=trust)


def parse_manifest(data: bytes, fragment: int, version: int, *, where: str, run_id: str | None = None,
                   trust: "Trust | None" = None) -> dict[str, Any]:
    """The bytes of an object at the key of ``version`` of ``fragment`` as a manifest a reader
    accepts: schema, fragment, version, run, the keys it names, its signature. Raises
    ProtocolError (NewerProtocolError: a newer ddiloco wrote it)."""
    key = layout.manifest_key(fragment, version)
    manifest = records.loads(data, "manifest", where=where)
    if manifest["fragment"] != fragment or manifest["version"] != version:
        raise ProtocolError(f"{where} claims fragment {manifest['fragment']} version {manifest['version']}")
    if run_id is not None and manifest["run_id"] != run_id:
        raise ProtocolError(f"{where} belongs to run {manifest['run_id']}, not {run_id}")
    # the keys it names are read next: only names of this fragment's objects (no "../")
    for e in manifest["payloads"]:
        if layout.key_kind(e["key"]) != ("payloads", fragment):
            raise ProtocolError(f"{where} names payload {e['key']!r}, not a payload of fragment {fragment}")
    for e in manifest["contributions"]:
        if layout.key_kind(e["key"]) != ("contributions", fragment):
            raise ProtocolError(f"{where} names contribution {e['key']!r}, not a contribution to fragment {fragment}")
    if trust is not None:
        trust.check_record(manifest, key=key, role="syncer", where=where)
    return manifest


def commit_manifest(store: Store, manifest: dict[str, Any]) -> bool:
    """Create-only write of a version manifest. True if this call committed it.

    The caller has already uploaded every payload the manifest names. On False
    another writer committed that version: re-read and re-decide.
    """
    records.validate(manifest, "manifest", where="new manifest")
    p, v = manifest["fragment"], manifest["version"]
    return store.put_if_absent(layout.manifest_key(p, v), records.dumps(manifest))


# --------------------------------------------------------------------- epochs
@dataclass(frozen=True)
class Epoch:
    epoch: int
    syncer_id: str
    fragments: frozenset[int]
    record: dict[str, Any]


def listed_epochs(store: Store) -> list[tuple[int, str]]:
    """(number, key) of every object named like an epoch claim, ascending, valid or not.
    Numbers above MAX_SAFE_INT are no epoch (the schema bounds them) and are left out."""
    out = []
    for info in store.list(layout.EPOCH_PREFIX):
        n = layout.parse_num(info.key)
        if n is not None and n <= records.MAX_SAFE_INT and info.key == layout.epoch_key(n):
            out.append((n, info.key))
    return out


def read_epoch(store: Store, n: int, *, run_id: str, trust: "Trust | None" = None) -> Epoch | None:
    """The valid claim of epoch ``n`` of this run, or None (skipped with a warning); with
    ``trust``, an unsigned or forged claim is skipped too ([A5]: it fences nobody).

    Raises NewerProtocolError when a newer ddiloco wrote it: this one must not serve next to it.
    """
    key = layout.epoch_key(n)
    try:
        rec = records.loads(store.get(key), "epoch", where=f"{store.url}/{key}")
    except records.NewerProtocolError:
        raise
    except (NotFound, ProtocolError) as exc:
        log.warning("ignoring epoch object: %s", exc)
        return None
    if rec["epoch"] != n or rec["run_id"] != run_id:
        log.warning("ignoring epoch object %s: wrong epoch number or run", key)
        return None
    if trust is not None and not trust.admits(rec, key=key, role="syncer"):
        log.warning("ignoring epoch object %s: not signed by an admitted syncer key", key)
        return None
    return Epoch(n, rec["syncer_id"], frozenset(rec["fragments"]), rec)


def list_epochs(store: Store, *, run_id: str, above: int = -1, trust: "Trust | None" = None) -> list[Epoch]:
    """Every valid epoch claim numbered above ``above``, ascending. Invalid or foreign
    objects (with ``trust``: unsigned ones too) are skipped with a warning; a newer
    protocol's raises NewerProtocolError."""
    epochs = (read_epoch(store, n, run_id=run_id, trust=trust) for n, _ in listed_epochs(store) if n > above)
    return [e for e in epochs if e is not None]


def claim_epoch(
    store: Store, *, run_id: str, syncer_id: str, fragments: Iterable[int], created_s: float,
    stop: Callable[[], bool] = lambda: False, signer: "Signer | None" = None,
) -> Epoch | None:
    """Claim the next epoch for ``fragments``: one above the highest epoch key LISTED,
    valid or not, so no object at a key can stall the claim [F4]. Create-only; on a
    conflict it re-lists and tries again until ``stop()``, then returns None.

    Raises NewerProtocolError when the newest claim is a newer ddiloco's: this one
    must not serve next to it. The claim is signed by ``signer`` when given ([A5]).
    """
    from ddiloco_cli.protocol.signing import sign_record

    frags = sorted(set(fragments))
    while not stop():
        listed = listed_epochs(store)
        n = listed[-1][0] + 1 if listed else 1
        if listed:  # the newest claim: a newer ddiloco's raises NewerProtocolError
            read_epoch(store, listed[-1][0], run_id=run_id)
        if n > records.MAX_SAFE_INT:
            raise ProtocolError(f"{store.url}/{listed[-1][1]}: no epoch number is left above it; "
                                "remove objects under syncers/epochs/ that no syncer wrote")
        rec = records.make(
            "epoch", run_id=run_id, epoch=n, syncer_id=syncer_id, fragments=frags,
            nonce=records.new_nonce(), created_s=created_s,
        )
        records.validate(rec, "epoch", where="new epoch claim")
        if signer is not None:
            rec = sign_record(rec, run_id=run_id, key=layout.epoch_key(n), signer=signer)
        if store.put_if_absent(layout.epoch_key(n), records.dumps(rec)):
            return Epoch(n, syncer_id, frozenset(frags), rec)
        log.info("epoch %d was claimed by someone else; retrying", n)
    return None


def current_owner(store: Store, *, run_id: str, fragments: Iterable[int], trust: "Trust | None" = None) -> Epoch | None:
    """The highest epoch overlapping ``fragments``: whoever holds (or last held) their lease."""
    frags = set(fragments)
    owners = [e for e in list_epochs(store, run_id=run_id, trust=trust) if e.fragments & frags]
    return owners[-1] if owners else None


# ----------------------------------------------------------------- heartbeats
@dataclass(frozen=True)
class Heartbeat:
    key: str
    record: dict[str, Any]
    age_s: float  # store clock: now - mtime of the heartbeat object


def heartbeat_age(now_s: float, mtime_s: float, *, lease_s: float | None) -> float:
    """A heartbeat's age by the store's clock. One dated more than ``lease_s`` in the future
    (a clock gone wrong, or an mtime set by hand) is invalid, not live: its age is infinite,
    so it never holds an id or counts as a live learner."""
    if lease_s is not None and mtime_s - now_s > lease_s:
        return math.inf
    return max(0.0, now_s - mtime_s)


def read_heartbeats(store: Store, prefix: str, record_type: str, *, now_s: float | None = None,
                    lease_s: float | None = None) -> list[Heartbeat]:
    """Heartbeats under ``prefix`` with their age by the store's clock (``heartbeat_age``:
    infinite for one dated more than ``lease_s`` ahead); bad ones skipped, and so are records
    that name another learner (or epoch) than their key [R1]."""
    infos = store.list(prefix)
    if not infos:
        return []
    now_s = store.now() if now_s is None else now_s
    beats = []
    for info in infos:
        owner = _heartbeat_owner(info.key, record_type)
        if owner is None:
            continue
        try:
            rec = records.loads(store.get(info.key), record_type, where=f"{store.url}/{info.key}")
        except (NotFound, ProtocolError) as exc:
            log.debug("skipping heartbeat %s: %s", info.key, exc)
            continue
        if rec["learner_id" if record_type == "learner_heartbeat" else "epoch"] != owner:
            log.debug("skipping heartbeat %s: it names another owner than its key", info.key)
            continue
        beats.append(Heartbeat(info.key, rec, heartbeat_age(now_s, info.mtime_s, lease_s=lease_s)))
    return beats


def _heartbeat_owner(key: str, record_type: str) -> str | int | None:
    """The learner id (or syncer epoch) a heartbeat's key names, or None if it names none."""
    if record_type == "learner_heartbeat":
        return layout.parse_learner_heartbeat_key(key)
    n = layout.parse_num(key)
    return n if n is not None and key == layout.syncer_heartbeat_key(n) else None


def syncer_heartbeat_age(store: Store, epoch: int, *, now_s: float | None = None) -> float | None:
    """Seconds since the syncer of ``epoch`` last beat (store clock), or None if it never did."""
    key = layout.syncer_heartbeat_key(epoch)
    infos = [i for i in store.list(key) if i.key == key]
    if not infos:
        return None
    now_s = store.now() if now_s is None else now_s
    return max(0.0, now_s - infos[0].mtime_s)
