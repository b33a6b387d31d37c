"""Token weights, RDA, the weighted mean, finiteness checks."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ddiloco_cli.errors import InvalidPayloadError, UsageError
from ddiloco_cli.numerics.merge import (
    all_finite,
    check_finite,
    is_embedding_key,
    merge_outer_gradients,
    rda,
    token_weight,
)

finite = st.floats(-1e3, 1e3, allow_nan=False, width=32)


def weighted_mean(vectors, weights):
    """The merge's `mean` method on one tensor."""
    return merge_outer_gradients([{"x": v} for v in vectors], weights, method="mean")["x"]


def vec_lists(min_size=1):
    return st.integers(1, 12).flatmap(
        lambda n: st.lists(st.lists(finite, min_size=n, max_size=n), min_size=min_size, max_size=5)
    )


def test_token_weight():
    assert token_weight(1000, 10) == 1000 * 1000 / 10
    assert token_weight(0, 5) == 0.0
    assert token_weight(100, 0) == 0.0
    # same tokens in fewer (bigger) steps weigh more
    assert token_weight(1000, 5) > token_weight(1000, 10)
    with pytest.raises(InvalidPayloadError):
        token_weight(-1, 3)


@settings(max_examples=60, deadline=None)
@given(st.lists(finite, min_size=1, max_size=20), st.floats(1e-3, 1e6))
def test_single_contribution_passes_through_bit_exact(values, w):
    v = torch.tensor(values, dtype=torch.float32)
    assert torch.equal(rda([v], [w]), v)
    assert torch.equal(weighted_mean([v], [w]), v)


@settings(max_examples=60, deadline=None)
@given(vec_lists(min_size=2), st.data())
def test_permutation_invariant_bit_exact(vs, data):
    vectors = [torch.tensor(v, dtype=torch.float32) for v in vs]
    weights = data.draw(st.lists(st.floats(0, 1e4), min_size=len(vs), max_size=len(vs)))
    perm = data.draw(st.permutations(range(len(vs))))
    for f in (rda, weighted_mean):
        a = f(vectors, weights)
        b = f([vectors[i] for i in perm], [weights[i] for i in perm])
        assert torch.equal(a, b)
        assert a.dtype == torch.float32 and a.shape == vectors[0].shape


@pytest.mark.parametrize("M", [2, 4, 8, 16])
def test_rda_keeps_norm_of_orthogonal_updates_mean_shrinks(M):
    n = 3.0
    vectors = [n * torch.eye(32)[i] for i in range(M)]
    weights = [1.0] * M
    assert float(rda(vectors, weights).norm()) == pytest.approx(n, rel=1e-6)
    assert float(weighted_mean(vectors, weights).norm()) == pytest.approx(n / math.sqrt(M), rel=1e-6)
    # and RDA points along the mean
    cos = torch.nn.functional.cosine_similarity(rda(vectors, weights), weighted_mean(vectors, weights), dim=0)
    assert float(cos) == pytest.approx(1.0, abs=1e-6)


def test_rda_radial_is_weighted_mean_of_norms():
    a, b = torch.tensor([2.0, 0.0]), torch.tensor([10.0, 0.0])  # same direction
    out = rda([a, b], [3.0, 1.0])
    assert torch.allclose(out, torch.tensor([(3 * 2 + 10) / 4, 0.0]))


def test_zero_vectors_and_zero_weights():
    z = torch.zeros(4)
    v = torch.tensor([1.0, -2.0, 0.0, 3.0])
    assert torch.equal(rda([z, z], [1.0, 2.0]), z)
    assert torch.equal(weighted_mean([z, z], [1.0, 2.0]), z)
    # a zero vector adds no direction but lowers the radial average: phi(0) = 0
    out = rda([v, z], [1.0, 1.0])
    assert torch.allclose(out, v / 2)
    # zero weight: ignored; all zero: zeros
    assert torch.equal(rda([v, 5 * v], [0.0, 1.0]), (5 * v))
    assert torch.equal(rda([v, 5 * v], [0.0, 0.0]), z)
    assert torch.equal(weighted_mean([v, 5 * v], [0.0, 0.0]), z)
    # exactly cancelling directions
    assert torch.equal(rda([v, -v], [1.0, 1.0]), z)
    with pytest.raises(InvalidPayloadError):
        rda([v], [-1.0])
    with pytest.raises(InvalidPayloadError):
        rda([v], [float("nan")])


