"""Codec: round trips, error bounds, hostile payloads, published-delta error feedback."""

import json
import struct

import pytest
import safetensors.torch
import torch
import zstandard

from ddiloco_cli.errors import InvalidPayloadError, UsageError
from ddiloco_cli.numerics import codec
from ddiloco_cli.numerics.codec import (
    CODECS,
    apply_published_delta,
    decode_tensors,
    encode_published_delta,
    encode_tensors,
    payload_codec,
)


def sample(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(300, 77, generator=g) * 0.01,
        "odd": torch.randn(13, generator=g),
        "scalar": torch.tensor(-2.5),
        "empty": torch.zeros(0, 4),
        "zeros": torch.zeros(100),
        "bf": torch.randn(64, generator=g).to(torch.bfloat16),
    }


def shapes(t):
    return {k: tuple(v.shape) for k, v in t.items()}


def rel_err(a, b):
    return float((a.float() - b).norm() / max(float(a.float().norm()), 1e-30))


# relative error bounds for N(0,1)-like data (measured: bf16 0.2%, int8 0.7%, int4 11%)
BOUND = {"none": 0.0, "bf16": 0.004, "int8": 0.012, "int4": 0.15, "sparse": 0.95}  # sparse: 2% of a Gaussian


@pytest.mark.parametrize("codec", CODECS)
def test_round_trip_error_and_metadata(codec):
    x = sample()
    data = encode_tensors(x, codec=codec, metadata={"learner": "a", "step": 3})
    y, meta = decode_tensors(data, expected=shapes(x), where="t")
    assert meta == {"learner": "a", "step": 3}
    assert set(y) == set(x)
    for k in x:
        assert y[k].dtype == torch.float32 and y[k].shape == x[k].shape
        assert rel_err(x[k], y[k]) <= BOUND[codec], (k, rel_err(x[k], y[k]))
    assert torch.equal(y["zeros"], x["zeros"])
    if codec == "none":
        assert all(torch.equal(y[k], x[k].float()) for k in x)
    # the file is a normal safetensors file of uint8 frames
    plain = safetensors.torch.load(data)
    assert set(plain) == set(x) and all(v.dtype == torch.uint8 for v in plain.values())
    assert payload_codec(data)["codec"] == codec


@pytest.mark.parametrize("codec,block", [("int8", 1), ("int8", 7), ("int4", 1), ("int4", 3), ("int4", 5),
                                         ("int4", 1000)])
def test_odd_block_sizes_and_per_block_bound(codec, block):
    x = {"a": torch.randn(1001), "b": torch.randn(1)}
    y, _ = decode_tensors(encode_tensors(x, codec=codec, block_size=block), expected=shapes(x))
    qmax = 127 if codec == "int8" else 7
    for k in x:
        xb = torch.nn.functional.pad(x[k], (0, -len(x[k]) % block)).view(-1, block)
        yb = torch.nn.functional.pad(y[k], (0, -len(y[k]) % block)).view(-1, block)
        # error <= half a quantization step (scale rounded up to bf16: < 1% larger)
        step = xb.abs().amax(1, keepdim=True) / qmax * 1.01
        assert torch.all((xb - yb).abs() <= step / 2 + 1e-7)
    assert payload_codec(encode_tensors(x, codec=codec, block_size=block))["block_size"] == block


def test_int4_is_about_half_a_byte_per_value():
    x = {"a": torch.randn(1 << 16)}
    n = {c: len(encode_tensors(x, codec=c)) / (1 << 16) for c in CODECS}
    assert n["int4"] < 0.6 and n["int8"] < 1.1 and n["bf16"] < 2.1 and 3.5 < n["none"] < 4.1


def test_bad_codec_flags():
    with pytest.raises(UsageError, match="unknown codec"):
        encode_tensors({"a": torch.ones(2)}, codec="int2")
    with pytest.raises(UsageError, match="block"):
        encode_tensors({"a": torch.ones(2)}, codec="int4", block_size=0)


# --- hostile payloads -----------------------------------------------------------------


