"""Tensor payload codec: quantize + zstd, inside a safetensors file.

Wire format: a safetensors file whose tensors are uint8 (one per input tensor,
same key) holding one zstd frame each (with content size and checksum), and whose header metadata has a single
entry "ddiloco" = JSON:

    {"format": 1, "codec": "int4", "block_size": 64,
     "tensors": {key: {"shape": [...], "dtype": "float32",
                       "raw_nbytes": ..., "comp_nbytes": ...}},
     "metadata": {...caller's...}}

The decompressed frame of a tensor with n elements is:

    none : n fp32 (little endian)
    bf16 : n bf16 (round to nearest even)
    int8 : ceil(n/B) bf16 scales, then n bytes q + 128 with q in [-127, 127]
    int4 : ceil(n/B) bf16 scales, then ceil(n/2) bytes, two values per byte
           (low nibble first), each q + 8 with q in [-7, 7]
    sparse: Top-k per chunk of B elements with 2-bit values; the header adds "topk" (sparse.py)

value = q * scale per block of B elements. The scale is absmax/qmax rounded *up*
to bf16, so |q| <= qmax without clipping. The decoder derives every size from the
shape and codec, checks them against the header, `expected` and `max_numel`
before decompressing anything, and caps decompression at the derived size. It
never unpickles.

`encode_published_delta`/`apply_published_delta` implement syncer-side error
feedback: the published value is always prev + decode(payload), computed the same
way on both sides, so learners hold it bit-exactly and the quantization error of
one version is corrected by the next delta instead of accumulating.
"""

from __future__ import annotations

import json
import math
from typing import Any, Callable, Mapping

import numpy as np
import torch
import zstandard

from ddiloco_cli.errors import InvalidPayloadError, UsageError
from ddiloco_cli.numerics import sparse
from ddiloco_cli.numerics.blockquant import (
    Sink,
    _dequantize,
    _flat32,
    _quantize,
    _quantize_flat,
    _quantize_together,
    _raw_nbytes,
    _sparse_sum,
    _sum_with,
)
from ddiloco_cli.numerics.codecnames import CODECS, DEFAULT_BLOCK_SIZE, DEFAULT_QMAX, check_qmax  # noqa: F401 (re-exported)
from ddiloco_cli.numerics.container import METADATA_KEY, payload_codec
from ddiloco_cli.numerics.container import compressor as _compressor
from ddiloco_cli.numerics.container import decompressed as _decompressed
from ddiloco_cli.numerics.container import parse_description as _parse_description
from ddiloco_cli.numerics.container import parse_safetensors as _parse_safetensors
from ddiloco_cli.numerics.container import write_safetensors as _write_safetensors
from ddiloco_cli.numerics.merge import all_finite
from ddiloco_cli.numerics.quantized import QMAX, DecodedTensors, Quantized, Source
from ddiloco_cli.protocol import records

FORMAT_VERSION = 1
_MAX_NDIM = 8
_MAX_NUMEL = 1 << 40  # per payload, whatever the caller's bounds: 4 TB of fp32


# --- encode / decode ----------------------------------------------------------------


def _check_codec(codec: str, block_size: int | None, qmax: int | None = None) -> int:
    if codec not in CODECS:
        raise UsageError(f"unknown codec {codec!r}; use one of {', '.join(CODECS)}")
    check_qmax(codec, qmax)
    if codec in DEFAULT_BLOCK_SIZE:
        block = DEFAULT_BLOCK_SIZE[codec] if block_size is None else int(block_size)
        if not 1 <= block <= (sparse.MAX_CHUNK if codec == "sparse" else 1 << 24):
            raise UsageError(f"--block-size {block} is out of range for codec {codec}")
        return block
    return 0


def _topk(codec: str, block: int, density: float | None) -> int:
    """Values per chunk of the sparse codec (0 for the others)."""
    if codec != "sparse":
        return 0
    density = sparse.DEFAULT_DENSITY if density is None else float(density)
    if not 0.0 < density <= 1.0:
        raise UsageError(f"--codec-density must be in (0, 1], got {density!r}")
    return sparse.topk(density, block)


