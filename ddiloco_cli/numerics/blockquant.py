"""Block quantisation of the int4/int8/bf16 codecs (the vectorised torch/numpy passes behind
codec.py's encoders and decoder, and the sums of published deltas): bf16 block scales rounded up, codes bounded by the run's
qmax, the learner's flat quantiser and the syncer's sink quantiser sharing one arithmetic
(``_block_codes``), and the inverse of a bf16/fp32 frame. codec.py is their one caller."""

from __future__ import annotations

import functools
import math
import warnings
from typing import Callable

import numpy as np
import torch

from ddiloco_cli.numerics import native, sparse
from ddiloco_cli.numerics.quantized import PER_BYTE, QABS, QMAX, Quantized, chunk_elems, num_blocks, q_values

# --- quantization (vectorised, pure torch) ---------------------------------------


_MAX_BF16_BITS = 0x7F7F0000  # the largest finite bf16, as fp32 bits


def _bf16_scale_bits_up(absmax: np.ndarray, qmax: int) -> np.ndarray:
    """The int32 bits of absmax / qmax rounded up to the next bf16 value (fp32, whose low 16
    bits are then zero)."""
    # bf16 is the top 16 bits of fp32; adding 0xFFFF before truncating rounds positive values
    # up. Huge scales stay at the largest finite bf16: clipped first, which gives the same bits
    # as clipping after (anything above it rounds to it or above) and keeps the sum in int32
    # (three in-place int32 operations, not seven through int64)
    bits = np.minimum((absmax / np.float32(qmax)).view(np.int32), _MAX_BF16_BITS)
    bits += 0xFFFF
    bits &= ~0xFFFF
    return bits


def _largest_bounded_scale_bits(qmax: int) -> int:
    """The largest bf16 scale (as fp32 bits) whose product with qmax is finite in fp32."""
    def bounded(top: int) -> bool:  # top: a bf16's 16 bits (a positive finite value)
        with np.errstate(over="ignore"):
            return bool(np.isfinite(np.array([top << 16], dtype=np.int32).view(np.float32)[0] * np.float32(qmax)))

    lo, hi = 0, _MAX_BF16_BITS >> 16  # bounded(lo); positive bf16 values grow with their bits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if bounded(mid) else (lo, mid - 1)
    return lo << 16


@functools.lru_cache(maxsize=None)
def _bounded_scale_bits(qmax: int) -> int:
    """|scale| * qmax is finite (the sign bit masked off) exactly when |scale| is at most this."""
    return _largest_bounded_scale_bits(qmax)


