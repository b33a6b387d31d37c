"""`ddiloco init`: plan fragments, write version 0 of every fragment, commit run.json;
resume or remove an interrupted init.

Everything is validated before the first write (the ``RunConfig``, the task, the
plan and the exact bytes of run.json), so a bad flag changes nothing. plan.json,
written first, carries the run.json this init will write (``pending_run``): an
init killed before run.json leaves a *half-made run* that the same ``init``
resumes (same config: it writes the versions 0 still missing, then run.json) and
``init --force-clean`` removes.

Identical inits are idempotent, also when they run at once (a fleet's start-up scripts
all running the same command): one that finds the run made with the same settings, or
loses the race for plan.json or run.json to an init of the same settings, joins it (it
writes the versions 0 still missing, create-only, then run.json if nobody has) and
reports "run X exists with the same settings". Other settings are refused.
"""

from __future__ import annotations

import uuid
from typing import Any, Callable

import torch

from ddiloco_cli.clock import WALL, Clock
from ddiloco_cli.errors import DdilocoError, UsageError
from ddiloco_cli.protocol import layout, ledger, records
from ddiloco_cli.protocol.fragments import FragmentPlan, gather_fragment, named_shapes_of, plan_fragments
from ddiloco_cli.protocol.published import encode_version, upload_payloads
from ddiloco_cli.protocol.runconfig import RunConfig
from ddiloco_cli.protocol.signing import Signer, sign_record
from ddiloco_cli.store.base import NotFound, Store
from ddiloco_cli.tasks import load_task, task_source_sha256

RunSpec = RunConfig  # the name init's library callers use for the config they pass

PENDING_RUN = "pending_run"  # plan.json field: the run.json an interrupted init will write


JOIN_ATTEMPTS = 4  # looks at what a faster identical init wrote: plan.json, then run.json (and spare)


def init_run(store: Store, spec: RunConfig, *, force_clean: bool = False,
             note: Callable[[str], None] = lambda _: None, admin: Signer | None = None,
             clock: Clock = WALL) -> dict[str, Any]:
    """The run.json record of the run ``init_or_join`` made or joined at ``store``."""
    return init_or_join(store, spec, force_clean=force_clean, note=note, admin=admin, clock=clock)[0]


def init_or_join(store: Store, spec: RunConfig, *, force_clean: bool = False,
                 note: Callable[[str], None] = lambda _: None, admin: Signer | None = None,
                 clock: Clock = WALL) -> tuple[dict[str, Any], bool]:
    """Create the run ``spec`` describes at ``store``, or join an identical init: returns
    (run.json record, True when this call wrote run.json). Another run there, or another
    init in progress with other settings, is a UsageError that changes nothing."""
    for _ in range(JOIN_ATTEMPTS):
        existing = _existing_run(store)
        if existing is not None:
            if force_clean:
                raise UsageError(f"a run already exists at {store.url}: --force-clean only removes an interrupted "
                                 "init; nothing was changed")
            _check_same_run(store, existing, spec, admin)
            return existing, False
        try:
            return _create(store, spec, force_clean=force_clean, note=note, admin=admin, clock=clock), True
        except ledger.InitRaceLost:
            force_clean = False  # what the faster init wrote is not ours to remove: look at it again
    raise UsageError(f"inits at {store.url} kept racing; run `ddiloco init` again")


def _existing_run(store: Store) -> dict[str, Any] | None:
    try:
        data = store.get(layout.RUN_CONFIG)
    except NotFound:
        return None
    return records.loads(data, "run", where=f"{store.url}/{layout.RUN_CONFIG}")