def encode_tensors(
    tensors: Mapping[str, torch.Tensor],
    *,
    codec: str,
    block_size: int | None = None,
    zstd_level: int = 1,
    metadata: dict | None = None,
    qmax: int | None = None,
    density: float | None = None,
) -> bytes:
    """Encode float tensors (any device/dtype; values are taken as fp32) into one
    payload. `metadata` must be JSON-serialisable; it comes back from decode. ``qmax``
    (int4/int8) bounds the codes the encoder writes (default: the codec's full range); the
    frame is an ordinary one of the codec, read the same way whatever the bound."""
    return _encode(tensors, codec=codec, block_size=block_size, zstd_level=zstd_level, metadata=metadata, qmax=qmax,
                   density=density)


def encode_with_residual(
    tensors: Mapping[str, torch.Tensor],
    *,
    codec: str,
    block_size: int | None = None,
    zstd_level: int = 1,
    metadata: dict | None = None,
    qmax: int | None = None,
    density: float | None = None,
) -> tuple[bytes, dict[str, torch.Tensor]]:
    """``encode_tensors`` plus what the payload does not carry: ``t - decode(payload)`` per
    key (fp32 CPU; zeros under codec none), for a sender's error feedback. The encoder
    dequantises its own frames, so no decode of the payload is needed."""
    residual: dict[str, torch.Tensor] = {}
    if codec in QMAX or codec == "sparse":  # the quantiser's one pass makes them (``_quantize_flat``, ``_sparse_frame``)
        payload = _encode(tensors, codec=codec, block_size=block_size, zstd_level=zstd_level, metadata=metadata,
                          residual=residual, qmax=qmax, density=density)
        return payload, residual

    def left_out(key: str) -> Sink:
        x = _flat32(tensors[key]).numpy()
        r = residual[key] = torch.empty(tensors[key].shape, dtype=torch.float32)
        flat = r.view(-1).numpy()

        def sink(start: int, stop: int, decoded: np.ndarray, bounded: bool) -> None:
            np.subtract(x[start:stop], decoded, out=flat[start:stop])

        return sink

    payload = _encode(tensors, codec=codec, block_size=block_size, zstd_level=zstd_level, metadata=metadata,
                      sink_for=left_out, qmax=qmax)
    return payload, residual


def _sparse_frame(t: torch.Tensor, chunk: int, k: int, *, sink: Sink | None, residual: dict | None, key: str,
                  minus: torch.Tensor | None) -> list:
    """A sparse tensor's raw frame (``sparse.encode``) of t (less ``minus``): the sink gets its
    decoded values; ``residual[key]`` becomes t - decoded (made from t's copy, sparsely)."""
    x = _flat32(t) if minus is None else _flat32(t) - _flat32(minus)
    enc = sparse.encode(x.numpy(), chunk, k)
    if residual is not None:
        r = x.clone() if minus is None else x
        r.numpy()[enc.index] -= enc.value
        residual[key] = r.view(t.shape)
    if sink is not None and hasattr(sink, "sparse"):  # only the sent values (a published delta)
        sink.sparse(enc.index, enc.value, enc.bounded)
    elif sink is not None:
        decoded = np.zeros(x.numel(), dtype=np.float32)
        decoded[enc.index] = enc.value
        sink(0, x.numel(), decoded, enc.bounded)
    return enc.buffers