def test_rda_falls_back_to_the_mean_where_directions_cancel():
    """Near v2 = -v1, RDA's direction is noise: it returns the weighted mean, which shrinks
    continuously to zero, instead of the full mean norm in a random direction."""
    v = torch.tensor([1.0, -2.0, 0.5, 3.0])
    noise = torch.tensor([1e-4, 0.0, -1e-4, 0.0])
    out = rda([v, -v + noise], [1.0, 1.0])
    assert torch.allclose(out, weighted_mean([v, -v + noise], [1.0, 1.0]))
    assert float(out.norm()) < 1e-3
    # well aligned: RDA proper (norm kept)
    assert float(rda([v, 0.9 * v + noise], [1.0, 1.0]).norm()) == pytest.approx(0.95 * float(v.norm()), rel=1e-4)


def test_merge_outer_gradients_methods_and_embedding_mean():
    g1 = {"wte.weight": torch.tensor([[1.0, 0.0]]), "h.0.w": torch.tensor([[1.0, 0.0]]), "h.0.b": torch.tensor([1.0, 0.0])}
    g2 = {"wte.weight": torch.tensor([[0.0, 1.0]]), "h.0.w": torch.tensor([[0.0, 1.0]]), "h.0.b": torch.tensor([0.0, 1.0])}
    mean_keys = {k for k in g1 if is_embedding_key(k)}
    assert mean_keys == {"wte.weight"}
    out = merge_outer_gradients([g1, g2], [1.0, 1.0], mean_keys=mean_keys)
    assert torch.allclose(out["wte.weight"], torch.tensor([[0.5, 0.5]]))
    assert float(out["h.0.w"].norm()) == pytest.approx(1.0)
    assert torch.allclose(out["h.0.b"], torch.tensor([0.5, 0.5]))  # 1-d (and 0-d) tensors: the mean
    out = merge_outer_gradients([g1, g2], [1.0, 1.0], method="mean")
    assert torch.allclose(out["h.0.w"], torch.tensor([[0.5, 0.5]]))
    with pytest.raises(UsageError, match="unknown merge method"):
        merge_outer_gradients([g1], [1.0], method="median")


def test_non_finite_rejected_naming_tensor_and_source():
    good = {"a": torch.ones(3), "b": torch.ones(2)}
    for bad_value in (float("nan"), float("inf"), float("-inf")):
        bad = {"a": torch.ones(3), "b": torch.tensor([1.0, bad_value])}
        with pytest.raises(InvalidPayloadError, match=r"contribution 1: tensor 'b' has non-finite"):
            merge_outer_gradients([good, bad], [1.0, 1.0])
        with pytest.raises(InvalidPayloadError, match=r"upload x: tensor 'b'"):
            check_finite(bad, where="upload x")
    check_finite(good, where="ok")
    with pytest.raises(InvalidPayloadError, match="contribution 1: tensor 'a' has shape"):
        merge_outer_gradients([good, {"a": torch.ones(4), "b": torch.ones(2)}], [1.0, 1.0])
    with pytest.raises(InvalidPayloadError, match="keys differ"):
        merge_outer_gradients([good, {"a": torch.ones(3)}], [1.0, 1.0])


def test_is_embedding_key():
    for k in ("transformer.wte.weight", "wpe.weight", "model.embed_tokens.weight[0:100]", "tok_emb.weight",
              "pos_emb", "lm_head.weight"):
        assert is_embedding_key(k)
    for k in ("h.0.attn.c_attn.weight", "layers.3.mlp.up_proj.weight", "ln_f.bias"):
        assert not is_embedding_key(k)


def test_tiny_weights_and_huge_values_stay_finite():
    # found by hypothesis: weights near the float64 denormal range used to give 0/0 in fp32
    z = torch.zeros(1)
    ws = [3.384316008488882e-127, 2.225073858507203e-309]
    for f in (rda, weighted_mean):
        assert torch.equal(f([z, z], ws), z)
        assert torch.equal(f([z, z], ws[::-1]), z)
    v = torch.tensor([1.0, -2.0])
    out = weighted_mean([v, 3 * v], [1e-300, 1e-300])
    torch.testing.assert_close(out, 2 * v)
    big = torch.tensor([1e38, -1e38])  # squares overflow fp32: the norm falls back to fp64
    out = rda([big, big], [1.0, 2.0])
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, big)


def test_all_finite_even_where_the_sum_overflows():
    big = torch.tensor([3e38, 3e38, -1.0])  # finite values whose sum is inf
    assert all_finite(big) and all_finite(torch.zeros(0)) and all_finite(torch.arange(3))
    assert all_finite(torch.tensor([1e38, 2e38]).to(torch.bfloat16))
    for bad in ([1.0, float("nan")], [float("inf"), 1.0], [-1.0, float("-inf")], [float("inf"), float("-inf")],
                [3e38, 3e38, float("nan")]):
        assert not all_finite(torch.tensor(bad)), bad
