"""Block-quantised tensors as a payload carries them: int4/int8 codes and per-block scales,
read without dequantising the whole tensor first (the wire format is codec.py's).

value = q * scale for each block of B elements; q * scale is exact in fp32 (a bf16 scale
times a small integer), so every reader gets the same values however it slices them.

``Quantized`` keeps a decompressed frame and gives

* ``values(start, stop, out=)``: the fp32 values of a range, the same products as the whole
  dequantisation. The syncer's merge sums its contributions range by range in cache, instead
  of writing and re-reading a full-size fp32 copy of each;
* ``sum_of_squares``: sum of value**2 from the codes and scales alone (per block, sum(q**2)
  by integer arithmetic on the packed int4 bytes, or a table over them, times scale**2),
  exact per block in fp64;
* ``dense()``: the whole tensor, made once and kept.

``DecodedTensors`` is a payload's tensors as a read-only mapping of fp32 tensors that keeps
each int4/int8 tensor as its ``Quantized`` until a value is asked for (``sources``).
"""

from __future__ import annotations

from typing import Iterator, Mapping

import numpy as np
import torch

from ddiloco_cli.numerics import native
from ddiloco_cli.numerics.codecnames import QMAX  # what an encoder writes: |q| <= QMAX

QABS = {"int8": 128, "int4": 8}  # what a frame can hold: the largest |q| of any byte (q + 128 = 0, q + 8 = 0)
PER_BYTE = {"int8": 1, "int4": 2}
_FLT_MAX = float(np.finfo(np.float32).max)

# q of every byte value, as fp32: int4 bytes hold two (low nibble first), int8 bytes one.
# One table lookup per byte (numpy's take) writes the fp32 values directly: fewer passes
# than unpacking nibbles with integer ops and casting inside the multiply.
_Q_OF_BYTE = {
    "int4": np.array([((b & 0x0F) - 8, (b >> 4) - 8) for b in range(256)], dtype=np.float32),
    "int8": np.array([[b - 128] for b in range(256)], dtype=np.float32),
}


def _q_of_word(codec: str, item: type) -> np.ndarray:
    """q of every 2-byte word (its first byte's codes, then its second's; the index is the word
    as this machine reads it), one row as a single ``item`` (16 or 8 bytes): one lookup per
    two bytes, half as many as by byte (int8: 2x faster, int4: 1.2x)."""
    words = np.arange(1 << 16)
    first, second = (words & 0xFF, words >> 8) if np.little_endian else (words >> 8, words & 0xFF)
    table = np.concatenate([_Q_OF_BYTE[codec][first], _Q_OF_BYTE[codec][second]], axis=1)
    return np.ascontiguousarray(table).view(item).reshape(-1)


_Q_OF_WORD = {"int4": _q_of_word("int4", np.complex128), "int8": _q_of_word("int8", np.uint64)}
Q_OF_WORD = _Q_OF_WORD  # for the merge, which reads ranges of codes with views of its own


def _sq_of_word(codec: str) -> np.ndarray:
    """Sum of q**2 over the codes of every 2-byte word (4 int4 codes, 2 int8 codes), as fp32
    (exact integers). The sum does not depend on the byte order, so it holds for either."""
    per_byte = (_Q_OF_BYTE[codec].astype(np.int64) ** 2).sum(axis=1)
    words = np.arange(1 << 16)
    return (per_byte[words & 0xFF] + per_byte[words >> 8]).astype(np.float32)


_SQ_OF_WORD = {"int4": _sq_of_word("int4"), "int8": _sq_of_word("int8")}


