"""Where every object lives in the bucket (protocol/PROTOCOL.md, "Bucket layout").

All keys are relative to the run root. Versions, sequence numbers and epochs
are zero-padded to 20 digits so that a lexicographic LIST is numeric order.
"""

from __future__ import annotations

import re

PAD = 20
RUN_CONFIG = "run.json"
PLAN = "plan.json"

# The one definition of the learner-id grammar (the schemas refer to it as the
# "ddiloco-learner-id" format). Always fullmatch: "$" would accept a trailing newline.
LEARNER_ID = r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}"
_LEARNER_ID = re.compile(LEARNER_ID)
_FRAG = r"p(?P<frag>[0-9]{5})"  # [0-9], not \d: \d also matches non-ASCII digits
_NUM = r"[0-9]{20}"
_NONCE = r"[A-Za-z0-9]+"


def num(n: int) -> str:
    assert n >= 0, n
    return f"{n:0{PAD}d}"


def parse_num(s: str) -> int | None:
    """The integer encoded by a zero-padded name (extension stripped), or None."""
    stem = s.rsplit("/", 1)[-1].split(".", 1)[0].split("-", 1)[0]
    if len(stem) != PAD or not (stem.isascii() and stem.isdigit()):
        return None
    return int(stem)


def valid_learner_id(learner_id: str) -> bool:
    return isinstance(learner_id, str) and _LEARNER_ID.fullmatch(learner_id) is not None


def frag(p: int) -> str:
    return f"p{p:05d}"


# -- global fragments: payloads first, then the manifest commits the version --
def fragment_prefix(p: int) -> str:
    return f"fragments/{frag(p)}/"


def manifest_prefix(p: int) -> str:
    return f"fragments/{frag(p)}/manifests/"


def manifest_key(p: int, version: int) -> str:
    return f"{manifest_prefix(p)}{num(version)}.json"


def payload_prefix(p: int) -> str:
    return f"fragments/{frag(p)}/payloads/"


def payload_key(p: int, version: int, kind: str, nonce: str) -> str:
    """kind: "full" (the exact value) or "delta" (from version - 1)."""
    return f"{payload_prefix(p)}{num(version)}-{kind}-{nonce}.safetensors"


def latest_hint_key(p: int) -> str:
    return f"fragments/{frag(p)}/latest.json"


_LATEST_HINT_KEY = re.compile(rf"fragments/{_FRAG}/latest\.json")


def is_latest_hint_key(key: str) -> bool:
    return _LATEST_HINT_KEY.fullmatch(key) is not None


# -- learner contributions (outer gradients), named by (fragment, learner, seq) --
CONTRIBUTION_ROOT = "contributions/"
CHECKPOINT_ROOT = "checkpoints/"


def contribution_prefix(p: int) -> str:
    return f"{CONTRIBUTION_ROOT}{frag(p)}/"


def parse_fragment_dir(key: str) -> int | None:
    """The fragment of a key under contributions/pNNNNN/..., or None."""
    m = re.match(rf"contributions/{_FRAG}/", key)
    return int(m.group(1)) if m else None


def contribution_key(p: int, learner_id: str, seq: int) -> str:
    return f"{contribution_prefix(p)}{learner_id}/{num(seq)}.safetensors"


_CONTRIBUTION_KEY = re.compile(rf"contributions/{_FRAG}/([^/]+)/({_NUM})\.safetensors")


def parse_contribution_key(key: str) -> tuple[int, str, int] | None:
    """(fragment, learner id, seq) of a contribution's name, or None. The learner id
    is whatever the name holds: callers check it with ``valid_learner_id``."""
    m = _CONTRIBUTION_KEY.fullmatch(key)
    if not m:
        return None
    return int(m.group(1)), m.group(2), int(m.group(3))


QUARANTINE_PREFIX = "quarantine/"


def quarantine_key(original_key: str) -> str:
    return f"{QUARANTINE_PREFIX}{original_key}.json"


def parse_quarantine_key(key: str) -> str | None:
    """The key a quarantine report is about, or None if ``key`` is not a report."""
    if not key.startswith(QUARANTINE_PREFIX) or not key.endswith(".json") or len(key) <= len(QUARANTINE_PREFIX) + 5:
        return None
    return key[len(QUARANTINE_PREFIX) : -len(".json")]


# -- syncer epochs (fencing) and heartbeats (lease) --
EPOCH_PREFIX = "syncers/epochs/"


def epoch_key(epoch: int) -> str:
    return f"{EPOCH_PREFIX}{num(epoch)}.json"


SYNCER_HEARTBEAT_PREFIX = "syncers/heartbeats/"


def syncer_heartbeat_key(epoch: int) -> str:
    return f"{SYNCER_HEARTBEAT_PREFIX}{num(epoch)}.json"


# -- learners --
LEARNER_HEARTBEAT_PREFIX = "learners/"


def learner_heartbeat_key(learner_id: str) -> str:
    return f"{LEARNER_HEARTBEAT_PREFIX}{learner_id}/heartbeat.json"


