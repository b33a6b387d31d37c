"""The sparse codec (ddiloco_cli/numerics/sparse.py): Top-k per chunk, 2-bit values, bounded decoder."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
import zstandard

from ddiloco_cli.errors import InvalidPayloadError, UsageError
from ddiloco_cli.numerics import codec, container, sparse


def _payload(frames: dict[str, tuple[list[int], bytes]], *, chunk: int = 16, topk: int = 4,
             codec_name: str = "sparse") -> bytes:
    """A payload holding the given raw (decompressed) frames as they are: hostile ones too."""
    cctx = zstandard.ZstdCompressor(write_content_size=True, write_checksum=True)
    out, info = [], {}
    for key, (shape, raw) in frames.items():
        comp = cctx.compress(raw)
        out.append((key, comp))
        info[key] = {"shape": shape, "dtype": "float32", "raw_nbytes": len(raw), "comp_nbytes": len(comp)}
    header = {"format": 1, "codec": codec_name, "block_size": chunk, "topk": topk, "tensors": info, "metadata": {}}
    return container.write_safetensors(out, {container.METADATA_KEY: json.dumps(header)})


def _frame(scales: list[int], codes: list[int], gaps: list[int]) -> bytes:
    """A raw frame from bf16 scale bits, 2-bit codes and gaps (the format in sparse.py)."""
    packed = sparse._pack2(np.array(codes, dtype=np.uint8))
    g = np.array(gaps, dtype=np.uint16)
    return (np.array(scales, dtype=np.uint16).tobytes() + packed.tobytes() + (g & 0xFF).astype(np.uint8).tobytes()
            + (g >> 8).astype(np.uint8).tobytes())


def _decode(data: bytes, **kw):
    return codec.decode_tensors(data, max_numel=1 << 20, where="p", **kw)


def test_roundtrip_sends_the_largest_k_of_each_chunk_and_the_residual_is_the_rest():
    torch.manual_seed(0)
    x = torch.randn(3 * 4096 + 1000)
    data, residual = codec.encode_with_residual({"w": x}, codec="sparse", block_size=4096, density=0.02)
    out, _ = _decode(data)
    d = out["w"]
    k = sparse.topk(0.02, 4096)
    assert k == 82 and codec.payload_codec(data)["topk"] == k
    assert torch.equal(residual["w"], x - d)  # fp32 x - value where sent, x elsewhere: exact
    for c in range(4):
        xs, ds = x[c * 4096 : (c + 1) * 4096], d[c * 4096 : (c + 1) * 4096]
        sent = ds != 0
        want = k if c < 3 else -(-k * 1000 // 4096)
        assert int(sent.sum()) == want
        # the largest magnitudes (those within 2**-11 of each other count as equal: sparse.py)
        assert float(xs[sent].abs().min()) >= float(xs[~sent].abs().max()) * (1 - 2**-11)
        assert torch.equal(torch.sign(ds[sent]), torch.sign(xs[sent]))
        mags = ds[sent].abs().unique()
        assert len(mags) <= 2 and (len(mags) == 1 or float(mags[1]) == 2 * float(mags[0]))
        s = mags[0].view(torch.int32) & 0xFFFF
        assert int(s) == 0  # a bf16 scale (or twice one)


def test_the_least_squares_scale_beats_the_mean_magnitude():
    torch.manual_seed(1)
    x = torch.randn(4096) * torch.rand(4096) * 3
    out, _ = _decode(codec.encode_tensors({"w": x}, codec="sparse", density=0.05))
    sent = out["w"] != 0
    err = float((x[sent] - out["w"][sent]).norm())
    naive = float((x[sent] - x[sent].abs().mean() * torch.sign(x[sent])).norm())
    assert err < naive


def test_ties_and_zeros_send_exactly_k_with_the_earliest_positions():
    x = torch.ones(64)
    data = codec.encode_tensors({"w": x, "z": torch.zeros(64), "e": torch.empty(0)}, codec="sparse",
                                block_size=16, density=0.25)
    out, _ = _decode(data, keep_codes=True)
    st = out.sources["w"]
    assert st.index.tolist() == [c * 16 + j for c in range(4) for j in range(4)]
    assert torch.equal(out["w"][st.index], torch.ones(16))
    assert float(out["z"].abs().sum()) == 0.0 and out["e"].numel() == 0


def test_mostly_zero_chunks_send_their_nonzeros_then_their_earliest_zeros():
    x = torch.zeros(2 * 4096)
    x[[5, 700, 4096 + 3]] = torch.tensor([1.0, -3.0, 2.0])
    x[4096 + 4000] = 2.0 * (1 + 2**-20)  # a near-tie: the earlier position wins
    out, _ = _decode(codec.encode_tensors({"w": x}, codec="sparse", block_size=4096, density=1 / 4096), keep_codes=True)
    assert out.sources["w"].index.tolist() == [700, 4096 + 3]
    out, _ = _decode(codec.encode_tensors({"w": x}, codec="sparse", block_size=4096, density=2 / 4096), keep_codes=True)
    assert out.sources["w"].index.tolist() == [5, 700, 4096 + 3, 4096 + 4000]
    out, _ = _decode(codec.encode_tensors({"w": x}, codec="sparse", block_size=4096, density=4 / 4096), keep_codes=True)
    assert out.sources["w"].index.tolist() == [0, 1, 5, 700, 4096, 4097, 4096 + 3, 4096 + 4000]


def _rows_of(kind: str, rng: np.random.Generator, nrows: int, width: int) -> np.ndarray:
    x = (rng.standard_normal((nrows, width)) * rng.random((nrows, 1)) * 10.0 ** rng.integers(-30, 5)).astype(np.float32)
    if kind == "sparse":  # fewer nonzeros than k in some rows: the screen lets everything through
        x[rng.random(x.shape) < 0.985] = 0
    elif kind == "half-zero":  # zero rows beside dense ones, in one block
        x[::2] = 0
    elif kind == "zero-tail":  # the zero rows after the first block: the screen stops early
        x[nrows // 3 :] = 0
    elif kind == "ties":  # few distinct magnitudes: ties at the threshold
        x = np.round(x / np.abs(x).max(axis=1, keepdims=True) * 3).astype(np.float32)
    elif kind == "non-finite":
        x[rng.random(x.shape) < 0.004] = np.nan
        x[rng.random(x.shape) < 0.004] = -np.inf
        x[0, :7] = np.array([0x7FFFFFFF, -1, 0x7F800001, 1, 0, 0x00000001, 0x80000001], dtype=np.int64).astype(np.int32).view(np.float32)
    elif kind == "subnormal":
        x *= np.float32(1e-39)
    return x


@pytest.mark.parametrize("kind", ["normal", "sparse", "half-zero", "zero-tail", "ties", "non-finite", "subnormal"])
@pytest.mark.parametrize("width,k", [(1024, 20), (4096, 82), (1536, 20), (512, 3), (1024, 40), (256, 16)])
def test_the_candidate_screen_selects_what_one_partition_per_row_selects(kind, width, k):
    """The selection's screen (group maxima, then a partition of the candidates only) is an
    optimisation: its positions and values are the plain per-row partition's, on every input."""
    assert sparse._screen_groups(width, k) > 0  # these sizes take the screen
    rng = np.random.default_rng(hash((kind, width, k)) % 2**32)
    rows = _rows_of(kind, rng, (3 << 18) // width + 5, width)  # several blocks and a short one
    pos, val = sparse._select(rows, k)
    want = sparse._partition_rows(rows, k)
    assert pos.dtype == np.int64 and np.array_equal(pos, want)
    assert np.array_equal(val.view(np.int32), rows.reshape(-1)[want].view(np.int32))
    assert np.all(np.diff(pos, axis=1) > 0) and np.all(pos // width == np.arange(rows.shape[0])[:, None])


def test_the_defaults_take_the_screen_and_the_rest_the_partition():
    assert sparse._screen_groups(1024, sparse.topk(0.02, 1024)) == 128
    assert sparse._screen_groups(4096, sparse.topk(0.02, 4096)) == 512
    assert sparse._screen_groups(1024, 40) == 256  # a published delta at twice the density: groups of 4
    assert sparse._screen_groups(1024, 65) == 0  # groups of 2
    assert sparse._screen_groups(1000, 20) == 0  # no power-of-two group count divides it
    x = np.random.default_rng(0).standard_normal((3, 1000)).astype(np.float32)
    assert np.array_equal(sparse._select(x, 20)[0], sparse._partition_rows(x, 20))


def test_small_tensors_are_sent_at_about_the_density():
    k = sparse.topk(0.02, 4096)
    assert sparse.sent_count(128, 4096, k) == 3 and sparse.sent_count(4096 + 1, 4096, k) == k + 1
    assert sparse.raw_nbytes(0, 4096, k) == 0


def test_published_deltas_apply_bit_exactly_and_feed_the_error_back():
    torch.manual_seed(2)
    target = {"w": torch.randn(5000), "b": torch.randn(7)}
    prev = {k: torch.zeros_like(v) for k, v in target.items()}
    errors = []
    for _ in range(60):
        data, published = codec.encode_published_delta(prev, target, codec="sparse", density=0.05)
        applied = codec.apply_published_delta(prev, data, where="d")
        assert all(torch.equal(applied[k], published[k]) for k in target)
        prev = published
        errors.append(float((published["w"] - target["w"]).norm() / target["w"].norm()))
    assert errors[-1] < 0.05 < errors[0]  # the error of one version is corrected by the next ones


def test_non_finite_input_makes_a_payload_the_decoder_refuses():
    x = torch.randn(100)
    x[3] = float("nan")
    data = codec.encode_tensors({"w": x}, codec="sparse")
    with pytest.raises(InvalidPayloadError, match="not finite|negative"):
        _decode(data)
    with pytest.raises(InvalidPayloadError, match="non-finite"):
        codec.encode_published_delta({"w": torch.zeros(100)}, {"w": x}, codec="sparse")


def test_bad_parameters_are_usage_errors():
    with pytest.raises(UsageError, match="density"):
        codec.encode_tensors({"w": torch.ones(4)}, codec="sparse", density=0.0)
    with pytest.raises(UsageError, match="block-size"):
        codec.encode_tensors({"w": torch.ones(4)}, codec="sparse", block_size=1 << 17)


def test_a_valid_hand_made_frame_decodes():
    raw = _frame([0x3F80, 0x4000], [0, 1, 2, 3, 3, 3, 0, 3], [0, 0, 5, 7, 0, 0, 0, 12])
    out, _ = _decode(_payload({"w": ([32], raw)}))
    d = out["w"]
    assert d[[0, 1, 7, 15]].tolist() == [-2.0, -1.0, 1.0, 2.0]  # scale 1.0, positions 0, 1, 7, 15
    assert d[[16, 17, 18, 31]].tolist() == [4.0, 4.0, -4.0, 4.0]  # scale 2.0, positions 0, 1, 2, 15
    assert int((d != 0).sum()) == 8


def test_a_short_last_chunk_decodes_from_its_own_start():
    # 40 values in chunks of 16, k 4: two full chunks send 4 each, the last (8 long) ceil(4 * 8 / 16) = 2
    gaps = [0, 0, 5, 7, 1, 0, 0, 0, 2, 4]
    out, _ = _decode(_payload({"w": ([40], _frame([0x3F80] * 3, [3] * 10, gaps))}))
    assert torch.nonzero(out["w"]).reshape(-1).tolist() == [0, 1, 7, 15, 17, 18, 19, 20, 34, 39]
    gaps[-1] = 5  # 2, 8: one past the last chunk's end (40), though inside a full chunk's width
    with pytest.raises(InvalidPayloadError, match="outside its chunk"):
        _decode(_payload({"w": ([40], _frame([0x3F80] * 3, [3] * 10, gaps))}))


def test_gaps_whose_running_sum_would_wrap_32_bits_are_refused():
    # k = chunk = 2^16 gaps of 2^16 - 1: the running sum reaches 2^32 (wraps a 32-bit integer)
    n = k = 1 << 16
    raw = _frame([0x3F80], [0] * k, [0xFFFF] * k)
    with pytest.raises(InvalidPayloadError, match="outside its chunk"):
        _decode(_payload({"w": ([n], raw)}, chunk=n, topk=k))


@pytest.mark.parametrize("frame, match", [
    (([0x3F80, 0x3F80], [0] * 8, [0, 0, 0, 13, 0, 0, 0, 0]), "outside its chunk"),  # 0, 1, 2, 16 > 15
    (([0x3F80, 0x3F80], [0] * 8, [0xFFFF, 0, 0, 0, 0, 0, 0, 0]), "outside its chunk"),
    (([0xBF80, 0x3F80], [0] * 8, [0] * 8), "negative"),  # sign bit
    (([0x7F80, 0x3F80], [0] * 8, [0] * 8), "not finite"),  # Inf
    (([0x7FC0, 0x3F80], [0] * 8, [0] * 8), "not finite"),  # NaN
    (([0x7F7F, 0x3F80], [0] * 8, [0] * 8), "not finite"),  # finite scale, 2s overflows
])
def test_hostile_frames_are_refused(frame, match):
    with pytest.raises(InvalidPayloadError, match=match):
        _decode(_payload({"w": ([32], _frame(*frame))}))


def test_padding_bits_after_the_last_code_are_refused():
    good = _frame([0x3F80], [1, 1, 1], [0, 0, 0])  # 12 elements, chunk 16, k 4: ceil(4 * 12 / 16) = 3 sent
    assert _decode(_payload({"w": ([12], good)}))[0]["w"][:3].tolist() == [-1.0] * 3
    bad = bytearray(good)
    bad[2] |= 0xC0  # the unused fourth code of the code byte
    with pytest.raises(InvalidPayloadError, match="padding"):
        _decode(_payload({"w": ([12], bytes(bad))}))


@pytest.mark.parametrize("chunk, topk", [(16, 0), (16, 17), (16, True), (16, "4"), (16, None), (0, 1),
                                          (1 << 17, 4), (16.0, 4)])
def test_bad_chunk_or_topk_headers_are_refused(chunk, topk):
    raw = _frame([0x3F80, 0x3F80], [0] * 8, [0] * 8)
    with pytest.raises(InvalidPayloadError, match="sparse"):
        _decode(_payload({"w": ([32], raw)}, chunk=chunk, topk=topk))


def test_a_frame_of_the_wrong_size_is_refused_before_decompression():
    raw = _frame([0x3F80, 0x3F80], [0] * 8, [0] * 8)
    with pytest.raises(InvalidPayloadError, match="raw_nbytes"):
        _decode(_payload({"w": ([32], raw + b"\0")}))
    with pytest.raises(InvalidPayloadError, match="raw_nbytes"):
        _decode(_payload({"w": ([32], raw)}, topk=3))


def test_fuzzed_payloads_decode_to_bounded_sparse_tensors_or_are_refused():
    """Random index lists, counts, scales and codes: a frame either decodes to strictly increasing
    in-range positions with finite values, or raises InvalidPayloadError; nothing else."""
    rng = random.Random(7)
    decoded = refused = 0
    for _ in range(400):
        chunk = rng.choice([1, 2, 7, 16, 64])
        topk = rng.randint(1, chunk)
        n = rng.randint(0, 200)
        count = sparse.sent_count(n, chunk, topk)
        rows = -(-n // chunk)
        hostile = rng.random() < 0.5
        scales = [rng.choice([0, 0x3F80, 0x0001, 0x7EFF] + ([0x7F7F, 0x8000, 0xFF80, rng.getrandbits(16)] * hostile))
                  for _ in range(rows)]
        codes = [rng.getrandbits(2) for _ in range(count)]
        gaps = []
        for r in range(rows):  # valid positions (hostile: random gaps, now and then)
            width = min(chunk, n - r * chunk)
            kk = min(topk, count - len(gaps))
            pos = sorted(rng.sample(range(width), min(kk, width)))
            gaps += [p - (pos[i - 1] + 1 if i else 0) for i, p in enumerate(pos)]
            gaps += [0] * (kk - len(pos))
        if hostile:
            gaps = [g if rng.random() < 0.8 else rng.choice([1, 2, rng.getrandbits(4), rng.getrandbits(16)])
                    for g in gaps]
        raw = bytearray(_frame(scales, codes, gaps))
        if raw and rng.random() < 0.3:
            raw[rng.randrange(len(raw))] = rng.getrandbits(8)
        declared_topk = topk if rng.random() < 0.9 else rng.choice([0, topk + 1, -1, 2**40])
        try:
            out, _ = _decode(_payload({"w": ([n], bytes(raw))}, chunk=chunk, topk=declared_topk), keep_codes=True)
        except InvalidPayloadError:
            refused += 1
            continue
        decoded += 1
        st = out.sources["w"]
        assert st.index.size == count and (np.diff(st.index) > 0).all()
        assert st.index.size == 0 or (0 <= st.index.min() and st.index.max() < n)
        assert np.isfinite(st.value).all() and torch.isfinite(out["w"]).all()
    assert decoded > 50 and refused > 50
