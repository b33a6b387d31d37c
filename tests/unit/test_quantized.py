"""int4/int8 tensors read from their codes (ddiloco_cli.numerics.quantized): the same values as the
dequantised tensor, norms from the codes, and the syncer's merge of contributions kept as codes."""

import json
import math
import shutil
import struct

import numpy as np
import pytest
import torch
import zstandard

from ddiloco_cli.errors import InvalidPayloadError
from ddiloco_cli.numerics import quantized
from ddiloco_cli.numerics.codec import decode_tensors, encode_tensors
from ddiloco_cli.numerics.merge import merge_outer_gradients
from ddiloco_cli.numerics.quantized import DecodedTensors, Quantized
from ddiloco_cli.protocol import ledger
from ddiloco_cli.store import open_store
from ddiloco_cli.syncer.intake import delta_norm

from support.runs import assert_same_state, beat, contribution, live_syncer, make_run, step

CASES = [("int4", 64, 10_000), ("int4", 64, 4_097), ("int4", 3, 1001), ("int4", 5, 7), ("int4", 1, 1), ("int4", 2, 1000),
         ("int8", 256, 10_000), ("int8", 7, 1001), ("int8", 4096, 9000)]  # the last: per-block sums in fp64


def _payload(codec, block, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * 0.01
    x[::97] *= 50  # outliers: blocks of very different scales
    x[: min(n, 2 * block)] = 0  # zero blocks
    return encode_tensors({"a": x}, codec=codec, block_size=block)


@pytest.mark.parametrize("codec,block,n", CASES)
def test_values_of_any_range_are_the_decoders(codec, block, n):
    data = _payload(codec, block, n)
    dense = decode_tensors(data)[0]["a"]
    kept = decode_tensors(data, keep_codes=True)[0]
    q = kept.sources["a"]
    assert isinstance(kept, DecodedTensors) and isinstance(q, Quantized)
    assert torch.equal(kept["a"], dense)  # dequantised on access
    for elems in (300, 6):  # 6: with a small block, ranges that start inside a 2-byte word of int4 codes
        step = quantized.chunk_elems(block, elems=elems)
        out = torch.empty(step)
        for start in range(0, n, step):
            stop = min(n, start + step)
            assert torch.equal(q.values(start, stop, out=out), dense[start:stop]), (start, stop)


@pytest.mark.parametrize("codec,block,n", CASES)
def test_sum_of_squares_from_the_codes(codec, block, n):
    q = decode_tensors(_payload(codec, block, n), keep_codes=True)[0].sources["a"]
    exact = float(q.dense().double().square().sum())
    assert q.sum_of_squares == pytest.approx(exact, rel=1e-12)


@pytest.mark.parametrize("block", [16, 64, 4080, 4096])  # 4080: the most 16-bit lanes hold; 4096: the table
def test_sum_of_squares_of_every_code(block):
    """Every byte value (q = -8, which no encoder writes, included) in int4 blocks: the same sum
    as from the values, and from the block sums of the table (the other way)."""
    n = 2 * 256 * 40 // block * block
    codes = torch.arange(n // 2).remainder(256).to(torch.uint8).numpy()
    g = torch.Generator().manual_seed(2)
    scale = (torch.rand(n // block, generator=g) * 2.0 ** torch.randint(-60, 60, (n // block,), generator=g))
    scale = scale.to(torch.bfloat16).to(torch.float32)
    q = Quantized(codec="int4", shape=(n,), block=block, scale=scale, codes=codes)
    exact = math.fsum(float(v) ** 2 for v in q.dense().double())
    assert q.sum_of_squares == pytest.approx(exact, rel=1e-12)
    words = torch.from_numpy(quantized._SQ_OF_WORD["int4"][codes.view("u2")].astype("float64"))
    assert torch.equal(torch.from_numpy(quantized._int4_block_sums(codes, n // block)),
                       words.view(n // block, -1).sum(1)) if block % 16 == 0 and block <= 4080 else True


@pytest.mark.parametrize("codec", ["int4", "int8"])
def test_bounded_is_every_scale_times_the_largest_code_finite(codec):
    big = float(torch.finfo(torch.float32).max) / quantized.QABS[codec]
    above = float(torch.nextafter(torch.tensor(big), torch.tensor(math.inf)))  # the next fp32
    for s, want in ((0.0, True), (-big, True), (big, True), (above, False), (-above, False),
                    (math.inf, False), (math.nan, False)):
        q = Quantized(codec=codec, shape=(8,), block=4, scale=torch.tensor([1.0, s]),
                      codes=torch.zeros(8 // quantized.PER_BYTE[codec], dtype=torch.uint8).numpy())
        assert q.bounded() is want, s
        assert bool(torch.isfinite((q.scale * quantized.QABS[codec]).float()).all()) is want, s


def _frame(codec, block, scales, body):
    """A payload of one tensor "t" from its frame: bf16 scales, then the codes."""
    n = len(body) * (2 if codec == "int4" else 1)
    raw = torch.tensor(scales).to(torch.bfloat16).view(torch.int16).numpy().tobytes() + bytes(body)
    comp = zstandard.ZstdCompressor(write_content_size=True).compress(raw)
    desc = {"format": 1, "codec": codec, "block_size": block, "metadata": {},
            "tensors": {"t": {"shape": [n], "dtype": "float32", "raw_nbytes": len(raw), "comp_nbytes": len(comp)}}}
    header = json.dumps({"__metadata__": {"ddiloco": json.dumps(desc)},
                         "t": {"dtype": "U8", "shape": [len(comp)], "data_offsets": [0, len(comp)]}}).encode()
    return struct.pack("<Q", len(header)) + header + comp


@pytest.mark.parametrize("keep_codes", [False, True])
def test_a_code_no_encoder_writes_cannot_smuggle_an_infinity(keep_codes):
    """q = -8 (nibble 0) or -128 (byte 0) times a scale whose 7x / 127x is finite overflows:
    the finiteness bound on the scales uses the largest code a frame can hold."""
    for codec, scale, code in (("int4", 2.0**125 * 1.125, 0x80), ("int8", 2.0**121 * (1 + 1 / 128), 0)):
        assert math.isfinite(float(torch.tensor(scale).to(torch.bfloat16)) * quantized.QMAX[codec])
        with pytest.raises(InvalidPayloadError, match="'t' has non-finite"):
            decode_tensors(_frame(codec, 4, [scale], [code] * (2 if codec == "int4" else 4)), keep_codes=keep_codes)


def _contributions(m, codec="int4", block=64):
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(m):
        t = {"h.0.w": torch.randn(40, 50, generator=g) * (i + 1), "h.0.b": torch.randn(50, generator=g),
             "wte.weight": torch.randn(30, 7, generator=g)}
        out.append(decode_tensors(encode_tensors(t, codec=codec, block_size=block), keep_codes=True)[0])
    return out


@pytest.mark.parametrize("method", ["rda", "mean"])
def test_merging_codes_is_merging_their_values(method):
    """Only the norms differ (fp64 from the codes, fp32 from the values): the results agree to
    fp32 rounding; and a merge of codes is as order-independent, bit for bit, as any merge."""
    kept = _contributions(4)
    dense = [{k: v.clone() for k, v in c.items()} for c in kept]
    weights = [1.0, 3.0, 0.5, 2.0]
    a = merge_outer_gradients(kept, weights, method=method, mean_keys={"wte.weight"})
    b = merge_outer_gradients(dense, weights, method=method, mean_keys={"wte.weight"})
    for k in a:  # sums of rounded terms: a few ulps of the largest value
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6 * float(b[k].abs().max()))
    perm = [2, 0, 3, 1]
    again = merge_outer_gradients([kept[i] for i in perm], [weights[i] for i in perm], method=method,
                                  mean_keys={"wte.weight"})
    assert all(torch.equal(a[k], again[k]) for k in a)
    mixed = merge_outer_gradients([kept[0], dense[1], kept[2], dense[3]], weights, method=method,
                                  mean_keys={"wte.weight"})
    for k in a:
        torch.testing.assert_close(mixed[k], a[k], rtol=0, atol=1e-6 * float(a[k].abs().max()))


def test_merge_of_codes_in_many_ranges_equals_one_range(monkeypatch):
    import ddiloco_cli.numerics.merge as M

    kept = _contributions(3, codec="int8", block=6)
    monkeypatch.setattr(M, "MERGE_CHUNK_ELEMS", 10**9)
    one = merge_outer_gradients(kept, [1.0, 2.0, 3.0])
    monkeypatch.setattr(M, "MERGE_CHUNK_ELEMS", 12)
    many = merge_outer_gradients(kept, [1.0, 2.0, 3.0])
    assert all(torch.equal(one[k], many[k]) for k in one)


@pytest.mark.parametrize("shape", [(40, 50), (1000,), (12, 1000)])  # (1000,): a partial last block
def test_merge_of_int4_codes_by_word_views_equals_by_values(monkeypatch, shape):
    """The merge reads int4 codes as q8 times the scales (``_codes_term``); the same bits as
    ``Quantized.values`` of each range, in one range or many."""
    import ddiloco_cli.numerics.merge as M

    g = torch.Generator().manual_seed(4)
    kept = [decode_tensors(encode_tensors({"w": torch.randn(shape, generator=g) * (i + 1)}, codec="int4",
                                          block_size=64), keep_codes=True)[0] for i in range(3)]
    out = {}
    for chunk in (10**9, 128):
        monkeypatch.setattr(M, "MERGE_CHUNK_ELEMS", chunk)
        out[chunk, "views"] = merge_outer_gradients(kept, [1.0, 2.0, 3.0])["w"]
        with monkeypatch.context() as m:
            m.setattr(M, "_codes_term", lambda *a: None)
            out[chunk, "values"] = merge_outer_gradients(kept, [1.0, 2.0, 3.0])["w"]
    first = out[10**9, "values"]
    assert all(torch.equal(v, first) for v in out.values())


def test_a_contributions_norm_from_its_codes():
    kept = _contributions(1)[0]
    exact = math.sqrt(sum(float(t.double().square().sum()) for t in kept.values()))
    assert delta_norm(kept) == pytest.approx(exact, rel=1e-12)


@pytest.mark.parametrize("qmax", [7, 3])
def test_a_replay_merges_int4_contributions_as_the_syncer_did(tmp_path, qmax):
    """Syncer and replay both read contributions as codes (intake): a syncer restarted from
    checkpoint + ledger holds the same raw value, momentum and published value, and its next
    commit has the same payload bytes. Learner b trails a version (its outer gradient is
    dense: current - base + delta), a merges on the current base (from its codes). With
    --codec-qmax 3 (the default) every published delta's codes lie in [-3, 3] (7: [-7, 7]), and the replay (which re-encodes
    each version with the run's bound and checks the manifest's sha256) still matches."""
    root = tmp_path / "run"
    store = open_store(str(root))
    make_run(store, codec="int4", publish_codec="int4", checkpoint_every=3, keyframe_every=4, codec_qmax=qmax)
    beat(store, "a")
    beat(store, "b")
    live = live_syncer(store)
    for _ in range(5):
        for p in (0, 1):
            v = live.states[p].version
            contribution(store, p, "a", 100 * (v + 1) + p, base_version=v, codec_name="int4")
            contribution(store, p, "b", 100 * (v + 1) + p + 1, base_version=max(0, v - 1), c_tokens=48, c_steps=3,
                         codec_name="int4")
            assert step(live, p)
    largest = 0.0
    for p in (0, 1):
        for v in ledger.list_versions(store, p)[1:]:
            for e in ledger.read_manifest(store, p, v)["payloads"]:
                if e["kind"] == "delta":
                    for src in decode_tensors(store.get(e["key"]), keep_codes=True)[0].sources.values():
                        q = np.empty(src.numel, dtype=np.float32)
                        quantized.q_values(src.codes, "int4", src.numel, out=q)
                        largest = max(largest, float(np.abs(q).max()))
    assert largest == qmax
    shutil.copytree(root, tmp_path / "copy")
    other = open_store(str(tmp_path / "copy"))
    again = live_syncer(other, syncer_id="again")
    assert_same_state(live, again)
    for store_, s in ((store, live), (other, again)):
        for lid in ("a", "b"):
            beat(store_, lid)
        s._refresh_learners()
        contribution(store_, 0, "a", 900, base_version=5, codec_name="int4")
        contribution(store_, 0, "b", 901, base_version=5, codec_name="int4")
        assert step(s, 0)
    payloads = [{e["kind"]: st.get(e["key"]) for e in ledger.read_manifest(st, 0, 6)["payloads"]} for st in (store, other)]
    assert payloads[0] == payloads[1]


@pytest.mark.parametrize("codec", ["int4", "int8"])
@pytest.mark.parametrize("n", [1, 2, 7, 64, 1001, 4096])
def test_q8_of_the_codes_equals_the_table(codec, n):
    """``q8_into`` (integer unpacking, for the merge) gives the q of ``q_values`` (the table),
    every byte value included, odd counts too."""
    from ddiloco_cli.numerics.quantized import PER_BYTE, q8_into, q_values

    rng = np.random.default_rng(n)
    codes = rng.integers(0, 256, size=-(-n // PER_BYTE[codec]), dtype=np.uint8)
    codes[: min(256, codes.size)] = np.arange(min(256, codes.size), dtype=np.uint8)
    want = np.empty(n + 1, dtype=np.float32)
    q_values(codes, codec, n, out=want)
    got = q8_into(codes, codec, n, out=np.empty(n + 1, dtype=np.int8), tmp=np.empty(n, dtype=np.uint16))
    assert got.dtype == np.int8 and got.size == n
    assert np.array_equal(got.astype(np.float32), want[:n])
