"""Merging learner contributions into one outer gradient (PROTOCOL.md "Merge semantics").

- token weight  w = c_tokens^2 / c_steps
- RDA           (sum w|v| / sum w) * phi(sum w phi(v) / sum w),  phi(x) = x/|x|, phi(0) = 0
- weighted mean for embedding tensors, 0-d and 1-d tensors (or everywhere with method="mean"),
  and where the unit vectors cancel (||sum w phi(v)|| / sum w < RDA_MIN_ALIGNMENT)

Numerics: vectors are summed in fp32 (a merge is memory-bound; fp64 cost 3x: 69 vs
21 ms for RDA of 8 x 2.1M values), weights normalised in float64 first so tiny or
huge weights neither underflow nor overflow. Contributions are put into a
canonical order first (by weight, then norm, then sha256 of the bytes) and summed
in that order, each term rounded before it is added (no fused multiply-add), so
the result is bit-identical whatever order the caller lists them in, and v - v
cancels exactly.
A single weighted contribution passes through bit-exact. All weights zero gives
zeros.
"""

from __future__ import annotations

import hashlib
import math
from typing import Mapping, Sequence

import torch

from ddiloco_cli.errors import InvalidPayloadError, UsageError

# Below this norm of the weighted mean of unit vectors, ||sum w phi(v)|| / sum w, RDA returns
# the weighted mean instead: as the directions cancel, RDA would keep the full mean norm in a
# direction that is mostly rounding noise, while the mean shrinks continuously to zero.
RDA_MIN_ALIGNMENT = 1e-2
EMBEDDING_MARKERS = ("wte", "wpe", "embed", "tok_emb", "pos_emb", "lm_head", "word_embeddings")


def token_weight(c_tokens: int, c_steps: int) -> float:
    """tokens^2 / steps: more tokens, and more tokens per step (bigger batch), weigh
    more. 0 when no step was taken."""
    if c_tokens < 0 or c_steps < 0:
        raise InvalidPayloadError(f"negative counters: c_tokens={c_tokens}, c_steps={c_steps}")
    if c_steps == 0:
        return 0.0
    return float(c_tokens) * float(c_tokens) / float(c_steps)


def all_finite(t: torch.Tensor) -> bool:
    """No NaN or Inf in t. (amax/amin propagate NaN; two reductions are ~5x faster
    than isfinite().all() on CPU.)"""
    if not t.is_floating_point() or t.numel() == 0:
        return True
    return bool(torch.isfinite(t.amax())) and bool(torch.isfinite(t.amin()))


def check_finite(tensors: Mapping[str, torch.Tensor], *, where: str) -> None:
    """Raise InvalidPayloadError naming the first tensor with a NaN or Inf."""
    for key, t in tensors.items():
        if not all_finite(t):
            num_nan = int(torch.isnan(t).sum())
            num_inf = int(torch.isinf(t).sum())
            raise InvalidPayloadError(
                f"{where}: tensor {key!r} has non-finite values ({num_nan} NaN, {num_inf} Inf)"
            )


def is_embedding_key(key: str) -> bool:
    """Heuristic: does this parameter (or slice key) hold token/position embeddings
    or the output projection over the vocabulary? Those are merged by plain mean."""
    k = key.lower()
    return any(m in k for m in EMBEDDING_MARKERS)


def _check_weights(weights: Sequence[float], n: int) -> list[float]:
    if len(weights) != n:
        raise UsageError(f"{n} vectors but {len(weights)} weights")
    out = [float(w) for w in weights]
    for w in out:
        if not math.isfinite(w) or w < 0:
            raise InvalidPayloadError(f"merge weight must be finite and >= 0, got {w}")
    return out


Item = tuple[float, torch.Tensor, float]  # (weight, flat fp32 CPU vector, its norm)


def _item(v: torch.Tensor, w: float) -> Item:
    """(weight, flat fp32 CPU vector, norm). The norm is fp32 (one pass, no copy), redone in
    fp64 when the squares overflow fp32; it is NaN or Inf only when a value is."""
    flat = v.detach().to(device="cpu", dtype=torch.float32).reshape(-1)
    norm = float(torch.linalg.vector_norm(flat))
    if not math.isfinite(norm):
        norm = float(torch.linalg.vector_norm(flat, dtype=torch.float64))
    return w, flat, norm


def _canonical(items: list[Item]) -> list[Item]:
    """The items sorted into an order that depends only on the multiset of inputs, so
    every later sum runs in one canonical order."""

    def digest(v: torch.Tensor) -> bytes:
        return hashlib.sha256(v.to(torch.float32).contiguous().numpy().tobytes()).digest()

    # sha256 only breaks exact (weight, norm) ties; equal digests mean equal inputs.
    ties: dict[tuple[float, float], int] = {}
    for w, _, n in items:
        ties[(w, n)] = ties.get((w, n), 0) + 1
    return sorted(items, key=lambda it: (it[0], it[2], digest(it[1]) if ties[(it[0], it[2])] > 1 else b""))


