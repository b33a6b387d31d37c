"""`ddiloco learn` and `ddiloco sync`: the processes that train."""

from __future__ import annotations

import logging
import math
import os
import sys
from enum import Enum
from typing import Annotated, Optional

import typer

from ddiloco_cli.cli.base import (
    StorageOpts,
    TaskOverride,
    Url,
    Verbose,
    _number,
    _setup_logging,
    _store,
    app,
    console,
    help_panels,
)
from ddiloco_cli.errors import UsageError
from ddiloco_cli.ops.metrics import LOGGERS

LogTarget = Enum("LogTarget", {n: n for n in LOGGERS}, type=str)  # type: ignore[misc]
LogWith = Annotated[Optional[list[LogTarget]], typer.Option(
    "--log-with", metavar="tensorboard|wandb|mlflow", help="Also send metrics to TensorBoard, W&B (offline) or MLflow (local SQLite); repeatable")]
LogDir = Annotated[str, typer.Option("--log-dir", metavar="DIR", help="Directory for --log-with output")]
WandbProject = Annotated[Optional[str], typer.Option(
    "--wandb-project", metavar="NAME", envvar="WANDB_PROJECT", show_envvar=True,
    help="W&B project for --log-with wandb (default: ddiloco)")]


def _use_wandb_project(name: str | None) -> None:
    if name:  # the W&B logger (metric_loggers.wandb_project) and wandb itself read it
        os.environ["WANDB_PROJECT"] = name


