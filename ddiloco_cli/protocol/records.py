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
import itertools
import json
import logging
import math
import re
import uuid
from importlib import resources
from typing import Any

from ddiloco_cli.errors import DdilocoError, ProtocolError
from ddiloco_cli.protocol import layout, schemacheck

log = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
PROTOCOL_MINOR = 0
FEATURES: tuple[str, ...] = ()  # features every run of this writer uses
SIGNATURES = "signatures"  # listed by runs that require signed contributions (PROTOCOL.md, "Signatures")
# listed by runs whose keyframes follow the size rule (run.json keyframe_rule = "size", since 0.2.4): a
# reader or GC of 0.2.3 would look for keyframes at multiples of keyframe_every and delete the chain's start
KEYFRAMES_BY_SIZE = "keyframes_by_size"
KNOWN_FEATURES = frozenset((*FEATURES, SIGNATURES, KEYFRAMES_BY_SIZE))  # a run.json listing a feature not here is refused

RECORD_TYPES = (
    "run",
    "plan",
    "manifest",
    "contribution",
    "epoch",
    "syncer_heartbeat",
    "learner_heartbeat",
    "learner_state",
    "checkpoint",
    "quarantine",
    "latest",
    "admission",
)


# Bounds of the one JSON parser every reader of bucket bytes uses (PROTOCOL.md [R7]).
MAX_RECORD_BYTES = 16 << 20  # a JSON record; a manifest of 10k contributions is ~3 MB
MAX_JSON_DEPTH = 32  # the deepest record (a manifest) nests 4 levels
UNHOOKED_MIN_BYTES = 8192  # a record this large has its numbers checked on its text, not one Python call each
MAX_INT_DIGITS = 20  # sign included; every integer field is further bounded by its schema
MAX_SAFE_INT = 2**53 - 1  # the schemas' "maximum" for integers: exact in every JSON reader

# Errors that parsing or validating hostile bytes can raise besides our own: too deep
# (RecursionError), too many digits or bad UTF-8 (ValueError), too large for a float
# (OverflowError), an allocation that cannot be served (MemoryError).
PARSE_ERRORS = (ValueError, RecursionError, OverflowError, MemoryError)

# a JSON string, unrolled so the regex engine never backtracks
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_OPENING = b"[{"


class NewerProtocolError(ProtocolError):
    """A record written by a newer ddiloco protocol: the message says to upgrade."""


class _TooLarge(ValueError):
    pass


def _parse_int(text: str) -> int:
    if len(text) > MAX_INT_DIGITS:
        raise _TooLarge(f"an integer with {len(text)} digits (at most {MAX_INT_DIGITS})")
    return int(text)


def _parse_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _TooLarge(f"number {text[:40]} is out of the float range")
    return value


def _parse_constant(text: str) -> float:
    raise _TooLarge(f"{text} is not JSON")


def _outside_strings(data: bytes) -> bytes | None:
    """The text of JSON ``data`` outside its strings, when it has no backslash (no escape can
    then hide a quote, so every other piece between quotes is a string); else None."""
    if b"\\" in data:
        return None
    return b"".join(data.split(b'"')[::2])


def _plain_numbers(outside: bytes) -> bool:
    """Whether no number in ``outside`` (JSON text outside its strings) needs the checks of
    ``parse_json``'s hooks: no run of more than MAX_INT_DIGITS digits and minus signs (an integer
    over the bound, sign included), no exponent of three digits (without one, and with at most
    MAX_INT_DIGITS digits before its point, a number is below 1e120: finite), no NaN or Infinity.
    Then the C scanner alone gives the values the hooked parse gives, without a Python call a
    number (most of the parse of a 64-contribution manifest)."""
    if b"NaN" in outside or b"Infinity" in outside:
        return False
    if b"0" * (MAX_INT_DIGITS + 1) in outside.translate(_DIGIT_RUNS):
        return False
    exponents = outside.translate(_EXPONENTS)
    return b"e000" not in exponents and b"e+000" not in exponents


