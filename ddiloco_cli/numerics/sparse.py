"""The sparse codec: chunk-wise Top-k with 2-bit values (SparseLoCo-style outer gradients).

A tensor of n elements is cut into chunks of ``chunk`` elements (the payload's block size;
the last chunk may be shorter). Each chunk sends its ``k`` largest values by magnitude:
their positions and a 2-bit code each, meaning {-2s, -s, +s, +2s} with one bf16 scale ``s``
per chunk, fitted by least squares to the chosen magnitudes. Everything else decodes to zero.

A short last chunk of length L sends ceil(k * L / chunk): a small tensor (a bias, a norm's
weight) is sent at about the same density as a large one.

The decompressed frame (codec.py wraps it in zstd and safetensors as for every codec), with
R = ceil(n / chunk) chunks and K = the number of sent values:

    R   bf16 scales (non-negative, finite)
    ceil(K / 4) bytes of codes, four per byte, the first in the low bits (0..3 meaning
        -2, -1, +1, +2 times the scale); the unused bits of the last byte are zero
    K   bytes: the low byte of each gap
    K   bytes: the high byte of each gap

Per chunk, the first gap is the first position and each next gap is ``position - previous
position - 1``: positions are strictly increasing by construction, and the decoder checks
the last one of each chunk lies inside it. The two byte planes compress well (most gaps
are below 256, so the high plane is nearly all zeros). Every size follows from n, chunk and
k, so the decoder checks them before decompressing, like the other codecs.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ddiloco_cli.errors import InvalidPayloadError
from ddiloco_cli.numerics.codecnames import SPARSE_DEFAULT_CHUNK as DEFAULT_CHUNK
from ddiloco_cli.numerics.codecnames import SPARSE_DEFAULT_DENSITY as DEFAULT_DENSITY
from ddiloco_cli.numerics.codecnames import topk

MAX_CHUNK = 1 << 16  # a gap fits in 16 bits
_MAX_BF16_BITS = 0x7F7F  # the largest finite bf16 (16 bits)
# the largest bf16 whose double is finite in fp32 (2 * s for the +-2 codes)
_BOUNDED_BF16 = 0x7EFF
# code -> its multiple of the scale
_CODE_VALUE = np.array([-2.0, -1.0, 1.0, 2.0], dtype=np.float32)


def check_params(chunk: int, k: int) -> None:
    """A frame's chunk size and per-chunk count must be ones an encoder can make."""
    if not (isinstance(chunk, int) and not isinstance(chunk, bool) and 1 <= chunk <= MAX_CHUNK):
        raise InvalidPayloadError(f"sparse chunk size must be in [1, {MAX_CHUNK}], got {chunk!r}")
    if not (isinstance(k, int) and not isinstance(k, bool) and 1 <= k <= chunk):
        raise InvalidPayloadError(f"sparse topk must be in [1, {chunk}], got {k!r}")


