"""The container of every tensor payload: a safetensors file of uint8 tensors, each one zstd
frame, with the codec's description as JSON under the "ddiloco" metadata key (codec.py
describes the frames). Parsing is bounded: the header length is checked against the bytes
and a size cap, and the JSON is read within records' limits."""

from __future__ import annotations

import json
import struct
import threading
from typing import Any

import zstandard

from ddiloco_cli.errors import InvalidPayloadError
from ddiloco_cli.protocol import records

METADATA_KEY = "ddiloco"
MAX_HEADER_BYTES = 64 << 20
_MAX_HEADER_BYTES = MAX_HEADER_BYTES


_COMPRESSORS = threading.local()


def compressor(level: int) -> zstandard.ZstdCompressor:
    """This thread's compressor for ``level``: one may not be shared between threads, and
    making one per payload costs more than compressing a small tensor."""
    by_level = _COMPRESSORS.__dict__.setdefault("by_level", {})
    cctx = by_level.get(level)
    if cctx is None:
        cctx = by_level[level] = zstandard.ZstdCompressor(level=level, write_content_size=True, write_checksum=True)
    return cctx


def decompressor() -> zstandard.ZstdDecompressor:
    """This thread's decompressor (as ``compressor``)."""
    dctx = getattr(_COMPRESSORS, "dctx", None)
    if dctx is None:
        dctx = _COMPRESSORS.dctx = zstandard.ZstdDecompressor()
    return dctx


def write_safetensors(frames: list[tuple[str, bytes]], metadata: dict[str, str]) -> bytes:
    """A safetensors file of uint8 tensors (the format is 8-byte LE header length,
    JSON header, data). Written directly to avoid two extra copies of the data;
    `safetensors.torch.load` reads it (tested)."""
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for key, comp in frames:
        header[key] = {"dtype": "U8", "shape": [len(comp)], "data_offsets": [offset, offset + len(comp)]}
        offset += len(comp)
    hbytes = json.dumps(header, separators=(",", ":")).encode()
    hbytes += b" " * (-len(hbytes) % 8)  # align the data section, as safetensors does
    return b"".join([struct.pack("<Q", len(hbytes)), hbytes, *(c for _, c in frames)])


def parse_safetensors(data: bytes, where: str) -> tuple[dict, int]:
    """(header dict, offset of the data section), validated against len(data)."""

    def bad(msg: str) -> InvalidPayloadError:
        return InvalidPayloadError(f"{where}: {msg}")

    if len(data) < 8:
        raise bad("payload too short to be a safetensors file")
    (hlen,) = struct.unpack("<Q", data[:8])
    if hlen > min(len(data) - 8, _MAX_HEADER_BYTES):
        raise bad(f"safetensors header length {hlen} exceeds the payload ({len(data)} bytes)")
    header = records.parse_json(data[8 : 8 + hlen], where=f"{where}: safetensors header",
                                max_bytes=_MAX_HEADER_BYTES, error=InvalidPayloadError)
    if not isinstance(header, dict):
        raise bad("safetensors header is not a JSON object")
    return header, 8 + hlen



def decompressed(comp: memoryview, raw_n: int, *, where: str, key: str) -> bytes:
    """A tensor's frame, decompressed (capped at its derived size ``raw_n``, and exactly that)."""
    try:
        raw = decompressor().decompress(comp, max_output_size=raw_n, allow_extra_data=False)
    except zstandard.ZstdError as err:
        raise InvalidPayloadError(f"{where}: tensor {key!r}: zstd decompression failed ({err})") from None
    if len(raw) != raw_n:
        raise InvalidPayloadError(f"{where}: tensor {key!r}: decompressed to {len(raw)} bytes, expected {raw_n}")
    return raw



def payload_codec(data: bytes, *, where: str = "") -> dict:
    """The 'ddiloco' header of a payload (codec, block size, tensors, metadata)
    without decoding any tensor; for `ddiloco inspect`."""
    header, _ = parse_safetensors(data, where or "payload")
    meta = header.get("__metadata__")
    if not isinstance(meta, dict) or not isinstance(meta.get(METADATA_KEY), str):
        raise InvalidPayloadError(f"{where or 'payload'}: not a ddiloco payload")
    desc = parse_description(meta[METADATA_KEY], where or "payload")
    if not isinstance(desc, dict):
        raise InvalidPayloadError(f"{where or 'payload'}: {METADATA_KEY!r} metadata is not a JSON object")
    return desc


def parse_description(text: str, where: str) -> Any:
    """The 'ddiloco' metadata entry, parsed within the bounds of every bucket read."""
    return records.parse_json(text, where=f"{where}: {METADATA_KEY!r} metadata", max_bytes=_MAX_HEADER_BYTES,
                              error=InvalidPayloadError)




__all__ = ["METADATA_KEY", "MAX_HEADER_BYTES", "compressor", "decompressor", "write_safetensors", "parse_safetensors",
           "decompressed", "payload_codec", "parse_description"]