def _raw_nbytes(codec: str, n: int, block: int, topk: int = 0) -> int:
    if codec == "sparse":
        return sparse.raw_nbytes(n, block, topk)
    if codec == "none":
        return 4 * n
    if codec == "bf16":
        return 2 * n
    scales = 2 * num_blocks(n, block)
    return scales + (n if codec == "int8" else -(-n // 2))


def _full_blocks(x: torch.Tensor, block: int) -> tuple[torch.Tensor, int]:
    """x (flat, n) as (num_blocks, block), zero-padding only the last block."""
    n = x.numel()
    nb = num_blocks(n, block)
    if nb * block == n:
        return x.view(nb, block), nb
    return torch.nn.functional.pad(x, (0, nb * block - n)).view(nb, block), nb


# (start, stop, values, bounded): the decoder's values of x[start:stop] as the encoder makes
# them (fp32 numpy, valid during the call); bounded: they are finite (known from the scales),
# else unknown. numpy: a sink's arithmetic then makes no torch call (each first torch call on an
# uploader thread woken after a training step costs tens of microseconds of cold dispatcher code)
Sink = Callable[[int, int, np.ndarray, bool], None]
QUANTIZE_CHUNK_ELEMS = 1 << 18  # x, its codes and their values stay in cache between the passes


def _quantize(x: torch.Tensor, codec: str, block: int, *, minus: torch.Tensor | None = None,
              sink: Sink | None = None, qmax: int | None = None) -> list:
    """fp32 flat contiguous tensor x (less ``minus``, one like it, when given) -> raw
    (uncompressed) frame, as a list of buffers to be concatenated. ``sink``, when given, gets
    every range's decoded values while they are in cache: bit for bit what a decoder of the
    frame computes (error feedback needs them). ``minus`` is subtracted range by range too:
    no full-size difference is written and read back."""
    n = x.numel()
    if codec in ("none", "bf16"):
        if minus is not None:
            x = x - minus
        if codec == "none":
            if sink is not None:
                sink(0, n, x.numpy(), False)
            return [x.numpy()]
        b = x.to(torch.bfloat16)
        if sink is not None:
            sink(0, n, b.to(torch.float32).numpy(), False)
        return [b.view(torch.int16).numpy()]
    step = chunk_elems(block, elems=QUANTIZE_CHUNK_ELEMS)
    diff = None if minus is None else torch.empty(min(step, n), dtype=torch.float32)
    scales, bodies = [], []
    for start in range(0, n, step):
        stop = min(n, start + step)
        xs = x[start:stop] if diff is None else torch.sub(x[start:stop], minus[start:stop], out=diff[: stop - start])
        sc, body = _quantize_chunk(xs, codec, block, sink=None if sink is None else functools.partial(sink, start, stop),
                                   qmax=qmax)
        scales.append(sc)
        bodies.append(body)
    return scales + bodies


def _quantize_together(xs: list[torch.Tensor], codec: str, block: int, *,
                       sinks: list[Sink | None], qmax: int | None = None) -> list[list]:
    """``_quantize`` of several flat fp32 tensors (int8/int4) in one pass over one buffer:
    a fragment of many small tensors then costs one set of torch calls, not one per
    tensor. Each tensor starts a block of the buffer, zero-padded to whole blocks as the
    format pads its last block, and (int4) on an even element (an odd block size adds one
    all-zero block), so its frame is a slice of the buffer's scales and codes and the bytes
    equal those of ``_quantize`` of the tensor alone. ``sinks[i]`` gets tensor i's ranges."""
    starts, total = [], 0
    for x in xs:
        span = num_blocks(x.numel(), block) * block
        if codec == "int4" and span % 2:
            span += block
        starts.append(total)
        total += span
    flat = torch.zeros(total, dtype=torch.float32)
    for x, start in zip(xs, starts):
        flat[start : start + x.numel()] = x

    def dispatch(lo: int, hi: int, values: torch.Tensor, bounded: bool) -> None:
        for sink, x, start in zip(sinks, xs, starts):  # the tensors that [lo, hi) overlaps
            a, b = max(lo, start), min(hi, start + x.numel())
            if sink is not None and a < b:
                sink(a - start, b - start, values[a - lo : b - lo], bounded)

    step = chunk_elems(block, elems=QUANTIZE_CHUNK_ELEMS)
    scales, bodies = [], []
    for lo in range(0, total, step):
        hi = min(total, lo + step)
        sc, body = _quantize_chunk(flat[lo:hi], codec, block,
                                   sink=None if all(k is None for k in sinks) else functools.partial(dispatch, lo, hi),
                                   qmax=qmax)
        scales.append(sc)
        bodies.append(body)
    scale_buf = np.concatenate(scales) if scales else np.empty(0, dtype=np.int16)
    body_buf = np.concatenate(bodies) if bodies else np.empty(0, dtype=np.uint8)
    per_byte = 1 if codec == "int8" else 2
    return [[scale_buf[start // block : start // block + num_blocks(x.numel(), block)],
             body_buf[start // per_byte : start // per_byte + -(-x.numel() // per_byte)]]
            for x, start in zip(xs, starts)]


_HIGH_HALF = 1 if np.little_endian else 0  # of an int32 viewed as two int16s, the one with its top 16 bits


def _block_codes(xt: torch.Tensor, y: np.ndarray, codes: np.ndarray, *, qmax: int,
                 offset: int) -> tuple[np.ndarray, np.ndarray]:
    """The codes of the blocks ``xt`` (blocks, block; fp32, contiguous) into ``codes`` (uint8,
    q + offset), with ``y`` (like xt, numpy) left holding x / scale + offset + 0.5, whose floor
    is the code. Returns each block's scale as (fp32 bits as int32, fp32). The one quantiser
    arithmetic of both encoders (``_quantize_chunk``, ``_quantize_flat``)."""
    absmax = torch.maximum(xt.amax(dim=1), xt.amin(dim=1).neg_()).numpy()  # (aminmax over a row is 10x slower)
    # a block of zeros: torch's vectorised maximum picks +0.0 or -0.0 by the CPU's lanes; + 0.0
    # makes it +0.0 (and leaves every other value, NaNs included), so the scale's bits are the
    # same on every CPU and in the compiled kernel (native.py), which takes max |x|
    absmax += np.float32(0.0)
    bits = _bf16_scale_bits_up(absmax, qmax)
    scale = bits.view(np.float32)
    inv = np.zeros_like(scale)
    np.divide(np.float32(1.0), scale, out=inv, where=scale > 0)
    # |x * inv| <= qmax because the scale was rounded up, so no clamp is needed;
    # floor(y + offset + 0.5) is round-half-up of y, shifted to be non-negative.
    np.multiply(xt.numpy(), inv[:, None], out=y)
    y += np.float32(offset + 0.5)
    with np.errstate(invalid="ignore"):  # a non-finite x: garbage codes (decoders refuse them)
        np.copyto(codes, y.reshape(-1), casting="unsafe")  # y >= 0.5: the cast floors
    return bits, scale


def _quantize_flat(tensors: list[torch.Tensor], keys: list[str], codec: str, block: int, *,
                   residual: dict[str, torch.Tensor] | None, qmax: int | None = None) -> list[list[np.ndarray]]:
    """``_quantize_together`` (int8/int4; the same layout and bytes) with fewer numpy and torch
    calls: each call costs a background thread woken after a training step tens of microseconds
    of cold code, more than its pass over the data. The buffers of the whole payload are made
    once (the scales, the codes, the packed bytes), a tensor already fp32, flat and in whole
    blocks is read in place, and with ``residual`` (filled with each key's ``t -
    decode(payload)``, bit for bit) the quantiser's own buffer becomes the residual: from the
    codes, q = code - offset (the decoder's q), times the scale, subtracted from x in place."""
    xs = [_flat32(t) for t in tensors]
    sizes = [x.numel() for x in xs]
    starts, total = [], 0
    for n in sizes:
        span = num_blocks(n, block) * block
        if codec == "int4" and span % 2:
            span += block
        starts.append(total)
        total += span
    if len(xs) == 1 and sizes[0] == total:
        flat = xs[0]  # whole blocks already: read in place
    else:
        flat = torch.zeros(total, dtype=torch.float32)
        flat_np = flat.numpy()
        for x, start, n in zip(xs, starts, sizes):
            if n:
                flat_np[start : start + n] = x.numpy()
    x_all = flat.numpy()
    out = torch.empty(total, dtype=torch.float32)  # the quantiser's values; with ``residual``, the residual
    y_all = out.numpy()
    scales = np.empty(total // block, dtype=np.int16)
    codes_all = np.empty(total, dtype=np.uint8)
    per_byte = PER_BYTE[codec]
    body = codes_all if per_byte == 1 else np.empty(total // 2, dtype=np.uint8)
    qmax, offset = (QMAX[codec] if qmax is None else qmax), (8 if codec == "int4" else 128)
    kernels = native.kernels  # one call over the whole buffer, the GIL released; 1: the numpy passes decide
    done = kernels is not None and not kernels.quantize(x_all, block, qmax, offset, per_byte, scales, body,
                                                         None if residual is None else y_all)
    step = chunk_elems(block, elems=QUANTIZE_CHUNK_ELEMS)
    for lo in range(0, 0 if done else total, step):
        hi = min(total, lo + step)
        xb = x_all[lo:hi].reshape(-1, block)
        y = y_all[lo:hi].reshape(-1, block)
        codes = codes_all[lo:hi]
        bits, scale = _block_codes(flat[lo:hi].view(-1, block), y, codes, qmax=qmax, offset=offset)
        if residual is not None:
            np.subtract(codes, np.float32(offset), out=y.reshape(-1))  # q, exactly as the decoder reads it
            y *= scale[:, None]  # q * scale: the decoder's products
            np.subtract(xb, y, out=y)  # x - decoded
        np.copyto(scales[lo // block : hi // block], bits.view(np.int16)[_HIGH_HALF::2])  # each scale's bf16
        if per_byte == 2:  # (first, second) as one little-endian word -> low byte first | second << 4
            pairs = codes.view("<u2")
            packed = np.right_shift(pairs, 4)
            packed |= pairs
            np.copyto(body[lo // 2 : hi // 2], packed, casting="unsafe")
    if residual is not None:
        for key, t, start, n in zip(keys, tensors, starts, sizes):
            residual[key] = (out if n == total else out[start : start + n]).view(t.shape)
    return [[scales[start // block : start // block + num_blocks(n, block)],
             body[start // per_byte : start // per_byte + -(-n // per_byte)]]
            for start, n in zip(starts, sizes)]


def _quantize_chunk(x: torch.Tensor, codec: str, block: int, *,
                    sink: Callable[[np.ndarray, bool], None] | None, qmax: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(bf16 scales as int16, codes) of x, |q| <= qmax (default: the codec's QMAX). The
    arithmetic is numpy's on x's memory (a numpy call costs ~1 us where a torch call costs
    several, and a contribution makes ~30 of them per chunk): the same IEEE fp32 operations,
    so the same bytes."""
    n = x.numel()
    qmax = QMAX[codec] if qmax is None else qmax
    offset = 8 if codec == "int4" else 128
    xb, _ = _full_blocks(x, block)
    y = np.empty(tuple(xb.shape), dtype=np.float32)
    codes = np.empty(xb.numel(), dtype=np.uint8)
    bits, scale = _block_codes(xb, y, codes, qmax=qmax, offset=offset)
    if sink is not None:  # q * scale: the decoder's products (quantized.dequantize_chunk), made in y's buffer
        q = np.floor(y, out=y)
        q -= np.float32(offset)
        q *= scale[:, None]  # padding of a partial last block included: sliced off below
        # |q| <= qmax: finite when every |scale| * qmax is (NaN scales lie above the bound too)
        bounded = int(np.bitwise_and(bits, 0x7FFFFFFF).max()) <= _bounded_scale_bits(qmax)
        sink(q.reshape(-1)[:n], bounded)
    scale_buf = (bits >> 16).astype(np.int16)  # the bf16 of each scale: its top 16 bits, exactly
    if codec == "int8":
        return scale_buf, codes[:n]  # stored as q + 128 (uint8)
    # an odd n pads with nibble 8 (q = 0): a padding zero of the last block already is one
    codes = codes[: n + n % 2] if codes.size > n or n % 2 == 0 else np.append(codes, np.uint8(8))
    pairs = codes.view("<u2")  # (first, second) as one little-endian word: first | second << 8
    return scale_buf, (pairs | (pairs >> 4)).astype(np.uint8)  # low byte: first | second << 4


def _dequantize(raw: bytes, codec: str, n: int, block: int) -> torch.Tensor:
    """raw frame bytes (length already checked) -> flat fp32 tensor of n values."""
    if n == 0:
        return torch.empty(0, dtype=torch.float32)
    if codec in QMAX:
        return Quantized.from_frame(raw, codec=codec, shape=(n,), block=block).dense()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # read-only buffer: we never write into it
        buf = torch.frombuffer(raw, dtype=torch.uint8)
    if codec == "none":
        return buf.view(torch.float32).clone()
    return buf.view(torch.bfloat16).to(torch.float32)


def _flat32(t: torch.Tensor) -> torch.Tensor:
    """t's values as a flat fp32 CPU tensor (t itself, viewed, when it already is one: one
    torch call instead of four)."""
    if t.dtype is torch.float32 and not t.requires_grad and t.device.type == "cpu" and t.is_contiguous():
        return t.view(-1)
    return t.detach().to(device="cpu", dtype=torch.float32).contiguous().view(-1)


# --- a frame's values added to a previous value (published deltas, readers and syncer) ---------


def _sparse_sum(base: np.ndarray | None, index: np.ndarray, sent: np.ndarray, *, out: np.ndarray) -> None:
    """out = base (zeros when None) with base[i] + sent at the sent positions i: one fp32 addition
    each, the same on the syncer (its new published value) and on every reader."""
    if base is None:
        out[:] = 0.0
        out[index] = sent
    else:
        out[:] = base
        out[index] += sent


# the largest bf16 magnitude (bits & 0x7FFF) whose product with the largest |q| a frame can hold
# (QABS) is finite; NaN and Inf lie above
_BOUNDED_BITS = {codec: _largest_bounded_scale_bits(q) >> 16 for codec, q in QABS.items()}
_SUM_CHUNK = 1 << 18  # values made this many at a time: each range is multiplied and summed while in cache


def _sum_with(prev: torch.Tensor | None, raw: bytes, codec: str, shape: tuple[int, ...],
              block: int) -> torch.Tensor | None:
    """prev + the values of a decompressed int4/int8 frame (length already checked), range by
    range in cache: q from the codes into the output, times the scales, plus prev, in place: the
    fp32 operations (and bits) of decoding, then adding. In numpy on the tensors' memory: a few
    calls a range, none of them through torch's dispatcher (on a background thread woken after a
    training step each first call costs tens of microseconds of cold code). None when a scale
    times the largest |q| a frame can hold is not finite (the caller then decodes and checks the
    values themselves)."""
    n = math.prod(shape)
    nb = num_blocks(n, block)
    bits = np.frombuffer(raw, dtype=np.uint16, count=nb)  # bf16 scales, as torch reads them
    if int(np.bitwise_and(bits, 0x7FFF).max()) > _BOUNDED_BITS[codec]:
        return None  # includes NaN and Inf scales
    scale = (bits.astype(np.uint32) << 16).view(np.float32)  # bf16 is fp32's top half
    codes = np.frombuffer(raw, dtype=np.uint8, offset=2 * nb)
    out = np.empty(n, dtype=np.float32)
    base = None
    if prev is not None:
        if prev.dtype == torch.float32 and prev.device.type == "cpu" and prev.is_contiguous() and not prev.requires_grad:
            base = prev.numpy().reshape(-1)
        else:
            base = _flat32(prev).numpy()
    per_byte = PER_BYTE[codec]
    if native.kernels is not None:  # the same products and sums in one call, the GIL released
        native.kernels.dequantize(codes, scale, n, block, QABS[codec], per_byte, base, out)
        return torch.from_numpy(out).view(shape)
    step = chunk_elems(block, elems=_SUM_CHUNK)
    for start in range(0, n, step):
        stop = min(n, start + step)
        m, b0 = stop - start, start // block
        values = out[start:stop]
        q_values(codes[start // per_byte : -(-stop // per_byte)], codec, m, out=values)
        full = (m // block) * block
        if full:
            rows = values[:full].reshape(-1, block)
            np.multiply(rows, scale[b0 : b0 + full // block, None], out=rows)
        if full < m:  # a partial last block
            np.multiply(values[full:], scale[b0 + full // block], out=values[full:])
        if base is not None:  # prev + decoded, as _add makes it (addition commutes: the same bits)
            np.add(values, base[start:stop], out=values)
    return torch.from_numpy(out).view(shape)