def _check_same_run(store: Store, existing: dict[str, Any], spec: RunConfig, admin: Signer | None) -> None:
    """UsageError unless the run at ``store`` is the one ``spec`` (and ``admin``) would make."""
    diffs = spec.differences(RunConfig.from_record(existing, where=f"{store.url}/{layout.RUN_CONFIG}"))
    if existing.get("task_sha256") not in (None, task_source_sha256(spec.task)):
        diffs.append("the task's source differs")
    if existing.get("admin_key") != (admin.public_key if admin else None):
        diffs.append("another admin key or signature setting")
    if diffs:
        raise UsageError(f"a run already exists at {store.url} with other settings ({'; '.join(diffs)}); "
                         "nothing was changed (use another URL)")


def _create(store: Store, spec: RunConfig, *, force_clean: bool, note: Callable[[str], None],
            admin: Signer | None, clock: Clock) -> dict[str, Any]:
    """Create a run at ``store``: plan, version 0 of every fragment, then run.json.

    With ``admin`` (the run's admin key) the run requires signatures: run.json
    records the admin's public key, and the admin key signs the version-0 manifests.

    Returns the run.json record. Raises UsageError, changing nothing, if a run
    exists, or if an interrupted init with another config is there and
    ``force_clean`` is not set. With ``force_clean``, an interrupted init's objects
    are deleted first (only when no run.json exists). ``note`` receives one line
    when an interrupted init is resumed or removed. ``clock`` stamps the records (the
    deterministic simulation passes its virtual clock).
    """
    task = load_task(spec.task)
    torch.manual_seed(spec.seed)
    model = task.build_model()
    plan = plan_fragments(named_shapes_of(model), spec.num_fragments)
    params = {k: v.detach() for k, v in model.named_parameters()}

    config = _run_record(store, spec, plan, force_clean=force_clean, note=note, admin=admin, clock=clock)
    run_id = config["run_id"]
    plan_record = {**ledger.plan_record(plan, run_id=run_id), PENDING_RUN: config}
    # the exact bytes of both records, checked before the first write
    for record, kind in ((config, "run"), (plan_record, "plan")):
        records.validate(record, kind, where=f"{kind} record")
        records.dumps(record)
    ledger.create_run(store, config=config, plan=plan_record, before_commit=lambda: _write_version_zero(
        store, plan, params, config=config, admin=admin, clock=clock))
    return config


def _run_record(store: Store, spec: RunConfig, plan: FragmentPlan, *, force_clean: bool,
                note: Callable[[str], None], admin: Signer | None, clock: Clock) -> dict[str, Any]:
    """The run.json record to write: a new one, or the one of the interrupted init this one resumes."""
    half_made = _interrupted_plan(store)
    if half_made is not None and force_clean:
        removed = remove_interrupted_init(store)
        note(f"removed an interrupted init at {store.url} ({removed} objects)")
    elif half_made is not None:
        config = _resumable(store, half_made, spec, ledger.plan_record(plan, run_id=half_made["run_id"]))
        note(f"resuming the init of run {config['run_id']} at {store.url} (same config; interrupted, or running "
             "elsewhere now: both finish the same run)")
        if config.get("admin_key") != (admin.public_key if admin else None):
            raise UsageError(f"the interrupted init at {store.url} was started with another admin key or signature "
                             "setting: run it again with the same --admin-key and --require-signatures, or add "
                             "--force-clean")
        return config
    config = spec.to_record(run_id=uuid.uuid4().hex, created_s=clock.time())
    config["task_sha256"] = task_source_sha256(spec.task)  # learners check their own copy of the task against it
    if admin is not None:
        config = {**config, "require_signatures": True, "admin_key": admin.public_key,
                  "features": [*config["features"], records.SIGNATURES]}
    return config


