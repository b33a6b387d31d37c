"""The compiled codec kernels (ddiloco_cli/numerics/_native.c) against the numpy passes they
replace: the same payload bytes, residuals and decoded values, bit for bit, on ordinary and
hostile inputs. .ci/run sets DDILOCO_REQUIRE_NATIVE=1, so a build that lost the module fails
here instead of silently testing numpy against itself; and each comparison checks that the
kernels were called in its first run."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from ddiloco_cli.numerics import codec, native
from ddiloco_cli.numerics.quantized import Quantized, q_values

if native.kernels is None:
    if os.environ.get("DDILOCO_REQUIRE_NATIVE") == "1":
        raise AssertionError(f"DDILOCO_REQUIRE_NATIVE=1 but {native.describe()}")
    pytest.skip(native.describe(), allow_module_level=True)

KERNELS = native.kernels


class Counted:
    """The kernels, each call's name and result recorded."""

    def __init__(self):
        self.calls: list[tuple[str, object]] = []

    def __getattr__(self, name):
        f = getattr(KERNELS, name)

        def call(*args):
            result = f(*args)
            self.calls.append((name, result))
            return result

        return call


def both(monkeypatch, fn, *, quantized=False):
    """fn() with the kernels (which it must call; ``quantized``: a quantize call that made the
    payload, not one handed back to numpy), then with the numpy passes."""
    counted = Counted()
    monkeypatch.setattr(native, "kernels", counted)
    try:
        with_kernels = fn()
        monkeypatch.setattr(native, "kernels", None)
        without = fn()
    finally:
        monkeypatch.setattr(native, "kernels", KERNELS)
    assert counted.calls, "the kernels were not called"
    if quantized:
        assert ("quantize", 0) in counted.calls, counted.calls
    return with_kernels, without


def same_tensors(a, b):
    assert a.keys() == b.keys()
    for k in a:
        x, y = a[k].contiguous().view(-1), b[k].contiguous().view(-1)
        assert x.dtype == y.dtype == torch.float32 and x.shape == y.shape, k
        # bit for bit: the int32 views (NaN payloads and the sign of zero included)
        assert torch.equal(x.view(torch.int32), y.view(torch.int32)), k


def fragment(seed: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(33, 17), (64,), (7,), (1,), (129, 3), (256, 8)]
    out = {f"t{i}": torch.randn(s, generator=g) * scale for i, s in enumerate(shapes)}
    out["t1"][:64] = 0.0  # a block of +0
    out["t4"].view(-1)[::5] *= 1e-3  # blocks of mixed magnitudes
    return out


CASES = [("int4", 64, None), ("int4", 7, 3), ("int4", 33, None), ("int8", 256, None), ("int8", 5, 31)]


@pytest.mark.parametrize("codec_name,block,qmax", CASES)
@pytest.mark.parametrize("scale", [1.0, 1e-30, 3e37])
def test_payload_and_residual_equal_the_numpy_passes(monkeypatch, codec_name, block, qmax, scale):
    for seed in range(3):
        tensors = fragment(seed, scale)

        def run():
            return codec.encode_with_residual(tensors, codec=codec_name, block_size=block, qmax=qmax)

        (p1, r1), (p2, r2) = both(monkeypatch, run, quantized=True)
        assert p1 == p2
        same_tensors(r1, r2)


@pytest.mark.parametrize("codec_name,block,qmax", CASES)
def test_single_whole_block_tensor_read_in_place(monkeypatch, codec_name, block, qmax):
    t = {"w": torch.randn(block * 8)}
    (p1, r1), (p2, r2) = both(monkeypatch, lambda: codec.encode_with_residual(t, codec=codec_name, block_size=block,
                                                                               qmax=qmax), quantized=True)
    assert p1 == p2
    same_tensors(r1, r2)
    assert codec.encode_tensors(t, codec=codec_name, block_size=block, qmax=qmax) == p1


