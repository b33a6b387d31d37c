"""The encoder quantises an int8/int4 payload's tensors together, in one flat buffer: each
tensor's compressed frame, decoded value and residual must be exactly what encoding it
alone gives (block boundaries restart at every tensor; int4 pads an odd tail with nibble 8)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import ddiloco_cli.numerics.blockquant as B
import ddiloco_cli.numerics.codec as C
from ddiloco_cli.errors import UsageError
from ddiloco_cli.numerics import quantized

SHAPES = [(5, 7), (0,), (1,), (64,), (130,), (3, 1, 3)]


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {f"t{i}": torch.randn(shape, generator=g) * 10.0 ** (i % 3 - 1) for i, shape in enumerate(SHAPES)}
    out["zeros"] = torch.zeros(9)
    return out


def _frames(payload: bytes) -> dict[str, bytes]:
    """The compressed frame of every tensor of a payload, by key."""
    header, start = C._parse_safetensors(payload, "test")
    return {k: payload[start + e["data_offsets"][0] : start + e["data_offsets"][1]]
            for k, e in header.items() if k != "__metadata__"}


@pytest.mark.parametrize("codec,block", [("int4", 64), ("int4", 3), ("int4", 7), ("int4", 1), ("int8", 7),
                                         ("int8", 256), ("bf16", None), ("none", None)])
def test_each_frame_and_residual_equal_encoding_the_tensor_alone(codec, block):
    tensors = _tensors(0)
    payload, residual = C.encode_with_residual(tensors, codec=codec, block_size=block)
    decoded, _ = C.decode_tensors(payload, expected={k: tuple(t.shape) for k, t in tensors.items()})
    frames = _frames(payload)
    for key, t in tensors.items():
        alone_payload, alone_residual = C.encode_with_residual({key: t}, codec=codec, block_size=block)
        assert frames[key] == _frames(alone_payload)[key], key
        assert torch.equal(decoded[key], C.decode_tensors(alone_payload)[0][key]), key
        assert residual[key].shape == t.shape and torch.equal(residual[key], alone_residual[key]), key
        assert torch.equal(t - decoded[key], residual[key]), key  # what the decoder leaves out, bit for bit


def test_chunks_split_inside_a_tensor_and_across_tensors(monkeypatch):
    """Chunk boundaries inside one tensor and between two give the one-shot bytes and residuals."""
    tensors = {"a": torch.randn(1000), "b": torch.randn(77), "c": torch.randn(300)}
    monkeypatch.setattr(B, "QUANTIZE_CHUNK_ELEMS", 10**9)
    one_shot, one_shot_res = C.encode_with_residual(tensors, codec="int4", block_size=5)
    monkeypatch.setattr(B, "QUANTIZE_CHUNK_ELEMS", 20)
    chunked, chunked_res = C.encode_with_residual(tensors, codec="int4", block_size=5)
    assert chunked == one_shot
    assert all(torch.equal(chunked_res[k], one_shot_res[k]) for k in tensors)


def _scale_bits_reference(absmax: np.ndarray, qmax: int) -> np.ndarray:
    """absmax / qmax rounded up to bf16 through int64, clipped after: the encoder's first form."""
    bits = (absmax / np.float32(qmax)).view(np.int32).astype(np.int64)
    return ((bits + 0xFFFF) & ~0xFFFF).clip(max=0x7F7F0000).astype(np.int32)


@pytest.mark.parametrize("qmax", [3, 7, 127])
def test_scale_rounding_in_int32_gives_the_bits_of_the_int64_form(qmax):
    """Every fp32 bit pattern's top half (signs, subnormals, Inf, NaN with any payload) with
    low halves that round differently; and the bound the sinks get from the bits is the
    isfinite(scale * qmax) of every scale the rounding can make."""
    rng = np.random.default_rng(0)
    top = np.arange(1 << 16, dtype=np.uint32) << 16
    with np.errstate(all="ignore"):
        for low in [0, 1, 0x7FFF, 0x8000, 0xFFFE, 0xFFFF, *rng.integers(0, 1 << 16, 4).tolist()]:
            absmax = (top | np.uint32(low)).view(np.float32)
            assert np.array_equal(B._bf16_scale_bits_up(absmax, qmax), _scale_bits_reference(absmax, qmax)), low
        scales = top.view(np.int32)
        finite = np.isfinite(scales.view(np.float32) * np.float32(qmax))
    assert np.array_equal(np.bitwise_and(scales, 0x7FFFFFFF) <= B._bounded_scale_bits(qmax), finite)