# ----------------------------------------------------------------------- learn
@app.command()
@help_panels({
    "Learner": ["learner_id", "device", "steps", "threads", "precision", "grad_accum", "compile_model", "parallel"],
    "Data": ["task", "shard", "num_shards"],
    "Bucket": ["wait_for_run", "poll", "key", "storage_option"],
    "Logging": ["log_with", "log_dir", "wandb_project", "verbose"],
})
def learn(
    url: Url,
    learner_id: Annotated[str, typer.Option(
        "--learner-id", metavar="ID", envvar="DDILOCO_LEARNER_ID", show_envvar=True,
        help="Stable name of this learner (reuse it to rejoin)")],
    device: Annotated[str, typer.Option(metavar="cpu|cuda[:N]|xla", envvar="DDILOCO_DEVICE", show_envvar=True,
                                        help="Device to train on")] = "cpu",
    steps: Annotated[Optional[int], typer.Option(
        metavar="N", min=1, help="Inner steps to run in this session (default: to the run's total)")] = None,
    shard: Annotated[Optional[int], typer.Option(
        metavar="I", min=0, help="Data shard index (default: a stream seeded by the learner id)")] = None,
    num_shards: Annotated[Optional[int], typer.Option(metavar="N", min=1, help="Number of data shards")] = None,
    threads: Annotated[Optional[int], typer.Option(metavar="N", min=1, help="torch CPU threads")] = None,
    poll: Annotated[float, typer.Option(
        "--poll", metavar="SECONDS", parser=_number("--poll"),
        help="Shortest seconds between polls for a wanted fragment (polls follow the step time above it)")] = 0.2,
    wait_for_run: Annotated[Optional[float], typer.Option(
        "--wait-for-run", metavar="SECONDS", parser=_number("--wait-for-run", allow_inf=True),
        help="Wait up to SECONDS (inf: forever) for the run to be created, polling with backoff, "
             "instead of exiting at once")] = None,
    wait_for_admission: Annotated[Optional[float], typer.Option(
        "--wait-for-admission", metavar="SECONDS", parser=_number("--wait-for-admission", allow_inf=True),
        help="In a run that requires signatures: make the --key file if missing, print its public key and "
             "the admin's `ddiloco admit` command, and wait up to SECONDS (inf: forever) for the admission")] = None,
    log_with: LogWith = None,
    log_dir: LogDir = "ddiloco-logs",
    wandb_project: WandbProject = None,
    task: TaskOverride = None,
    precision: Annotated[str, typer.Option(
        metavar="fp32|bf16", help="bf16: forward under bf16 autocast (weights and optimizer stay fp32)")] = "fp32",
    grad_accum: Annotated[int, typer.Option("--grad-accum", metavar="N", min=1, help="Micro-batches per inner step")] = 1,
    compile_model: Annotated[bool, typer.Option("--compile", metavar="", help="torch.compile the model")] = False,
    parallel: Annotated[str, typer.Option(metavar="ddp|fsdp", help="Under torchrun: ddp, or fsdp (FSDP2 fully_shard)")] = "ddp",
    key: Annotated[Optional[str], typer.Option(
        "--key", metavar="PATH", envvar="DDILOCO_KEY", show_envvar=True,
        help="Signing key admitted for this learner id (runs that require signatures)")] = None,
    io_process: Annotated[bool, typer.Option(
        "--io-process", metavar="",
        help="Encode, upload, poll and decode in a helper process, off the training process's GIL (one "
             "process a learner, decoupled, CPU or CUDA: for a learner with a core to spare)")] = False,
    storage_option: StorageOpts = None,
    verbose: Verbose = False,
) -> None:
    """Run one learner (one island): inner AdamW steps, background fragment uploads,
    non-blocking receives. SIGTERM leaves cleanly; after kill -9 the same command rejoins."""
    _setup_logging(verbose)
    _use_wandb_project(wandb_project)
    from ddiloco_cli.cli.live import learner_view
    from ddiloco_cli.learner import Learner, LearnerOptions, SyncOptions
    from ddiloco_cli.learner.progress import summary
    from ddiloco_cli.protocol.runconfig import wait_for_run_config

    if shard is not None and num_shards is None or num_shards is not None and shard is None:
        raise UsageError("--shard and --num-shards go together")
    if shard is not None and not 0 <= shard < num_shards:
        raise UsageError(f"--shard must be in [0, {num_shards})")
    opts = LearnerOptions(learner_id=learner_id, device=device, steps=steps, shard=shard, num_shards=num_shards,
                          task=task, precision=precision, grad_accum=grad_accum, compile=compile_model,
                          parallel=parallel, sync=SyncOptions(min_poll_s=poll, key_path=key, io_process=io_process))
    opts.check()
    log = logging.getLogger("ddiloco")
    from ddiloco_cli.numerics import native

    native.log_if_missing(log)
    store = _store(url, storage_option)
    if wait_for_run is not None:
        wait_for_run_config(store, timeout_s=wait_for_run, on_wait=lambda waited_s: log.info(
            "no run at %s yet (waited %.0f s of %s): waiting for `ddiloco init`", store.url, waited_s,
            "no limit" if math.isinf(wait_for_run) else f"{wait_for_run:g} s"))
    from ddiloco_cli.protocol import ledger

    if wait_for_run is None and not ledger.run_exists(store):
        raise ledger.RunNotFoundError(f"no ddiloco run at {store.url}: create it with `ddiloco init {url}`, or start "
                                      "learners before it with --wait-for-run SECONDS (inf: wait forever)")
    if wait_for_admission is not None and os.environ.get("RANK", "0") == "0":
        from ddiloco_cli.ops.admission import wait_for_admission as wait_admitted

        wait_admitted(store, run=ledger.read_run(store), member_id=learner_id, key_path=key,
                      timeout_s=wait_for_admission, say=log.info)
    if threads:
        import torch

        torch.set_num_threads(threads)
    _maybe_init_distributed(device)
    from ddiloco_cli.ops import metrics

    writer = None
    finished = False
    try:
        learner = Learner(store, options=opts)  # checks the id and the run first
        with learner_view(console, learner_id, session_steps=steps,
                          total_steps=learner.config.total_steps) as on_progress:
            learner.on_progress = on_progress
            if os.environ.get("RANK", "0") == "0":  # one metrics writer per island: rank 0 does the bucket I/O
                writer = metrics.open_writer(store, role="learner", writer_id=learner_id,
                                             log_with=[t.value for t in log_with or ()], log_dir=log_dir)
                learner.on_progress = metrics.chain(on_progress, metrics.learner_progress_hook(writer))
            reason = learner.train()
            finished = True
    finally:
        if writer:
            writer.close()
        island = _end_distributed(finished)
    log.info("%s", summary(learner_id, reason, learner.stats))
    if island:
        _exit_island_rank()


def _maybe_init_distributed(device: str) -> None:
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        import torch
        import torch.distributed as dist

        backend = "nccl" if device.startswith("cuda") else "gloo"
        if device.startswith("cuda"):
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend)


