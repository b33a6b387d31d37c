"""The two references every simulated run is compared with, on the same batches.

* ``dp``: data-parallel, the exact M x B plain AdamW loop: step t trains on the
  concatenation of the M learners' t-th batches (the decoupled learners' streams), with
  the learners' inner optimizer, clip and lr schedule.
* ``sync``: classic synchronous DiLoCo at the same M and H (bench_convergence's
  ``diloco`` arm): every learner in every merge, one fragment, exact fp32 outer
  gradients, no overlap: every H steps the global model takes one Nesterov outer step
  (``outer.OuterOptimizer``, the run's outer lr and momentum, or DiLoCo's defaults when the
  run is sparse) on the mean of the learners' deltas, and every learner starts the next H
  steps from it. A last partial cycle is merged too (as the decoupled
  learners flush their unsent steps).

Both are deterministic functions of the scenario (no clock): they also give the curve
of val loss against steps, which their time models turn into times on the scenario's
link (``dp_step_s``, ``sync_time_s``: compute at the slowest learner's pace plus ring
all-reduces of fp32 values, nothing overlapped), for the model size of
``Scenario.model_params``. Data-parallel trains ``Scenario.dp_steps`` steps (its own lr
schedule over them): its final loss is the target of every arm's time to a loss.
"""

from __future__ import annotations

import zlib
from typing import Any, Iterator

import torch

from ddiloco_cli.learner.learn import lr_at, train_step
from ddiloco_cli.numerics.outer import OuterOptimizer
from ddiloco_cli.protocol.runconfig import CODEC_OUTER_DEFAULTS, RunConfig
from ddiloco_cli.simtrain.scenario import Scenario
from ddiloco_cli.tasks import Task, evaluate

VAL_BATCH = 64


def learner_streams(task: Task, scenario: Scenario, batch_size: int) -> list[Iterator[Any]]:
    """The M learners' batch streams, seeded as the simulated learners seed theirs."""
    return [task.batches(shard=0, num_shards=1, seed=zlib.crc32(lid.encode()) + scenario.seed, batch_size=batch_size)
            for lid in scenario.learner_ids()]


