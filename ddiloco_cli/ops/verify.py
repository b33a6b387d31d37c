"""``ddiloco inspect --verify``: every inconsistency in the bucket, one line each. The one
observer that decodes payloads (every retained version, every checkpoint header), so the
one that imports torch; the scan it works on is observe.py's."""

from __future__ import annotations

from typing import Any

import torch

from ddiloco_cli.errors import InvalidPayloadError, ProtocolError
from ddiloco_cli.numerics import codec
from ddiloco_cli.ops.observe import _epochs, _heartbeats, _manifests, _quarantined, _Scan, _scan
from ddiloco_cli.protocol import layout, records, signing
from ddiloco_cli.protocol.published import (FragmentReader, KeyframeChain, expected_shapes, keyframe_due,
                                             payload_sizes)
from ddiloco_cli.store.base import NotFound, Store
from ddiloco_cli.syncer.audit import audit_ledger
from ddiloco_cli.syncer.replay import checkpoint_shapes, replay_check


def verify_run(store: Store) -> list[str]:
    """Every inconsistency in the bucket, one line each naming the key; [] when consistent.

    Checks: run.json and plan.json schemas; every manifest (schema, run, fragment and
    version matching its name); versions contiguous from the oldest retained to the
    newest; every payload a manifest names exists with the recorded size and sha256
    and decodes to the plan's shapes; every retained version is readable (a keyframe
    at or below it plus the deltas after it) and a delta that sits beside a keyframe
    reproduces it bit for bit; the versions after the newest checkpoint are what
    ``apply_decision`` of their manifests' decisions re-encodes (the replay a restarting
    syncer runs); epochs, heartbeats, quarantine records and checkpoint
    headers are valid. Quarantined contributions and orphans are not problems.
    """
    scan = _scan(store)
    problems = scan.errors  # the scan's record errors are problems too
    if scan.run is None:
        return problems
    for p in scan.fragment_ids():
        before = len(problems)
        latest = _verify_fragment(scan, p, problems)
        if len(problems) == before and latest is not None:  # readable: the ledger must reproduce it too
            _verify_replay(scan, p, latest, problems)
    _epochs(scan)
    beats = _heartbeats(scan, layout.SYNCER_HEARTBEAT_PREFIX, "syncer_heartbeat")
    _heartbeats(scan, layout.LEARNER_HEARTBEAT_PREFIX, "learner_heartbeat")
    _quarantined(scan)
    _verify_checkpoints(scan, problems)
    _verify_tips(scan, beats, problems)
    problems.extend(audit_ledger(store, run_id=scan.run_id, fragments=scan.fragment_ids()).problems)
    return problems


def _verify_tips(scan: _Scan, beats: list[tuple[dict[str, Any], float]], problems: list[str]) -> None:
    """A newest manifest deleted leaves no gap: what tells of it is a version some syncer
    reported in its heartbeat, or checkpointed, above the newest manifest there is."""
    claimed: dict[int, tuple[int, str]] = {}
    for rec, _ in beats:
        for p, v in (rec.get("versions") or {}).items():
            if str(p).isdigit() and int(v) > claimed.get(int(p), (-1, ""))[0]:
                claimed[int(p)] = (int(v), layout.syncer_heartbeat_key(rec["epoch"]))
    for info in scan.under(layout.CHECKPOINT_ROOT):
        parsed = layout.parse_checkpoint_key(info.key)
        if parsed is not None and parsed[1] > claimed.get(parsed[0], (-1, ""))[0]:
            claimed[parsed[0]] = (parsed[1], info.key)
    for p in scan.fragment_ids():
        versions = [v for i in scan.under(layout.manifest_prefix(p))
                    if (v := layout.parse_num(i.key)) is not None and i.key == layout.manifest_key(p, v)]
        newest = max(versions, default=-1)
        v, where = claimed.get(p, (-1, ""))
        if v > newest:
            problems.append(f"{layout.manifest_key(p, newest + 1)}: missing: {where} names version {v} of fragment "
                            f"{p}, but its newest manifest is {newest} (a committed manifest was deleted)")


def _verify_fragment(scan: _Scan, p: int, problems: list[str]) -> int | None:
    """Checks fragment p's retained versions (see ``verify_run``); returns its newest one."""
    versions, manifests = _manifests(scan, p)
    if not versions:
        problems.append(f"{layout.manifest_prefix(p)}: fragment {p} has no committed version")
        return None
    present = set(versions)
    for v in range(versions[0], versions[-1] + 1):
        if v not in present:
            problems.append(f"{layout.manifest_key(p, v)}: missing: gap in the versions of fragment {p} "
                            f"(retained {versions[0]}..{versions[-1]})")
    shapes = expected_shapes(scan.plan, p) if scan.plan is not None else None
    numel = scan.plan.fragment_numel(p) if scan.plan is not None else None
    value: dict[str, torch.Tensor] | None = None
    prev_v: int | None = None
    for v in versions:
        mkey = layout.manifest_key(p, v)
        m = manifests.get(v)
        if m is None:  # already reported by _manifests
            value, prev_v = None, v
            continue
        good = _check_payloads(scan, p, m, problems)
        if shapes is None:
            continue
        broken_before = prev_v != v - 1 or value is None
        new = None
        if "delta" in good and not broken_before:
            key, data = good["delta"]
            try:
                new = codec.apply_published_delta(value, data, where=key, expected=shapes)
            except InvalidPayloadError as exc:
                problems.append(str(exc))
        if "full" in good:
            key, data = good["full"]
            try:
                full, _ = codec.decode_tensors(data, expected=shapes, max_numel=numel, where=key)
            except InvalidPayloadError as exc:
                problems.append(str(exc))
                full = None
            if full is not None and new is not None and any(not torch.equal(full[k], new[k]) for k in full):
                problems.append(f"{good['delta'][0]}: version {v - 1} plus this delta does not reproduce the "
                                f"keyframe {key}")
            new = full if full is not None else new
        if new is None and len(good) == len(m["payloads"]):  # no payload problem explains it
            why = (f"its delta needs version {v - 1}, which is not readable" if "delta" in good
                   else "it has no keyframe and no delta from the previous version")
            problems.append(f"{mkey}: version {v} of fragment {p} is not readable: {why}")
        value, prev_v = new, v
    _check_keyframes(scan, p, versions, manifests, problems)
    return versions[-1]


