"""The protocol's JSON records: build, serialise, parse and validate them.

Every JSON object in the bucket carries ``format`` (its type) and
``protocol_version`` (the protocol major version). Readers validate against
the JSON Schemas in ``ddiloco_cli/schemas/`` (also at ``protocol/schemas/``),
ignore unknown fields, and refuse a newer major version with an upgrade
message (PROTOCOL.md, "Protocol evolution").
"""

from __future__ import annotations

import functools
import hashlib
import json
import uuid
from importlib import resources
from typing import Any

import jsonschema

from ddiloco_cli.errors import ProtocolError

PROTOCOL_VERSION = 1
PROTOCOL_MINOR = 0
FEATURES: tuple[str, ...] = ()  # features this writer uses; a run.json listing a feature not here is refused
KNOWN_FEATURES = frozenset(FEATURES)

RECORD_TYPES = (
    "run",
    "plan",
    "manifest",
    "contribution",
    "epoch",
    "syncer_heartbeat",
    "learner_heartbeat",
    "checkpoint",
    "quarantine",
    "latest",
)


def new_nonce() -> str:
    return uuid.uuid4().hex


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@functools.cache
def _validator(record_type: str) -> jsonschema.protocols.Validator:
    text = resources.files("ddiloco_cli").joinpath(f"schemas/{record_type}.schema.json").read_text()
    schema = json.loads(text)
    cls = jsonschema.validators.validator_for(schema)
    return cls(schema)


def make(record_type: str, **fields: Any) -> dict[str, Any]:
    """A new record of ``record_type`` with the format and protocol version set."""
    assert record_type in RECORD_TYPES, record_type
    return {"format": f"ddiloco.{record_type}", "protocol_version": PROTOCOL_VERSION, **fields}


def dumps(record: dict[str, Any]) -> bytes:
    """Canonical bytes of a record (sorted keys): equal records give equal bytes."""
    return (json.dumps(record, sort_keys=True, separators=(",", ":"), allow_nan=False) + "\n").encode()


def validate(record: Any, record_type: str, *, where: str) -> dict[str, Any]:
    """Check ``record`` against its schema and protocol version; return it.

    Raises ProtocolError naming ``where`` and the first violation.
    """
    if not isinstance(record, dict):
        raise ProtocolError(f"{where}: expected a JSON object, got {type(record).__name__}")
    version = record.get("protocol_version")
    if isinstance(version, int) and version > PROTOCOL_VERSION:
        raise ProtocolError(
            f"{where} was written with ddiloco protocol version {version}, this ddiloco "
            f"speaks version {PROTOCOL_VERSION}: upgrade ddiloco (pip install -U ddiloco)"
        )
    error = jsonschema.exceptions.best_match(_validator(record_type).iter_errors(record))
    if error is not None:
        path = "/".join(str(p) for p in error.absolute_path) or "(top level)"
        raise ProtocolError(f"{where}: not a valid {record_type} record at {path}: {error.message}")
    unknown = sorted(set(record.get("features") or ()) - KNOWN_FEATURES) if record_type == "run" else []
    if unknown:
        raise ProtocolError(f"{where} needs protocol features {unknown} that this ddiloco does not know: "
                            "upgrade ddiloco (pip install -U ddiloco)")
    return record


def loads(data: bytes, record_type: str, *, where: str) -> dict[str, Any]:
    """Parse and validate a JSON record read from the bucket."""
    try:
        record = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProtocolError(f"{where}: not valid JSON ({exc})") from exc
    return validate(record, record_type, where=where)
