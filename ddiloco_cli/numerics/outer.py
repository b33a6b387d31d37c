"""Outer optimizer: SGD with (Nesterov) momentum on the merged outer gradient,
one instance per fragment (PROTOCOL.md "Merge semantics" [M3]).

Same arithmetic, op for op, as torch.optim.SGD(lr, momentum, nesterov,
dampening=0, weight_decay=0) with .grad = outer_grad, so results match it
bit-for-bit; the state is plain tensors so it round-trips through safetensors.
"""

from __future__ import annotations

from typing import Mapping

import torch

from ddiloco_cli.errors import InvalidPayloadError, UsageError

# ``OuterOptimizer.stepped`` steps each tensor range by range: the ranges of the param, the
# gradient, the old and new buffers and the new param (5 x 256 KB) stay in cache between the ops.
# A multiple of 64 elements: every range but a tensor's last is whole vector lanes, as unranged.
STEP_CHUNK_ELEMS = 1 << 16


def _flat_ok(t: torch.Tensor) -> bool:
    """t can be stepped range by range in place of step (a contiguous fp32 CPU tensor)."""
    return t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()


class OuterOptimizer:
    def __init__(self, *, lr: float = 0.7, momentum: float = 0.9, nesterov: bool = True):
        if lr <= 0:
            raise UsageError(f"--outer-lr must be > 0, got {lr}")
        if not 0 <= momentum < 1:
            raise UsageError(f"--outer-momentum must be in [0, 1), got {momentum}")
        if nesterov and momentum == 0:
            raise UsageError("Nesterov needs --outer-momentum > 0")
        self.lr = lr
        self.momentum = momentum
        self.nesterov = nesterov
        self.momentum_buffers: dict[str, torch.Tensor] = {}
        self.num_steps = 0

    @torch.no_grad()
    def step(self, params: Mapping[str, torch.Tensor], outer_grad: Mapping[str, torch.Tensor]) -> None:
        """params[k] -= lr * (g + momentum * buf) (Nesterov) for each key k of
        outer_grad, in place. The first step for a key sets buf = g, as torch does.
        Keys of params without a gradient are left alone."""
        for key, grad in outer_grad.items():
            if key not in params:
                raise UsageError(f"outer gradient for {key!r} but no such parameter")
            param = params[key]
            assert param.shape == grad.shape, (key, param.shape, grad.shape)
            if self.momentum != 0:
                buf = self.momentum_buffers.get(key)
                if buf is None:
                    buf = grad.detach().clone()
                    self.momentum_buffers[key] = buf
                else:
                    buf.mul_(self.momentum).add_(grad, alpha=1)
                grad = grad.add(buf, alpha=self.momentum) if self.nesterov else buf
            param.add_(grad, alpha=-self.lr)
        self.num_steps += 1

    @torch.no_grad()
    def stepped(self, params: Mapping[str, torch.Tensor], outer_grad: Mapping[str, torch.Tensor], *,
                lr: float | None = None, intake: float = 1.0) -> tuple[dict[str, torch.Tensor], "OuterOptimizer"]:
        """``step`` without touching ``params`` or this optimizer: returns (the new params, an
        optimizer with ``lr`` (default: this one's) that has taken the step). The same operations,
        element by element, as ``copy()`` then ``step`` on copies of ``params`` (so the same bits),
        but range by range (``STEP_CHUNK_ELEMS``: the ranges of every tensor stay in cache
        between the operations) and into fresh tensors: no copies of the old values are made
        first. Keys of params without a gradient are copied.

        ``intake`` < 1 (a catch-up, ``stepped_with_intake``): the buffer takes in only that part of
        the gradient. 1: exactly ``step``."""
        if intake != 1.0:
            return self.stepped_with_intake(params, outer_grad, lr=self.lr if lr is None else lr, intake=intake)
        out = OuterOptimizer(lr=self.lr if lr is None else lr, momentum=self.momentum, nesterov=self.nesterov)
        out.num_steps = self.num_steps + 1
        new: dict[str, torch.Tensor] = {}
        for key, grad in outer_grad.items():
            if key not in params:
                raise UsageError(f"outer gradient for {key!r} but no such parameter")
            param = params[key]
            assert param.shape == grad.shape, (key, param.shape, grad.shape)
            buf = self.momentum_buffers.get(key) if self.momentum != 0 else None
            if not all(_flat_ok(t) for t in (param, grad) + (() if buf is None else (buf,))):
                one = OuterOptimizer(lr=out.lr, momentum=self.momentum, nesterov=self.nesterov)
                if buf is not None:
                    one.momentum_buffers[key] = buf.detach().clone()
                new[key] = param.detach().clone()
                one.step(new, {key: grad})  # in place on the copies
                out.momentum_buffers.update(one.momentum_buffers)
                continue
            new[key], new_buf = self._step_ranges(param.detach(), grad.detach(), buf, lr=out.lr)
            if new_buf is not None:
                out.momentum_buffers[key] = new_buf
        for key, param in params.items():
            if key not in new:
                new[key] = param.detach().clone()
        for key, buf in self.momentum_buffers.items():
            if key not in out.momentum_buffers:
                out.momentum_buffers[key] = buf.detach().clone()
        return new, out

    def stepped_with_intake(self, params: Mapping[str, torch.Tensor], outer_grad: Mapping[str, torch.Tensor], *,
                            lr: float, intake: float) -> tuple[dict[str, torch.Tensor], "OuterOptimizer"]:
        """A bounded catch-up step ([M3]): ``buf = momentum * buf + intake * g`` (first step:
        ``intake * g``), then ``param - lr * (g + momentum * buf)`` (Nesterov) or ``param - lr *
        buf``. A contribution covering k cycles (after a syncer outage) is applied once, and loads
        the buffer with one cycle's worth (intake = 1/k), not k cycles at once. Pure, like
        ``stepped``."""
        assert 0.0 < intake <= 1.0, intake
        out = self.copy()
        out.lr, out.num_steps = lr, self.num_steps + 1
        new = {k: p.detach().clone() for k, p in params.items()}
        for key, grad in outer_grad.items():
            if key not in params:
                raise UsageError(f"outer gradient for {key!r} but no such parameter")
            g = grad.detach().to(torch.float32)
            if self.momentum == 0:
                new[key].add_(g, alpha=-lr)
                continue
            buf = out.momentum_buffers.get(key)
            buf = g.mul(intake) if buf is None else buf.mul_(self.momentum).add_(g, alpha=intake)
            out.momentum_buffers[key] = buf
            new[key].add_(g.add(buf, alpha=self.momentum) if self.nesterov else buf, alpha=-lr)
        return new, out

    def _step_ranges(self, param: torch.Tensor, grad: torch.Tensor, buf: torch.Tensor | None, *,
                     lr: float) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(new param, new momentum buffer or None) of one tensor, as ``step`` computes them, range
        by range. Contiguous fp32 CPU tensors of one shape."""
        n = param.numel()
        new_param = torch.empty_like(param)
        p, g, out_p = param.view(-1), grad.view(-1), new_param.view(-1)
        if self.momentum == 0:
            for a in range(0, n, STEP_CHUNK_ELEMS):
                b = min(n, a + STEP_CHUNK_ELEMS)
                torch.add(p[a:b], g[a:b], alpha=-lr, out=out_p[a:b])
            return new_param, None
        if buf is None:  # the first step: buf = g, as torch does
            new_buf = grad.clone()
            d = g.add(new_buf.view(-1), alpha=self.momentum) if self.nesterov else new_buf.view(-1)
            torch.add(p, d, alpha=-lr, out=out_p)
            return new_param, new_buf
        new_buf = torch.empty_like(buf)
        old_b, out_b = buf.view(-1), new_buf.view(-1)
        tmp = torch.empty(min(n, STEP_CHUNK_ELEMS), dtype=param.dtype) if self.nesterov else None
        for a in range(0, n, STEP_CHUNK_ELEMS):
            b = min(n, a + STEP_CHUNK_ELEMS)
            nb = out_b[a:b]
            torch.mul(old_b[a:b], self.momentum, out=nb).add_(g[a:b], alpha=1)  # buf.mul_(m).add_(g)
            if tmp is not None:  # g.add(buf, alpha=m)
                d = torch.add(g[a:b], nb, alpha=self.momentum, out=tmp[: b - a])
            else:
                d = nb
            torch.add(p[a:b], d, alpha=-lr, out=out_p[a:b])  # param.add_(d, alpha=-lr)
        return new_param, new_buf

    def copy(self) -> "OuterOptimizer":
        """An independent optimizer with the same hyperparameters, buffers and step count:
        step the copy, keep the original as the rollback point."""
        out = OuterOptimizer(lr=self.lr, momentum=self.momentum, nesterov=self.nesterov)
        out.momentum_buffers = self.state_tensors()
        out.num_steps = self.num_steps
        return out

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Copies of the momentum buffers by parameter key (fp32, contiguous): ready
        for safetensors or `codec.encode_tensors(codec="none")`, and safe to keep as
        a rollback point (later steps do not change them). `num_steps` is not
        included: store it beside them (e.g. in the payload metadata)."""
        return {k: v.detach().clone().contiguous() for k, v in self.momentum_buffers.items()}

    def load_state_tensors(
        self,
        d: Mapping[str, torch.Tensor],
        *,
        expected: Mapping[str, tuple[int, ...]] | None = None,
    ) -> None:
        """Restore momentum buffers from `state_tensors()` output (copied in). With
        `expected` ({key: shape}), every key must be expected and have that shape.
        Leaves `num_steps` alone. Raises InvalidPayloadError on a bad tensor."""
        bufs = {}
        for k, v in d.items():
            if v.dtype != torch.float32:
                raise InvalidPayloadError(f"outer optimizer state: {k!r} has dtype {v.dtype}, expected float32")
            if expected is not None and (k not in expected or tuple(v.shape) != tuple(expected[k])):
                raise InvalidPayloadError(
                    f"outer optimizer state: unexpected tensor {k!r} of shape {list(v.shape)}"
                )
            if not bool(torch.isfinite(v).all()):
                raise InvalidPayloadError(f"outer optimizer state: {k!r} has non-finite values")
            bufs[k] = v.detach().to("cpu").clone()
        self.momentum_buffers = bufs