_DIGIT_RUNS = bytes(ord("0") if ord("0") <= b <= ord("9") or b == ord("-") else ord(" ") for b in range(256))
_EXPONENTS = bytes(ord("0") if ord("0") <= b <= ord("9") else ord("+") if b in b"+-" else ord("e") if b in b"eE"
                   else ord(" ") for b in range(256))


def json_depth(data: bytes, outside: bytes | None = None) -> int:
    """The nesting depth of JSON ``data`` without recursion: strings removed (``outside``, the
    text outside them, when the caller has it), then a running sum over the brackets. Exact for
    valid JSON (invalid JSON fails to parse anyway)."""
    if outside is None:
        outside = _outside_strings(data)
    brackets = (_JSON_STRING.sub(b"", data) if outside is None else outside).translate(None, _NOT_BRACKETS)
    if not brackets:
        return 0
    if len(brackets) < 4096:  # a record's few brackets: no numpy (commands like `status` never import it)
        return max(itertools.accumulate(1 if c in _OPENING else -1 for c in brackets))
    import numpy as np

    codes = np.frombuffer(brackets, dtype=np.uint8)
    steps = np.where((codes == ord("[")) | (codes == ord("{")), 1, -1).astype(np.int32)
    return int(np.cumsum(steps).max())


def parse_json(
    data: bytes | str, *, where: str, max_bytes: int = MAX_RECORD_BYTES, error: type[DdilocoError] = ProtocolError
) -> Any:
    """Parse JSON read from the bucket within bounds: UTF-8, at most ``max_bytes`` bytes,
    ``MAX_JSON_DEPTH`` levels, ``MAX_INT_DIGITS`` digits per integer, finite numbers only.

    Raises ``error("<where>: what is wrong")``; never RecursionError, ValueError or
    OverflowError, whatever the bytes.
    """
    raw = data.encode() if isinstance(data, str) else bytes(data)
    if len(raw) > max_bytes:
        raise error(f"{where}: {len(raw)} bytes of JSON exceed the bound of {max_bytes}")
    try:
        text = raw.decode("utf-8")  # UTF-8 only: in it no byte of a multi-byte character looks like a bracket
        deep = raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH
        # the text outside the strings: for the depth, and for the numbers where their hooks cost more than it
        outside = _outside_strings(raw) if deep or len(raw) > UNHOOKED_MIN_BYTES else None
        # no deeper than its number of opening brackets: count the depth only when that could exceed the bound
        if deep:
            depth = json_depth(raw, outside)
            if depth > MAX_JSON_DEPTH:
                raise _TooLarge(f"nested {depth} levels deep (at most {MAX_JSON_DEPTH})")
        if outside is not None and _plain_numbers(outside):
            return json.loads(text)
        return json.loads(text, parse_int=_parse_int, parse_float=_parse_float, parse_constant=_parse_constant)
    except PARSE_ERRORS as exc:
        raise error(f"{where}: not valid JSON ({one_line(exc)})") from None