def _write_version_zero(store: Store, plan: FragmentPlan, params: dict[str, Any], *, config: dict[str, Any],
                        admin: Signer | None, clock: Clock) -> None:
    """Version 0 of every fragment (payloads, then its manifest), skipping those already there."""
    run_id = config["run_id"]
    for p in range(plan.num_fragments):
        if _has_version_zero(store, p, run_id=run_id):
            continue  # written by the init this one resumes
        value = gather_fragment(plan, p, params)
        encoded = encode_version(fragment=p, version=0, new_value=value, prev_published=None,
                                 publish_codec=config["publish_codec"], block_size=config["codec_block"],
                                 keyframe=True)
        upload_payloads(store, encoded)
        manifest = records.make(
            "manifest", run_id=run_id, fragment=p, version=0, epoch=0, syncer_id="init",
            nonce=records.new_nonce(), created_s=clock.time(), numel=plan.fragment_numel(p),
            payloads=[e for _, _, e in encoded.payloads], contributions=[], quorum_size=0, grace_s=0.0,
            outer_steps=0, high_water={},
        )
        if admin is not None:
            manifest = sign_record(manifest, run_id=run_id, key=layout.manifest_key(p, 0), signer=admin)
        if not ledger.commit_manifest(store, manifest) and not _has_version_zero(store, p, run_id=run_id):
            raise UsageError(f"fragment {p} version 0 already exists at {store.url}: another init raced; "
                             "nothing more was written")


def _interrupted_plan(store: Store) -> dict[str, Any] | None:
    """plan.json's record when it exists without run.json (an interrupted init), else None.
    An unreadable plan.json is reported with what to do."""
    try:
        data = store.get(layout.PLAN)
    except NotFound:
        return None
    try:
        return records.loads(data, "plan", where=f"{store.url}/{layout.PLAN}")
    except DdilocoError as exc:
        raise UsageError(f"{store.url} holds an unreadable plan.json and no run.json ({exc}); "
                         "remove it with `ddiloco init --force-clean`") from None


def _resumable(store: Store, half_made: dict[str, Any], spec: RunConfig, plan: dict[str, Any]) -> dict[str, Any]:
    """The run.json the interrupted init meant to write, when it is the run ``spec``
    and ``plan`` describe; otherwise UsageError saying how they differ."""
    hint = "run the same `ddiloco init` again to resume it, or add --force-clean to remove it"
    pending = half_made.get(PENDING_RUN)
    try:
        records.validate(pending, "run", where=f"{layout.PLAN} {PENDING_RUN}")
        theirs = RunConfig.from_record(pending, where=f"{layout.PLAN} {PENDING_RUN}")
    except DdilocoError:
        raise UsageError(f"an interrupted init left plan.json without run.json at {store.url}, and its config "
                         "cannot be read back; remove it with `ddiloco init --force-clean`") from None
    diffs = spec.differences(theirs)
    if not diffs and pending["run_id"] != half_made["run_id"]:
        diffs = [f"its run id {pending['run_id']} is not plan.json's {half_made['run_id']}"]
    if not diffs and {k: half_made.get(k) for k in plan} != plan:
        diffs = ["the task's model splits into another fragment plan"]
    if diffs:
        raise UsageError(f"an interrupted init of another config is at {store.url} (plan.json without run.json; "
                         f"{'; '.join(diffs)}): {hint}")
    return pending


def _has_version_zero(store: Store, p: int, *, run_id: str) -> bool:
    try:
        ledger.read_manifest(store, p, 0, run_id=run_id)
    except NotFound:
        return False
    except DdilocoError:
        raise UsageError(f"{store.url}/{layout.manifest_key(p, 0)} is not version 0 of this run; remove the "
                         "interrupted init with `ddiloco init --force-clean`") from None
    return True


def remove_interrupted_init(store: Store) -> int:
    """Delete what an interrupted init wrote (fragments/ and plan.json, plan.json last so
    that a removal cut short is still recognised). Refuses when run.json exists.
    Returns the number of objects deleted. Objects the protocol does not name are kept."""
    if ledger.run_exists(store):
        raise UsageError(f"{store.url} holds a run (run.json exists): --force-clean only removes an interrupted init")
    keys = [i.key for i in store.list("fragments/")]
    for key in keys:
        store.delete(key)
    store.delete(layout.PLAN)
    return len(keys) + 1