def rewrite(data, edit):
    """Re-pack a payload after edit(header_dict, ddiloco_desc)."""
    (hlen,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + hlen])
    desc = json.loads(header["__metadata__"]["ddiloco"])
    edit(header, desc)
    header["__metadata__"]["ddiloco"] = json.dumps(desc)
    h = json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h + data[8 + hlen :]


def test_expected_shapes_and_keys_enforced():
    x = {"a": torch.randn(4, 5), "b": torch.randn(3)}
    data = encode_tensors(x, codec="int8")
    with pytest.raises(InvalidPayloadError, match=r"^up/x: tensor 'a': shape \[4, 5\] but expected \[5, 4\]"):
        decode_tensors(data, expected={"a": (5, 4), "b": (3,)}, where="up/x")
    with pytest.raises(InvalidPayloadError, match="missing \\['c'\\]"):
        decode_tensors(data, expected={"a": (4, 5), "b": (3,), "c": (1,)}, where="w")
    with pytest.raises(InvalidPayloadError, match="allowed 22 elements"):
        decode_tensors(data, max_numel=22, where="w")
    decode_tensors(data, max_numel=23, where="w")


def test_hostile_declared_size_is_refused_before_decompressing(monkeypatch):
    # A tiny frame that would expand to 16 MB of zeros (the same holds for any size).
    huge = 1 << 22
    x = {"a": torch.zeros(4)}
    data = encode_tensors(x, codec="none")
    bomb = zstandard.ZstdCompressor(level=3).compress(bytes(4 * huge))
    assert len(bomb) < 10_000

    def edit(header, desc):
        desc["tensors"]["a"]["shape"] = [huge]
        desc["tensors"]["a"]["raw_nbytes"] = 4 * huge

    hostile = rewrite(data, edit)
    calls = []
    monkeypatch.setattr(zstandard.ZstdDecompressor, "decompress", lambda *a, **k: calls.append(1))
    with pytest.raises(InvalidPayloadError, match="allowed 4 elements"):
        decode_tensors(hostile, max_numel=4, where="w")
    with pytest.raises(InvalidPayloadError, match="expected \\[4\\]"):
        decode_tensors(hostile, expected={"a": (4,)}, where="w")
    # header says 4 elements but the frame declares 1 GB: refused from the frame header
    (hlen,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + hlen])
    header["a"]["shape"] = [len(bomb)]
    header["a"]["data_offsets"] = [0, len(bomb)]
    h = json.dumps(header).encode()
    with pytest.raises(InvalidPayloadError, match="zstd frame declares"):
        decode_tensors(struct.pack("<Q", len(h)) + h + bomb, expected={"a": (4,)}, where="w")
    assert calls == []


def test_frame_without_content_size_is_capped():
    x = {"a": torch.zeros(4)}
    data = encode_tensors(x, codec="none")
    bomb = zstandard.ZstdCompressor(write_content_size=False).compress(bytes(1 << 20))
    (hlen,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + hlen])
    header["a"]["shape"] = [len(bomb)]
    header["a"]["data_offsets"] = [0, len(bomb)]
    h = json.dumps(header).encode()
    with pytest.raises(InvalidPayloadError, match="decompression failed"):
        decode_tensors(struct.pack("<Q", len(h)) + h + bomb, expected={"a": (4,)}, where="w")


