"""OuterOptimizer matches torch.optim.SGD bit for bit and its state round-trips."""

import pytest
import safetensors.torch
import torch

from ddiloco_cli.errors import InvalidPayloadError, UsageError
from ddiloco_cli.numerics.codec import decode_tensors, encode_tensors
from ddiloco_cli.numerics.outer import OuterOptimizer


def make(seed):
    g = torch.Generator().manual_seed(seed)
    params = {"a": torch.randn(7, 5, generator=g), "b": torch.randn(11, generator=g)}
    grads = [{k: torch.randn(v.shape, generator=g) for k, v in params.items()} for _ in range(6)]
    return params, grads


@pytest.mark.parametrize("lr,momentum,nesterov", [(0.7, 0.9, True), (0.4, 0.5, False), (1.0, 0.0, False)])
def test_matches_torch_sgd_bit_for_bit(lr, momentum, nesterov):
    params, grads = make(0)
    ref = {k: torch.nn.Parameter(v.clone()) for k, v in params.items()}
    sgd = torch.optim.SGD(list(ref.values()), lr=lr, momentum=momentum, nesterov=nesterov)
    ours = {k: v.clone() for k, v in params.items()}
    opt = OuterOptimizer(lr=lr, momentum=momentum, nesterov=nesterov)
    for g in grads:
        for k, p in ref.items():
            p.grad = g[k].clone()
        sgd.step()
        opt.step(ours, g)
        for k in params:
            assert torch.equal(ours[k], ref[k].detach()), k
    assert opt.num_steps == len(grads)


@pytest.mark.parametrize("lr,momentum,nesterov", [(0.7, 0.9, True), (0.4, 0.5, False), (1.0, 0.0, False)])
def test_stepped_is_copy_then_step_bit_for_bit(lr, momentum, nesterov, monkeypatch):
    """``stepped`` (range by range, into new tensors: the syncer's update) makes the bits of
    ``copy()`` then ``step`` on copies, over many ranges with a short last one, a first step,
    a key without a gradient and a non-contiguous tensor; the inputs are left as they were."""
    import ddiloco_cli.numerics.outer as outer_mod

    monkeypatch.setattr(outer_mod, "STEP_CHUNK_ELEMS", 64)
    g = torch.Generator().manual_seed(3)
    params = {"a": torch.randn(37, 29, generator=g), "b": torch.randn(11, generator=g),
              "c": torch.randn(5, 4, generator=g).t()}
    ref, ref_opt = {k: v.clone() for k, v in params.items()}, OuterOptimizer(lr=lr, momentum=momentum, nesterov=nesterov)
    ours, opt = {k: v.clone() for k, v in params.items()}, OuterOptimizer(lr=lr, momentum=momentum, nesterov=nesterov)
    for i in range(4):
        grads = {k: torch.randn(v.shape, generator=g) for k, v in params.items()}
        if i == 2:
            del grads["b"]
        ref_opt.step(ref, grads)
        before = {k: v.clone() for k, v in ours.items()}
        bufs = {k: v.clone() for k, v in opt.momentum_buffers.items()}
        new, new_opt = opt.stepped(ours, grads, lr=lr)
        assert all(torch.equal(ours[k], before[k]) for k in ours)  # untouched: the rollback point
        assert all(torch.equal(opt.momentum_buffers[k], bufs[k]) for k in bufs)
        ours, opt = new, new_opt
        assert set(ours) == set(ref) and all(torch.equal(ours[k], ref[k]) for k in ref), i
        assert set(opt.momentum_buffers) == set(ref_opt.momentum_buffers)
        assert all(torch.equal(opt.momentum_buffers[k], b) for k, b in ref_opt.momentum_buffers.items())
        assert opt.num_steps == ref_opt.num_steps and opt.lr == lr


def test_state_round_trip_through_safetensors_and_codec_is_bit_exact():
    params, grads = make(1)
    a = {k: v.clone() for k, v in params.items()}
    opt = OuterOptimizer()
    for g in grads[:3]:
        opt.step(a, g)
    state = opt.state_tensors()
    snapshot = {k: v.clone() for k, v in state.items()}
    shapes = {k: tuple(v.shape) for k, v in params.items()}
    loaded_states = [
        safetensors.torch.load(safetensors.torch.save(state)),
        decode_tensors(encode_tensors(state, codec="none"), expected=shapes)[0],
    ]
    for loaded in loaded_states:
        assert all(torch.equal(loaded[k], state[k]) for k in state)
        restored = OuterOptimizer()
        restored.load_state_tensors(loaded, expected=shapes)
        x, y = {k: v.clone() for k, v in a.items()}, {k: v.clone() for k, v in a.items()}
        cont = OuterOptimizer()
        cont.load_state_tensors(state)
        for g in grads[3:]:
            restored.step(x, g)
            cont.step(y, g)
        assert all(torch.equal(x[k], y[k]) for k in x)
    # state_tensors is a snapshot: stepping afterwards does not change it (rollback point)
    opt.step(a, grads[4])
    assert all(torch.equal(state[k], snapshot[k]) for k in state)
    assert not all(torch.equal(opt.momentum_buffers[k], snapshot[k]) for k in state)


def test_bad_state_and_flags():
    opt = OuterOptimizer()
    with pytest.raises(InvalidPayloadError, match="non-finite"):
        opt.load_state_tensors({"a": torch.tensor([float("nan")])})
    with pytest.raises(InvalidPayloadError, match="unexpected tensor 'a'"):
        opt.load_state_tensors({"a": torch.zeros(3)}, expected={"a": (4,)})
    with pytest.raises(InvalidPayloadError, match="dtype"):
        opt.load_state_tensors({"a": torch.zeros(3, dtype=torch.float64)})
    with pytest.raises(UsageError):
        OuterOptimizer(lr=0)
    with pytest.raises(UsageError):
        OuterOptimizer(momentum=0.0, nesterov=True)
