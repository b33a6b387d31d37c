"""The `ddiloco` command line. Commands only: each body calls one library function.

Set DDILOCO_TRACEBACK=1 to see full tracebacks instead of one-line errors.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Annotated, Optional

import typer
from rich.console import Console

from ddiloco_cli.errors import DdilocoError, UsageError
from ddiloco_cli.store.base import TransientStoreError

app = typer.Typer(
    name="ddiloco",
    help="Decoupled DiLoCo: asynchronous, fault-tolerant, low-communication training over a shared bucket.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console(stderr=True)
out = Console(width=None if sys.stdout.isatty() else 160)  # tables stay readable when piped

StorageOpts = Annotated[
    Optional[list[str]],
    typer.Option("--storage-option", "-o", help="Backend option key=value (repeatable), e.g. -o endpoint_url=http://127.0.0.1:9000"),
]
Url = Annotated[str, typer.Argument(help="Run location: a local path, file://, s3://bucket/prefix or gs://bucket/prefix")]


def _store(url: str, opts: list[str] | None):
    from ddiloco_cli.store import open_store, parse_storage_options

    return open_store(url, options=parse_storage_options(opts or []))


def _setup_logging(verbose: bool) -> None:
    level = logging.DEBUG if verbose else logging.INFO
    if sys.stderr.isatty():
        from rich.logging import RichHandler

        handler: logging.Handler = RichHandler(console=console, show_path=False, rich_tracebacks=False)
        fmt = "%(message)s"
    else:
        handler = logging.StreamHandler(sys.stderr)
        fmt = "%(asctime)s %(levelname)s %(name)s: %(message)s"
    handler.setFormatter(logging.Formatter(fmt, datefmt="%H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for noisy in ("botocore", "s3fs", "aiobotocore", "urllib3", "fsspec", "google"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    logging.getLogger("gcsfs").setLevel(logging.CRITICAL)  # it logs a traceback per exhausted retry


def _pair(text: str, flag: str) -> tuple[float, float]:
    try:
        a, b = (float(x) for x in text.split(","))
        return a, b
    except ValueError:
        raise UsageError(f"{flag}: give two comma-separated numbers, e.g. 0.9,0.95") from None


@app.command()
def init(
    url: Url,
    task: Annotated[str, typer.Option(help="module:object (or path.py:object) giving the model, data and loss")] = "ddiloco_cli.tasks.gpt:tiny",
    fragments: Annotated[int, typer.Option("--fragments", "-P", help="Number of fragments P")] = 4,
    sync_every: Annotated[int, typer.Option("--sync-every", "-H", help="Inner steps between two syncs of a fragment (H)")] = 24,
    overlap_steps: Annotated[int, typer.Option("--overlap-steps", help="Steps a fragment's sync overlaps with compute (tau)")] = 2,
    quorum: Annotated[int, typer.Option("--quorum", "-K", help="Minimum distinct learners per merge (K)")] = 1,
    alpha: Annotated[float, typer.Option(help="Learner-side merge: theta <- alpha*theta + (1-alpha)*global")] = 0.0,
    keep_overlap_progress: Annotated[bool, typer.Option(
        "--keep-overlap-progress/--discard-overlap-progress",
        help="On receive, keep the steps trained since the send (theta <- Theta_new + progress) or overwrite them")] = True,
    merge: Annotated[str, typer.Option(help="rda (Radial-Directional Averaging) or mean")] = "rda",
    outer_lr: Annotated[float, typer.Option(help="Outer Nesterov learning rate")] = 0.7,
    outer_momentum: Annotated[float, typer.Option(help="Outer Nesterov momentum")] = 0.9,
    outer_lr_scaling: Annotated[str, typer.Option(help="participation: a merge of m of M live learners uses lr*m/M; none")] = "participation",
    codec: Annotated[str, typer.Option(help="Outer-gradient codec: none, bf16, int8, int4")] = "int4",
    codec_block: Annotated[Optional[int], typer.Option(help="Quantization block size (default 64 for int4, 256 for int8)")] = None,
    publish_codec: Annotated[Optional[str], typer.Option(help="Codec of published fragment deltas (default: --codec)")] = None,
    mode: Annotated[str, typer.Option(help="decoupled, or lockstep (the streaming-DiLoCo baseline)")] = "decoupled",
    inner_lr: Annotated[float, typer.Option(help="Inner AdamW peak learning rate")] = 1e-3,
    adam_betas: Annotated[str, typer.Option(help="Inner AdamW betas B1,B2")] = "0.9,0.95",
    weight_decay: Annotated[float, typer.Option(help="Inner AdamW weight decay")] = 0.1,
    warmup_steps: Annotated[int, typer.Option(help="Inner LR warmup steps")] = 20,
    lr_schedule: Annotated[str, typer.Option(help="constant or cosine")] = "cosine",
    total_steps: Annotated[int, typer.Option(help="Inner steps per learner (schedule length; 0: unlimited)")] = 1000,
    grad_clip: Annotated[float, typer.Option(help="Gradient-norm clip (0 disables)")] = 1.0,
    batch_size: Annotated[int, typer.Option(help="Inner batch size per learner")] = 16,
    seed: Annotated[int, typer.Option(help="Seed of the initial model")] = 0,
    grace_gamma: Annotated[float, typer.Option(help="Grace window = gamma * slack of the overlap window")] = 0.5,
    grace_max: Annotated[float, typer.Option("--grace-max", help="Upper bound of the grace window, seconds")] = 5.0,
    max_staleness: Annotated[int, typer.Option(help="Oldest base version accepted, in versions behind")] = 8,
    checkpoint_every: Annotated[int, typer.Option(help="Outer-state checkpoint every N versions")] = 10,
    keyframe_every: Annotated[int, typer.Option(help="Full (exact) payload every N versions")] = 8,
    lease: Annotated[float, typer.Option("--lease", help="Syncer lease, seconds")] = 10.0,
    heartbeat: Annotated[float, typer.Option("--heartbeat", help="Heartbeat interval, seconds")] = 2.0,
    retain_versions: Annotated[int, typer.Option(help="Versions kept per fragment by GC")] = 16,
    gc_grace: Annotated[float, typer.Option("--gc-grace", help="Seconds before orphans may be deleted")] = 300.0,
    storage_option: StorageOpts = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the run config as JSON")] = False,
) -> None:
    """Create a run: write its config, fragment plan and version 0 of every fragment.

    Refuses to touch an existing run.
    """
    from ddiloco_cli.runinit import RunSpec, init_run

    spec = RunSpec(
        task=task, num_fragments=fragments, sync_every=sync_every, overlap_steps=overlap_steps, quorum=quorum,
        alpha=alpha, keep_overlap_progress=keep_overlap_progress, merge=merge, outer_lr=outer_lr, outer_momentum=outer_momentum, outer_lr_scaling=outer_lr_scaling, codec=codec,
        codec_block=codec_block, publish_codec=publish_codec, mode=mode, inner_lr=inner_lr,
        adam_betas=_pair(adam_betas, "--adam-betas"), weight_decay=weight_decay, warmup_steps=warmup_steps,
        lr_schedule=lr_schedule, total_steps=total_steps, grad_clip=grad_clip, batch_size=batch_size, seed=seed,
        grace_gamma=grace_gamma, grace_max_s=grace_max, max_staleness=max_staleness,
        checkpoint_every=checkpoint_every, keyframe_every=keyframe_every, lease_s=lease, heartbeat_s=heartbeat,
        retain_versions=retain_versions, gc_grace_s=gc_grace,
    )
    spec.check()
    config = init_run(_store(url, storage_option), spec)
    if json_out:
        out.print_json(json.dumps(config))
    else:
        console.print(f"[green]created run {config['run_id']}[/] at {url}: P={fragments} H={sync_every} "
                      f"tau={overlap_steps} K={quorum} codec={config['codec']} mode={mode}")


@app.command()
def learn(
    url: Url,
    learner_id: Annotated[str, typer.Option("--learner-id", help="Stable name of this learner (reuse it to rejoin)")],
    device: Annotated[str, typer.Option(help="cpu, cuda, cuda:N or xla")] = "cpu",
    steps: Annotated[Optional[int], typer.Option(help="Inner steps to run in this session (default: to the run's total)")] = None,
    shard: Annotated[Optional[int], typer.Option(help="Data shard index (default: a stream seeded by the learner id)")] = None,
    num_shards: Annotated[Optional[int], typer.Option(help="Number of data shards")] = None,
    threads: Annotated[Optional[int], typer.Option(help="torch CPU threads")] = None,
    poll: Annotated[float, typer.Option("--poll", help="Seconds between polls for a new version of a fragment it waits for")] = 0.2,
    storage_option: StorageOpts = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
) -> None:
    """Run one learner (one island): inner AdamW steps, background fragment uploads,
    non-blocking receives. SIGTERM leaves cleanly; after kill -9 the same command rejoins."""
    _setup_logging(verbose)
    from ddiloco_cli.learner import Learner, LearnerOptions
    from ddiloco_cli.live import learner_view

    if shard is not None and num_shards is None or num_shards is not None and shard is None:
        raise UsageError("--shard and --num-shards go together")
    if shard is not None and not 0 <= shard < num_shards:
        raise UsageError(f"--shard must be in [0, {num_shards})")
    if threads:
        import torch

        torch.set_num_threads(threads)
    _maybe_init_distributed(device)
    opts = LearnerOptions(learner_id=learner_id, device=device, steps=steps, shard=shard, num_shards=num_shards,
                          poll_s=poll)
    with learner_view(console, learner_id) as on_progress:
        reason = Learner(_store(url, storage_option), options=opts, on_progress=on_progress).train()
    logging.getLogger("ddiloco").info("learner %s: %s", learner_id, reason)


def _maybe_init_distributed(device: str) -> None:
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        import torch
        import torch.distributed as dist

        backend = "nccl" if device.startswith("cuda") else "gloo"
        if device.startswith("cuda"):
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend)


@app.command()
def sync(
    url: Url,
    fragments: Annotated[Optional[str], typer.Option(help="Fragments this syncer serves, e.g. 0-11 or 0,2,4 (default: all)")] = None,
    syncer_id: Annotated[Optional[str], typer.Option(help="Name shown in heartbeats and the ledger")] = None,
    poll: Annotated[float, typer.Option("--poll", help="Seconds between polls of the bucket")] = 0.2,
    no_gc: Annotated[bool, typer.Option("--no-gc", help="Do not collect garbage while serving")] = False,
    max_versions: Annotated[Optional[int], typer.Option(help="Stop after committing this many versions")] = None,
    max_runtime: Annotated[Optional[float], typer.Option("--max-runtime", help="Stop after this many seconds")] = None,
    storage_option: StorageOpts = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
) -> None:
    """Serve fragments: claim the lease (or stand by), merge contributions at quorum plus
    grace (token-weighted RDA), take outer Nesterov steps and commit new versions."""
    _setup_logging(verbose)
    import signal

    from ddiloco_cli.live import syncer_view
    from ddiloco_cli.syncer import Syncer, SyncerOptions, parse_fragment_spec

    stopping = {"flag": False}
    signal.signal(signal.SIGTERM, lambda *_: stopping.update(flag=True))
    opts = SyncerOptions(fragments=parse_fragment_spec(fragments), syncer_id=syncer_id or "", poll_s=poll,
                         gc=not no_gc, max_versions=max_versions, max_runtime_s=max_runtime)
    with syncer_view(console) as on_progress:
        reason = Syncer(_store(url, storage_option), options=opts, on_progress=on_progress).serve(stop=lambda: stopping["flag"])
    logging.getLogger("ddiloco").info("syncer: %s", reason)


@app.command()
def status(
    url: Url,
    json_out: Annotated[bool, typer.Option("--json", help="Machine-readable output")] = False,
    watch: Annotated[bool, typer.Option("--watch", help="Live view, refreshed every --interval seconds")] = False,
    interval: Annotated[float, typer.Option(help="Refresh interval for --watch")] = 2.0,
    storage_option: StorageOpts = None,
) -> None:
    """Learners, syncers, fragment versions, goodput and bytes moved. Read-only."""
    from ddiloco_cli.render import render_status, watch_status
    from ddiloco_cli.observe import run_status

    store = _store(url, storage_option)
    if watch:
        watch_status(out, lambda: run_status(store), interval_s=interval)
    elif json_out:
        out.print_json(json.dumps(run_status(store)))
    else:
        out.print(render_status(run_status(store)))


@app.command()
def inspect(
    url: Url,
    json_out: Annotated[bool, typer.Option("--json", help="Machine-readable output")] = False,
    verify: Annotated[bool, typer.Option("--verify", help="Check every manifest, payload size/sha256 and version contiguity")] = False,
    storage_option: StorageOpts = None,
) -> None:
    """Show the bucket by meaning: run config, fragments and versions, pending contributions,
    epochs, heartbeats, sizes, orphans. With --verify, exit 1 on any inconsistency."""
    from ddiloco_cli.render import render_inspect
    from ddiloco_cli.observe import inspect_run, verify_run

    from ddiloco_cli import ledger

    store = _store(url, storage_option)
    if not ledger.run_exists(store):
        raise ledger.RunNotFoundError(f"no ddiloco run at {store.url} (create one with `ddiloco init {url}`)")
    report = inspect_run(store)
    problems = verify_run(store) if verify else []
    if verify:
        report["problems"] = problems
    if json_out:
        out.print_json(json.dumps(report))
    else:
        out.print(render_inspect(report))
        if verify:
            for problem in problems:
                console.print(f"[red]problem:[/] {problem}")
            console.print("[green]verify: consistent[/]" if not problems else f"[red]verify: {len(problems)} problem(s)[/]")
    if problems:
        raise typer.Exit(1)


@app.command()
def gc(
    url: Url,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="List what would be deleted")] = False,
    storage_option: StorageOpts = None,
) -> None:
    """Delete merged contributions, old versions and orphans beyond the run's retention."""
    from ddiloco_cli import ledger
    from ddiloco_cli.gc import collect_garbage

    store = _store(url, storage_option)
    report = collect_garbage(store, run=ledger.read_run(store), dry_run=dry_run)
    verb = "would delete" if dry_run else "deleted"
    out.print(f"{verb} {len(report.deleted)} objects, {report.bytes_freed / 1e6:.1f} MB")
    if dry_run:
        for key in report.deleted:
            out.print(f"  {key}")


