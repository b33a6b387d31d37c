"""One outer update of a fragment: the only place a new version's value is computed.

The syncer *decides* first (``Decision``: which contributions, their effective weights,
the outer lr, the cycle advance, what is superseded or refused and why); the decision is
the new manifest's ledger. Then ``apply_decision`` computes the new value, momentum and
published payload from the previous ``FragmentValue`` and the decision alone (plus the
run's fixed ``ApplyRules`` and the decoded contributions, ``Inputs``). The serving syncer
(commit) and a restarting one (ledger replay, ``Decision.from_manifest``) both call it, so
a replay reproduces a commit by construction, down to the payload bytes (the replay still
checks their sha256 against the manifest, as a guard).

The update (PROTOCOL.md "Merge semantics"):

1. the outer gradient of each contribution (``contribution_gradient``), measured against
   the current value: ``g_m = current - theta_m = (current - base_m) + delta_m`` (a sparse
   one: its sent values, ``delta_m``);
2. merge (token-weighted RDA, or mean) with each weight times its staleness discount;
3. one outer Nesterov step on the *raw* (unquantised) value;
4. publish ``Q(raw_new - published)``: the new published value is
   ``published + decode(that)``, and ``raw_new - published_new`` (the residual)
   stays in ``raw`` for the next delta: true error feedback.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol, Sequence

import torch

from ddiloco_cli.errors import InvalidPayloadError
from ddiloco_cli.numerics.merge import all_finite, is_embedding_key, merge_outer_gradients
from ddiloco_cli.numerics.outer import OuterOptimizer
from ddiloco_cli.numerics.quantized import sources
from ddiloco_cli.numerics.sparse import SparseTensor
from ddiloco_cli.protocol.published import EncodedVersion, encode_version
from ddiloco_cli.protocol.typed_records import LedgerEntry, Manifest

Tensors = dict[str, torch.Tensor]


class NonFiniteUpdate(InvalidPayloadError):
    """The merged gradient or the new value is not finite although every input was:
    nothing is committed."""


@dataclass
class FragmentValue:
    """What the outer loop of one fragment carries from version to version (the checkpoint
    holds all of it; ``published`` is re-read from the payloads)."""

    version: int
    published: Tensors  # the exact value every reader reconstructs
    raw: Tensors  # the unquantised value: published + the residual not yet published
    outer: OuterOptimizer
    cycle: float = 0.0  # the fragment's cycle clock (staleness) at this version (manifest field `cycle`)


def contribution_gradient(delta: Tensors, *, base: Tensors | None = None, current: Tensors | None = None) -> Tensors:
    """The outer gradient of one contribution: ``current - theta_m = (current - base_m) + delta_m``
    (``base`` and ``current``: the published values of its base version and of the version it
    merges into). A contribution on an older base pulls the fragment towards the learner's
    model, not past it: what the others merged since its base is not counted twice. ``base``
    None: the base is the current version and the gradient is the delta itself, bit for bit.

    A sparse contribution (``SparseTensor`` sources) is its sent values whatever its base
    (PROTOCOL [M6]): it carries 2% of the learner's progress and says nothing of the rest, so
    ``base - delta`` is no estimate of the learner's model; measured against the current value
    it would pull every unsent coordinate back to the stale base, and a sparse run whose
    versions came back a cycle late diverged that way (docs/sparse.md, "Versions a cycle late")."""
    if base is not None and not is_sparse(delta):
        assert current is not None
        return {k: (current[k] - base[k]) + t for k, t in delta.items()}
    return delta


def is_sparse(delta: Tensors) -> bool:
    """Whether a decoded contribution is in the sparse codec (its sources are ``SparseTensor``)."""
    return any(isinstance(t, SparseTensor) for t in sources(delta).values())


def merge_gradients(grads: Sequence[Tensors], weights: Sequence[float], *, method: str) -> Tensors:
    if len(grads) == 1:  # a single contribution passes through unchanged, bit for bit
        return grads[0]
    mean_keys = {k for k in grads[0] if is_embedding_key(k)}
    return merge_outer_gradients(grads, weights, method=method, mean_keys=mean_keys)


def outer_update(
    value: FragmentValue, *, fragment: int, grads: Sequence[Tensors], weights: Sequence[float], lr: float,
    method: str, publish_codec: str, block_size: int, keyframe: bool, cycle: float,
    publish_qmax: int | None = None, publish_density: float | None = None, intake: float = 1.0,
) -> tuple[FragmentValue, EncodedVersion]:
    """The next version of ``value`` from the contributions' outer gradients; ``cycle`` is the
    new staleness clock. Pure: ``value`` (and its optimizer) are left as they were, so a lost
    commit needs no rollback.

    Raises NonFiniteUpdate when the merged gradient or the new published value has a
    NaN or Inf (e.g. a huge but finite contribution overflowed fp32)."""
    merged = merge_gradients(grads, weights, method=method)
    for k, t in merged.items():
        if not all_finite(t):
            raise NonFiniteUpdate(f"fragment {fragment}: the merged outer gradient of {k!r} is not finite")
    raw, outer = value.outer.stepped(value.raw, merged, lr=lr, intake=intake)  # into new tensors: value is kept
    encoded = encode_version(fragment=fragment, version=value.version + 1, new_value=raw,
                             prev_published=value.published, publish_codec=publish_codec,
                             block_size=block_size, keyframe=keyframe, qmax=publish_qmax,
                             density=publish_density)
    for k, t in encoded.published.items():
        if not all_finite(t) or not all_finite(raw[k]):
            raise NonFiniteUpdate(f"fragment {fragment}: the new value of {k!r} is not finite")
    return FragmentValue(value.version + 1, encoded.published, raw, outer, cycle), encoded


# ------------------------------------------------------------------ decide, then apply
@dataclass(frozen=True)
class Decision:
    """What one merge does, decided by the syncer before any tensor moves; the ledger and
    outer fields of the manifest it commits (``manifest_fields``), and all ``apply_decision``
    needs besides the previous value. ``used`` entries carry their effective weight
    (``LedgerEntry.effective_weight``) and, for a resend on a merged base, ``increment_of``."""

    fragment: int
    version: int  # the version it makes
    used: tuple[LedgerEntry, ...]
    closed: tuple[LedgerEntry, ...] = ()  # superseded / refused, with reasons
    lr: float = 0.0
    cycle: float = 0.0  # the fragment's cycle clock at ``version``
    cycle_advance: float = 0.0
    intake: float = 1.0  # the part of the merged gradient the momentum buffer takes in (bounded catch-up)
    high_water: Mapping[str, int] = field(default_factory=dict)
    quorum_size: int = 0
    grace_s: float = 0.0
    keyframe: bool = False  # the version carries a full payload (``published.keyframe_due``)

    @property
    def weights(self) -> list[float]:
        return [e.effective_weight for e in self.used]

    @classmethod
    def from_manifest(cls, m: Manifest, *, default_lr: float) -> "Decision":
        """The decision a committed manifest records (replay and audit). Manifests of older
        writers lack the outer fields: ``default_lr`` (the run's outer lr), one cycle per
        version."""
        return cls(m.fragment, m.version, m.used, tuple(e for e in m.contributions if not e.used),
                   lr=float(default_lr if m.outer_lr is None else m.outer_lr), cycle=m.cycle_clock,
                   cycle_advance=float(m.cycle_advance or 0.0),
                   intake=float(1.0 if m.outer_intake is None else m.outer_intake), high_water=dict(m.high_water),
                   quorum_size=int(m.quorum_size or 0), grace_s=float(m.grace_s or 0.0),
                   keyframe="full" in m.payload_sha256())

    def manifest_fields(self) -> dict[str, Any]:
        """The manifest's fields this decision fills (the rest: who committed, payloads)."""
        fields = dict(fragment=self.fragment, version=self.version,
                      contributions=[e.to_json() for e in self.used + self.closed], quorum_size=self.quorum_size,
                      grace_s=self.grace_s, high_water=dict(self.high_water), outer_lr=self.lr, cycle=self.cycle,
                      cycle_advance=self.cycle_advance)
        if self.intake != 1.0:  # written only for a bounded catch-up: other manifests stay as they were
            fields["outer_intake"] = self.intake
        return fields


@dataclass(frozen=True)
class ApplyRules:
    """The run's fixed settings an update applies (run.json; the same for every version)."""

    merge: str
    publish_codec: str
    block_size: int
    publish_qmax: int | None = None
    publish_density: float | None = None  # the sparse codec's (run.json publish_density)

    @classmethod
    def of(cls, config: Any) -> "ApplyRules":
        return cls(merge=config.merge, publish_codec=config.publish_codec,
                   block_size=config.codec_block, publish_qmax=config.publish_qmax, publish_density=config.publish_density)


class Inputs(Protocol):
    """The tensors an update reads: held in memory by a committing syncer, fetched from the
    bucket (sha256-checked) by a replay."""

    def delta(self, entry: LedgerEntry) -> Tensors:
        """The decoded contribution of a used entry."""

    def base(self, version: int) -> Tensors:
        """The published value of ``version`` (a contribution's base)."""


def clipped(delta: Tensors, clip: float | None) -> Tensors:
    """A used contribution's delta as merged: scaled by its ledger entry's ``clip`` (the norm
    bound, ``judge.norm_clip``), or itself, bit for bit, when it was not clipped."""
    if clip is None or clip >= 1.0:
        return delta
    return {k: delta[k] * float(clip) for k in delta}


def hold(previous: FragmentValue, decision: Decision, *, rules: ApplyRules) -> tuple[FragmentValue, EncodedVersion]:
    """The version a merge of total weight 0 makes (counters that claim no work): no outer
    step and no momentum step; the raw value and optimizer carry over, and the payload
    publishes only what the residual still owes."""
    encoded = encode_version(fragment=decision.fragment, version=decision.version, new_value=previous.raw,
                             prev_published=previous.published, publish_codec=rules.publish_codec,
                             block_size=rules.block_size, keyframe=decision.keyframe,
                             qmax=rules.publish_qmax, density=rules.publish_density)
    return FragmentValue(decision.version, encoded.published, previous.raw, previous.outer, decision.cycle), encoded


def apply_decision(previous: FragmentValue, decision: Decision, *, rules: ApplyRules,
                   inputs: Inputs) -> tuple[FragmentValue, EncodedVersion]:
    """The next version from ``previous`` and ``decision``: each used contribution's outer
    gradient (``contribution_gradient``), then ``outer_update``. Pure but for ``inputs``'
    reads; raises NonFiniteUpdate, or whatever ``inputs`` raises when a tensor cannot be read."""
    assert decision.version == previous.version + 1, (decision.version, previous.version)
    if not any(w > 0 for w in decision.weights):
        return hold(previous, decision, rules=rules)
    deltas = [inputs.delta(e) for e in decision.used]
    # a sparse contribution is its sent values whatever its base (``contribution_gradient``), clipped or not
    grads = [contribution_gradient(clipped(d, e.clip), current=previous.published,
                                   base=inputs.base(int(e.base_version))
                                   if e.base_version != previous.version and not is_sparse(d) else None)
             for e, d in zip(decision.used, deltas)]
    return outer_update(previous, fragment=decision.fragment, grads=grads, weights=decision.weights,
                        lr=decision.lr, method=rules.merge, publish_codec=rules.publish_codec,
                        block_size=rules.block_size, keyframe=decision.keyframe, cycle=decision.cycle,
                        publish_qmax=rules.publish_qmax, publish_density=rules.publish_density,
                        intake=decision.intake)