def _encode(
    tensors: Mapping[str, torch.Tensor], *, codec: str, block_size: int | None, zstd_level: int, metadata: dict | None,
    minus: Mapping[str, torch.Tensor] | None = None, sink_for: Callable[[str], Sink] | None = None,
    residual: dict[str, torch.Tensor] | None = None, qmax: int | None = None, density: float | None = None,
) -> bytes:
    """The payload of ``tensors``, less ``minus`` where it has the key (then the header's dtype
    is float32). ``sink_for(key)``, when given, makes the sink that gets the decoded values of
    tensor ``key`` as they are made. ``residual`` (int8/int4, without ``minus`` and sinks: a
    learner's contribution) is filled with what the payload leaves out of each tensor. ``qmax``
    bounds the codes (default: the codec's range)."""
    block = _check_codec(codec, block_size, qmax)
    topk = _topk(codec, block, density)
    cctx = _compressor(zstd_level)
    frames: list[tuple[str, bytes]] = []
    info: dict[str, Any] = {}
    keys = list(tensors)
    sinks = [None if sink_for is None else sink_for(key) for key in keys]
    if codec == "sparse":
        quantized = [_sparse_frame(tensors[k], block, topk, sink=sink, residual=residual, key=k,
                                   minus=None if minus is None or k not in minus else minus[k])
                     for k, sink in zip(keys, sinks)]
    elif codec in QMAX and not minus and sink_for is None:  # a learner's fragment: its tensors in one pass
        quantized = _quantize_flat([tensors[k] for k in keys], keys, codec, block, residual=residual, qmax=qmax)
    elif codec in QMAX and not minus and len(keys) > 1:
        quantized = _quantize_together([_flat32(tensors[k]) for k in keys], codec, block, sinks=sinks, qmax=qmax)
    else:
        quantized = [_quantize(_flat32(tensors[k]), codec, block, sink=sink, qmax=qmax,
                               minus=None if minus is None or k not in minus else _flat32(minus[k]))
                     for k, sink in zip(keys, sinks)]
    for key, raw in zip(keys, quantized):
        t = tensors[key]
        m = None if minus is None else minus.get(key)
        parts = [memoryview(p).cast("B") for p in raw]
        raw_n = sum(p.nbytes for p in parts)
        assert raw_n == _raw_nbytes(codec, t.numel(), block, topk)
        cobj = cctx.compressobj(size=raw_n)
        comp = b"".join([*(cobj.compress(p) for p in parts), cobj.flush()])
        frames.append((key, comp))
        info[key] = {
            "shape": list(t.shape),
            "dtype": "float32" if m is not None else str(t.dtype).removeprefix("torch."),
            "raw_nbytes": raw_n,
            "comp_nbytes": len(comp),
        }
    header = {
        "format": FORMAT_VERSION,
        "codec": codec,
        "block_size": block,
        **({"topk": topk} if topk else {}),
        "tensors": info,
        "metadata": metadata or {},
    }
    return _write_safetensors(frames, {METADATA_KEY: json.dumps(header, separators=(",", ":"))})


def decode_tensors(
    data: bytes,
    *,
    expected: Mapping[str, tuple[int, ...]] | None = None,
    max_numel: int | None = None,
    where: str = "",
    keep_codes: bool = False,
) -> tuple[Mapping[str, torch.Tensor], dict]:
    """Decode a payload into ({key: fp32 CPU tensor}, caller metadata).

    `keep_codes`: return a ``DecodedTensors`` that keeps int4/int8 tensors as their codes
    (``Quantized``) until a value is asked for; the syncer's merge reads the codes directly.
    The checks are the same either way.

    `expected` ({key: shape}): the payload must hold exactly these keys and shapes.
    `max_numel`: cap on the total element count. Both are checked, and every frame
    size is derived and checked, before any decompression, so memory use is bounded
    by the payload size plus the declared (and accepted) tensor sizes. Pass at least
    one of them for bytes from a bucket. Decoded values must be finite.

    Raises InvalidPayloadError("<where>: what is wrong") on any problem, whatever
    the bytes (never RecursionError, ValueError, OverflowError, MemoryError).
    """
    where = where or "payload"
    try:
        return _decode_tensors(data, expected=expected, max_numel=max_numel, where=where, keep_codes=keep_codes)
    except records.PARSE_ERRORS as exc:  # a bound this decoder does not know of; still just bad input
        raise InvalidPayloadError(f"{where}: cannot decode ({type(exc).__name__}: {records.one_line(exc)})") from None


