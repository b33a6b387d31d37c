"""Where every object lives in the bucket (protocol/PROTOCOL.md, "Bucket layout").

All keys are relative to the run root. Versions, sequence numbers and epochs
are zero-padded to 20 digits so that a lexicographic LIST is numeric order.
"""

from __future__ import annotations

import re

PAD = 20
RUN_CONFIG = "run.json"
PLAN = "plan.json"

_LEARNER_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def num(n: int) -> str:
    assert n >= 0, n
    return f"{n:0{PAD}d}"


def parse_num(s: str) -> int | None:
    """The integer encoded by a zero-padded name (extension stripped), or None."""
    stem = s.rsplit("/", 1)[-1].split(".", 1)[0].split("-", 1)[0]
    if len(stem) != PAD or not stem.isdigit():
        return None
    return int(stem)


def valid_learner_id(learner_id: str) -> bool:
    return bool(_LEARNER_ID.match(learner_id))


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


# -- learner contributions (outer gradients), named by (fragment, learner, seq) --
CONTRIBUTION_ROOT = "contributions/"


def contribution_prefix(p: int) -> str:
    return f"{CONTRIBUTION_ROOT}{frag(p)}/"


def parse_fragment_dir(key: str) -> int | None:
    """The fragment of a key under contributions/pNNNNN/..., or None."""
    m = re.match(r"^contributions/p(\d{5})/", key)
    return int(m.group(1)) if m else None


def contribution_key(p: int, learner_id: str, seq: int) -> str:
    return f"{contribution_prefix(p)}{learner_id}/{num(seq)}.safetensors"


def parse_contribution_key(key: str) -> tuple[int, str, int] | None:
    m = re.match(r"^contributions/p(\d{5})/([^/]+)/(\d{20})\.safetensors$", key)
    if not m:
        return None
    return int(m.group(1)), m.group(2), int(m.group(3))


def quarantine_key(original_key: str) -> str:
    return f"quarantine/{original_key}.json"


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


def learner_state_key(learner_id: str) -> str:
    """Non-authoritative resume hints of a learner (next sequence number per fragment)."""
    return f"{LEARNER_HEARTBEAT_PREFIX}{learner_id}/state.json"


# -- outer optimizer checkpoints --
def checkpoint_prefix(p: int) -> str:
    return f"checkpoints/{frag(p)}/"


def checkpoint_key(p: int, version: int, nonce: str) -> str:
    return f"{checkpoint_prefix(p)}{num(version)}-{nonce}.safetensors"


# scratch area for store-clock probes and temp objects; safe to delete any time
CLOCK_PREFIX = "tmp/clock/"
