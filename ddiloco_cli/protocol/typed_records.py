"""Protocol records as frozen dataclasses: the one place their keys are spelled.

``records`` checks a record's bytes against its JSON schema; the classes here are what the
syncer side, replay and audit read and write instead of string-keyed dicts:

* ``LedgerEntry``: how one contribution ended in a manifest (used, superseded, refused);
* ``Manifest``: one committed version of a fragment (its ledger, payloads and outer step);
* ``SyncerHeartbeat`` and ``LearnerHeartbeat``: the liveness records.

``from_json`` takes a record that ``records.validate``/``records.loads`` accepted (so the
types are the schema's); keys this version does not know are kept in ``extra`` and
written back by ``to_json``, so a record round-trips whole. ``to_json`` omits fields that
are None, as the writers always have; ``format`` and ``protocol_version`` are added by
``records.make`` on the way out (``to_record``) and dropped on the way in.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping, TypeVar

from ddiloco_cli.protocol import records

USED, SUPERSEDED, REFUSED = "used", "superseded", "refused"
ENVELOPE = ("format", "protocol_version")  # written by records.make, checked by records.validate

R = TypeVar("R", bound="_Record")


class _Record:
    """from_json / to_json over a frozen dataclass's fields (``extra``: unknown keys)."""

    RECORD_TYPE: ClassVar[str]
    NESTED: ClassVar[dict[str, type]] = {}  # field -> record class of each item of a list field

    @classmethod
    def from_json(cls: type[R], record: Mapping[str, Any]) -> R:
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}  # type: ignore[arg-type]
        known = {k: tuple(v) if isinstance(v, list) else v for k, v in record.items() if k in names}
        for name, item_cls in cls.NESTED.items():
            if name in known:
                known[name] = tuple(item_cls.from_json(x) for x in known[name])
        extra = {k: v for k, v in record.items() if k not in names and k not in ENVELOPE}
        return cls(**known, extra=extra)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if f.name == "extra" or value is None:
                continue
            if f.name in self.NESTED:
                value = [x.to_json() for x in value]
            elif isinstance(value, tuple):
                value = list(value)
            elif isinstance(value, Mapping):
                value = dict(value)
            out[f.name] = value
        out.update(self.extra)  # type: ignore[attr-defined]
        return out

    def to_record(self) -> dict[str, Any]:
        """The record as written to the bucket (envelope added, schema-checked)."""
        return records.make(self.RECORD_TYPE, **self.to_json())


@dataclass(frozen=True)
class LedgerEntry(_Record):
    """One contribution's end in a manifest's ``contributions`` (PROTOCOL.md [W9]). A used
    one carries everything a replay needs: its bytes' sha256, base, weight and discount."""

    learner_id: str
    seq: int
    key: str
    size: int
    used: bool
    sha256: str | None = None
    base_version: int | None = None
    c_tokens: int | None = None
    c_steps: int | None = None
    weight: float | None = None
    status: str | None = None
    staleness: float | None = None
    discount: float | None = None
    merged_tokens: int | None = None
    increment_of: Mapping[str, Any] | None = None
    reason: str | None = None
    carried_by: int | None = None
    clip: float | None = None  # used: its delta scaled by this to the norm bound (None: 1)
    share_cap: float | None = None  # used: its weight cut by this to cap its learner's share (None: 1)
    norm: float | None = None  # used: its delta's norm as merged (after clip), for the running median
    extra: Mapping[str, Any] = field(default_factory=dict)

    RECORD_TYPE: ClassVar[str] = "ledger_entry"

    @property
    def final_status(self) -> str:
        """Its status; entries written before ``status`` existed say it with ``used``."""
        return self.status or (USED if self.used else SUPERSEDED)

    @property
    def effective_weight(self) -> float:
        """The merge weight of a used entry: token weight times staleness discount times the
        share cap times the norm clip (a delta cut to the bound also weighs that much less)."""
        return (float(self.weight) * float(1.0 if self.discount is None else self.discount)
                * float(1.0 if self.share_cap is None else self.share_cap)
                * float(1.0 if self.clip is None else self.clip))

    @property
    def tokens_merged(self) -> int:
        return int(self.c_tokens if self.merged_tokens is None else self.merged_tokens)


@dataclass(frozen=True)
class Manifest(_Record):
    """A committed version of a fragment (PROTOCOL.md "Version manifests")."""

    run_id: str
    fragment: int
    version: int
    epoch: int
    syncer_id: str
    nonce: str
    numel: int
    payloads: tuple[Mapping[str, Any], ...]
    contributions: tuple[LedgerEntry, ...]
    high_water: Mapping[str, int]
    outer_steps: int
    created_s: float | None = None
    quorum_size: int | None = None
    grace_s: float | None = None
    outer_lr: float | None = None
    cycle: float | None = None
    cycle_advance: float | None = None
    outer_intake: float | None = None
    signature: Mapping[str, Any] | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    RECORD_TYPE: ClassVar[str] = "manifest"
    NESTED: ClassVar[dict[str, type]] = {"contributions": LedgerEntry}

    @property
    def used(self) -> tuple[LedgerEntry, ...]:
        return tuple(e for e in self.contributions if e.used)

    @property
    def cycle_clock(self) -> float:
        """The fragment's cycle clock at this version; manifests without it (version 0, older
        writers) count one cycle per version."""
        return float(self.version if self.cycle is None else self.cycle)

    def payload_sha256(self) -> dict[str, str]:
        return {e["kind"]: e["sha256"] for e in self.payloads}


@dataclass(frozen=True)
class SyncerHeartbeat(_Record):
    """A syncer's liveness record for its epoch; its object's mtime is the lease clock."""

    epoch: int
    syncer_id: str
    fragments: tuple[int, ...]
    state: str
    run_id: str | None = None
    versions: Mapping[str, int] | None = None
    quorum_sizes: Mapping[str, int] | None = None
    num_merges: int | None = None
    num_quarantined: int | None = None
    time_s: float | None = None
    alerts: tuple[str, ...] | None = None  # what the syncer cannot fix itself (``status`` shows them)
    num_repairs: int | None = None  # ledger repairs it made (a manifest put back, junk deleted)
    repairs: tuple[str, ...] | None = None  # the last of them, one line each
    signature: Mapping[str, Any] | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    RECORD_TYPE: ClassVar[str] = "syncer_heartbeat"


@dataclass(frozen=True)
class LearnerHeartbeat(_Record):
    """A learner's liveness and progress record (the syncer reads state and step time)."""

    learner_id: str
    state: str
    step: int
    tokens: int
    run_id: str | None = None
    step_time_s: float | None = None
    time_s: float | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)  # loss, bytes, versions, host, ...

    RECORD_TYPE: ClassVar[str] = "learner_heartbeat"