def _decode_tensors(
    data: bytes, *, expected: Mapping[str, tuple[int, ...]] | None, max_numel: int | None, where: str,
    keep_codes: bool,
) -> tuple[Mapping[str, torch.Tensor], dict]:
    codec, block, topk, plan, caller_meta = _checked_frames(data, expected=expected, max_numel=max_numel, where=where)
    out: dict[str, Source] = {}
    for key, shape, n, raw_n, comp in plan:
        raw = _decompressed(comp, raw_n, where=where, key=key)
        out[key] = _decoded(raw, codec, tuple(shape), block, keep_codes=keep_codes, where=f"{where}: tensor {key!r}",
                            topk=topk)
    return (DecodedTensors(out, codec=codec, block_size=block, topk=topk or None) if keep_codes else out), caller_meta


def _checked_frames(
    data: bytes, *, expected: Mapping[str, tuple[int, ...]] | None, max_numel: int | None, where: str,
) -> tuple[str, int, int, list[tuple[str, list[int], int, int, memoryview]], dict]:
    """(codec, block size, sparse values per chunk (0 for the other codecs), [(key, shape, numel, raw size, compressed frame)], caller metadata) of a
    payload, every declared size checked (see ``decode_tensors``) and nothing decompressed."""
    def bad(msg: str) -> InvalidPayloadError:
        return InvalidPayloadError(f"{where}: {msg}")

    data = bytes(data) if not isinstance(data, bytes) else data
    header, data_start = _parse_safetensors(data, where)
    codec, block, topk, tinfo, caller_meta = _checked_description(header, bad, where)

    # -- validate every declared size before touching the frames
    entries = {k: v for k, v in header.items() if k != "__metadata__"}
    if set(entries) != set(tinfo):
        raise bad("safetensors tensors and ddiloco metadata list different keys")
    if expected is not None and set(tinfo) != set(expected):
        missing = sorted(set(expected) - set(tinfo))
        extra = sorted(set(tinfo) - set(expected))
        raise bad(f"tensor keys differ from the expected ones (missing {missing}, extra {extra})")
    plan = []
    total_numel = 0
    numel_limit = _MAX_NUMEL if max_numel is None else min(max_numel, _MAX_NUMEL)
    frames = _Frames(memoryview(data), data_start, len(data) - data_start, bad)
    for key, ti in tinfo.items():
        shape = ti.get("shape") if isinstance(ti, dict) else None
        if (
            not isinstance(shape, list)
            or len(shape) > _MAX_NDIM
            or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in shape)
        ):
            raise bad(f"tensor {key!r}: bad shape {shape!r}")
        if expected is not None and tuple(shape) != tuple(expected[key]):
            raise bad(f"tensor {key!r}: shape {shape} but expected {list(expected[key])}")
        n = math.prod(shape)
        total_numel += n
        if total_numel > numel_limit:
            raise bad(f"declares more than the allowed {numel_limit} elements")
        raw_n = _raw_nbytes(codec, n, block, topk)
        if ti.get("raw_nbytes") != raw_n:
            raise bad(f"tensor {key!r}: raw_nbytes {ti.get('raw_nbytes')!r} != {raw_n} for shape {shape}")
        plan.append((key, shape, n, raw_n, frames.frame(key, entries[key], raw_n)))
    return codec, block, topk, plan, caller_meta


def _checked_description(header: Mapping[str, Any], bad: Callable[[str], InvalidPayloadError],
                         where: str) -> tuple[str, int, int, dict, dict]:
    """(codec, block size, sparse topk, tensors, caller metadata) of a payload's ddiloco
    description, each checked."""
    meta = header.get("__metadata__")
    if not isinstance(meta, dict) or not isinstance(meta.get(METADATA_KEY), str):
        raise bad(f"missing {METADATA_KEY!r} metadata: not a ddiloco payload")
    desc = _parse_description(meta[METADATA_KEY], where)
    if not isinstance(desc, dict):
        raise bad(f"{METADATA_KEY!r} metadata is not a JSON object")
    fmt = desc.get("format")
    if not isinstance(fmt, int) or fmt > FORMAT_VERSION:
        raise bad(f"payload format {fmt!r} is newer than this ddiloco understands; upgrade ddiloco")
    codec = desc.get("codec")
    if codec not in CODECS:
        raise bad(f"unknown codec {codec!r}")
    block = desc.get("block_size")
    if codec in QMAX:
        if not isinstance(block, int) or isinstance(block, bool) or not 1 <= block <= (1 << 24):
            raise bad(f"bad block_size {block!r}")
    topk = desc.get("topk") if codec == "sparse" else 0
    if codec == "sparse":
        try:
            sparse.check_params(block, topk)
        except InvalidPayloadError as exc:
            raise bad(str(exc)) from None
    tinfo = desc.get("tensors")
    caller_meta = desc.get("metadata", {})
    if not isinstance(tinfo, dict) or not isinstance(caller_meta, dict):
        raise bad("'tensors' and 'metadata' must be JSON objects")
    return codec, block, topk, tinfo, caller_meta