def _end_distributed(finished: bool) -> bool:
    """Tear an island's process group down; True when there was one.

    On a clean finish every rank meets at a barrier first, so no rank leaves while
    another still talks; after an error there is no barrier (the other ranks may never
    reach it)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return False
    try:
        if finished:
            dist.barrier()
    finally:
        dist.destroy_process_group()
    return True


def _exit_island_rank() -> None:
    """End a finished island rank without interpreter finalisation.

    A gloo worker thread releases a finished collective's tensors some time after the
    collective returns, and releasing a tensor Python once held takes the GIL; when that
    lands while the interpreter finalises, the thread is forced to exit inside a noexcept
    destructor and the process aborts (SIGABRT, "terminate called without an active
    exception") after a run that finished. `destroy_process_group` does not join those
    threads while the model (DDP, FSDP) still holds the group. Seen on 2 loaded cores in
    1 run in 3 to 8 (and in CI). Everything this process owns is closed by now (the
    learner joined its threads, the metrics writer is closed), so flush and leave."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(0)


# ------------------------------------------------------------------------ sync
@app.command()
@help_panels({
    "Syncer": ["fragments", "syncer_id", "poll", "no_gc", "max_versions", "max_runtime", "eval_every"],
    "Bucket": ["key", "storage_option"],
    "Logging": ["log_with", "log_dir", "wandb_project", "verbose"],
})
def sync(
    url: Url,
    fragments: Annotated[Optional[str], typer.Option(
        metavar="SPEC", help="Fragments this syncer serves, e.g. 0-11 or 0,2,4 (default: all)")] = None,
    syncer_id: Annotated[Optional[str], typer.Option(
        metavar="NAME", envvar="DDILOCO_SYNCER_ID", show_envvar=True,
        help="Name shown in heartbeats and the ledger (default: host and pid)")] = None,
    poll: Annotated[float, typer.Option("--poll", metavar="SECONDS", parser=_number("--poll"),
                                        help="Seconds between polls of the bucket while contributions arrive; "
                                             "idle, the pause doubles up to a quarter of the learners' step "
                                             "time (at most the heartbeat interval)")] = 0.2,
    no_gc: Annotated[bool, typer.Option("--no-gc", metavar="", help="Do not collect garbage while serving")] = False,
    max_versions: Annotated[Optional[int], typer.Option(metavar="N", min=1,
                                                        help="Stop after committing this many versions")] = None,
    max_runtime: Annotated[Optional[float], typer.Option(
        "--max-runtime", metavar="SECONDS", parser=_number("--max-runtime", positive=True),
        help="Stop after this many seconds")] = None,
    key: Annotated[Optional[str], typer.Option(
        "--key", metavar="PATH", envvar="DDILOCO_KEY", show_envvar=True,
        help="Signing key admitted with --role syncer (runs that require signatures)")] = None,
    eval_every: Annotated[Optional[int], typer.Option(
        "--eval-every", metavar="N", min=1,
        help="Evaluate the global model on the task's val_batches every N merges (in the background; "
             "written to the run's metrics)")] = None,
    log_with: LogWith = None,
    log_dir: LogDir = "ddiloco-logs",
    wandb_project: WandbProject = None,
    storage_option: StorageOpts = None,
    verbose: Verbose = False,
) -> None:
    """Serve fragments: claim the lease (or stand by), merge contributions at quorum plus
    grace (token-weighted RDA), take outer Nesterov steps and commit new versions."""
    import signal

    from ddiloco_cli.cli.live import syncer_view
    from ddiloco_cli.ops import metrics
    from ddiloco_cli.ops.evaluation import PeriodicEvaluator
    from ddiloco_cli.protocol.fragspec import parse_fragment_spec
    from ddiloco_cli.syncer.core import Syncer, SyncerOptions

    frags = parse_fragment_spec(fragments)  # before any logging or bucket access: a typo fails fast
    _setup_logging(verbose)
    _use_wandb_project(wandb_project)
    import torch

    # one intra-op thread: the merge and encode are passes over cache-sized ranges, too short to
    # share (at 2 threads on a busy host a merge took 7-50x the CPU); a syncer scales by
    # decode threads and by --fragments shards, one process per core
    torch.set_num_threads(1)
    from ddiloco_cli.numerics import native

    native.log_if_missing(logging.getLogger("ddiloco"))
    stopping = {"flag": False}
    signal.signal(signal.SIGTERM, lambda *_: stopping.update(flag=True))
    opts = SyncerOptions(fragments=frags, syncer_id=syncer_id or "", poll_s=poll,
                         gc=not no_gc, max_versions=max_versions, max_runtime_s=max_runtime, key_path=key)
    store = _store(url, storage_option)
    writer = metrics.open_writer(store, role="syncer", writer_id=metrics.writer_id_from(f"fragments-{fragments or 'all'}"),
                                 log_with=[t.value for t in log_with or ()], log_dir=log_dir)
    evaluator = PeriodicEvaluator(store, every_versions=eval_every, writer=writer) if eval_every else None
    hook = metrics.syncer_progress_hook(writer, on_merges=evaluator.on_merges if evaluator else None)
    try:
        with syncer_view(console) as on_progress:
            syncer = Syncer(store, options=opts, on_progress=metrics.chain(on_progress, hook))
            reason = syncer.serve(stop=lambda: stopping["flag"])
    finally:
        if evaluator:
            evaluator.close()
        writer.close()
    logging.getLogger("ddiloco").info("syncer: %s", reason)