@app.command()
def export(
    url: Url,
    output: Annotated[str, typer.Argument(help="Output .safetensors file")],
    storage_option: StorageOpts = None,
) -> None:
    """Assemble the latest global model into one safetensors file (run config in its metadata)."""
    from ddiloco_cli.export import export_model

    info = export_model(_store(url, storage_option), output)
    console.print(f"wrote {output}: {info['num_params']:,} parameters, versions {info['versions']}")


@app.command()
def demo(
    workdir: Annotated[str, typer.Option(help="Directory for the bucket, logs and plot")] = "runs/demo",
    learners: Annotated[int, typer.Option(help="Number of learners")] = 3,
    duration: Annotated[float, typer.Option(help="Approximate training time, seconds")] = 150.0,
    kill: Annotated[bool, typer.Option(help="kill -9 one learner half-way and restart it")] = True,
) -> None:
    """A real run on a local-directory bucket: init, one syncer and several learners as
    subprocesses on the built-in GPT and Shakespeare; ends with a summary and a plot."""
    from ddiloco_cli.demo import run_demo

    run_demo(workdir=workdir, num_learners=learners, duration_s=duration, kill=kill, console=console)


@app.command()
def simulate(
    mode: Annotated[str, typer.Option(help="data-parallel, elastic-data-parallel or decoupled")] = "decoupled",
    chips: Annotated[int, typer.Option(help="Number of chips")] = 1_200_000,
    learners: Annotated[int, typer.Option(help="Learners M (decoupled only)")] = 8,
    mtbi_years: Annotated[float, typer.Option(help="Mean time between interruptions per chip, years")] = 1.0,
    quorum: Annotated[int, typer.Option(help="Quorum K (decoupled)")] = 1,
    seed: Annotated[int, typer.Option()] = 0,
    json_out: Annotated[bool, typer.Option("--json", help="Machine-readable output")] = False,
) -> None:
    """Discrete-event goodput simulator of training at scale (see docs/simulator.md)."""
    from ddiloco_cli.simulate import simulate as run_sim

    result = run_sim(mode=mode, chips=chips, learners=learners if mode == "decoupled" else 1,
                     mtbi_years=mtbi_years, quorum=quorum, seed=seed)
    if json_out:
        out.print_json(json.dumps(result))
    else:
        out.print(f"{mode}: goodput {result['goodput']:.1%}, uptime {result['uptime']:.1%}")


def main() -> None:
    try:
        app()
    except DdilocoError as exc:
        if os.environ.get("DDILOCO_TRACEBACK"):
            raise
        console.print(f"[bold red]error:[/] {exc}", highlight=False)
        sys.exit(exc.exit_code)
    except TransientStoreError as exc:
        if os.environ.get("DDILOCO_TRACEBACK"):
            raise
        console.print(f"[bold red]error:[/] the bucket kept failing after retries: {exc}", highlight=False)
        sys.exit(3)
    except KeyboardInterrupt:
        console.print("interrupted")
        sys.exit(130)


if __name__ == "__main__":
    main()