_LEARNER_HEARTBEAT_KEY = re.compile(rf"{LEARNER_HEARTBEAT_PREFIX}({LEARNER_ID})/heartbeat\.json")


def parse_learner_heartbeat_key(key: str) -> str | None:
    """The learner id a heartbeat key names, or None."""
    m = _LEARNER_HEARTBEAT_KEY.fullmatch(key)
    return m.group(1) if m else None


def learner_state_key(learner_id: str) -> str:
    """Where a learner's data stream stands (a resume hint, never authoritative; PROTOCOL "Learner state")."""
    return f"{LEARNER_HEARTBEAT_PREFIX}{learner_id}/state.json"


# -- metrics history (non-authoritative): rolling JSON-lines segments per writer --
METRICS_PREFIX = "metrics/"
METRICS_ROLES = ("learner", "syncer")


def metrics_prefix(role: str, writer_id: str) -> str:
    return f"{METRICS_PREFIX}{role}/{writer_id}/"


def metrics_segment_key(role: str, writer_id: str, segment: int, nonce: str) -> str:
    """nonce: 8 hex digits per writing process, so two processes never share a key."""
    return f"{metrics_prefix(role, writer_id)}{num(segment)}-{nonce}.jsonl"


_METRICS_KEY = re.compile(rf"metrics/(learner|syncer)/({LEARNER_ID})/({_NUM})-[0-9a-f]{{8}}\.jsonl")


def parse_metrics_key(key: str) -> tuple[str, str, int] | None:
    """(role, writer_id, segment) of a metrics segment key, or None."""
    m = _METRICS_KEY.fullmatch(key)
    return (m.group(1), m.group(2), int(m.group(3))) if m else None


# -- outer optimizer checkpoints --
def checkpoint_prefix(p: int) -> str:
    return f"{CHECKPOINT_ROOT}{frag(p)}/"


def checkpoint_key(p: int, version: int, nonce: str) -> str:
    return f"{checkpoint_prefix(p)}{num(version)}-{nonce}.safetensors"


_CHECKPOINT_KEY = re.compile(rf"checkpoints/{_FRAG}/({_NUM})-{_NONCE}\.safetensors")


def parse_checkpoint_key(key: str) -> tuple[int, int] | None:
    """(fragment, version) of a checkpoint's name, or None."""
    m = _CHECKPOINT_KEY.fullmatch(key)
    return (int(m.group(1)), int(m.group(2))) if m else None


# -- every name the protocol defines, by the category `ddiloco status` counts it in
_KEY_KINDS = [
    (re.compile(rf"fragments/{_FRAG}/manifests/{_NUM}\.json"), "manifests"),
    (re.compile(rf"fragments/{_FRAG}/payloads/{_NUM}-(?:full|delta)-{_NONCE}\.safetensors"), "payloads"),
    (_LATEST_HINT_KEY, "other"),
    (re.compile(rf"contributions/{_FRAG}/{LEARNER_ID}/{_NUM}\.safetensors"), "contributions"),
    (_CHECKPOINT_KEY, "checkpoints"),
    (re.compile(rf"syncers/heartbeats/{_NUM}\.json"), "heartbeats"),
    (_LEARNER_HEARTBEAT_KEY, "heartbeats"),
    (re.compile(rf"syncers/epochs/{_NUM}\.json"), "other"),
    (re.compile(rf"learners/{LEARNER_ID}/state\.json"), "other"),
    (re.compile(r"quarantine/.+\.json", re.DOTALL), "other"),
    (re.compile(r"tmp/.+", re.DOTALL), "other"),
    (re.compile(rf"metrics/(?:learner|syncer)/{LEARNER_ID}/{_NUM}-[0-9a-f]{{8}}\.jsonl"), "other"),
    (re.compile(r"(?:run|plan)\.json"), "other"),
    (re.compile(rf"admissions/{LEARNER_ID}\.json"), "other"),
]


_TENSOR_DIR = re.compile(r"(?:contributions/p([0-9]{5})/|fragments/p([0-9]{5})/payloads/|checkpoints/p([0-9]{5})/)")


def tensor_fragment(key: str) -> int | None:
    """The fragment of any object under a directory of tensor payloads (contributions,
    fragment payloads, checkpoints), whatever its name; None elsewhere."""
    m = _TENSOR_DIR.match(key)
    return int(next(g for g in m.groups() if g is not None)) if m else None


def key_kind(key: str) -> tuple[str, int | None] | None:
    """(category, fragment index or None) of a name the protocol defines; None for a
    foreign name. Categories: manifests, payloads, contributions, checkpoints,
    heartbeats, other."""
    for pattern, kind in _KEY_KINDS:
        m = pattern.fullmatch(key)
        if m is not None:
            frag = m.groupdict().get("frag")
            return kind, (int(frag) if frag is not None else None)
    return None


# scratch area for store-clock probes and temp objects; safe to delete any time
CLOCK_PREFIX = "tmp/clock/"


# -- admissions: which public key may sign as which learner or syncer id (signed by the admin key) --
ADMISSION_PREFIX = "admissions/"


def admission_key(member_id: str) -> str:
    return f"{ADMISSION_PREFIX}{member_id}.json"