class _Frames:
    """The compressed frames of a payload's data section, each checked against its entry."""

    def __init__(self, view: memoryview, start: int, length: int, bad: Callable[[str], InvalidPayloadError]):
        self.view, self.start, self.length, self.bad = view, start, length, bad

    def frame(self, key: str, e: Any, raw_n: int) -> memoryview:
        offs = e.get("data_offsets") if isinstance(e, dict) else None
        if (
            not isinstance(e, dict)
            or e.get("dtype") != "U8"
            or not isinstance(offs, list)
            or len(offs) != 2
            or not all(isinstance(x, int) for x in offs)
            or not 0 <= offs[0] <= offs[1] <= self.length
            or e.get("shape") != [offs[1] - offs[0]]
        ):
            raise self.bad(f"tensor {key!r}: bad safetensors entry {e!r:.200}")
        comp = self.view[self.start + offs[0]: self.start + offs[1]]
        try:
            declared = zstandard.frame_content_size(comp)
        except zstandard.ZstdError as err:
            raise self.bad(f"tensor {key!r}: not a zstd frame ({err})") from None
        if declared not in (-1, raw_n):
            raise self.bad(f"tensor {key!r}: zstd frame declares {declared} bytes, expected {raw_n}")
        return comp


def _decoded(raw: bytes, codec: str, shape: tuple[int, ...], block: int, *, keep_codes: bool, where: str,
             topk: int = 0) -> Source:
    """The tensor of a decompressed frame (length already checked): fp32, or with
    ``keep_codes`` a ``Quantized`` for int4/int8 (a ``sparse.SparseTensor`` for sparse).
    Raises InvalidPayloadError when a value is not finite."""
    if codec == "sparse":
        st = sparse.decode(raw, shape, block, topk, where=where)
        return st if keep_codes else st.dense()
    if codec in QMAX and math.prod(shape):
        q = Quantized.from_frame(raw, codec=codec, shape=shape, block=block)
        # the codes are small integers: when every scale times the largest of them is finite, so
        # is every value (a check on the scales); otherwise check the values themselves
        if not q.bounded() and not all_finite(q.dense()):
            raise InvalidPayloadError(f"{where} has non-finite values")
        return q if keep_codes else q.dense()
    t = _dequantize(raw, codec, math.prod(shape), block).view(shape)
    if not all_finite(t):
        raise InvalidPayloadError(f"{where} has non-finite values")
    return t


# --- syncer-side error feedback for published fragments --------------------------------