@pytest.mark.parametrize(
    "mangle,match",
    [
        (lambda d: d[:5], "too short"),
        (lambda d: struct.pack("<Q", 1 << 40) + d[8:], "header length"),
        (lambda d: d[:8] + b"{" * (len(d) - 8), "not valid JSON"),
        (lambda d: rewrite(d, lambda h, m: m.update(codec="int2")), "unknown codec"),
        (lambda d: rewrite(d, lambda h, m: m.update(format=9)), "upgrade"),
        (lambda d: rewrite(d, lambda h, m: m.update(block_size=0)), "block_size"),
        (lambda d: rewrite(d, lambda h, m: m["tensors"]["a"].update(shape=[-1])), "bad shape"),
        (lambda d: rewrite(d, lambda h, m: m["tensors"]["a"].update(raw_nbytes=1)), "raw_nbytes"),
        (lambda d: rewrite(d, lambda h, m: h["a"].update(data_offsets=[0, 10**9])), "safetensors entry"),
        (lambda d: rewrite(d, lambda h, m: h["a"].update(dtype="F32")), "safetensors entry"),
        (lambda d: safetensors.torch.save({"a": torch.zeros(2)}), "not a ddiloco"),
        (lambda d: d[:-3] + b"xyz", "zstd"),
    ],
)
def test_corrupt_payloads_raise_invalid_payload(mangle, match):
    data = encode_tensors({"a": torch.randn(200)}, codec="int4")
    with pytest.raises(InvalidPayloadError, match=f"^where-x: .*{match}"):
        decode_tensors(mangle(data), where="where-x")


@pytest.mark.parametrize("codec", ["none", "bf16", "int4"])
def test_non_finite_payload_rejected(codec):
    x = {"a": torch.tensor([1.0, float("nan"), 2.0])}
    with pytest.raises(InvalidPayloadError, match="'a' has non-finite"):
        decode_tensors(encode_tensors(x, codec=codec), where="w")


def test_never_unpickles():
    import pickle

    with pytest.raises(InvalidPayloadError):
        decode_tensors(pickle.dumps({"a": 1}), where="w")


# --- published deltas with error feedback ------------------------------------------------


@pytest.mark.parametrize("codec", ["int4", "int8", "bf16"])
def test_published_value_bit_exact_and_error_does_not_accumulate(codec):
    g = torch.Generator().manual_seed(3)
    true = {"w": torch.randn(64, 33, generator=g), "b": torch.randn(33, generator=g)}
    # version 0: full snapshot, lossless
    payload, syncer_pub = encode_published_delta({}, true, codec="none")
    learner_pub = apply_published_delta({}, payload, where="v0", expected=shapes(true))
    assert all(torch.equal(syncer_pub[k], true[k]) and torch.equal(learner_pub[k], true[k]) for k in true)
    step_norm = 0.01
    errs = []
    for version in range(1, 60):
        true = {k: v + step_norm * torch.randn(v.shape, generator=g) for k, v in true.items()}
        payload, syncer_pub = encode_published_delta(syncer_pub, true, codec=codec)
        learner_pub = apply_published_delta(learner_pub, payload, where=f"v{version}")
        assert all(torch.equal(syncer_pub[k], learner_pub[k]) for k in true), version
        errs.append(max(float((syncer_pub[k] - true[k]).abs().max()) for k in true))
    # the published value is within one quantization step of the truth, every version:
    # error feedback keeps it from drifting (without it, error would grow like sqrt(version))
    per_step = {"int4": 0.6, "int8": 0.05, "bf16": 0.02}[codec]
    assert max(errs) <= per_step * 4 * step_norm + 1e-6
    assert max(errs[-10:]) <= 2 * max(errs[:10]) + 1e-6


def test_without_error_feedback_the_error_would_accumulate():
    """Control for the test above: decoding each delta against the *true* previous
    value (no feedback) drifts far more than the error-fed published value."""
    g = torch.Generator().manual_seed(4)
    true = torch.randn(4096, generator=g)
    naive = true.clone()
    _, pub = encode_published_delta({}, {"a": true}, codec="none")
    for _ in range(100):
        new = true + 0.01 * torch.randn(4096, generator=g)
        step, _ = decode_tensors(encode_tensors({"a": new - true}, codec="int4"))
        naive = naive + step["a"]
        _, pub = encode_published_delta(pub, {"a": new}, codec="int4")
        true = new
    assert float((naive - true).norm()) > 3 * float((pub["a"] - true).norm())