def concat(batches: list[Any]) -> Any:
    """One batch of the M batches side by side (tensors, or tuples / lists of tensors)."""
    first = batches[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(batches)
    if isinstance(first, (tuple, list)):
        return type(first)(concat([b[i] for b in batches]) for i in range(len(first)))
    raise TypeError(f"cannot concatenate batches of type {type(first).__name__}")


def _adamw(model: torch.nn.Module, config: RunConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW([t for t in model.parameters() if t.requires_grad], lr=config.inner_lr,
                             betas=config.adam_betas, weight_decay=config.weight_decay)


def _eval_steps(total: int, points: int) -> set[int]:
    return {max(1, round(total * (k + 1) / points)) for k in range(points)}


def run_dp(task: Task, scenario: Scenario, config: RunConfig, inner: dict[str, Any]) -> dict[str, Any]:
    """Data-parallel for ``scenario.dp_steps`` steps (0: steps_per_learner), its lr schedule
    over that many: its own run, whose final loss is the time-to-loss target."""
    torch.manual_seed(config.seed)
    model = task.build_model()
    opt = _adamw(model, config)
    streams = learner_streams(task, scenario, config.batch_size)
    batches = (concat([next(s) for s in streams]) for _ in iter(int, 1))
    N = scenario.dp_steps or scenario.steps_per_learner
    if inner:
        inner = {**inner, "total_steps": N}
    marks, curve = _eval_steps(N, scenario.eval_points), []
    for step in range(N):
        train_step(task, model, opt, batches, lr=lr_at(step, inner), clip=config.grad_clip)
        if step + 1 in marks and step + 1 < N:
            curve.append((step + 1, evaluate(task, model, batch_size=VAL_BATCH, max_batches=scenario.eval_batches)))
    val = evaluate(task, model, batch_size=VAL_BATCH)
    curve.append((N, val))
    return {"val_loss": val, "curve_steps": curve}


def run_sync(task: Task, scenario: Scenario, config: RunConfig, inner: dict[str, Any], *,
             curve: bool = False) -> dict[str, Any]:
    """Classic DiLoCo; with ``curve``, the global model's val loss at the scenario's eval points
    too (``curve_steps``, as run_dp's)."""
    torch.manual_seed(config.seed)
    global_model = task.build_model()
    names = [n for n, t in global_model.named_parameters() if t.requires_grad]
    global_params = {n: t.detach() for n, t in global_model.named_parameters() if t.requires_grad}
    # the run's outer step; a sparse run's plain averaged descent is SparseLoCo's rule, not
    # DiLoCo's, so its reference takes DiLoCo's Nesterov defaults
    outer_settings = CODEC_OUTER_DEFAULTS[None] if config.codec == "sparse" else {
        "outer_lr": config.outer_lr, "outer_momentum": config.outer_momentum}
    outer = OuterOptimizer(lr=outer_settings["outer_lr"], momentum=outer_settings["outer_momentum"])
    models = []
    for _ in range(scenario.learners):
        torch.manual_seed(config.seed)
        models.append(task.build_model())
    opts = [_adamw(m, config) for m in models]
    streams = learner_streams(task, scenario, config.batch_size)
    N, H = scenario.steps_per_learner, config.sync_every
    marks, points = _eval_steps(N, scenario.eval_points) if curve else set(), []
    for step in range(N):
        for model, opt, stream in zip(models, opts, streams):
            train_step(task, model, opt, stream, lr=lr_at(step, inner), clip=config.grad_clip)
        if (step + 1) % H == 0 or step + 1 == N:
            locals_ = [dict(m.named_parameters()) for m in models]
            with torch.no_grad():
                grad = {n: torch.stack([global_params[n] - lp[n].detach() for lp in locals_]).mean(0) for n in names}
                outer.step(global_params, grad)
                for lp in locals_:
                    for n in names:
                        lp[n].copy_(global_params[n])
        if step + 1 in marks and step + 1 < N and step + 1 >= H:  # the global model moves every H steps
            points.append((step + 1, evaluate(task, global_model, batch_size=VAL_BATCH,
                                              max_batches=scenario.eval_batches)))
    val = evaluate(task, global_model, batch_size=VAL_BATCH)
    return {"val_loss": val, "outer_steps": outer.num_steps, "curve_steps": points + [(N, val)]}


def allreduce_s(scenario: Scenario, num_params: float) -> float:
    """A ring all-reduce of ``num_params`` fp32 values over the scenario's link
    (bench_bandwidth.py's model: each worker sends and receives 2 (M-1)/M x 4 bytes per
    parameter, in 2 (M-1) latency-bound rounds)."""
    M = scenario.learners
    if M == 1:
        return 0.0
    nbytes = 2 * (M - 1) / M * 4 * num_params
    bw = min(scenario.up_mbps, scenario.down_mbps) * 1e6 / 8
    return nbytes / bw + 2 * (M - 1) * scenario.rtt_ms / 1e3 / 2


def dp_step_s(scenario: Scenario, num_params: float) -> float:
    """Data-parallel's step time over the scenario's link: the slowest learner's compute (a
    synchronous step waits for it) + an all-reduce of the fp32 gradient."""
    return scenario.step_s * scenario.slowest() + allreduce_s(scenario, num_params)


def sync_time_s(scenario: Scenario, num_params: float, steps: int, sync_every: int) -> float:
    """Classic DiLoCo's time for its first ``steps`` steps: the slowest learner's compute, and
    an all-reduce of the fp32 outer gradient every ``sync_every`` steps (nothing overlaps it)."""
    return steps * scenario.step_s * scenario.slowest() + (steps // sync_every) * allreduce_s(scenario, num_params)