def _check_keyframes(scan: _Scan, p: int, versions: list[int], manifests: dict[int, dict[str, Any]],
                     problems: list[str]) -> None:
    """[W15]: a retained version carries a full payload exactly when the run's keyframe rule
    asks for one (under ``size``, checked from the first retained keyframe on, across no gap)."""
    run = scan.run
    if run is None or run.publish_codec == "none":
        return
    chain: KeyframeChain | None = None
    prev: int | None = None
    for v in versions:
        m = manifests.get(v)
        if m is None or prev != v - 1:
            chain = None
        prev = v
        if m is None:
            continue
        sizes = payload_sizes(m["payloads"])
        if v > 0 and (chain is not None or run.keyframe_rule == "every"):
            due = keyframe_due(v, publish_codec=run.publish_codec, keyframe_every=run.keyframe_every,
                               rule=run.keyframe_rule, chain=chain)
            if due != ("full" in sizes):
                problems.append(f"{layout.manifest_key(p, v)}: version {v} of fragment {p} "
                                f"{'has no' if due else 'has a'} full payload, but the run's keyframe rule "
                                f"({run.keyframe_rule}, keyframe_every {run.keyframe_every}) "
                                f"{'asks for one' if due else 'does not ask for one'} there [W15]")
        if "full" in sizes:
            chain = KeyframeChain(v, sizes["full"])
        elif chain is not None:
            chain = chain.after(v, sizes)


def _verify_replay(scan: _Scan, p: int, latest: int, problems: list[str]) -> None:
    """Replay fragment ``p`` from its newest checkpoint to its newest version, as a
    restarting syncer would (``replay.replay_check``: the same ``apply_decision``)."""
    if scan.plan is None or scan.run is None:
        return
    reader = FragmentReader(scan.store, run_id=scan.run.run_id, plan=scan.plan, fragment=p,
                            trust=signing.Trust(scan.store, run=scan.run))
    try:
        replay_check(scan.store, config=scan.run, plan=scan.plan, fragment=p, reader=reader, latest=latest)
    except (NotFound, InvalidPayloadError, ProtocolError) as exc:
        problems.append(f"fragment {p}: the ledger does not replay to version {latest} (what a restarting syncer "
                        f"does): {exc}")


def _check_payloads(scan: _Scan, p: int, m: dict[str, Any], problems: list[str]) -> dict[str, tuple[str, bytes]]:
    """Fetch every payload of manifest ``m``, checking name, size and sha256.
    Returns {kind: (key, bytes)} of the good ones."""
    v = m["version"]
    mkey = layout.manifest_key(p, v)
    good = {}
    for entry in m["payloads"]:
        key = entry["key"]
        if not key.startswith(layout.payload_prefix(p)) or layout.parse_num(key) != v:
            problems.append(f"{mkey}: names payload {key}, which is not a payload of fragment {p} version {v}")
            continue
        if entry["kind"] == "delta" and entry.get("base_version") != v - 1:
            problems.append(f"{mkey}: delta payload {key} has base version {entry.get('base_version')}, not {v - 1}")
            continue
        try:
            data = scan.store.get(key)
        except NotFound:
            problems.append(f"{key}: missing (named by {mkey})")
            continue
        if len(data) != entry["size"]:
            problems.append(f"{key}: size {len(data)} != {entry['size']} recorded in {mkey}")
        elif records.sha256_hex(data) != entry["sha256"]:
            problems.append(f"{key}: sha256 does not match the one recorded in {mkey}")
        else:
            good[entry["kind"]] = (key, data)
    return good


def _verify_checkpoints(scan: _Scan, problems: list[str]) -> None:
    for info in scan.under(layout.CHECKPOINT_ROOT):
        parsed = layout.parse_checkpoint_key(info.key)
        if parsed is None:
            continue  # a foreign object: inspect lists it under orphans
        p, v = parsed
        if scan.plan is None or p >= scan.plan.num_fragments:
            continue  # nothing to check the tensors against (already reported)
        shapes = checkpoint_shapes(scan.plan, p)
        try:
            tensors, header = codec.decode_tensors(scan.store.get(info.key), where=info.key,
                                                   max_numel=3 * scan.plan.fragment_numel(p))
            records.validate(header, "checkpoint", where=info.key)
        except NotFound:
            continue  # collected since the LIST
        except (InvalidPayloadError, ProtocolError) as exc:
            problems.append(str(exc))
            continue
        if (header["run_id"], header["fragment"], header["version"]) != (scan.run_id, p, v):
            problems.append(f"{info.key}: header names run {header['run_id']} fragment {header['fragment']} "
                            f"version {header['version']}, not its key's")
        elif any(k not in shapes or tuple(t.shape) != shapes[k] for k, t in tensors.items()):
            problems.append(f"{info.key}: checkpoint tensors do not match fragment {p}'s shapes")


# --------------------------------------------------------------------- status


__all__ = ["verify_run"]