@pytest.mark.parametrize("codec,block", [("int4", 64), ("int4", 3), ("int8", 7)])
def test_chunked_quantization_equals_one_shot(monkeypatch, codec, block):
    import ddiloco_cli.numerics.blockquant as B
    import ddiloco_cli.numerics.quantized as Q

    def chunks(elems):  # the encoder's and the decoder's chunk size
        for module in (B, Q):
            monkeypatch.setattr(module, "chunk_elems", lambda b, **_: elems(b))

    x = {"a": torch.randn(10_001)}
    chunks(lambda b: 10**9)
    one_shot = encode_tensors(x, codec=codec, block_size=block)
    chunks(lambda b: 6 * b)  # many small chunks, even, block multiple
    chunked = encode_tensors(x, codec=codec, block_size=block)
    assert chunked == one_shot
    y_chunked, _ = decode_tensors(one_shot)
    chunks(lambda b: 10**9)
    assert torch.equal(decode_tensors(one_shot)[0]["a"], y_chunked["a"])


@pytest.mark.parametrize("codec,n", [("int4", 512), ("int4", 511), ("int8", 256)])
def test_every_byte_value_decodes_to_q_times_its_block_scale(codec, n):
    """The wire format read literally (q + 8 per nibble, low nibble first; q + 128 per byte),
    times its block's bf16 scale, for every possible byte: the decoder's table agrees."""
    block = 7
    nb = -(-n // block)
    scales = torch.linspace(-3.0, 5.0, nb).to(torch.bfloat16)
    bodies = bytes(range(256)) * (2 if codec == "int8" else 1)
    body = bodies[: n if codec == "int8" else -(-n // 2)]
    qs = [b - 128 for b in body] if codec == "int8" else [q for b in body for q in ((b & 0x0F) - 8, (b >> 4) - 8)][:n]
    want = torch.tensor([q * float(scales[i // block]) for i, q in enumerate(qs)], dtype=torch.float32)
    raw = scales.view(torch.int16).numpy().tobytes() + body
    cctx = zstandard.ZstdCompressor(write_content_size=True)
    desc = {"format": 1, "codec": codec, "block_size": block, "metadata": {},
            "tensors": {"t": {"shape": [n], "dtype": "float32", "raw_nbytes": len(raw), "comp_nbytes": 0}}}
    comp = cctx.compress(raw)
    header = json.dumps({"__metadata__": {"ddiloco": json.dumps(desc)},
                         "t": {"dtype": "U8", "shape": [len(comp)], "data_offsets": [0, len(comp)]}}).encode()
    got, _ = decode_tensors(struct.pack("<Q", len(header)) + header + comp)
    assert torch.equal(got["t"], want)


@pytest.mark.parametrize("codec", CODECS)
def test_published_value_is_what_a_reader_of_the_payload_gets(codec):
    """The syncer dequantises its own frames without decompressing them: the value must be
    the one every learner computes from the payload, bit for bit."""
    prev = {k: v.float() * 0.5 for k, v in sample(1).items()}
    payload, published = encode_published_delta(prev, {k: v.float() for k, v in sample(2).items()}, codec=codec)
    read = apply_published_delta(prev, payload, where="v1")
    assert published.keys() == read.keys()
    assert all(torch.equal(published[k], read[k]) for k in read)


@pytest.mark.parametrize("codec_name", ["int4", "int8", "bf16", "none"])
def test_the_residual_is_exactly_what_a_decoder_leaves_out(codec_name):
    """encode_with_residual (learner error feedback, PROTOCOL [L6]) computes x - decode(payload)
    in the quantising pass: bit for bit what a decoder of the payload leaves out, for partial
    blocks, zero blocks, outliers and more than one chunk."""
    torch.manual_seed(0)
    for n in (1, 63, 64, 65, 130_001, 2_100_001):
        x = torch.randn(n) * 0.01
        x[::97] *= 50
        x[5:70] = 0
        tensors = {"a": x, "b": torch.randn(3, 7)}
        data, residual = codec.encode_with_residual(tensors, codec=codec_name, block_size=64)
        decoded, _ = codec.decode_tensors(data, max_numel=10**8)
        assert data == codec.encode_tensors(tensors, codec=codec_name, block_size=64)  # the same payload
        for k, t in tensors.items():
            assert torch.equal(residual[k], t - decoded[k]), (n, k)
        if codec_name == "none":
            assert all(not r.any() for r in residual.values())
