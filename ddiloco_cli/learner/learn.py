"""``ddiloco learn``: a nanoGPT-like training loop on top of ``DiLoCoSync``.

Each iteration: determine the lr, forward/backward/update (with bf16 autocast
and gradient accumulation if asked), ``sync.step``, timing and logging. Under
torchrun the island trains with DDP or FSDP2 (``fully_shard``); rank 0 does the
bucket I/O inside the wrapper.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
import time
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn

from ddiloco_cli.errors import UsageError
from ddiloco_cli.learner import allocator, progress
from ddiloco_cli.learner.island import move_model, resolve_device
from ddiloco_cli.learner.sync import DiLoCoSync, SyncOptions, check_learner_id
from ddiloco_cli.protocol import layout, ledger
from ddiloco_cli.protocol.runconfig import RunConfig
from ddiloco_cli.store.base import Store
from ddiloco_cli.tasks import Task, load_run_task, move_batch

log = logging.getLogger(__name__)

PRECISIONS = ("fp32", "bf16")
PARALLEL = ("ddp", "fsdp")


@dataclass
class LearnerOptions:
    learner_id: str
    device: str = "cpu"
    steps: int | None = None  # inner steps in this session (None: until the run's total_steps)
    shard: int | None = None
    num_shards: int | None = None
    log_every: int = 10
    task: str | None = None  # this machine's task (module:object or a local file); default: run.json's module
    precision: str = "fp32"  # bf16: forward and loss under bf16 autocast (weights and optimizer stay fp32)
    grad_accum: int = 1  # micro-batches per inner step
    compile: bool = False  # torch.compile the model's forward
    parallel: str = "ddp"  # inside a torchrun island: ddp or fsdp (FSDP2 fully_shard)
    sync: SyncOptions = field(default_factory=SyncOptions)  # the DiLoCoSync options (uploads, polls, key)

    def check(self) -> None:
        if self.precision not in PRECISIONS:
            raise UsageError(f"--precision {self.precision!r}: use {' or '.join(PRECISIONS)}")
        if self.grad_accum < 1:
            raise UsageError(f"--grad-accum must be >= 1, got {self.grad_accum}")
        if self.parallel not in PARALLEL:
            raise UsageError(f"--parallel {self.parallel!r}: use {' or '.join(PARALLEL)}")


def lr_at(step: int, inner: dict[str, Any]) -> float:
    """Inner learning rate: linear warmup, then constant or cosine decay to 10%."""
    base, warmup, total = float(inner["lr"]), int(inner["warmup_steps"]), int(inner["total_steps"])
    if warmup and step < warmup:
        return base * (step + 1) / warmup
    if inner["lr_schedule"] == "cosine" and total > warmup:
        progress = min(1.0, (step - warmup) / (total - warmup))
        return base * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
    return base


def resumable_batches(task: Task, *, shard: int, num_shards: int, seed: int, batch_size: int,
                      resume: dict[str, Any] | None) -> tuple[Iterator[Any], Callable[[int], dict[str, Any] | None]]:
    """The task's batch stream, continued from ``resume`` when the task supports it,
    and a function of the number of batches drawn this session giving the state to
    save. A task supports resuming by accepting ``start_step`` (batches already
    drawn) or ``state`` (what its iterator's ``state_dict()`` returned) in batches()."""
    params = inspect.signature(task.batches).parameters
    kwargs: dict[str, Any] = dict(shard=shard, num_shards=num_shards, seed=seed, batch_size=batch_size)
    resume = resume or {}
    start = int(resume.get("start_step", 0)) if "start_step" in params else 0
    if "start_step" in params:
        kwargs["start_step"] = start
    if "state" in params and resume.get("state") is not None:
        kwargs["state"] = resume["state"]
    stream = task.batches(**kwargs)
    progress.log_resume(resume, start=start, batch_size=batch_size, with_state="state" in params)

    def state(drawn: int) -> dict[str, Any] | None:
        out: dict[str, Any] = {}
        if "start_step" in params:
            out["start_step"] = start + drawn
        if "state" in params and callable(getattr(stream, "state_dict", None)):
            out["state"] = stream.state_dict()
        return out or None

    return stream, state


def shard_island(model: nn.Module, *, parallel: str, world: int) -> nn.Module:
    """The module the loop calls: DDP or FSDP2 across the island's ranks (in place for
    FSDP2: every block, then the root), the model itself on one process."""
    if world == 1:
        return model
    if parallel == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    from torch.distributed.fsdp import fully_shard  # noqa: PLC0415 - torchrun only

    for module in model.modules():
        if isinstance(module, nn.ModuleList):
            for block in module:
                fully_shard(block)
    return fully_shard(model)


@contextlib.contextmanager
def grad_sync(net: nn.Module, *, enabled: bool) -> Iterator[None]:
    """Gradient all-reduce inside an island only on the last micro-batch of a step."""
    if enabled:
        yield
    elif hasattr(net, "no_sync"):  # DDP
        with net.no_sync():
            yield
    elif hasattr(net, "set_requires_gradient_sync"):  # FSDP2
        net.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            net.set_requires_gradient_sync(True)
    else:
        yield


def train_step(task: Task, net: nn.Module, optimizer: torch.optim.Optimizer, batches: Iterator[Any], *, lr: float,
               clip: float, grad_accum: int = 1, device: torch.device | None = None,
               forward: Callable[..., Any] | None = None,
               autocast: contextlib.AbstractContextManager | None = None) -> tuple[torch.Tensor, int]:
    """One inner step: set the lr, forward/backward over ``grad_accum`` micro-batches of
    ``batches``, clip, ``optimizer.step()``. Returns (the last micro-batch's loss, tokens
    trained). ``ddiloco learn`` and the deterministic simulation both train with it."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)
    forward = forward or net
    n_tok = 0
    for micro in range(grad_accum):
        batch = next(batches) if device is None else move_batch(task, next(batches), device)
        n_tok += int(task.num_tokens(batch))
        with grad_sync(net, enabled=micro == grad_accum - 1):
            with autocast or contextlib.nullcontext():
                loss = task.loss(forward, batch)
            (loss / grad_accum if grad_accum > 1 else loss).backward()
    if clip > 0:
        torch.nn.utils.clip_grad_norm_([t for t in net.parameters() if t.requires_grad], clip)
    optimizer.step()
    if device is not None and device.type == "xla":
        import torch_xla  # noqa: PLC0415 - only on XLA devices

        torch_xla.sync()
    return loss, n_tok


class Learner:
    """One learner (island) of a run: ``train()`` runs inner steps until --steps, the
    run's total_steps or SIGTERM."""

    def __init__(self, store: Store, *, options: LearnerOptions, on_progress: Callable[[dict], None] | None = None):
        options.check()
        allocator.tune()  # before the model and its optimizer allocate (docs/learner.md, "The allocator")
        check_learner_id(options.learner_id)
        self.store, self.opts, self.on_progress = store, options, on_progress
        record = ledger.read_run(store)
        self.config = RunConfig.from_record(record, where=f"{store.url}/{layout.RUN_CONFIG}")
        self.inner = record["inner"]  # lr_at's schedule, as run.json writes it
        self.task = load_run_task(record, override=options.task)  # checks the task's hash in run.json
        self.device = resolve_device(options.device)
        self.stats = None
        self.model: nn.Module | None = None

    def train(self) -> str:
        """Returns "finished", "left" (SIGTERM), "taken over" or "steps" (session limit)."""
        config, inner, opts, task = self.config, self.inner, self.opts, self.task
        torch.manual_seed(config.seed)
        model = move_model(task.build_model(), self.device)
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        net = shard_island(model, parallel=opts.parallel, world=world)
        # distinct learners get distinct data without coordination: shard by --shard, else by id
        num_shards, shard = (opts.num_shards or 1) * world, (opts.shard or 0) * world + rank
        seed = config.seed if opts.shard is not None else zlib.crc32(opts.learner_id.encode())
        sync = DiLoCoSync(self.store, net, learner_id=opts.learner_id, config=config,
                          heartbeat_fields={"shard": shard, "num_shards": num_shards},
                          options=opts.sync)
        self.stats, self.model = sync.stats, model
        optimizer = torch.optim.AdamW([t for t in model.parameters() if t.requires_grad], lr=config.inner_lr,
                                      betas=config.adam_betas, weight_decay=config.weight_decay)
        forward = torch.compile(net) if opts.compile else net
        autocast = (torch.autocast(self.device.type, dtype=torch.bfloat16) if opts.precision == "bf16"
                    else contextlib.nullcontext())
        clip = config.grad_clip
        with sync:
            batches, data_state = resumable_batches(task, shard=shard, num_shards=num_shards, seed=seed,
                                                    batch_size=config.batch_size, resume=sync.resume_state)
            end_step = sync.step_count + opts.steps if opts.steps is not None else None
            drawn = 0
            while not sync.should_stop and (end_step is None or sync.step_count < end_step):
                t0 = time.perf_counter()
                lr = lr_at(sync.step_count, inner)
                loss, n_tok = train_step(task, net, optimizer, batches, lr=lr, clip=clip, grad_accum=opts.grad_accum,
                                         device=self.device, forward=forward, autocast=autocast)
                drawn += opts.grad_accum
                sync.step(num_tokens=n_tok, data_state=data_state(drawn))
                # timing and logging
                step, s = sync.step_count, sync.stats
                read_loss = step % opts.log_every == 0 or s.loss is None  # .item() syncs an accelerator
                sync.record_step_time(time.perf_counter() - t0, loss=float(loss.detach()) if read_loss else None)
                share = sync.cost_share if rank == 0 else None
                if self.on_progress is not None and rank == 0:
                    self.on_progress({"step": step, "loss": s.loss, "lr": lr, "step_time_s": s.step_time_s,
                                      "tokens": s.tokens, "bytes_up": s.bytes_up, "bytes_down": s.bytes_down,
                                      "versions": dict(s.versions), "blocked_s": s.blocked_s, "ddiloco_share": share})
                if step % opts.log_every == 0 and rank == 0:
                    progress.log_step(step, s, lr=lr, tokens_per_step=n_tok, ddiloco_share=share)
        return sync.stop_reason or "steps"
