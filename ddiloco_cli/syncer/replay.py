"""Restoring a fragment's outer state: the newest checkpoint plus a replay of the ledger.

A checkpoint (PROTOCOL.md "Outer-optimizer checkpoints") holds, as of version V,
the Nesterov momentum buffers (tensor keys as in the plan) and the raw,
unquantised value (keys prefixed ``raw/``). The replay applies ``update.apply_decision``
(the same function a commit uses) to the decision every manifest after V records, and checks that the payloads it re-encodes have the sha256 the
manifest recorded: the restored state is then the committing syncer's, bit for
bit, residual included [M4].
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from ddiloco_cli.errors import InvalidPayloadError, ProtocolError
from ddiloco_cli.numerics import codec
from ddiloco_cli.numerics.outer import OuterOptimizer
from ddiloco_cli.protocol import layout, ledger, records
from ddiloco_cli.protocol.fragments import FragmentPlan
from ddiloco_cli.protocol.published import FragmentReader, expected_shapes
from ddiloco_cli.protocol.runconfig import RunConfig
from ddiloco_cli.protocol.typed_records import LedgerEntry, Manifest
from ddiloco_cli.store.base import NotFound, Store
from ddiloco_cli.syncer.update import ApplyRules, Decision, FragmentValue, apply_decision

log = logging.getLogger(__name__)

Tensors = dict[str, torch.Tensor]
Fetch = Callable[[int, str, str], Tensors]  # (fragment, key, sha256) -> a used contribution's tensors
RAW_PREFIX = "raw/"  # plan keys never contain "/" (they are parameter names and row ranges)
REPLAY_BASES = 64  # published values a replay keeps for contributions' bases (older ones are re-read)


def manifest_cycle(manifest: dict[str, Any]) -> float:
    """The fragment's cycle clock at a version. Manifests without it (version 0, older
    writers) count one cycle per version."""
    return float(manifest.get("cycle", manifest["version"]))


def staleness_floor(store: Store, *, run_id: str, fragment: int, latest: int, max_staleness: float) -> int:
    """The oldest version whose cycle clock is within ``max_staleness`` cycles of ``latest``'s:
    a pending contribution on an older base is refused anyway, so GC may retire the versions
    before it (a syncer judges staleness from the base's manifest). 0 when a manifest in
    between cannot be read (nothing can then be proven unneeded)."""
    v = latest
    try:
        oldest_cycle = manifest_cycle(ledger.read_manifest(store, fragment, latest, run_id=run_id)) - max_staleness
        while v > 0 and manifest_cycle(ledger.read_manifest(store, fragment, v - 1, run_id=run_id)) >= oldest_cycle:
            v -= 1
    except (NotFound, ProtocolError):
        return 0
    return v


def replay_base_floor(store: Store, *, run_id: str, fragment: int, checkpoint: int, latest: int) -> int:
    """The oldest base version a replay from ``checkpoint`` to ``latest`` reads (every used
    contribution is measured against its base's published value), at most ``checkpoint``; 0
    when a manifest in between cannot be read."""
    floor = checkpoint
    try:
        for v in range(checkpoint + 1, latest + 1):
            m = ledger.read_manifest(store, fragment, v, run_id=run_id)
            floor = min([floor] + [int(e["base_version"]) for e in m["contributions"] if e["used"]])
    except (NotFound, ProtocolError):
        return 0
    return floor


def new_outer(config: RunConfig) -> OuterOptimizer:
    return OuterOptimizer(lr=config.outer_lr, momentum=config.outer_momentum,
                          nesterov=config.outer_momentum > 0)  # 0: plain averaged descent


def checkpoint_bytes(value: FragmentValue, *, run_id: str, fragment: int, epoch: int) -> tuple[str, bytes]:
    """(key, bytes) of the checkpoint of ``value``: momentum buffers plus the raw value."""
    header = records.make("checkpoint", run_id=run_id, fragment=fragment, version=value.version, epoch=epoch,
                          outer_steps=value.outer.num_steps, nonce=records.new_nonce(), raw_value=True)
    tensors = {**value.outer.state_tensors(), **{RAW_PREFIX + k: t for k, t in value.raw.items()}}
    data = codec.encode_tensors(tensors, codec="none", metadata=header)
    return layout.checkpoint_key(fragment, value.version, header["nonce"][:12]), data


def checkpoint_shapes(plan: FragmentPlan, fragment: int) -> dict[str, tuple[int, ...]]:
    """Keys and shapes of a checkpoint of ``fragment``: momentum and the raw value."""
    shapes = expected_shapes(plan, fragment)
    return {**shapes, **{RAW_PREFIX + k: s for k, s in shapes.items()}}


def decode_checkpoint(data: bytes, *, plan: FragmentPlan, fragment: int, where: str) -> tuple[Tensors, dict[str, Any]]:
    """(tensors, header) of checkpoint bytes, checked against the plan's keys and shapes and the
    schema. Raises InvalidPayloadError or ProtocolError (a checkpoint of the retired per-cycle
    momentum, header ``accum``, too)."""
    tensors, meta = codec.decode_tensors(data, expected=checkpoint_shapes(plan, fragment), where=where)
    records.validate(meta, "checkpoint", where=where)
    if meta.get("accum"):
        raise ProtocolError(f"{where}: a checkpoint of the retired per-cycle momentum (outer_lr_scaling = cycle)")
    return tensors, meta


def load_checkpoint(store: Store, *, config: RunConfig, plan: FragmentPlan, fragment: int,
                    latest: int) -> tuple[int, OuterOptimizer, Tensors] | None:
    """(version, optimizer, raw value) of the newest valid checkpoint at or below ``latest``,
    or None. Invalid ones are skipped with a warning [R4]."""
    shapes = expected_shapes(plan, fragment)
    infos = sorted(store.list(layout.checkpoint_prefix(fragment)), key=lambda i: i.key, reverse=True)
    for info in infos:
        v = layout.parse_num(info.key)
        if v is None or v > latest:
            continue
        try:
            tensors, meta = decode_checkpoint(store.get(info.key), plan=plan, fragment=fragment,
                                              where=f"{store.url}/{info.key}")
            if meta["run_id"] != config.run_id or meta["fragment"] != fragment or meta["version"] != v:
                raise ProtocolError(f"{info.key}: checkpoint header does not match its name or run")
            outer = new_outer(config)
            outer.load_state_tensors({k: t for k, t in tensors.items() if k in shapes}, expected=shapes)
        except (NotFound, InvalidPayloadError, ProtocolError) as exc:
            log.warning("skipping checkpoint %s: %s", info.key, exc)
            continue
        outer.num_steps = int(meta["outer_steps"])
        return v, outer, {k: tensors[RAW_PREFIX + k] for k in shapes}
    return None


def _start_value(config: RunConfig, reader: FragmentReader,
                 loaded: tuple[int, OuterOptimizer, Tensors] | None) -> FragmentValue:
    """Where a replay starts: a loaded checkpoint with its version's published value, or
    version 0 (no momentum; its raw value is the published one)."""
    if loaded is None:
        start = reader.read(0)
        return FragmentValue(0, start, start, new_outer(config), manifest_cycle(reader.manifest(0)))
    v, outer, raw = loaded
    return FragmentValue(v, reader.read(v), raw, outer, manifest_cycle(reader.manifest(v)))


def restore_value(store: Store, *, config: RunConfig, plan: FragmentPlan, fragment: int, reader: FragmentReader,
                  fetch: Fetch, latest: int,
                  republish: Callable[[int, list[tuple[str, bytes]]], None] | None = None) -> FragmentValue:
    """The outer state of ``fragment`` at version ``latest``: checkpoint + replay. A
    checkpoint whose version's published value cannot be read (a payload deleted or
    corrupt) is passed over for an older one, down to version 0. ``republish(v,
    payloads)`` is offered every replayed version's payloads as (recorded key, bytes),
    proven identical to the manifest's, so a syncer can put back the ones that are gone.
    If the replay cannot run (objects gone, or it does not reproduce the ledger), the
    state is the checkpoint's momentum with the published value of ``latest`` (residual
    lost), and an error is logged."""
    limit = latest
    while True:
        loaded = load_checkpoint(store, config=config, plan=plan, fragment=fragment, latest=limit)
        try:
            value = _start_value(config, reader, loaded)
            break
        except (NotFound, InvalidPayloadError) as exc:
            if loaded is None:
                raise
            log.warning("fragment %d: the value of checkpoint %d cannot be read (%s); trying an older one",
                        fragment, loaded[0], exc)
            limit = loaded[0] - 1
    if value.version == latest:
        return value
    try:
        return replay(config=config, fragment=fragment, reader=reader, fetch=fetch, start=value, latest=latest,
                      republish=republish)
    except (NotFound, InvalidPayloadError, ProtocolError) as exc:
        log.error("fragment %d: cannot replay the ledger from checkpoint %d (%s); continuing with the "
                  "checkpoint's momentum and no residual, which lags the committed trajectory",
                  fragment, value.version, exc)
        pub = reader.read(latest)
        return FragmentValue(latest, pub, pub, value.outer, manifest_cycle(reader.manifest(latest)))


def fetch_contribution(store: Store, plan: FragmentPlan, p: int, key: str, sha256: str) -> Tensors:
    """The tensors of the contribution a used ledger entry names, checked against its sha256
    (the ``Fetch`` of a replay)."""
    data = store.get(key)
    if records.sha256_hex(data) != sha256:
        raise InvalidPayloadError(f"{store.url}/{key}: sha256 differs from the ledger")
    tensors, _ = codec.decode_tensors(data, expected=expected_shapes(plan, p), max_numel=plan.fragment_numel(p),
                                      where=key, keep_codes=True)
    return tensors


def replay_check(store: Store, *, config: RunConfig, plan: FragmentPlan, fragment: int, reader: FragmentReader,
                 latest: int) -> int:
    """Replay the ledger of ``fragment`` from its newest checkpoint at or below ``latest``
    (version 0 when there is none) up to ``latest``: ``apply_decision`` of each manifest's
    decision must re-encode the payloads the manifest recorded (``inspect --verify``).
    Returns the version it started from; raises ProtocolError when a version is not
    reproduced, NotFound / InvalidPayloadError when an object it needs is gone or bad."""
    value = _start_value(config, reader, load_checkpoint(store, config=config, plan=plan, fragment=fragment,
                                                         latest=latest))
    if value.version < latest:
        replay(config=config, fragment=fragment, reader=reader,
               fetch=lambda p, key, sha256: fetch_contribution(store, plan, p, key, sha256),
               start=value, latest=latest)
    return value.version


class _LedgerInputs:
    """What a replay's ``apply_decision`` reads: contributions fetched by key and checked
    against the ledger's sha256, and the published values of their bases (recent ones kept)."""

    def __init__(self, *, fragment: int, reader: FragmentReader, fetch: Fetch):
        self.fragment, self.reader, self.fetch = fragment, reader, fetch
        self.bases: dict[int, Tensors] = {}  # published values of versions replayed so far

    def delta(self, entry: LedgerEntry) -> Tensors:
        return self.fetch(self.fragment, entry.key, entry.sha256)

    def base(self, version: int) -> Tensors:
        if version not in self.bases:
            self.bases[version] = self.reader.read(version)
        return self.bases[version]

    def replayed(self, value: FragmentValue) -> None:
        self.bases[value.version] = value.published
        if len(self.bases) > REPLAY_BASES:
            del self.bases[min(self.bases)]


