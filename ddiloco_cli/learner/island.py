"""One learner = one island of ranks (torchrun): rank 0 talks to the bucket, the
others learn what it received through broadcasts.

Fragments are handled as *full* (unsharded) values on every rank: under FSDP2
(``fully_shard``) a parameter is a DTensor, and gathering a fragment calls
``full_tensor()`` (an all-gather every rank joins); writing one back puts each
rank's own shard of the full value in place. Outer gradients, the receive rule
and the bucket therefore never see shards, and a run can mix islands of any
layout. The cost is one fragment's full values in memory at a time (1/P of the
model)."""

from __future__ import annotations

import os
from typing import Mapping

import torch
import torch.distributed as dist
import torch.nn as nn

from ddiloco_cli.errors import UsageError
from ddiloco_cli.protocol.fragments import FragmentPlan, gather_fragment, scatter_fragment

Tensors = dict[str, torch.Tensor]


def resolve_device(name: str) -> torch.device:
    if name == "cpu":
        return torch.device("cpu")
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise UsageError("--device cuda: no CUDA device is visible to torch (check drivers / CUDA_VISIBLE_DEVICES)")
        if name == "cuda" and dist.is_initialized():
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        return torch.device(name)
    if name == "xla":
        try:
            import torch_xla  # noqa: PLC0415 - only when asked
        except ImportError as exc:
            raise UsageError("--device xla needs torch_xla: pip install 'ddiloco[xla]' (in an env with its matching torch)") from exc
        return torch_xla.device()
    raise UsageError(f"--device {name!r}: use cpu, cuda, cuda:N or xla")


def move_model(model: nn.Module, device: torch.device) -> nn.Module:
    """``model.to(device)`` with tied parameters still tied.

    ``Module.to`` swaps a parameter's data in place only when both tensor types are
    compatible; moving CPU tensors to an XLA device instead puts a new Parameter on
    every module that names one, so a weight shared by two modules (GPT's ``wte`` and
    ``lm_head``) would train as two and no longer match the run's plan. On CPU and
    CUDA the ties survive and this is ``model.to(device)``."""
    tied: dict[int, list[str]] = {}
    for name, t in model.named_parameters(remove_duplicate=False):
        tied.setdefault(id(t), []).append(name)
    model = model.to(device)
    for first, *others in tied.values():
        shared = model.get_parameter(first)
        for name in others:
            if model.get_parameter(name) is not shared:
                owner, _, attr = name.rpartition(".")
                setattr(model.get_submodule(owner), attr, shared)
    return model


def _dtensor_type() -> type | None:
    try:
        from torch.distributed.tensor import DTensor  # noqa: PLC0415 - absent in minimal builds
    except ImportError:
        return None
    return DTensor


_DTensor = _dtensor_type()


def _is_dtensor(t: torch.Tensor) -> bool:
    return _DTensor is not None and isinstance(t, _DTensor)


class Island:
    """The ranks of one learner. Every method is called by every rank in the same order."""

    def __init__(self, device: torch.device):
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.device = device
        self.io = self.rank == 0  # only rank 0 touches the bucket

    def agree(self, values: list) -> list:
        """Rank 0's small values on every rank (no-op on a single process)."""
        if self.world == 1:
            return values
        box = list(values)
        dist.broadcast_object_list(box, src=0)
        return box

    def broadcast(self, plan: FragmentPlan, p: int, version: int, value: Tensors) -> tuple[int, Tensors]:
        """Rank 0's (version, value) of fragment p on every rank."""
        if self.world == 1:
            return version, value
        version = self.agree([version])[0]
        if self.rank != 0:
            value = {s.key: torch.empty(s.slice_shape) for s in plan.fragments[p]}
        for key in sorted(value):
            t = value[key].to(self.device) if self.device.type != "cpu" else value[key]
            dist.broadcast(t, src=0)
            value[key] = t.cpu()
        return version, value

    def gather(self, plan: FragmentPlan, p: int, params: Mapping[str, torch.Tensor], *,
               non_blocking: bool = False) -> Tensors:
        """{slice key: fp32 CPU copy} of fragment p's full values, on every rank.
        ``non_blocking``: on CUDA, a ``CopyOut`` to be read once ``landed`` (gather_fragment)."""
        # plan order, the same on every rank (a set's order differs between processes)
        names = dict.fromkeys(s.name for s in plan.fragments[p])
        return gather_fragment(plan, p, {n: self._full(params[n]) for n in names}, non_blocking=non_blocking)

    def scatter(self, plan: FragmentPlan, p: int, params: Mapping[str, torch.Tensor], value: Tensors) -> None:
        """Write fragment p's full values into the parameters (each rank its own shard)."""
        sharded = list(dict.fromkeys(s.name for s in plan.fragments[p] if _is_dtensor(params[s.name])))
        if not sharded:
            scatter_fragment(plan, p, params, value)
            return
        from torch.distributed.tensor import distribute_tensor  # noqa: PLC0415 - only with DTensors

        full = {n: self._full(params[n]).detach().clone() for n in sharded}
        scatter_fragment(plan, p, {**params, **full}, value)
        with torch.no_grad():
            for n in sharded:
                t = params[n]
                # every rank holds the same full value: cut out our own shard, no communication
                mine = distribute_tensor(full[n], t.device_mesh, t.placements, src_data_rank=None)
                t.to_local().copy_(mine.to_local())

    @staticmethod
    def _full(t: torch.Tensor) -> torch.Tensor:
        return t.full_tensor() if _is_dtensor(t) else t


def unwrap(model: nn.Module) -> nn.Module:
    """The module whose parameter names the run's plan uses: DDP's ``.module`` and
    torch.compile's ``._orig_mod`` are peeled off (FSDP2 keeps the names)."""
    while True:
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, nn.Module):
            model = model._orig_mod
        else:
            return model
