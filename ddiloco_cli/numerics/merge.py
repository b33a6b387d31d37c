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
cancels exactly. A term is v * (w / (W ||v||)), one multiply (for int4/int8 codes
q * (scale * that factor)), or (v / ||v||) * (w / W) where that factor is not safely
inside fp32's range.
A single weighted contribution passes through bit-exact. All weights zero gives
zeros.

Sparse contributions (``sparse.SparseTensor``) are merged on the union of their supports: each
term adds its sent values (times its factor) into the sum at their positions, and reads no
other element; their norms come from the sent values.

Contributions decoded with their codes kept (``quantized.DecodedTensors``, the syncer's
intake) are merged from the codes, range by range, with no full-size fp32 copy; their norms
come from the codes too, in fp64 (a tensor's norm is fp32). Syncer and replay decode the same
way, so they merge the same way.
"""

from __future__ import annotations

import hashlib
import math
from typing import Callable, Mapping, Sequence

import numpy as np
import torch

from ddiloco_cli.errors import InvalidPayloadError, UsageError
from ddiloco_cli.numerics import native
from ddiloco_cli.numerics.quantized import PER_BYTE, QABS, Quantized, Source, chunk_elems, q8_into, shape_of, sources
from ddiloco_cli.numerics.sparse import SparseTensor

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
    """No NaN or Inf in t. One sum (a NaN or Inf makes it NaN or Inf; 2x faster than amax and
    amin, 18x than isfinite().all() on CPU); only when it overflows, amax and amin (they
    propagate NaN) decide."""
    if not t.is_floating_point() or t.numel() == 0:
        return True
    if bool(torch.isfinite(t.sum())):
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


Item = tuple[float, Source, float]  # (weight, flat fp32 CPU vector or its codes, its norm)


def norm(src: Source) -> float:
    """The L2 norm of a tensor, or of a ``Quantized`` one from its codes (fp64, no dequantising).
    A tensor's is fp32 (one pass, no copy), redone in fp64 when the squares overflow fp32; it is
    NaN or Inf only when a value is."""
    if isinstance(src, (Quantized, SparseTensor)):
        return math.sqrt(src.sum_of_squares)
    n = float(torch.linalg.vector_norm(src))
    if not math.isfinite(n):
        n = float(torch.linalg.vector_norm(src, dtype=torch.float64))
    return n


def _item(v: Source, w: float) -> Item:
    if isinstance(v, (Quantized, SparseTensor)):
        return w, v, norm(v)
    flat = v.detach().to(device="cpu", dtype=torch.float32).reshape(-1)
    return w, flat, norm(flat)


def _dense(v: Source) -> torch.Tensor:
    return v.dense().reshape(-1) if isinstance(v, (Quantized, SparseTensor)) else v


def _canonical(items: list[Item]) -> list[Item]:
    """The items sorted into an order that depends only on the multiset of inputs, so
    every later sum runs in one canonical order."""

    def digest(v: Source) -> bytes:
        return hashlib.sha256(_dense(v).contiguous().numpy().tobytes()).digest()

    # sha256 only breaks exact (weight, norm) ties; equal digests mean equal inputs.
    ties: dict[tuple[float, float], int] = {}
    for w, _, n in items:
        ties[(w, n)] = ties.get((w, n), 0) + 1
    return sorted(items, key=lambda it: (it[0], it[2], digest(it[1]) if ties[(it[0], it[2])] > 1 else b""))


def _finish(out: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    return out.to(torch.float32).reshape(shape)


def _numel(v: Source) -> int:
    return v.numel if isinstance(v, (Quantized, SparseTensor)) else v.numel()


def _items(vectors: Sequence[torch.Tensor], weights: Sequence[float]) -> list[Item]:
    assert vectors, "need at least one vector"
    return [_item(v, w) for v, w in zip(vectors, _check_weights(weights, len(vectors)))]


def _trivial(items: list[Item], shape: tuple[int, ...]) -> torch.Tensor | None:
    """The result when the merge is trivial, else None: no weight at all gives zeros; one
    weighted contribution passes through bit-exact."""
    live = [item for item in items if item[0] > 0]
    if not live:
        return _finish(torch.zeros(_numel(items[0][1])), shape)
    if len(live) == 1:
        return _finish(_dense(live[0][1]).clone(), shape)
    return None


# A merge sums its terms range by range (MERGE_CHUNK_ELEMS values: the sum, one term and the
# codes stay in cache), every term of a range before the next range, instead of one pass over
# the whole vector per term; an int4/int8 contribution is read from its codes, without a
# full-size fp32 copy. Each value gets the same operations in the same order whatever the
# ranges (a term is rounded, then added).
MERGE_CHUNK_ELEMS = 1 << 16
# A factor in this range is a normal fp32 number with room to spare: a term v * f then neither
# overflows nor loses bits (|v / d * f| <= 1 for a unit vector times a weight in [0, 1]).
_ONE_MULTIPLY = (2.0 ** -100, 2.0 ** 100)

class _Dest:
    """Where a term writes the values of one range: ``t`` (the sum's range, for the first term, or
    the scratch), with its views made once per merge and shared by every term, as a range's
    views cost more than a small multiply (several microseconds each, for ~200 ranges x terms)."""

    __slots__ = ("t", "_views")

    def __init__(self, t: torch.Tensor):
        self.t = t
        self._views: dict = {}

    def flat(self) -> np.ndarray:
        """The range as a flat fp32 numpy array."""
        v = self._views.get(None)
        if v is None:
            v = self._views[None] = self.t.numpy()
        return v

    def blocks(self, block: int) -> torch.Tensor:
        """The range's whole blocks, as (blocks, block)."""
        v = self._views.get(block)
        if v is None:
            full = self.t.numel() // block * block
            v = self._views[block] = self.t[:full].view(-1, block)
        return v


Term = Callable[[int, int, _Dest], torch.Tensor]  # (start, stop, destination) -> the term's values there


class _CodesScratch:
    """One range's q as int8 (and as a tensor) and the unpacking's temporary, shared by every term
    of a merge (the terms of a range run one after another): ~100 KB that stay in cache."""

    __slots__ = ("q8", "q8_t", "tmp")

    def __init__(self, step: int):
        self.q8 = np.empty(step, dtype=np.int8)
        self.q8_t = torch.from_numpy(self.q8)
        self.tmp = np.empty(step // 2 + 1, dtype=np.uint16)


class _NativeCodesTerm:
    """``_codes_term`` by the compiled kernel (native.py): q * scale written into a range in one
    call, or added into the sum in place (``add_into``: the same fp32 product, then the same one
    addition as ``np.add`` of it, so the same bits), the GIL released."""

    __slots__ = ("codes", "scale", "block", "per_byte", "offset")

    def __init__(self, v: Quantized, scale: np.ndarray):
        self.codes, self.scale, self.block = v.codes, scale, v.block
        self.per_byte, self.offset = PER_BYTE[v.codec], QABS[v.codec]

    def _run(self, start: int, stop: int, base: np.ndarray | None, out: np.ndarray) -> None:
        m, b0, pb = stop - start, start // self.block, self.per_byte
        native.kernels.dequantize(self.codes[start // pb : -(-stop // pb)], self.scale[b0 : b0 + -(-m // self.block)],
                                  m, self.block, self.offset, pb, base, out)

    def __call__(self, start: int, stop: int, dest: _Dest) -> torch.Tensor:
        self._run(start, stop, None, dest.flat())
        return dest.t

    def add_into(self, start: int, stop: int, into: np.ndarray) -> None:
        self._run(start, stop, into, into)


def _codes_term(v: Quantized, scale: np.ndarray, scratch: _CodesScratch) -> Term | None:
    """q * scale of each block of v, for ranges [start, stop) that start on a block (and an even
    element): the products of ``Quantized.values`` (fp32 q times the block's fp32 scale, one
    rounding), as the range's q unpacked to int8 (``quantized.q8_into``: integer operations, no
    table lookups), converted into the range (exact), then one in-place multiply by the scales
    (torch's vectorised kernels; a table's lookups cost ~2 ns a value). With the compiled kernels
    the same products in one call (``_NativeCodesTerm``)."""
    if native.kernels is not None:
        return _NativeCodesTerm(v, scale)
    block, per_byte, codec = v.block, PER_BYTE[v.codec], v.codec
    scale_t = torch.from_numpy(scale)
    per_block = scale_t[:, None]
    codes = v.codes

    def term(start: int, stop: int, dest: _Dest) -> torch.Tensor:
        m, b0 = stop - start, start // block
        q8_into(codes[start // per_byte : -(-stop // per_byte)], codec, m, out=scratch.q8, tmp=scratch.tmp)
        t = dest.t
        t.copy_(scratch.q8_t[:m])
        rows = dest.blocks(block)
        k = rows.shape[0]
        if k:
            rows.mul_(per_block[b0 : b0 + k])
        if k * block < m:  # the tensor's partial last block
            t[k * block :].mul_(scale_t[b0 + k])
        return t

    return term


class _SparseTerm:
    """(v / d) * f of a sparse v: the sent values times c = f / d (one fp32 multiply), or where c
    is not safely inside fp32's range divided by d, then times f. Called as a ``Term`` it writes
    the range densely (the first term of a sum); ``add_into`` adds the range's sent values into
    the sum at their positions (positions are unique within a contribution)."""

    def __init__(self, v: SparseTensor, d: float | None, f: float):
        c = f if d is None else f / d
        if _ONE_MULTIPLY[0] <= c <= _ONE_MULTIPLY[1]:
            self.value = v.value * np.float32(c)
        else:
            value = v.value if d is None else v.value / np.float32(d)
            self.value = value * np.float32(f)
        self.index = v.index

    def _range(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        lo, hi = np.searchsorted(self.index, (start, stop))
        return self.index[lo:hi] - start, self.value[lo:hi]

    def __call__(self, start: int, stop: int, dest: _Dest) -> torch.Tensor:
        t = dest.t
        t.zero_()
        at, value = self._range(start, stop)
        dest.flat()[at] = value
        return t

    def add_into(self, start: int, stop: int, into: np.ndarray) -> None:
        at, value = self._range(start, stop)
        into[at] += value


def _sparse_sum(terms: list[_SparseTerm], n: int) -> torch.Tensor:
    """``_weighted_sum`` of sparse terms only, over the whole vector a term at a time: the first
    term's values written into zeros, every next one's added at its positions (``index_add_``,
    one fp32 add a sent value, as ``add_into``), so each value gets the same operations in the
    same order as range by range. A term's positions are sorted, so its adds run forward through
    the sum; with no dense term there is nothing a range would keep in cache, and one call a term
    instead of one a range and term is 3x faster at M = 64 (docs/results.md, "Syncer throughput")."""
    acc = torch.zeros(n, dtype=torch.float32)
    acc.numpy()[terms[0].index] = terms[0].value
    for term in terms[1:]:
        acc.index_add_(0, torch.from_numpy(term.index), torch.from_numpy(term.value))
    return acc


def _term(v: Source, d: float | None, f: float, scratch: _CodesScratch | None) -> Term:
    """(v / d) * f, d None for 1, as computed for the range [start, stop): one multiply by the
    factor c = f / d (for codes: by each block's scale times c, so q * (scale * c)), or, when c
    is not safely inside fp32's range, a division by d, then a multiply by f."""
    if isinstance(v, SparseTensor):
        return _SparseTerm(v, d, f)
    c = f if d is None else f / d
    if _ONE_MULTIPLY[0] <= c <= _ONE_MULTIPLY[1]:
        if isinstance(v, Quantized):
            # fl32(scale * c), the product in fp64 (numpy: a few small ops, not several torch calls)
            with np.errstate(over="ignore"):
                scaled = (v.scale.numpy().astype(np.float64) * c).astype(np.float32)
            if np.isfinite(scaled).all():  # a huge scale over zero codes could overflow: then the general way
                fast = _codes_term(v, scaled, scratch)  # (None: the tests' way to the reference below)
                if fast is not None:
                    return fast
                scale = torch.from_numpy(scaled)
                return lambda start, stop, dest: v.values(start, stop, out=dest.t, scale=scale)
        else:
            return lambda start, stop, dest: torch.mul(v[start:stop], c, out=dest.t)

    def general(start: int, stop: int, dest: _Dest) -> torch.Tensor:
        t = dest.t
        x = v.values(start, stop, out=t) if isinstance(v, Quantized) else v[start:stop]
        if d is not None:
            x = torch.div(x, d, out=t)
        return torch.mul(x, f, out=t)

    return general


def _weighted_sum(items: list[Item], factors: Sequence[tuple[float | None, float]]) -> torch.Tensor:
    """sum_i (v_i / d_i) * f_i over the items with f_i != 0, in the items' order (zeros if
    none): ``factors`` holds (d_i, f_i), d_i None for no division. fp32, flat. The sum starts
    from the first term itself, not from 0 + it (they differ only in the sign of a zero)."""
    n = _numel(items[0][1])
    blocks = [v.block for _, v, _ in items if isinstance(v, Quantized)]
    step = chunk_elems(math.lcm(1, *blocks), elems=MERGE_CHUNK_ELEMS)
    codes = _CodesScratch(min(step, n + n % 2)) if blocks else None  # only codes need it
    terms = [_term(v, d, f, codes) for (_, v, _), (d, f) in zip(items, factors) if f]
    if not terms:
        return torch.zeros(n, dtype=torch.float32)
    if all(isinstance(term, _SparseTerm) for term in terms):
        return _sparse_sum(terms, n)
    acc = torch.empty(n, dtype=torch.float32)
    scratch = torch.empty(min(step, n), dtype=torch.float32)
    whole = _Dest(scratch)  # the scratch of every whole range (its views made once)
    for start in range(0, n, step):
        stop = min(n, start + step)
        part = _Dest(acc[start:stop])
        t = whole if stop - start == scratch.numel() else _Dest(scratch[: stop - start])
        terms[0](start, stop, part)
        into = part.flat()
        for term in terms[1:]:
            if isinstance(term, (_SparseTerm, _NativeCodesTerm)):  # sparse: its sent values only (the
                term.add_into(start, stop, into)                   # union of the supports); codes: in place
            else:
                np.add(into, term(start, stop, t).numpy(), out=into)
    return acc


def _mean(items: list[Item], shape: tuple[int, ...]) -> torch.Tensor:
    total = math.fsum(w for w, _, _ in items)
    # normalised in float64 first: tiny weights cannot underflow in fp32
    return _finish(_weighted_sum(items, [(None, w / total) for w, _, _ in items]), shape)


def _rda(items: list[Item], shape: tuple[int, ...]) -> torch.Tensor:
    total = math.fsum(w for w, _, _ in items)
    radial = math.fsum(w * n for w, _, n in items) / total
    # unit vector, then a weight in [0, 1]: no over/underflow
    direction = _weighted_sum(items, [(n, w / total if w and n > 0 else 0.0) for w, _, n in items])
    dnorm = float(torch.linalg.vector_norm(direction))
    if dnorm < RDA_MIN_ALIGNMENT:  # the directions (nearly) cancel: RDA's direction is noise there
        return _mean(items, shape)
    if radial == 0:
        return _finish(torch.zeros_like(direction), shape)
    return _finish(direction.mul_(radial / dnorm), shape)


def _merge_items(items: list[Item], shape: tuple[int, ...], *, rda_merge: bool) -> torch.Tensor:
    items = _canonical(items)
    trivial = _trivial(items, shape)
    if trivial is not None:
        return trivial
    return _rda(items, shape) if rda_merge else _mean(items, shape)


def rda(vectors: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """Radial-Directional Averaging: the weighted mean norm times the direction of
    the weighted mean of unit vectors. fp32 result; zeros if all weights are 0 or
    the directions cancel exactly. A single contribution comes back bit-exact."""
    return _merge_items(_items(vectors, weights), tuple(vectors[0].shape), rda_merge=True)


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
    srcs = [sources(g) for g in grads]  # int4/int8 contributions as their codes: read in the merge's one pass
    shapes = {k: shape_of(srcs[0][k]) for k in keys}
    for i, g in enumerate(srcs):
        label = f"contribution {i}"
        if set(g) != set(keys):
            missing = sorted(set(keys) - set(g))
            extra = sorted(set(g) - set(keys))
            raise InvalidPayloadError(f"{label}: tensor keys differ (missing {missing}, extra {extra})")
        for k in keys:
            if shape_of(g[k]) != shapes[k]:
                raise InvalidPayloadError(f"{label}: tensor {k!r} has shape {list(shape_of(g[k]))}, "
                                          f"expected {list(shapes[k])}")
    ws = _check_weights(weights, len(grads))
    # the norms every merge needs are finite exactly when the values are: they stand in for a
    # separate finiteness pass, and check_finite only runs to name what is wrong
    items = {k: [_item(g[k], w) for g, w in zip(srcs, ws)] for k in keys}
    for i, g in enumerate(grads):
        if not all(math.isfinite(items[k][i][2]) for k in keys):
            check_finite(g, where=f"contribution {i}")
    out = {}
    for k in keys:
        # biases, norms, scalars: no direction to keep
        use_rda = not (method == "mean" or k in mean_keys or len(shapes[k]) <= 1)
        out[k] = _merge_items(items[k], shapes[k], rda_merge=use_rda)
    return out