def _counts(n: int, chunk: int, k: int) -> tuple[int, int, int]:
    """(full chunks, length of the short last chunk (0: none), values it sends: k in proportion,
    rounded up)."""
    full, rest = divmod(n, chunk)
    return full, rest, -(-k * rest // chunk)


def sent_count(n: int, chunk: int, k: int) -> int:
    full, _, last_k = _counts(n, chunk, k)
    return full * k + last_k


def raw_nbytes(n: int, chunk: int, k: int) -> int:
    """A short last chunk of length L sends ceil(k * L / chunk): a small tensor (a bias, a norm's
weight) is sent at about the same density as a large one.

The decompressed frame's size for a tensor of n elements."""
    rows = -(-n // chunk)
    count = sent_count(n, chunk, k)
    return 2 * rows + -(-count // 4) + 2 * count


# --- encoding ----------------------------------------------------------------------------


_ROWS_AT_ONCE_ELEMS = 1 << 18  # the rows screened together: their magnitudes and mask stay in cache


def _partition_rows(rows: np.ndarray, k: int) -> np.ndarray:
    """:func:`_top_positions` by one partition of every row's keys (any width, any k), a few
    rows at a time in reused buffers that stay in cache."""
    nrows, width = rows.shape
    if k == width:
        return np.arange(nrows * width, dtype=np.int64).reshape(nrows, width)
    high_mask = np.int32(-(1 << max(1, (width - 1).bit_length())))
    column_key = (width - 1 - np.arange(width)).astype(np.int32)
    step = max(1, min(nrows, _ROWS_AT_ONCE_ELEMS // width))
    key_buf = np.empty((step, width), dtype=np.float32)
    part_buf = np.empty((step, width), dtype=np.int32)
    mask_buf = np.empty((step, width), dtype=bool)
    out = np.empty((nrows, k), dtype=np.int64)
    for r0 in range(0, nrows, step):
        r1 = min(nrows, r0 + step)
        a, part, mask = key_buf[: r1 - r0], part_buf[: r1 - r0], mask_buf[: r1 - r0]
        keys = a.view(np.int32)
        np.abs(rows[r0:r1], out=a)
        keys &= high_mask
        keys |= column_key
        np.copyto(part, keys)
        part.partition(width - k, axis=1)
        np.greater_equal(keys, part[:, width - k : width - k + 1], out=mask)  # each row's k-th largest key
        out[r0:r1] = np.flatnonzero(mask).reshape(-1, k)
        out[r0:r1] += r0 * width
    return out


def _screen_groups(width: int, k: int) -> int:
    """The number of column groups for the candidate screen of :func:`_select` (0: no screen):
    the power of two >= 4k, where it divides the row into groups of at least 4 (fewer, larger
    groups let more candidates through; more, smaller ones cost more to rank: 4k measured best,
    and groups of 2 gain little over the plain partition)."""
    groups = 1 << max(0, (4 * k - 1).bit_length())
    return groups if width % groups == 0 and width // groups >= 4 else 0


_ABS_BITS = np.int32(0x7FFFFFFF)  # an fp32's bits without its sign: its magnitude's (NaN too)


def _select(rows: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`_top_positions`, with the selected values: ((rows, k) int64 positions, (rows, k)
    fp32 values).

    A screen first cuts each row to a few candidates: the row's columns fall into G groups
    (column mod G, G >= 4k); the k-th largest of the G group maxima, t, has k values at or
    above it, so each of the row's k largest keys is at least t with its low bits cleared, and
    only the values whose bits reach that are candidates (about 1.2 k a row on outer
    gradients). The candidates' keys are then partitioned row by row, padded to the longest; a
    row with too many candidates (mostly equal magnitudes, zeros, so t is 0) goes to the plain
    per-row partition. The result is the set the plain partition selects, at about a third of
    its cost: the group maxima are one cheap pass (torch's reduction over the middle axis;
    numpy's is 4x slower) and the partition sees about 1/40 of the values. The candidates'
    values are taken while their rows are in cache."""
    nrows, width = rows.shape
    groups = _screen_groups(width, k)
    if not groups or nrows < 2:
        pos = _partition_rows(rows, k)
        return pos, rows.reshape(-1)[pos]
    high_mask = np.int32(-(1 << max(1, (width - 1).bit_length())))
    per = width // groups
    step = max(1, min(nrows, _ROWS_AT_ONCE_ELEMS // width))
    bits_buf = np.empty((step, width), dtype=np.int32)
    mask_buf = np.empty((step, width), dtype=bool)
    found, found_val = [], []
    heavy = np.zeros(nrows, dtype=bool)  # rows whose screen lets everything through
    for r0 in range(0, nrows, step):
        r1 = min(nrows, r0 + step)
        block = rows[r0:r1]
        bits, mask = bits_buf[: r1 - r0], mask_buf[: r1 - r0]
        np.bitwise_and(block.view(np.int32), _ABS_BITS, out=bits)
        gmax = torch.from_numpy(bits).view(r1 - r0, per, groups).amax(dim=1).numpy()
        gmax.partition(groups - k, axis=1)
        t = gmax[:, groups - k : groups - k + 1]  # the k-th largest group maximum
        t &= high_mask
        zero = heavy[r0:r1]
        np.equal(t[:, 0], 0, out=zero)  # fewer than k groups hold a nonzero: no screen
        t[zero] = _ABS_BITS  # no candidates (but a NaN of all ones, which the heavy rows drop)
        np.greater_equal(bits, t, out=mask)
        p = np.flatnonzero(mask)
        found_val.append(block.reshape(-1)[p])
        p += r0 * width
        found.append(p)
        if 2 * np.count_nonzero(zero) > zero.size:  # mostly zeros (a merge): the rest unscreened
            heavy[r1:] = True
            break
    pos, val = np.concatenate(found), np.concatenate(found_val)
    row = pos >> (width.bit_length() - 1) if width & (width - 1) == 0 else pos // width
    count = np.bincount(row, minlength=nrows)
    heavy |= count > 4 * k
    if heavy.all():
        pos = _partition_rows(rows, k)
        return pos, rows.reshape(-1)[pos]
    if not heavy.any() and int(count.max()) == k:
        return pos.reshape(nrows, k), val.reshape(nrows, k)
    out = None
    if heavy.any():  # rows of mostly equal magnitudes (zeros): their own partition
        out = np.empty((nrows, k), dtype=np.int64)
        hrows = np.flatnonzero(heavy)
        out[hrows] = _partition_rows(rows[hrows], k) + ((hrows - np.arange(hrows.size)) * width)[:, None]
        light = ~heavy[row]
        pos, val, row = pos[light], val[light], row[light]
        count[hrows] = 0
    padded = int(count.max()) if pos.size else k
    keys = (val.view(np.int32) & (_ABS_BITS & high_mask)) | (width - 1 - (pos - row * width)).astype(np.int32)
    start = np.zeros(nrows, dtype=np.int64)
    np.cumsum(count[:-1], out=start[1:])
    pad = np.full(nrows * padded, -1, dtype=np.int32)  # below every key
    pad[row * padded + (np.arange(pos.size) - start[row])] = keys
    pad = pad.reshape(nrows, padded)
    pad.partition(padded - k, axis=1)
    chosen = keys >= pad[row, padded - k]
    if out is None:
        return pos[chosen].reshape(nrows, k), val[chosen].reshape(nrows, k)
    out[np.flatnonzero(~heavy)] = pos[chosen].reshape(-1, k)
    return out, rows.reshape(-1)[out]


def _top_positions(rows: np.ndarray, k: int) -> np.ndarray:
    """The flat positions (in ``rows``, (rows, width) fp32) of each row's k largest magnitudes,
    ascending, as (rows, k) int64; NaN counts as the largest.

    The selection is on one int32 key per value: the magnitude's bits (whose order is the
    magnitudes') with their lowest b bits replaced by ``width - 1 - column`` (b: the bits of a
    column). Every key of a row is then distinct, so exactly k are at or above the k-th largest,
    and numpy's selection keeps its speed (it slows down 30x on long runs of equal values, such
    as the zeros of a merge of sparse gradients). Magnitudes within a relative 2**(b - 23) of
    each other (0.012% for chunks of 1024, 0.05% for 4096) count as equal and go to the earlier
    column: zeros and exact ties too."""
    return _select(rows, k)[0]


def _round_bf16(x: np.ndarray) -> np.ndarray:
    """fp32 -> nearest bf16 (ties to even) as its 16 bits (uint16); non-negative finite input,
    overflow saturating at infinity."""
    b = x.astype(np.float32).view(np.uint32)
    b = b + (np.uint32(0x7FFF) + ((b >> 16) & 1))
    return (b >> 16).astype(np.uint16)


def _fit(a: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Scales and multiples for magnitudes ``a`` (rows, k): (bf16 bits, fp32 scale, m in {1, 2}).
    m = 2 where a >= 1.5 s; s fitted by least squares to the chosen multiples, twice (in fp64:
    a * m and the counts are exact there, so the sums do not depend on how they are formed)."""
    k = a.shape[1]
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        a64 = a.astype(np.float64)
        twice = a64 + a64
        s = a64.sum(axis=1) / k
        for _ in range(2):
            two = a64 >= 1.5 * s[:, None]
            s = np.where(two, twice, a64).sum(axis=1) / (k + 3 * np.count_nonzero(two, axis=1))
        s = np.nan_to_num(s, nan=np.inf)
        bits = _round_bf16(np.minimum(s, np.float64(np.finfo(np.float32).max) * 2).astype(np.float32))
        scale = (bits.astype(np.uint32) << 16).view(np.float32)
        m = (a >= np.float32(1.5) * scale[:, None]).view(np.uint8) + np.uint8(1)
    return bits, scale, m


def _pack2(codes: np.ndarray) -> np.ndarray:
    """2-bit codes (uint8 0..3), four per byte, the first in the low bits; zero-padded."""
    pad = -codes.size % 4
    c = np.concatenate([codes, np.zeros(pad, dtype=np.uint8)]) if pad else codes
    c = c.reshape(-1, 4)
    return (c[:, 0] | (c[:, 1] << 2) | (c[:, 2] << 4) | (c[:, 3] << 6)).astype(np.uint8)


def _rows(x: np.ndarray, chunk: int, k: int) -> list[tuple[np.ndarray, int, int]]:
    """(chunk rows as (rows, width), offset of the first, values per row) of the full chunks
    and of a short last chunk."""
    full, rest, last_k = _counts(x.size, chunk, k)
    parts = []
    if full:
        parts.append((x[: full * chunk].reshape(full, chunk), 0, k))
    if rest:
        parts.append((x[full * chunk :].reshape(1, rest), full * chunk, last_k))
    return parts


class Encoded:
    """One tensor's sparse frame (``buffers``), with what it sends: flat positions ``index``
    (int64, ascending) and the values a decoder makes of them (``value``, fp32)."""

    __slots__ = ("buffers", "index", "value", "bounded")

    def __init__(self, buffers: list[np.ndarray], index: np.ndarray, value: np.ndarray, bounded: bool):
        self.buffers, self.index, self.value, self.bounded = buffers, index, value, bounded


def encode(x: np.ndarray, chunk: int, k: int) -> Encoded:
    """The frame of flat fp32 ``x`` (Top-k per chunk by magnitude, 2-bit codes)."""
    scales, codes, gaps, index, value = [], [], [], [], []
    with np.errstate(invalid="ignore", over="ignore"):
        for rows, offset, kk in _rows(x, chunk, k):
            pos, v = _select(rows, kk)
            bits, scale, m = _fit(np.abs(v))
            neg = np.signbit(v)
            codes.append(np.where(neg, 2 - m, m + 1).astype(np.uint8).reshape(-1))
            g = np.empty_like(pos)
            g[:, 0] = pos[:, 0] - np.arange(rows.shape[0], dtype=np.int64) * rows.shape[1]  # the column
            np.subtract(pos[:, 1:], pos[:, :-1] + 1, out=g[:, 1:])
            gaps.append(g.reshape(-1))
            scales.append(bits)
            index.append(pos.reshape(-1) + offset)
            mv = m.astype(np.float32) * scale[:, None]
            value.append(np.where(neg, -mv, mv).reshape(-1))
    cat = (lambda parts, dt: np.concatenate(parts) if parts else np.empty(0, dtype=dt))
    g = cat(gaps, np.int64).astype(np.uint16)
    sb = cat(scales, np.uint16)
    bounded = not sb.size or int(sb.max()) <= _BOUNDED_BF16
    buffers = [sb, _pack2(cat(codes, np.uint8)), (g & 0xFF).astype(np.uint8), (g >> 8).astype(np.uint8)]
    return Encoded(buffers, cat(index, np.int64), cat(value, np.float32), bounded)


# --- decoding ----------------------------------------------------------------------------


class SparseTensor:
    """A decoded sparse tensor: ``index`` (flat positions, int64, strictly increasing) and
    ``value`` (fp32) of the sent entries; everything else is zero."""

    def __init__(self, *, shape: tuple[int, ...], index: np.ndarray, value: np.ndarray):
        self.shape = tuple(shape)
        self.numel = int(math.prod(self.shape))
        self.index, self.value = index, value
        self._dense: torch.Tensor | None = None

    def dense(self) -> torch.Tensor:
        """All values (fp32, its shape), made on the first call and kept."""
        if self._dense is None:
            out = np.zeros(self.numel, dtype=np.float32)
            out[self.index] = self.value
            self._dense = torch.from_numpy(out).view(self.shape)
        return self._dense

    def values(self, start: int, stop: int, *, out: torch.Tensor, factor: float | None = None) -> torch.Tensor:
        """Elements [start, stop) (flat) written into out[:stop - start] and returned, each
        sent value times ``factor`` when given (one fp32 multiply)."""
        t = out[: stop - start]
        t.zero_()
        lo, hi = np.searchsorted(self.index, (start, stop))
        v = self.value[lo:hi]
        if factor is not None:
            v = v * np.float32(factor)
        t.numpy()[self.index[lo:hi] - start] = v
        return t

    @property
    def sum_of_squares(self) -> float:
        return float(np.square(self.value, dtype=np.float64).sum())


def _bad(where: str, msg: str) -> InvalidPayloadError:
    return InvalidPayloadError(f"{where}: {msg}")


def _values_of_byte() -> np.ndarray:
    """byte -> the multiples of the scale its four 2-bit codes mean, the first code in the low
    bits: four fp32 as one 16-byte item, so a lookup is one ``take`` of whole items (10x faster
    than indexing a (256, 4) table)."""
    table = _CODE_VALUE[(np.arange(256)[:, None] >> (2 * np.arange(4))) & 3]
    return np.ascontiguousarray(table).view("V16")[:, 0]


_VALUES_OF_BYTE = _values_of_byte()


def _multiples(body: np.ndarray, count: int, where: str) -> np.ndarray:
    """The multiples of the scale (-2, -1, +1, +2; fp32) that the ``count`` 2-bit codes of
    ``body`` mean, by one table lookup a byte; the unused bits of its last byte must be zero."""
    spare = 4 * body.size - count
    if spare and int(body[-1]) >> (2 * (4 - spare)):
        raise _bad(where, "non-zero padding after the last 2-bit code")
    return _VALUES_OF_BYTE.take(body).view(np.float32)[:count]


def decode(raw: bytes, shape: tuple[int, ...], chunk: int, k: int, *, where: str) -> SparseTensor:
    """The tensor of a decompressed frame whose length is already checked (``raw_nbytes``).
    Raises InvalidPayloadError on a negative or non-finite scale, a position outside its
    chunk, or set padding bits."""
    n = int(math.prod(shape))
    rows = -(-n // chunk)
    count = sent_count(n, chunk, k)
    buf = np.frombuffer(raw, dtype=np.uint8)
    sb = buf[: 2 * rows].view(np.uint16)  # as bf16 is read: this machine's byte order
    top = int(sb.max()) if sb.size else 0
    if top > _MAX_BF16_BITS:  # sign bit set, Inf or NaN
        raise _bad(where, "a sparse scale is negative or not finite")
    scale = (sb.astype(np.uint32) << 16).view(np.float32)
    off = 2 * rows
    value = _multiples(buf[off : off + -(-count // 4)], count, where)  # a new array: scaled in place below
    off += -(-count // 4)
    gaps = buf[off : off + count].astype(np.int32)
    gaps |= buf[off + count : off + 2 * count].astype(np.int32) << 8
    gaps += 1
    # A chunk's positions are the running sums of its gaps + 1, minus 1: one running sum over
    # all the gaps (int64: no bound on hostile ones), less each chunk's start in it.
    index = np.cumsum(gaps, dtype=np.int64)
    full, rest, last_k = _counts(n, chunk, k)
    prior = 0  # the running sum before the chunks of the next round
    for lo, nrows, width, kk, first in ((0, full, chunk, k, 0), (full * k, 1 if rest else 0, rest, last_k, full)):
        if not nrows:
            continue
        sums = index[lo : lo + nrows * kk].reshape(nrows, kk)
        before = np.empty(nrows, dtype=np.int64)  # the running sum before each chunk
        before[0], before[1:] = prior, sums[:-1, -1]
        prior = int(sums[-1, -1])
        if int((sums[:, -1] - before).max()) > width:  # a chunk's last position (each gap + 1 >= 1: its largest)
            raise _bad(where, "a sparse index lies outside its chunk")
        sums += (np.arange(first, first + nrows, dtype=np.int64) * chunk - 1 - before)[:, None]
        row_values = value[lo : lo + nrows * kk].reshape(nrows, kk)
        with np.errstate(over="ignore"):  # exact (a bf16 times 1 or 2); finite, checked below
            np.multiply(row_values, scale[first : first + nrows, None], out=row_values)
    if top > _BOUNDED_BF16 and not np.isfinite(value).all():  # only a scale this large has a double that overflows
        raise _bad(where, "a sparse value is not finite")
    return SparseTensor(shape=shape, index=index, value=value)
