"""``apply_published_delta`` sums an int8/int4 delta into the previous value in one pass
(``addcmul`` of q and the scales) instead of decoding it and adding: its result must be the
bits of decoding, then adding (which is what the syncer publishes), for every codec, shape,
block size, chunking, signed zero and hostile scale, and it must refuse what the decoder
refuses, with the same message."""

from __future__ import annotations

import json
import struct

import pytest
import torch
import zstandard

import ddiloco_cli.numerics.blockquant as B
import ddiloco_cli.numerics.codec as C
from ddiloco_cli.errors import InvalidPayloadError


def _decode_then_add(prev: dict, payload: bytes, expected: dict | None = None) -> dict:
    """The reference: the general decoder, then prev + decoded."""
    if expected is None:
        expected = {k: tuple(v.shape) for k, v in prev.items()}
    decoded, _ = C.decode_tensors(payload, expected=expected, where="x")
    return C._add(prev, dict(decoded))


def _same_bits(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype == torch.float32 and a[k].shape == b[k].shape, k
        assert torch.equal(a[k].view(torch.int32), b[k].view(torch.int32)), k


SHAPES = [(512, 256), (7,), (1,), (3, 5), (129,), (0,), (4, 0), (2, 3, 5), (300_001,), (262_146,)]


@pytest.mark.parametrize("codec,block", [("int4", 64), ("int4", 7), ("int4", 3), ("int4", 1), ("int4", 100),
                                         ("int8", 256), ("int8", 5), ("bf16", None), ("none", None)])
def test_the_sum_is_the_bits_of_decoding_then_adding(codec, block):
    g = torch.Generator().manual_seed(0)
    for shape in SHAPES:
        prev = {"a": 0.02 * torch.randn(shape, generator=g), "b": torch.randn(13, generator=g)}
        prev["a"].view(-1)[:3] = -0.0
        new = {k: v + 1e-3 * torch.randn(v.shape, generator=g) for k, v in prev.items()}
        new["a"].view(-1)[:2] = -0.0
        new["a"].view(-1)[2:3] = 0.0
        payload, published = C.encode_published_delta(prev, new, codec=codec, block_size=block)
        got = C.apply_published_delta(prev, payload, where="x")
        _same_bits(got, _decode_then_add(prev, payload))
        _same_bits(got, published)  # what the syncer holds
        expected = {k: tuple(v.shape) for k, v in prev.items()}
        _same_bits(C.apply_published_delta({}, payload, where="x", expected=expected),
                   _decode_then_add({}, payload, expected))


def _with_first_scale(payload: bytes, bits: int) -> bytes:
    """``payload`` with the first bf16 scale of every frame replaced by ``bits``."""
    hlen = struct.unpack("<Q", payload[:8])[0]
    header = json.loads(payload[8 : 8 + hlen])
    desc = json.loads(header["__metadata__"][C.METADATA_KEY])
    frames = []
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        a, b = entry["data_offsets"]
        raw = bytearray(zstandard.ZstdDecompressor().decompress(payload[8 + hlen + a : 8 + hlen + b]))
        raw[0:2] = struct.pack("<H", bits)
        frames.append((key, zstandard.ZstdCompressor(level=1, write_content_size=True).compress(bytes(raw))))
        desc["tensors"][key]["comp_nbytes"] = len(frames[-1][1])
    return C._write_safetensors(frames, {C.METADATA_KEY: json.dumps(desc)})


# bf16 bits: the largest finite, +/-Inf, NaN, the largest whose product with 8 is finite, the smallest
# whose is not, negative, subnormal, -0
HOSTILE_SCALES = [0x7F7F, 0x7F80, 0xFF80, 0x7FC0, 0xFF7F, 0x7DFF, 0x7E00, 0xBC00, 0x0001, 0x8000, 0x7BFF, 0x7C00]


@pytest.mark.parametrize("codec,block", [("int4", 64), ("int8", 256), ("int4", 5)])
@pytest.mark.parametrize("bits", HOSTILE_SCALES)
def test_a_hostile_scale_is_refused_or_summed_as_the_decoder_does(codec, block, bits):
    g = torch.Generator().manual_seed(1)
    prev = {"a": 0.02 * torch.randn(1000, generator=g)}
    new = {"a": prev["a"] + 1e-3 * torch.randn(1000, generator=g)}
    payload, _ = C.encode_published_delta(prev, new, codec=codec, block_size=block)
    hostile = _with_first_scale(payload, bits)
    try:
        reference, refused = _decode_then_add(prev, hostile), None
    except InvalidPayloadError as exc:
        reference, refused = None, str(exc)
    if refused is not None:
        with pytest.raises(InvalidPayloadError) as got:
            C.apply_published_delta(prev, hostile, where="x")
        assert str(got.value) == refused
    else:
        _same_bits(C.apply_published_delta(prev, hostile, where="x"), reference)


def test_the_bound_on_the_scales_is_the_last_bf16_whose_product_with_the_largest_code_is_finite():
    for codec, qabs in (("int4", 8), ("int8", 128)):
        edge = B._BOUNDED_BITS[codec]
        below = torch.tensor([edge], dtype=torch.int16).view(torch.bfloat16).float()
        above = torch.tensor([edge + 1], dtype=torch.int16).view(torch.bfloat16).float()
        assert torch.isfinite(below * qabs) and not torch.isfinite(above * qabs)


def test_a_previous_value_that_is_not_a_plain_fp32_tensor_is_summed_as_its_fp32_values():
    g = torch.Generator().manual_seed(2)
    prev = {"a": 0.02 * torch.randn(64, 48, generator=g)}
    new = {"a": prev["a"] + 1e-3 * torch.randn(64, 48, generator=g)}
    payload, published = C.encode_published_delta(prev, new, codec="int4", block_size=64)
    # not contiguous, requiring grad, fp64
    for other in (prev["a"].t().contiguous().t(), prev["a"].clone().requires_grad_(True), prev["a"].double()):
        got = C.apply_published_delta({"a": other}, payload, where="x")
        _same_bits(got, published)
        _same_bits(got, _decode_then_add({"a": other.detach()}, payload))