def _finish(out: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return out.to(torch.float32).reshape(like.shape)


def _items(vectors: Sequence[torch.Tensor], weights: Sequence[float]) -> list[Item]:
    assert vectors, "need at least one vector"
    return [_item(v, w) for v, w in zip(vectors, _check_weights(weights, len(vectors)))]


def _trivial(items: list[Item], like: torch.Tensor) -> torch.Tensor | None:
    """The result when the merge is trivial, else None: no weight at all gives zeros; one
    weighted contribution passes through bit-exact."""
    live = [item for item in items if item[0] > 0]
    if not live:
        return _finish(torch.zeros(items[0][1].numel()), like)
    if len(live) == 1:
        return _finish(live[0][1].clone(), like)
    return None


# The sums below write each term into one scratch buffer (torch.mul/div with out=) instead of
# a fresh tensor per term: the same operations in the same order, so the same rounding, without
# an allocation per contribution.


def _mean(items: list[Item], like: torch.Tensor) -> torch.Tensor:
    total = math.fsum(w for w, _, _ in items)
    acc = torch.zeros(items[0][1].numel(), dtype=torch.float32)
    term = torch.empty_like(acc)
    for w, v, _ in items:
        if w:
            acc.add_(torch.mul(v, w / total, out=term))  # normalised in float64 first: tiny weights cannot underflow in fp32
    return _finish(acc, like)


def _rda(items: list[Item], like: torch.Tensor) -> torch.Tensor:
    total = math.fsum(w for w, _, _ in items)
    direction = torch.zeros(items[0][1].numel(), dtype=torch.float32)
    term = torch.empty_like(direction)
    radial = math.fsum(w * n for w, _, n in items) / total
    for w, v, n in items:
        if w and n > 0:
            # unit vector, then a weight in [0, 1]: no over/underflow
            direction.add_(torch.div(v, n, out=term).mul_(w / total))
    dnorm = float(torch.linalg.vector_norm(direction))
    if dnorm < RDA_MIN_ALIGNMENT:  # the directions (nearly) cancel: RDA's direction is noise there
        return _mean(items, like)
    if radial == 0:
        return _finish(torch.zeros_like(direction), like)
    return _finish(direction.mul_(radial / dnorm), like)


def _merge_items(items: list[Item], like: torch.Tensor, *, rda_merge: bool) -> torch.Tensor:
    items = _canonical(items)
    trivial = _trivial(items, like)
    if trivial is not None:
        return trivial
    return _rda(items, like) if rda_merge else _mean(items, like)


def weighted_mean(vectors: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """sum w v / sum w, fp32 result (zeros if all weights are 0)."""
    return _merge_items(_items(vectors, weights), vectors[0], rda_merge=False)


def rda(vectors: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """Radial-Directional Averaging: the weighted mean norm times the direction of
    the weighted mean of unit vectors. fp32 result; zeros if all weights are 0 or
    the directions cancel exactly. A single contribution comes back bit-exact."""
    return _merge_items(_items(vectors, weights), vectors[0], rda_merge=True)


def merge_outer_gradients(
    grads: Sequence[Mapping[str, torch.Tensor]],
    weights: Sequence[float],
    *,
    method: str = "rda",
    mean_keys: set[str] | frozenset[str] = frozenset(),
) -> dict[str, torch.Tensor]:
    """Merge per-learner outer gradients v_m (already against the current global
    value) tensor by tensor.

    method="rda": RDA for every key except those in `mean_keys` (embeddings, see
    `is_embedding_key`), which use the weighted mean; method="mean": weighted mean
    everywhere. All grads must have the same keys and shapes.

    Raises InvalidPayloadError on non-finite values or mismatched keys/shapes
    (naming the contribution and tensor), UsageError on an unknown method.
    """
    if method not in ("rda", "mean"):
        raise UsageError(f"unknown merge method {method!r}; use 'rda' or 'mean'")
    if not grads:
        raise UsageError("merge_outer_gradients needs at least one contribution")
    keys = list(grads[0])
    for i, g in enumerate(grads):
        label = f"contribution {i}"
        if set(g) != set(keys):
            missing = sorted(set(keys) - set(g))
            extra = sorted(set(g) - set(keys))
            raise InvalidPayloadError(f"{label}: tensor keys differ (missing {missing}, extra {extra})")
        for k in keys:
            if tuple(g[k].shape) != tuple(grads[0][k].shape):
                raise InvalidPayloadError(
                    f"{label}: tensor {k!r} has shape {list(g[k].shape)}, expected {list(grads[0][k].shape)}"
                )
    ws = _check_weights(weights, len(grads))
    # the norms every merge needs are finite exactly when the values are: they stand in for a
    # separate finiteness pass, and check_finite only runs to name what is wrong
    items = {k: [_item(g[k], w) for g, w in zip(grads, ws)] for k in keys}
    for i, g in enumerate(grads):
        if not all(math.isfinite(items[k][i][2]) for k in keys):
            check_finite(g, where=f"contribution {i}")
    out = {}
    for k in keys:
        # biases, norms, scalars: no direction to keep
        use_rda = not (method == "mean" or k in mean_keys or grads[0][k].dim() <= 1)
        out[k] = _merge_items(items[k], grads[0][k], rda_merge=use_rda)
    return out


def alpha_merge(local: torch.Tensor, global_value: torch.Tensor, alpha: float) -> None:
    """local <- alpha * local + (1 - alpha) * global_value, in place (any device and
    dtype; global_value is cast). alpha = 0 copies global_value exactly."""
    if not 0.0 <= alpha <= 1.0:
        raise UsageError(f"--alpha must be in [0, 1], got {alpha}")
    with torch.no_grad():
        if alpha == 0.0:
            local.copy_(global_value)
        elif alpha != 1.0:
            g = global_value.to(device=local.device, dtype=local.dtype)
            local.mul_(alpha).add_(g, alpha=1.0 - alpha)
