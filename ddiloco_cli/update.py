"""One outer update of a fragment: the only place a new version's value is computed.

Both the serving syncer (commit) and a restarting one (ledger replay) call
``outer_update``, so a replay reproduces a commit by construction, down to the
payload bytes (the replay checks their sha256 against the manifest).

The update (PROTOCOL.md "Merge semantics"):

1. the outer gradient of each contribution (``contribution_gradient``): by default against
   the current value, ``g_m = current - theta_m = (current - base_m) + delta_m``; or
   (``outer_gradient = delta``) the learner's progress on its own base, ``base_m - theta_m``;
2. merge (token-weighted RDA, or mean) with each weight times its staleness discount;
3. an outer Nesterov step on the *raw* (unquantised) value: one step per merge, or
   (``per_cycle``) one momentum step per cycle of the outer phase (one learner's share of
   a cycle per contribution), each merge applying its share of the gradient term at once
   and the momentum term when the phase crosses a whole number;
4. publish ``Q(raw_new - published)``: the new published value is
   ``published + decode(that)``, and ``raw_new - published_new`` (the residual)
   stays in ``raw`` for the next delta: true error feedback.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import torch

from ddiloco_cli.errors import InvalidPayloadError
from ddiloco_cli.merge import all_finite, is_embedding_key, merge_outer_gradients
from ddiloco_cli.outer import OuterOptimizer
from ddiloco_cli.published import EncodedVersion, encode_version

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
    accum: Tensors = field(default_factory=dict)  # per-cycle mode: this cycle's gradient so far ({}: none)
    phase: float = 0.0  # per-cycle mode: learner shares merged so far (manifest field `outer_phase`)


def contribution_gradient(delta: Tensors, *, prior: Tensors | None = None, base: Tensors | None = None,
                          current: Tensors | None = None) -> Tensors:
    """The outer gradient of one contribution (``outer_gradient`` in run.json):

    * ``current`` (pass ``base`` and ``current``, the published values of its base version and
      of the version it merges into): ``current - theta_m = (current - base_m) + delta_m``. A
      contribution on an older base pulls the fragment towards the learner's model, not past
      it: what the others merged since its base is not counted twice. ``base`` None: the base
      is the current version and the gradient is the delta itself, bit for bit.
    * ``delta``: the learner's progress on its own base, less ``prior`` (the delta of its
      earlier contribution on the same base that a previous version already merged).
    """
    if base is not None:
        assert current is not None
        return {k: (current[k] - base[k]) + t for k, t in delta.items()}
    if prior is not None:
        return {k: t - prior[k] for k, t in delta.items()}
    return delta


def merge_gradients(grads: Sequence[Tensors], weights: Sequence[float], *, method: str) -> Tensors:
    if len(grads) == 1:  # a single contribution passes through unchanged, bit for bit
        return grads[0]
    mean_keys = {k for k in grads[0] if is_embedding_key(k)}
    return merge_outer_gradients(grads, weights, method=method, mean_keys=mean_keys)


def outer_update(
    value: FragmentValue, *, fragment: int, grads: Sequence[Tensors], weights: Sequence[float], lr: float,
    method: str, publish_codec: str, block_size: int, keyframe_every: int, cycle: float, share: float,
    per_cycle: bool, publish_qmax: int | None = None,
) -> tuple[FragmentValue, EncodedVersion]:
    """The next version of ``value`` from the contributions' outer gradients; ``cycle`` is the
    new staleness clock, ``share`` the part of a cycle this merge is (per_cycle). Pure:
    ``value`` (and its optimizer) are left as they were, so a lost commit needs no rollback.

    ``per_cycle``: a merge that is exactly one whole cycle from a phase boundary (every
    learner once, in phase) takes the plain Nesterov step, bit-exact with torch.optim.SGD.
    Any other merge applies ``share`` of the gradient term and adds ``share * g`` to the
    cycle's gradient; crossing a whole number closes the cycle (momentum term, then the
    buffer update). Learners out of phase then move a fragment per cycle as far as one
    synchronous DiLoCo step, with momentum stepping once per cycle, not once per merge.

    Raises NonFiniteUpdate when the merged gradient or the new published value has a
    NaN or Inf (e.g. a huge but finite contribution overflowed fp32)."""
    merged = merge_gradients(grads, weights, method=method)
    for k, t in merged.items():
        if not all_finite(t):
            raise NonFiniteUpdate(f"fragment {fragment}: the merged outer gradient of {k!r} is not finite")
    phase = value.phase + share if per_cycle else value.phase
    accum: Tensors = {}
    whole_cycle = share == 1.0 and not value.accum and value.phase == math.floor(value.phase)
    if not per_cycle or whole_cycle:
        raw, outer = value.outer.stepped(value.raw, merged, lr=lr)  # into new tensors: value is kept
    else:
        outer = value.outer.copy()
        outer.lr = lr
        raw = {k: t.clone() for k, t in value.raw.items()}
        outer.gradient_part(raw, merged, fraction=share)
        accum = {k: (value.accum[k] + share * g) if value.accum else share * g for k, g in merged.items()}
        if math.floor(phase) > math.floor(value.phase):
            outer.close_cycle(raw, accum)
            accum = {}
    encoded = encode_version(fragment=fragment, version=value.version + 1, new_value=raw,
                             prev_published=value.published, publish_codec=publish_codec,
                             block_size=block_size, keyframe_every=keyframe_every, qmax=publish_qmax)
    for k, t in encoded.published.items():
        if not all_finite(t) or not all_finite(raw[k]):
            raise NonFiniteUpdate(f"fragment {fragment}: the new value of {k!r} is not finite")
    return FragmentValue(value.version + 1, encoded.published, raw, outer, cycle, accum, phase), encoded