@pytest.mark.parametrize("poison", ["negzero", "nan", "inf", "subnormal_scale", "huge"])
def test_inputs_the_kernel_leaves_to_numpy_give_numpy_bytes(monkeypatch, poison):
    t = fragment(5)
    w = t["t5"].view(-1)
    if poison == "negzero":  # blocks of zeros, some -0.0: the scale is +0.0 either way
        w[:256] = 0.0
        w[3:200:7] = -0.0
    elif poison == "nan":
        w[100] = float("nan")
    elif poison == "inf":
        w[100] = -float("inf")
    elif poison == "subnormal_scale":  # absmax / qmax below fp32's normals: 1 / scale overflows
        w[:64] = 1e-44
    else:  # the scale held at the largest bf16
        w[:64] = 3.4e38
    (p1, r1), (p2, r2) = both(monkeypatch, lambda: codec.encode_with_residual(t, codec="int4"))
    assert p1 == p2
    same_tensors(r1, r2)
    # and the kernel says so itself, on that tensor alone
    x = w.numpy()
    status = KERNELS.quantize(x, 64, 7, 8, 2, np.empty(x.size // 64, np.int16), np.empty(x.size // 2, np.uint8),
                              np.empty_like(x))
    assert status == (0 if poison in ("huge", "negzero") else 1)


@pytest.mark.parametrize("codec_name,block", [("int4", 64), ("int4", 7), ("int8", 256), ("int8", 5)])
def test_decoded_values_and_published_sums_equal_the_numpy_passes(monkeypatch, codec_name, block):
    tensors = fragment(11)
    prev = {k: torch.randn(v.shape, generator=torch.Generator().manual_seed(3)) for k, v in tensors.items()}
    payload = codec.encode_tensors(tensors, codec=codec_name, block_size=block)

    def decoded():
        values, _ = codec.decode_tensors(payload)
        return {k: v.clone() for k, v in values.items()}

    same_tensors(*both(monkeypatch, decoded))
    same_tensors(*both(monkeypatch, lambda: codec.apply_published_delta(prev, payload, where="t")))
    same_tensors(*both(monkeypatch, lambda: codec.apply_published_delta({}, payload, where="t")))

    def codes_values():  # the syncer's way: the codes kept, values made on first access
        values, _ = codec.decode_tensors(payload, keep_codes=True)
        assert all(isinstance(q, Quantized) for q in values.sources.values())
        return {k: values[k].clone() for k in values}

    same_tensors(*both(monkeypatch, codes_values))


def test_every_code_byte_decodes_as_the_tables_say(monkeypatch):
    """All 256 code bytes, int4 and int8, an odd count (int4's padding nibble), scales of both
    signs and a zero."""
    codes = np.arange(256, dtype=np.uint8)
    for name, per_byte, offset in (("int4", 2, 8), ("int8", 1, 128)):
        n = 256 * per_byte - 1
        block = 5
        nb = -(-n // block)
        scale = torch.tensor([(-1) ** i * 2.0 ** (i % 40 - 20) if i % 7 else 0.0 for i in range(nb)], dtype=torch.float32)
        out = torch.empty(n)
        KERNELS.dequantize(codes, scale.numpy(), n, block, offset, per_byte, None, out.numpy())
        q = np.empty(n, dtype=np.float32)
        q_values(codes[: -(-n // per_byte)], name, n, out=q)
        expect = torch.from_numpy(q) * scale.repeat_interleave(block)[:n]
        assert torch.equal(out.view(torch.int32), expect.view(torch.int32)), name


def test_wrong_buffers_are_refused_not_read_past():
    x = np.zeros(128, np.float32)
    with pytest.raises(ValueError, match="body"):
        KERNELS.quantize(x, 64, 7, 8, 2, np.empty(2, np.int16), np.empty(10, np.uint8), None)
    with pytest.raises(ValueError, match="whole blocks"):
        KERNELS.quantize(x[:100], 64, 7, 8, 2, np.empty(2, np.int16), np.empty(64, np.uint8), None)
    with pytest.raises(ValueError, match="int4's or int8's"):
        KERNELS.quantize(x, 64, 9, 8, 2, np.empty(2, np.int16), np.empty(64, np.uint8), None)
    with pytest.raises(ValueError, match="codes"):
        KERNELS.dequantize(np.zeros(3, np.uint8), np.ones(2, np.float32), 100, 64, 8, 2, None, np.empty(100, np.float32))
    with pytest.raises(ValueError, match="base"):
        KERNELS.dequantize(np.zeros(50, np.uint8), np.ones(2, np.float32), 100, 64, 8, 2, np.zeros(3, np.float32),
                           np.empty(100, np.float32))
    out = np.zeros(100, np.float32)
    with pytest.raises(ValueError, match="base overlaps"):  # in place only as the same object (out += ...)
        KERNELS.dequantize(np.zeros(50, np.uint8), np.ones(2, np.float32), 99, 64, 8, 2, out[1:], out)
    KERNELS.dequantize(np.full(50, 0x9A, np.uint8), np.ones(2, np.float32), 100, 64, 8, 2, out, out)
    assert out[:2].tolist() == [2.0, 1.0]  # 0 + (0xA - 8), 0 + (0x9 - 8)
    with pytest.raises(ValueError, match="x overlaps"):
        KERNELS.quantize(x, 64, 7, 8, 2, np.empty(2, np.int16), np.empty(64, np.uint8), x)
    with pytest.raises(TypeError):  # a read-only output
        KERNELS.dequantize(np.zeros(50, np.uint8), np.ones(2, np.float32), 100, 64, 8, 2, None, bytes(400))


@pytest.mark.parametrize("codec_name,block,shape", [("int4", 64, (40, 50)), ("int4", 64, (1000,)), ("int8", 256, (12, 1000)),
                                                    ("int4", 7, (333,)), ("int4", 8192, (3, 9000))])  # (blocks past
@pytest.mark.parametrize("chunk", [10**9, 128])                                                 # the kernel's pieces)
def test_merges_of_codes_equal_the_numpy_passes(monkeypatch, codec_name, block, shape, chunk):
    """The syncer's merge reads each contribution's codes: the first term written by the kernel,
    every next one added into the sum in place by it; the same bits as the numpy passes, with
    RDA and the plain mean, in one range or many."""
    import ddiloco_cli.numerics.merge as M

    monkeypatch.setattr(M, "MERGE_CHUNK_ELEMS", chunk)
    g = torch.Generator().manual_seed(4)
    kept = [codec.decode_tensors(codec.encode_tensors({"w": torch.randn(shape, generator=g) * (i + 1)}, codec=codec_name,
                                                      block_size=block), keep_codes=True)[0] for i in range(4)]
    for method in ("rda", "mean"):
        def merged():
            return {k: v.clone() for k, v in M.merge_outer_gradients(kept, [1.0, 2.0, 0.5, 3.0], method=method).items()}

        same_tensors(*both(monkeypatch, merged))


@pytest.mark.parametrize("codec_name,block,shape", [("int4", 64, (40, 50)), ("int4", 4, (1001,)), ("int4", 8192, (3, 9000)),
                                                    ("int8", 256, (12, 1000)), ("int8", 2, (77,)), ("int4", 6, (50,))])
def test_norms_from_codes_equal_the_numpy_passes(monkeypatch, codec_name, block, shape):
    """A contribution's sum of squares from its codes (the syncer's norms): the kernel's per-block
    integers are the numpy passes', so the sum is the same float (scales of many magnitudes)."""
    g = torch.Generator().manual_seed(9)
    t = torch.randn(shape, generator=g) * torch.logspace(-30, 30, shape[-1])
    payload = codec.encode_tensors({"w": t}, codec=codec_name, block_size=block)

    def norm():
        q = codec.decode_tensors(payload, keep_codes=True)[0].sources["w"]
        return q.sum_of_squares

    a, b = both(monkeypatch, norm)
    assert a == b and a > 0
    blocks = np.empty(3, np.float64)
    KERNELS.square_sums(np.array([0x08, 0x08, 0x0F, 0xF0, 0x00, 0x88], np.uint8), 3, 4, 2, blocks)
    assert blocks.tolist() == [64 + 64, 49 + 64 + 64 + 49, 64 + 64 + 0]  # (nibble - 8)**2, low nibble first


def test_learn_and_sync_say_when_the_kernels_are_missing(monkeypatch, caplog):
    import logging

    log = logging.getLogger("ddiloco.test")
    with caplog.at_level(logging.INFO, logger="ddiloco.test"):
        native.log_if_missing(log)
        assert not caplog.records  # in use: nothing to say
        monkeypatch.setattr(native, "kernels", None)
        monkeypatch.setattr(native, "why_not", "left out: DDILOCO_NATIVE=0")
        native.log_if_missing(log)
    assert len(caplog.records) == 1 and "DDILOCO_NATIVE=0" in caplog.text and "same bytes" in caplog.text


def test_a_stale_build_is_not_used(tmp_path):
    """An in-place build whose API is not the one this code calls (an editable install not rebuilt
    after a pull) is left out, with a reason, and the numpy passes run."""
    import subprocess
    import sys

    probe = ("import sys, types; m = types.ModuleType('ddiloco_cli.numerics._native'); m.API = 0; "
             "sys.modules['ddiloco_cli.numerics._native'] = m; "
             "from ddiloco_cli.numerics import native; print(native.kernels is None, native.describe())")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("True") and "stale build (API 0" in out.stdout, out.stdout



def _outer_inputs(seed: int = 0):
    """theta, base and residual as a send meets them: zeros of both signs, subnormals, huge and
    infinite values."""
    g = torch.Generator().manual_seed(seed)
    shapes = {"a": (40, 16), "b": (300,), "c": (7, 3, 2), "d": ()}
    theta = {k: torch.randn(s, generator=g) for k, s in shapes.items()}
    theta["a"].view(-1)[:6] = torch.tensor([0.0, -0.0, 1e-42, -3e38, float("inf"), float("-inf")])
    base = {k: torch.randn(s, generator=g) for k, s in shapes.items()}
    base["a"].view(-1)[:4] = torch.tensor([-0.0, 0.0, -1e-42, 3e38])
    residual = {k: 1e-3 * torch.randn(s, generator=g) for k, s in shapes.items()}
    return theta, base, residual


def _torch_outer_gradient(theta, base, residual, decay=1.0):
    """The send's general way: base - theta (+ residual) as two _foreach ops."""
    keys = list(theta)
    delta = dict(zip(keys, torch._foreach_sub([base[k] for k in keys], [theta[k] for k in keys])))
    if residual is not None:
        torch._foreach_add_([delta[k] for k in keys], [residual[k] for k in keys], alpha=decay)
    return delta


@pytest.mark.parametrize("with_residual", [False, True])
def test_the_outer_gradient_equals_the_foreach_ops(monkeypatch, with_residual):
    """A learner's outer gradient in one kernel pass a tensor: bit for bit the two _foreach ops
    (signed zeros, subnormals, infinities included)."""
    from ddiloco_cli.learner.sendpath import outer_gradient

    theta, base, residual = _outer_inputs()
    residual = residual if with_residual else None
    with_kernels, without = both(monkeypatch, lambda: outer_gradient(theta, base, residual))
    same_tensors(with_kernels, without)
    same_tensors(with_kernels, _torch_outer_gradient(theta, base, residual))


def test_the_outer_gradient_takes_the_foreach_ops_where_the_kernel_does_not_apply(monkeypatch):
    """A decayed residual, a bf16 or non-contiguous tensor: the _foreach ops (the kernel is not
    called), the same values."""
    from ddiloco_cli.learner.sendpath import outer_gradient

    theta, base, residual = _outer_inputs(1)
    counted = Counted()
    monkeypatch.setattr(native, "kernels", counted)
    same_tensors(outer_gradient(theta, base, residual, decay=0.9), _torch_outer_gradient(theta, base, residual, 0.9))
    strided = {**theta, "a": theta["a"].t().contiguous().t()}
    same_tensors(outer_gradient(strided, base, residual), _torch_outer_gradient(strided, base, residual))
    half = {**residual, "b": residual["b"].to(torch.bfloat16)}
    assert outer_gradient(theta, base, half)["b"].dtype == torch.float32
    assert counted.calls == []


def test_the_outer_delta_kernel_refuses_short_and_overlapping_buffers():
    x = np.ones(10, np.float32)
    out = np.empty(20, np.float32)
    with pytest.raises(ValueError, match="base"):
        KERNELS.outer_delta(x, np.ones(9, np.float32), None, np.empty(10, np.float32))
    with pytest.raises(ValueError, match="residual"):
        KERNELS.outer_delta(x, x.copy(), np.ones(3, np.float32), np.empty(10, np.float32))
    with pytest.raises(ValueError, match="theta overlaps"):
        KERNELS.outer_delta(out[:10], x, None, out[5:15])
    with pytest.raises(TypeError):  # a read-only output
        KERNELS.outer_delta(x, x, None, bytes(40))
    delta = np.empty(10, np.float32)
    KERNELS.outer_delta(x, np.full(10, 3.0, np.float32), np.full(10, 0.5, np.float32), delta)
    assert delta.tolist() == [2.5] * 10


def _bits_equal(a: np.ndarray, b: np.ndarray) -> bool:
    """Bit for bit, NaNs equal where both are NaN (their payloads are the hardware's choice)."""
    nan = np.isnan(a)
    return bool((nan == np.isnan(b)).all() and (a[~nan].view(np.int32) == b[~nan].view(np.int32)).all())


@pytest.mark.parametrize("per_byte,offset", [(2, 8), (1, 128)])
@pytest.mark.parametrize("block,n", [(64, 64 * 40), (64, 64 * 40 - 6), (7, 7 * 30 + 3), (33, 33 * 9), (2, 101),
                                     (8192, 8192 + 70), (100, 1000), (48, 47), (4096 + 34, 3 * (4096 + 34) - 1)])
def test_the_vector_passes_equal_the_scalar_ones(per_byte, offset, block, n):
    """The AVX2 copies of dequantize, the in-place accumulate and the sums of squares (picked at
    import where the CPU has AVX2) against the scalar passes of the same build: every code byte,
    blocks that start on an odd element (int4), tails shorter than a vector, scales of every
    magnitude, zero, subnormal, huge (products that overflow) and NaN."""
    if not KERNELS.simd():
        pytest.skip("this CPU (or this build) has no AVX2 passes")
    rng = np.random.default_rng(block * 1000 + n + per_byte)
    codes = rng.integers(0, 256, size=-(-n // per_byte), dtype=np.uint8)
    codes[:256] = np.arange(256, dtype=np.uint8)[: codes.size]
    nb = -(-n // block)
    scale = (rng.standard_normal(nb) * 2.0 ** rng.integers(-140, 128, nb)).astype(np.float32)
    scale[::5], scale[1::7], scale[2::11] = 0.0, np.nan, 3e38
    base = rng.standard_normal(n).astype(np.float32)
    base[::13] = np.nan
    results = {}
    try:
        for on in (True, False):
            KERNELS.simd(on)
            out, with_base, acc = np.empty(n, np.float32), np.empty(n, np.float32), base.copy()
            KERNELS.dequantize(codes, scale, n, block, offset, per_byte, None, out)
            KERNELS.dequantize(codes, scale, n, block, offset, per_byte, base, with_base)
            KERNELS.dequantize(codes, scale, n, block, offset, per_byte, acc, acc)  # acc += q * scale
            sums = np.zeros(n // block, np.float64)
            if per_byte == 1 or block % 2 == 0:
                KERNELS.square_sums(codes, n // block, block, per_byte, sums)
            results[on] = (out, with_base, acc, sums)
    finally:
        KERNELS.simd(True)
    for what, vec, scalar in zip(("dequantize", "with base", "in place"), results[True], results[False]):
        assert _bits_equal(vec, scalar), what
    assert np.array_equal(results[True][3], results[False][3])
    if per_byte == 2 and block % 2 == 0 and n // block:  # the sums are the integers the codes give
        q = (np.stack([codes & 15, codes >> 4], axis=1).reshape(-1)[:n].astype(np.int64) - 8)
        assert results[True][3].tolist() == (q[: n // block * block].reshape(-1, block) ** 2).sum(1).tolist()


def test_the_vector_passes_can_be_turned_off_and_on():
    before = KERNELS.simd()
    try:
        assert KERNELS.simd(False) == before
        assert KERNELS.simd() is False
        KERNELS.simd(True)
        assert KERNELS.simd() == before  # on again only where the CPU has AVX2
    finally:
        KERNELS.simd(before)