def _add(prev: Mapping[str, torch.Tensor], decoded: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """prev + decoded, summed into ``decoded`` (fresh tensors from a decoder: no copy)."""
    for k, d in decoded.items():
        p = prev.get(k)
        if p is not None:
            d.add_(p.to(torch.float32))  # p + d, as addition commutes: the same bits
    return decoded


def encode_published_delta(
    prev_published: Mapping[str, torch.Tensor],
    new_value: Mapping[str, torch.Tensor],
    *,
    codec: str,
    block_size: int | None = None,
    zstd_level: int = 1,
    metadata: dict | None = None,
    qmax: int | None = None,
    density: float | None = None,
) -> tuple[bytes, dict[str, torch.Tensor]]:
    """Encode new_value - prev_published; return (payload, new published value).

    The new published value is prev_published + decode(payload), exactly what
    `apply_published_delta` computes on a learner (made from the quantised values as the
    encoder makes them, range by range in cache, without the zstd round trip: the same bytes
    give the same values). The syncer must keep it (not new_value) as the base of the next
    delta: that carries the quantization error forward. An empty prev_published means zeros;
    with codec "none" the published value then equals new_value exactly (use that for a full
    snapshot). Tensors are fp32 CPU. Raises InvalidPayloadError when a decoded value is not finite.
    """
    published: dict[str, torch.Tensor] = {}
    # fp32 (a header's dtype is float32 either way); the difference is made range by range
    value = {k: v.detach().to("cpu", torch.float32) for k, v in new_value.items()}

    def into_published(key: str) -> Sink:
        out = published[key] = torch.empty(value[key].shape, dtype=torch.float32)
        flat, p = out.view(-1).numpy(), prev_published.get(key)
        base = None if p is None else _flat32(p).numpy()

        def sink(start: int, stop: int, decoded: np.ndarray, bounded: bool) -> None:
            if not bounded and not all_finite(torch.from_numpy(decoded)):
                raise InvalidPayloadError(f"own published delta: tensor {key!r} has non-finite values")
            if base is None:
                flat[start:stop] = decoded
            else:  # what _add computes on a reader's decode: base + decoded
                np.add(base[start:stop], decoded, out=flat[start:stop])

        def sparse_sink(index: np.ndarray, sent: np.ndarray, bounded: bool) -> None:
            if not bounded and not np.isfinite(sent).all():
                raise InvalidPayloadError(f"own published delta: tensor {key!r} has non-finite values")
            _sparse_sum(base, index, sent, out=flat)  # as apply_published_delta: only the sent values change

        sink.sparse = sparse_sink  # type: ignore[attr-defined]
        return sink

    payload = _encode(value, codec=codec, block_size=block_size, zstd_level=zstd_level, metadata=metadata,
                      minus=prev_published, sink_for=into_published, qmax=qmax, density=density)
    return payload, published


def apply_published_delta(
    prev_published: Mapping[str, torch.Tensor],
    payload: bytes,
    *,
    where: str,
    expected: Mapping[str, tuple[int, ...]] | None = None,
) -> dict[str, torch.Tensor]:
    """prev_published + decode(payload): bit-identical to the syncer's published
    value when prev_published is (fp32 CPU). `expected` defaults to prev's shapes
    when prev is non-empty. Raises InvalidPayloadError."""
    if expected is None and prev_published:
        expected = {k: tuple(v.shape) for k, v in prev_published.items()}
    where = where or "payload"
    try:
        codec, block, topk, plan, _ = _checked_frames(payload, expected=expected, max_numel=None, where=where)
        out: dict[str, torch.Tensor] = {}
        for key, shape, n, raw_n, comp in plan:
            raw = _decompressed(comp, raw_n, where=where, key=key)
            p = prev_published.get(key)
            summed = _sum_with(p, raw, codec, tuple(shape), block) if codec in QMAX and n else None
            if codec == "sparse":
                st = sparse.decode(raw, tuple(shape), block, topk, where=f"{where}: tensor {key!r}")
                out_flat = np.empty(n, dtype=np.float32)
                _sparse_sum(None if p is None else _flat32(p).numpy(), st.index, st.value, out=out_flat)
                summed = torch.from_numpy(out_flat).view(tuple(shape))
            if summed is None:  # the general way: decode (values checked), then add
                t = _decoded(raw, codec, tuple(shape), block, keep_codes=False, where=f"{where}: tensor {key!r}",
                             topk=topk)
                summed = _add({key: p} if p is not None else {}, {key: t})[key]
            out[key] = summed
    except records.PARSE_ERRORS as exc:  # as decode_tensors
        raise InvalidPayloadError(f"{where}: cannot decode ({type(exc).__name__}: {records.one_line(exc)})") from None
    return out


__all__ = [
    "CODECS",
    "DEFAULT_BLOCK_SIZE",
    "encode_tensors",
    "decode_tensors",
    "payload_codec",
    "encode_published_delta",
    "apply_published_delta",
]
