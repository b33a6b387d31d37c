"""The learner's receive rule, a pure function: theta <- alpha*theta + (1-alpha)*(Theta_new + progress),
progress = what the overlap window trained after the send (kept or discarded by the run)."""

from __future__ import annotations

import pytest
import torch

from ddiloco_cli.learner import receive_rule


def _fragment(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g), "s": torch.randn((), generator=g)}


@pytest.mark.parametrize("keep,alpha", [(True, 0.0), (False, 0.0), (True, 0.5), (False, 0.5), (True, 1.0)])
def test_receive_rule_keeps_or_discards_overlap_progress(keep, alpha):
    theta_send, new_global = _fragment(0), _fragment(1)
    progress = {k: v * 0.01 for k, v in _fragment(2).items()}  # the tau steps after the send
    local = {k: theta_send[k] + progress[k] for k in theta_send}
    before = {k: v.clone() for k, v in local.items()}

    got = receive_rule(local, new_global, theta_send, alpha=alpha, keep_progress=keep)

    for k in got:
        target = new_global[k] + (local[k] - theta_send[k]) if keep else new_global[k]
        want = alpha * local[k] + (1 - alpha) * target
        torch.testing.assert_close(got[k], want, rtol=0, atol=1e-6)
    assert all(torch.equal(local[k], before[k]) for k in local), "the rule must not modify its inputs"


def test_receive_rule_is_bit_identical_to_the_per_tensor_alpha_merge():
    """The _foreach form computes exactly what local <- alpha * local + (1 - alpha) * target
    does tensor by tensor (target: the new global value plus the progress since the send)."""
    theta_send, new_global, local = _fragment(3), _fragment(4), _fragment(5)
    got = receive_rule(local, new_global, theta_send, alpha=0.3, keep_progress=True)
    for k in local:
        want = local[k].clone()
        want.mul_(0.3).add_(new_global[k] + (local[k] - theta_send[k]), alpha=1.0 - 0.3)
        assert torch.equal(got[k], want), k


def test_alpha_zero_without_progress_is_the_new_global_value():
    new_global = _fragment(6)
    got = receive_rule(_fragment(7), new_global, _fragment(8), alpha=0.0, keep_progress=False)
    assert all(torch.equal(got[k], new_global[k]) for k in new_global)