def q8_into(codes: np.ndarray, codec: str, n: int, *, out: np.ndarray, tmp: np.ndarray) -> np.ndarray:
    """q of n elements as int8 (exact), written into out[:n] and returned, from the bytes holding
    their codes, by vectorised integer operations (no table lookups); ``tmp``: uint16 scratch of
    at least ceil(n / 2) items (int4). int4: each byte b spread to the 16-bit word
    (b | b << 4) & 0x0F0F (low byte the low nibble, high byte the high one, written in this
    machine's order), then 8 subtracted from each byte (modulo 256: the int8 of nibble - 8);
    int8: q + 128 with its top bit flipped is q."""
    if codec == "int8":
        return np.bitwise_xor(codes[:n], np.uint8(0x80), out=out[:n].view(np.uint8)).view(np.int8)
    nbytes = -(-n // 2)
    w, t = out[: 2 * nbytes].view(np.uint16), tmp[:nbytes]
    np.copyto(w, codes[:nbytes], casting="unsafe")  # the byte, zero-extended
    np.left_shift(w, np.uint16(4), out=t)
    w |= t
    w &= np.uint16(0x0F0F)
    if not np.little_endian:  # the low nibble's byte first in memory
        w.byteswap(inplace=True)
    u = out[: 2 * nbytes].view(np.uint8)
    u -= np.uint8(8)
    return out[:n]


def chunk_elems(block: int, *, elems: int = 1 << 20) -> int:
    """Elements per chunk: about ``elems``, a multiple of the block size and even, so chunks
    start on a block and on a byte of int4 codes (chunked output equals one-shot output)."""
    c = block * max(1, elems // block)
    return c if c % 2 == 0 else 2 * c


def num_blocks(n: int, block: int) -> int:
    return -(-n // block)


def q_values(codes: np.ndarray, codec: str, n: int, *, out: np.ndarray) -> None:
    """Write q (fp32, exact) of n elements into out[:n] from the bytes holding their codes: one
    table lookup per 2-byte word, or per byte where the range is not whole words."""
    table = _Q_OF_BYTE[codec]
    if n % (2 * PER_BYTE[codec]) == 0:  # whole words, no padding nibble
        words = _Q_OF_WORD[codec]
        words.take(codes.view(np.uint16), out=out[:n].view(words.dtype), mode="clip")
    elif codec == "int4" and n % 2:  # the last byte's high nibble is padding
        q = np.empty(n + 1, dtype=np.float32)
        np.take(table, codes, axis=0, out=q.reshape(-1, 2), mode="clip")
        out[:n] = q[:n]
    else:  # mode="clip": a uint8 index is always in range, and no buffered copy of the output
        np.take(table, codes, axis=0, out=out[:n].reshape(-1, table.shape[1]), mode="clip")


def dequantize_chunk(scale: torch.Tensor, codes: np.ndarray, codec: str, n: int, block: int, *,
                     out: torch.Tensor) -> None:
    """Write q * scale (fp32) into out (n values) from the bytes holding their codes: q exactly
    as fp32 from a table, then one in-place multiply per block (the same fp32 products as
    multiplying q by its scale)."""
    if native.kernels is not None:  # the same products in one call, the GIL released
        native.kernels.dequantize(codes, scale.numpy(), n, block, QABS[codec], PER_BYTE[codec], None, out.numpy())
        return
    q_values(codes, codec, n, out=out.numpy())
    full = (n // block) * block
    if full:
        out[:full].view(-1, block).mul_(scale[: full // block, None])
    if full < n:
        out[full:].mul_(scale[-1])


class Quantized:
    """One int4/int8 tensor as its frame holds it: ``scale`` (fp32, one per block) and ``codes``
    (the frame's bytes after the scales, a read-only view: numpy slices them with less overhead
    than torch, which counts in a merge's many small ranges)."""

    def __init__(self, *, codec: str, shape: tuple[int, ...], block: int, scale: torch.Tensor, codes: np.ndarray):
        self.codec, self.shape, self.block, self.scale, self.codes = codec, tuple(shape), block, scale, codes
        self.numel = int(np.prod(self.shape, dtype=np.int64))
        # made on first use and kept; not functools.cached_property, whose lock (Python < 3.12)
        # is one per class: the syncer's decode threads would take turns
        self._dense: torch.Tensor | None = None
        self._sum_of_squares: float | None = None

    @classmethod
    def from_frame(cls, raw: bytes, *, codec: str, shape: tuple[int, ...], block: int) -> "Quantized":
        """The tensor of a decompressed frame whose length is already checked (codec.py)."""
        buf = np.frombuffer(raw, dtype=np.uint8)
        nb = num_blocks(int(np.prod(shape, dtype=np.int64)), block)
        bf16 = buf[: 2 * nb].view(np.uint16)  # as torch reads bf16: this machine's byte order
        scale = torch.from_numpy((bf16.astype(np.uint32) << 16).view(np.float32))  # bf16 is fp32's top half
        return cls(codec=codec, shape=shape, block=block, scale=scale, codes=buf[2 * nb:])

    def values(self, start: int, stop: int, *, out: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        """The fp32 values of elements [start, stop) (flat), written into out[:stop - start]
        and returned; ``start`` must be a multiple of the block size and even. ``scale`` (one
        fp32 per block) replaces the frame's scales: q * scale[block]."""
        m, block, per_byte = stop - start, self.block, PER_BYTE[self.codec]
        assert start % block == 0 and start % 2 == 0 and 0 <= start <= stop <= self.numel
        b0 = start // block
        scale = self.scale if scale is None else scale
        dequantize_chunk(scale[b0 : b0 + num_blocks(m, block)], self.codes[start // per_byte : -(-stop // per_byte)],
                         self.codec, m, block, out=out[:m])
        return out[:m]

    def dense(self) -> torch.Tensor:
        """All values (fp32, its shape), dequantised on the first call and kept."""
        if self._dense is None:
            out = torch.empty(self.numel, dtype=torch.float32)
            step = chunk_elems(self.block)
            for start in range(0, self.numel, step):
                self.values(start, min(self.numel, start + step), out=out[start:])
            self._dense = out.view(self.shape)
        return self._dense

    def bounded(self) -> bool:
        """Every value is finite: true when every scale times the largest |q| a frame can hold
        is (a check on the scales alone); false does not mean a value is not finite."""
        if not self.scale.numel():
            return True
        # |scale| * QABS (a power of 2: the product is exact unless it overflows) is finite iff
        # |scale| <= FLT_MAX / QABS; a NaN fails the comparison. One pass in numpy.
        return float(np.abs(self.scale.numpy()).max()) <= _FLT_MAX / QABS[self.codec]

    @property
    def sum_of_squares(self) -> float:
        """sum(value**2) in fp64 from the codes: per block scale**2 * sum(q**2), which is exact
        (bf16 scale, small integers); the blocks are then summed in one fixed order. Kept."""
        if self._sum_of_squares is None:
            self._sum_of_squares = self._squares_from_codes()
        return self._sum_of_squares

    def _squares_from_codes(self) -> float:
        n, block, per_byte = self.numel, self.block, PER_BYTE[self.codec]
        full = n // block
        parts, done = [], 0
        if full and block % (2 * per_byte) == 0:  # whole 2-byte words per block: sum(q**2) of each, exact integers
            if native.kernels is not None:  # in one call
                per_block = torch.empty(full, dtype=torch.float64)
                native.kernels.square_sums(self.codes, full, block, per_byte, per_block.numpy())
            elif self.codec == "int4" and block % 16 == 0 and block // 16 <= _MAX_U64_PER_BLOCK:
                per_block = torch.from_numpy(_int4_block_sums(self.codes[: full * block // 2], full))
            else:  # the word table
                words = self.codes[: full * block // per_byte].view(np.uint16)
                sq = torch.from_numpy(_SQ_OF_WORD[self.codec].take(words, mode="clip")).view(full, -1)
                if block * QABS[self.codec] ** 2 < 2**24:  # fp32 sums of these integers are exact: BLAS, fast
                    per_block = torch.mv(sq, torch.ones(sq.shape[1])).to(torch.float64)
                else:
                    per_block = sq.to(torch.float64).sum(1)
            parts.append(per_block.mul_(self.scale[:full].to(torch.float64).square()))
            done = full * block
        if done < n:  # the rest (a partial last block, or blocks that split a word): from the values,
            # whose squares sum exactly per block in fp64 in any order
            rest = self.values(done, n, out=torch.empty(n - done)).to(torch.float64).square_()
            rest = torch.nn.functional.pad(rest, (0, -(n - done) % block))
            parts.append(rest.view(-1, block).sum(1))
        return float(torch.cat(parts).sum()) if parts else 0.0


# _int4_block_sums: a block's uint64s are summed in 16-bit lanes of at most 2 * 128 each
_MAX_U64_PER_BLOCK = 255
_BYTES = np.uint64(0x00FF00FF00FF00FF)
_HALVES = np.uint64(0x0000FFFF0000FFFF)


def _int4_block_sums(codes: np.ndarray, blocks: int) -> np.ndarray:
    """sum(q**2) of each of ``blocks`` whole int4 blocks of 16k codes (8k bytes, k <= 255), as
    fp64 (exact integers), by integer arithmetic on the bytes: no table lookups (numpy's take
    costs 1 ns a lookup; these passes are SIMD). Per byte, (nibble - 8)**2 of both nibbles in
    uint8: exact, as (n - 8)**2 <= 64 and uint8 arithmetic is modulo 256 (lo**2 + hi**2 <= 128);
    then the bytes of a block summed in the lanes of uint64s (SWAR), with no lane overflowing."""
    lo = np.bitwise_and(codes, np.uint8(0x0F))
    hi = np.right_shift(codes, np.uint8(4))
    lo -= np.uint8(8)
    lo *= lo
    hi -= np.uint8(8)
    hi *= hi
    lo += hi  # lo**2 + hi**2 per byte, <= 128
    pairs, odd = lo.view(np.uint64), hi.view(np.uint64)  # in place: no more temporaries
    np.right_shift(pairs, np.uint64(8), out=odd)
    odd &= _BYTES
    pairs &= _BYTES
    pairs += odd  # 4 lanes of 16 bits, <= 256 each
    pairs = pairs.reshape(blocks, -1)
    acc = pairs[:, 0].copy()
    for j in range(1, pairs.shape[1]):
        acc += pairs[:, j]  # <= 256 * 255 per lane
    acc = (acc & _HALVES) + ((acc >> np.uint64(16)) & _HALVES)  # 2 lanes of 32 bits
    acc = (acc & np.uint64(0xFFFFFFFF)) + (acc >> np.uint64(32))
    return acc.astype(np.float64)


Source = torch.Tensor | Quantized  # one tensor of a decoded payload


class DecodedTensors(Mapping[str, torch.Tensor]):
    """A decoded payload's tensors: {key: fp32 tensor} on access (an int4/int8 tensor is
    dequantised on first access, then kept). ``sources`` gives them as decoded: a
    ``Quantized`` for int4/int8 tensors, a tensor otherwise; ``codec`` and ``block_size``
    are the payload's, as its header declares them (``topk``: the sparse codec's values per
    chunk, else None)."""

    def __init__(self, sources: dict[str, Source], *, codec: str, block_size: int | None, topk: int | None = None):
        self.sources, self.codec, self.block_size, self.topk = sources, codec, block_size, topk

    def __getitem__(self, key: str) -> torch.Tensor:
        src = self.sources[key]
        return src if isinstance(src, torch.Tensor) else src.dense()

    def __iter__(self) -> Iterator[str]:
        return iter(self.sources)

    def __len__(self) -> int:
        return len(self.sources)


def sources(tensors: Mapping[str, torch.Tensor]) -> Mapping[str, Source]:
    """The tensors of a mapping as decoded (``DecodedTensors.sources``), or the mapping itself."""
    return tensors.sources if isinstance(tensors, DecodedTensors) else tensors


def shape_of(src: Source) -> tuple[int, ...]:
    return src.shape if isinstance(src, Quantized) else tuple(src.shape)  # (a SparseTensor's is a tuple too)