@pytest.mark.parametrize("codec_name,qmax", [("int4", 3), ("int4", 1), ("int8", 15)])
def test_a_bounded_encoder_writes_only_codes_within_its_bound(codec_name, qmax):
    """``qmax`` bounds the codes an encoder writes; the frame is an ordinary one of its codec
    (the plain decoder reads it), the residual is exactly what it leaves out, and a smaller bound
    gives fewer bytes after zstd."""
    g = torch.Generator().manual_seed(3)
    x = {"w": torch.randn(37, 129, generator=g), "b": torch.randn(131, generator=g)}
    data, residual = C.encode_with_residual(x, codec=codec_name, block_size=64, qmax=qmax)
    full = C.encode_tensors(x, codec=codec_name, block_size=64)
    assert len(data) < len(full)
    decoded, _ = C.decode_tensors(data, keep_codes=True)
    for k, t in x.items():
        src = decoded.sources[k]
        q = np.empty(src.numel, dtype=np.float32)
        quantized.q_values(src.codes, codec_name, src.numel, out=q)
        assert float(np.abs(q).max()) == qmax  # the bound is reached (each block's absmax) and kept
        assert torch.equal(residual[k], t - decoded[k])  # what the payload does not carry, exactly
    assert C.decode_tensors(C.encode_tensors(x, codec=codec_name, block_size=64, qmax=None))[0]["w"].shape == (37, 129)


@pytest.mark.parametrize("codec_name,qmax", [("int4", 0), ("int4", 8), ("int8", 128), ("none", 3), ("bf16", 3),
                                             ("int4", 2.5), ("int4", True)])
def test_a_bound_outside_the_codec_is_a_usage_error(codec_name, qmax):
    with pytest.raises(UsageError, match="codec-qmax"):
        C.encode_tensors({"w": torch.ones(4)}, codec=codec_name, qmax=qmax)


def _edge_tensors() -> list[dict[str, torch.Tensor]]:
    """Payloads whose blocks are zeros of either sign, subnormal (scales whose inverse overflows),
    huge, non-finite, empty, of odd sizes, and tensors that are not flat fp32 (a view, bf16, one
    that requires grad)."""
    g = torch.Generator().manual_seed(1)
    out = []
    for scale in (1e-3, 1.0, 1e-40, 1e36):
        out.append({"w": scale * torch.randn(40, 64, generator=g), "b": scale * torch.randn(63, generator=g)})
    out.append({"z": torch.zeros(128), "nz": -torch.zeros(128), "mixed": torch.tensor([0.0, -0.0] * 64),
                "huge": torch.full((64,), 3e38), "empty": torch.zeros(0, 4)})
    nonfinite = torch.randn(300, generator=g)
    nonfinite[[3, 100, 250]] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    out.append({"x": nonfinite})
    out.append({"t": torch.randn(64, 30, generator=g).t(), "h": torch.randn(129, generator=g).to(torch.bfloat16),
                "g": torch.randn(77, generator=g).requires_grad_()})
    out.append({"one": torch.randn(256 * 64, generator=g)})  # one tensor of whole blocks: read in place
    return out


@pytest.mark.parametrize("codec,block", [("int4", 64), ("int4", 3), ("int4", 1), ("int8", 7), ("int8", 256)])
@pytest.mark.parametrize("chunk", [None, 20])
@pytest.mark.parametrize("qmax", [None, 3])
def test_the_learner_quantiser_gives_the_bytes_of_the_sink_quantiser(codec, block, chunk, qmax, monkeypatch):
    """``encode_tensors`` and ``encode_with_residual`` (``_quantize_flat``) make the bytes of the
    quantiser the syncer's published deltas use (``_quantize``/``_quantize_together`` with sinks),
    and a residual that is what the decoder leaves out, bit for bit, wherever the input is finite
    (subnormal blocks too, whose codes the decoder reads as q = code - offset)."""
    if chunk is not None:
        monkeypatch.setattr(B, "QUANTIZE_CHUNK_ELEMS", chunk)
    for i, tensors in enumerate(_edge_tensors()):
        meta = {"case": i}
        with np.errstate(all="ignore"):
            reference = C._encode(tensors, codec=codec, block_size=block, zstd_level=1, metadata=meta, qmax=qmax,
                                  sink_for=lambda key: (lambda start, stop, values, bounded: None))
            assert C.encode_tensors(tensors, codec=codec, block_size=block, metadata=meta, qmax=qmax) == reference, i
            payload, residual = C.encode_with_residual(tensors, codec=codec, block_size=block, metadata=meta,
                                                       qmax=qmax)
        assert payload == reference, i
        assert list(residual) == list(tensors)
        if i == 5:
            continue  # non-finite values: the decoder refuses the payload
        decoded, _ = C.decode_tensors(payload, expected={k: tuple(t.shape) for k, t in tensors.items()})
        for key, t in tensors.items():
            r = residual[key]
            assert r.dtype == torch.float32 and r.shape == t.shape and not r.requires_grad, (i, key)
            assert torch.equal(t.detach().float() - decoded[key], r), (i, key)