def replay(*, config: RunConfig, fragment: int, reader: FragmentReader, fetch: Fetch, start: FragmentValue,
           latest: int, republish: Callable[[int, list[tuple[str, bytes]]], None] | None = None) -> FragmentValue:
    """``apply_decision`` of every version after ``start`` up to ``latest``, each decision
    read from its manifest; each version's re-encoded payloads go to ``republish`` once they
    are proven identical to the manifest's. Raises ProtocolError when they differ."""
    value = start
    rules = ApplyRules.of(config)
    inputs = _LedgerInputs(fragment=fragment, reader=reader, fetch=fetch)
    for v in range(start.version + 1, latest + 1):
        m = Manifest.from_json(reader.manifest(v))
        decision = Decision.from_manifest(m, default_lr=config.outer_lr)
        if not decision.used:
            raise ProtocolError(f"version {v} of fragment {fragment} merged nothing: not a syncer commit")
        previous = value
        value, encoded = apply_decision(previous, decision, rules=rules, inputs=inputs)
        inputs.replayed(previous)
        if m.payload_sha256() != {e["kind"]: e["sha256"] for _, _, e in encoded.payloads}:
            raise ProtocolError(f"replaying version {v} of fragment {fragment} does not reproduce its payloads")
        if republish is not None:  # under the names the manifest recorded (a re-encode draws a new nonce)
            names = {e["kind"]: e["key"] for e in m.payloads}
            republish(v, [(names[entry["kind"]], data) for _, data, entry in encoded.payloads])
    return value