def one_line(value: object, limit: int = 200) -> str:
    """``str(value)`` on one line, at most ``limit`` characters (for messages about bucket content)."""
    text = " ".join(str(value).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def new_nonce() -> str:
    return uuid.uuid4().hex


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@functools.cache
def _schema(record_type: str) -> dict[str, Any]:
    return json.loads(resources.files("ddiloco_cli").joinpath(f"schemas/{record_type}.schema.json").read_text())


@functools.cache
def _validator(record_type: str) -> Any:
    """jsonschema's validator of ``record_type``, imported on first use: it decides and
    explains only what the compiled check refuses."""
    import jsonschema

    schema = _schema(record_type)
    cls = jsonschema.validators.validator_for(schema)
    return cls(schema, format_checker=_formats())


@functools.cache
def _fast_check(record_type: str) -> schemacheck.Check:
    """The compiled yes/no check of ``record_type`` (schemacheck); never-yes if its schema
    uses a keyword the compiler does not implement (then jsonschema decides every time)."""
    try:
        return schemacheck.compile_schema(_schema(record_type), formats=_FORMAT_CHECKS)
    except schemacheck.Unsupported as exc:
        log.warning("schema %s: %s; validating with jsonschema only", record_type, exc)
        return lambda record: False


# The schemas name the learner-id grammar by format; its one definition is in layout.
_FORMAT_CHECKS = {"ddiloco-learner-id": lambda value: not isinstance(value, str) or layout.valid_learner_id(value)}


@functools.cache
def _formats() -> Any:
    import jsonschema

    formats = jsonschema.FormatChecker(formats=())
    for name, check in _FORMAT_CHECKS.items():
        formats.checks(name)(check)
    return formats


def make(record_type: str, **fields: Any) -> dict[str, Any]:
    """A new record of ``record_type`` with the format and protocol version set."""
    assert record_type in RECORD_TYPES, record_type
    return {"format": f"ddiloco.{record_type}", "protocol_version": PROTOCOL_VERSION, **fields}


def dumps(record: dict[str, Any]) -> bytes:
    """Canonical bytes of a record (sorted keys): equal records give equal bytes."""
    return (json.dumps(record, sort_keys=True, separators=(",", ":"), allow_nan=False) + "\n").encode()


def _best_error(record_type: str, record: Any) -> Any:
    import jsonschema

    return jsonschema.exceptions.best_match(_validator(record_type).iter_errors(record))


def validate(record: Any, record_type: str, *, where: str) -> dict[str, Any]:
    """Check ``record`` against its schema and protocol version; return it.

    Raises ProtocolError naming ``where`` and the first violation.
    """
    if not isinstance(record, dict):
        raise ProtocolError(f"{where}: expected a JSON object, got {type(record).__name__}")
    version = record.get("protocol_version")
    if isinstance(version, int) and version > PROTOCOL_VERSION:
        raise NewerProtocolError(
            f"{where} was written with ddiloco protocol version {version}, this ddiloco "
            f"speaks version {PROTOCOL_VERSION}: upgrade ddiloco (pip install -U ddiloco)"
        )
    # the compiled check accepts the common case fast; jsonschema has the last word otherwise
    error = None if _fast_check(record_type)(record) else _best_error(record_type, record)
    if error is not None:
        path = "/".join(str(p) for p in error.absolute_path) or "(top level)"
        raise ProtocolError(f"{where}: not a valid {record_type} record at {path}: {one_line(error.message)}")
    unknown = sorted(set(record.get("features") or ()) - KNOWN_FEATURES) if record_type == "run" else []
    if unknown:
        raise ProtocolError(f"{where} needs protocol features {unknown} that this ddiloco does not know: "
                            "upgrade ddiloco (pip install -U ddiloco)")
    return record


# (record type, digest of the bytes) that validated: the same bytes validate the same way every
# time, and manifests are read again and again (restores, replays, audits). A digest, not the
# bytes: the set stays small (4096 x 16 B). Cleared whole when full.
_VALIDATED: set[tuple[str, bytes]] = set()
VALIDATED_MAX = 4096  # entries
VALIDATED_MAX_BYTES = 1 << 16  # larger records are validated every time


def loads(data: bytes, record_type: str, *, where: str) -> dict[str, Any]:
    """Parse (bounded: ``parse_json``) and validate a JSON record read from the bucket.
    Raises ProtocolError (NewerProtocolError for a newer protocol version)."""
    record = parse_json(data, where=where)
    raw = data.encode() if isinstance(data, str) else bytes(data)
    key = (record_type, hashlib.blake2b(raw, digest_size=16).digest()) if len(raw) <= VALIDATED_MAX_BYTES else None
    if key is not None and key in _VALIDATED:
        return record
    validate(record, record_type, where=where)
    if key is not None:
        if len(_VALIDATED) >= VALIDATED_MAX:
            _VALIDATED.clear()
        _VALIDATED.add(key)
    return record
