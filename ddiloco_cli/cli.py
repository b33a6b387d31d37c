"""The `ddiloco` command line. Commands only: each body calls one library function.

A new command is one ``@app.command()`` function in the section it belongs to,
taking the shared ``Url`` / ``StorageOpts`` / ``JsonOut`` options and calling
one library function; errors it should report are ``DdilocoError`` subclasses
(``UsageError`` for bad flags), which ``_Commands`` turns into one line and an
exit code. Set DDILOCO_TRACEBACK=1 to see full tracebacks instead.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
from enum import Enum
from typing import Annotated, Any, Optional

import typer
from rich.console import Console
from rich.markup import escape  # messages quote bucket content: never read it as markup
from typer.core import TyperGroup

from ddiloco_cli.errors import DdilocoError, UsageError
from ddiloco_cli.metrics import LOGGERS
from ddiloco_cli.runconfig import RunConfig
from ddiloco_cli.runflags import settings_of, with_run_settings
from ddiloco_cli.store.base import TransientStoreError


class _Commands(TyperGroup):
    """Runs a command and turns the errors a user can cause or must act on into one
    line on stderr and the error's exit code (2 usage, 3 bucket, 4 protocol, ...).
    DDILOCO_TRACEBACK=1 shows the traceback instead."""

    def invoke(self, ctx: typer.Context):  # type: ignore[override]
        try:
            return super().invoke(ctx)
        except DdilocoError as exc:
            _fail(str(exc), exc.exit_code)
        except TransientStoreError as exc:
            _fail(f"the bucket kept failing after retries: {exc}", 3)
        except KeyboardInterrupt:
            console.print("interrupted")
            raise typer.Exit(130) from None

    # --help is a flag: show no "<bool>" value placeholder for it (Typer's own option
    # has no metavar), here and in every command
    def get_help_option(self, ctx: typer.Context):  # type: ignore[override]
        return _flag(super().get_help_option(ctx))

    def get_command(self, ctx: typer.Context, cmd_name: str):  # type: ignore[override]
        command = super().get_command(ctx, cmd_name)
        if command is not None:
            _flag(command.get_help_option(ctx))
        return command


def _flag(option):
    if option is not None:
        option.metavar = ""
    return option


def _fail(message: str, exit_code: int) -> None:
    if os.environ.get("DDILOCO_TRACEBACK"):
        raise
    console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(exit_code)


app = typer.Typer(
    name="ddiloco",
    cls=_Commands,
    help="Decoupled DiLoCo: asynchronous, fault-tolerant, low-communication training over a shared bucket.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console(stderr=True)
out = Console(width=None if sys.stdout.isatty() else 160)  # tables stay readable when piped

# -- options several commands share; each can come from a DDILOCO_* environment variable --
Url = Annotated[str, typer.Argument(
    metavar="URL", envvar="DDILOCO_URL", show_envvar=True,
    help="Run location: a local path, file://, s3://bucket/prefix or gs://bucket/prefix")]
StorageOpts = Annotated[Optional[list[str]], typer.Option(
    "--storage-option", "-o", metavar="KEY=VALUE", envvar="DDILOCO_STORAGE_OPTIONS", show_envvar=True,
    help="Backend option (repeatable; in the variable: space-separated), e.g. -o endpoint_url=http://127.0.0.1:9000")]
JsonOut = Annotated[bool, typer.Option("--json", metavar="", help="Machine-readable output")]
Verbose = Annotated[bool, typer.Option("--verbose", "-v", metavar="", help="Debug logging")]
LogTarget = Enum("LogTarget", {n: n for n in LOGGERS}, type=str)  # type: ignore[misc]
LogWith = Annotated[Optional[list[LogTarget]], typer.Option(
    "--log-with", metavar="tensorboard|wandb|mlflow", help="Also send metrics to TensorBoard, W&B (offline) or MLflow (local files); repeatable")]
TaskOverride = Annotated[Optional[str], typer.Option(
    metavar="MODULE:OBJECT", help="This machine's task, module:object or path/to/file.py:object (default: the "
                                  "module run.json names); its source must match the run's")]
LogDir = Annotated[str, typer.Option("--log-dir", metavar="DIR", help="Directory for --log-with output")]


def _number(flag: str, *, positive: bool = False, allow_inf: bool = False):
    """A parser for a quantity flag (seconds, years): a number >= 0 (> 0 when
    ``positive``), finite unless ``allow_inf`` ("inf": no limit)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise typer.BadParameter(f"{text!r} is not a number", param_hint=flag) from None
        if math.isnan(value) or (math.isinf(value) and not allow_inf) or value < 0 or (positive and value == 0):
            want = f"a {'' if allow_inf else 'finite '}number {'>' if positive else '>='} 0"
            raise typer.BadParameter(f"must be {want}, got {text}", param_hint=flag)
        return value

    return parse


def _version(value: bool) -> None:
    if value:
        typer.echo(f"ddiloco {_installed_version()}")
        raise typer.Exit()


def _installed_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    from ddiloco_cli import __version__

    try:
        return version("ddiloco")
    except PackageNotFoundError:  # running from a source tree
        return __version__


@app.callback()
def _main(
    _: Annotated[bool, typer.Option("--version", metavar="", callback=_version, is_eager=True,
                                    help="Print the version and exit")] = False,
) -> None:
    """Decoupled DiLoCo: asynchronous, fault-tolerant, low-communication training over a shared bucket."""


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


# ------------------------------------------------------------------------ init


@app.command()
@with_run_settings(before="storage_option")
def init(
    ctx: typer.Context,
    url: Annotated[Optional[str], typer.Argument(
        metavar="URL", envvar="DDILOCO_URL", show_envvar=True,
        help="Run location: a local path, file://, s3://bucket/prefix or gs://bucket/prefix")] = None,
    config: Annotated[Optional[str], typer.Option(
        "--config", metavar="FILE", help="TOML (or YAML) file of settings keyed by these flags' names; "
        "flags given here override it")] = None,
    print_config: Annotated[bool, typer.Option(
        "--print-config", metavar="", help="Print the default settings as a --config file and exit")] = False,
    force_clean: Annotated[bool, typer.Option(
        "--force-clean", metavar="", help="Remove an interrupted init (plan.json without run.json) first, "
        "instead of resuming it; only while no other init runs there")] = False,
    require_signatures: Annotated[Optional[bool], typer.Option(
        "--require-signatures/--no-require-signatures", metavar="",
        help="Accept only contributions signed by admitted keys (default: on for s3:// and gs://, off for local paths)")
    ] = None,
    admin_key: Annotated[Optional[str], typer.Option(
        "--admin-key", metavar="PATH", envvar="DDILOCO_ADMIN_KEY", show_envvar=True,
        help="The run's admin key, created if missing (default ~/.config/ddiloco/admin.pem); signed runs only")] = None,
    storage_option: StorageOpts = None,
    json_out: Annotated[bool, typer.Option("--json", metavar="", help="Print the run config as JSON")] = False,
    **settings: Any,  # every run setting, one option per RunConfig field (runflags)
) -> None:
    """Create a run: write its fragment plan, version 0 of every fragment, then its config.

    Every setting is checked before the first write. Refuses to touch an existing
    run; resumes an interrupted init with the same settings (or removes it with
    --force-clean).
    """
    from ddiloco_cli.runconfig import default_config_toml, load_config_file
    from ddiloco_cli.runinit import init_run
    from ddiloco_cli.signing import default_require_signatures, load_admin_key

    if print_config:
        typer.echo(default_config_toml(), nl=False)
        return
    if url is None:
        raise UsageError("give the run URL (or set DDILOCO_URL)")
    values = settings_of(ctx.params)
    if config is not None:  # the file fills in what the command line left at its default
        for key, value in load_config_file(config).items():
            if getattr(ctx.get_parameter_source(key), "name", "DEFAULT") == "DEFAULT":
                values[key] = value
    spec = RunConfig.from_flags(values)
    require = default_require_signatures(url) if require_signatures is None else require_signatures
    admin = load_admin_key(admin_key, create=True) if require else None
    run = init_run(_store(url, storage_option), spec, force_clean=force_clean,
                   note=lambda line: console.print(line, highlight=False, soft_wrap=True), admin=admin)
    if json_out:
        out.print_json(json.dumps(run))
    else:
        console.print(f"[green]created run {run['run_id']}[/] at {url}: P={spec.num_fragments} H={spec.sync_every} "
                      f"tau={spec.overlap_steps} K={spec.quorum} codec={spec.codec} mode={spec.mode}",
                      highlight=False, soft_wrap=True)
        if admin is not None:
            console.print(f"signatures required (admin key {admin.path}): admit each learner with "
                          f"`ddiloco admit {url} ID PUBKEY` and each syncer with `... --role syncer`",
                          highlight=False, soft_wrap=True)


# ------------------------------------------------------------------------ keys
keys_app = typer.Typer(cls=_Commands, help="Signing keys of learners, syncers and run admins.",
                       no_args_is_help=True)
app.add_typer(keys_app, name="keys")


@keys_app.command("new")
def keys_new(path: Annotated[str, typer.Argument(
        metavar="PATH", help="Where to write the private key (mode 0600); PATH.pub gets the public key")]) -> None:
    """Create an ed25519 keypair and print its public key (give it to the run's admin)."""
    from ddiloco_cli.signing import new_key

    signer = new_key(path)
    console.print(f"wrote private key {path} and public key {path}.pub", highlight=False, soft_wrap=True)
    out.print(signer.public_key)


@app.command()
def admit(
    url: Url,
    member_id: Annotated[str, typer.Argument(metavar="ID", help="Learner id (or syncer name with --role syncer)")],
    public_key: Annotated[str, typer.Argument(metavar="PUBKEY", help="Public key printed by `ddiloco keys new`")],
    role: Annotated[str, typer.Option(metavar="learner|syncer", help="What the key may sign")] = "learner",
    admin_key: Annotated[Optional[str], typer.Option(
        "--admin-key", metavar="PATH", envvar="DDILOCO_ADMIN_KEY", show_envvar=True,
        help="The run's admin key (default ~/.config/ddiloco/admin.pem)")] = None,
    storage_option: StorageOpts = None,
) -> None:
    """Let PUBKEY sign as ID in a run that requires signatures (re-admitting an id replaces its key)."""
    from ddiloco_cli import ledger
    from ddiloco_cli.signing import admit as admit_key, load_admin_key, parse_public_key

    public_key = parse_public_key(public_key)  # a typo fails before any key file or bucket is read
    store = _store(url, storage_option)
    record = admit_key(store, run=ledger.read_run(store), member_id=member_id, public_key=public_key, role=role,
                       admin=load_admin_key(admin_key, create=False))
    console.print(f"admitted {role} {member_id} with key {record['public_key']}", highlight=False, soft_wrap=True)


# ----------------------------------------------------------------------- learn
@app.command()
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
    log_with: LogWith = None,
    log_dir: LogDir = "ddiloco-logs",
    task: TaskOverride = None,
    precision: Annotated[str, typer.Option(
        metavar="fp32|bf16", help="bf16: forward under bf16 autocast (weights and optimizer stay fp32)")] = "fp32",
    grad_accum: Annotated[int, typer.Option("--grad-accum", metavar="N", min=1, help="Micro-batches per inner step")] = 1,
    compile_model: Annotated[bool, typer.Option("--compile", metavar="", help="torch.compile the model")] = False,
    parallel: Annotated[str, typer.Option(metavar="ddp|fsdp", help="Under torchrun: ddp, or fsdp (FSDP2 fully_shard)")] = "ddp",
    key: Annotated[Optional[str], typer.Option(
        "--key", metavar="PATH", envvar="DDILOCO_KEY", show_envvar=True,
        help="Signing key admitted for this learner id (runs that require signatures)")] = None,
    storage_option: StorageOpts = None,
    verbose: Verbose = False,
) -> None:
    """Run one learner (one island): inner AdamW steps, background fragment uploads,
    non-blocking receives. SIGTERM leaves cleanly; after kill -9 the same command rejoins."""
    _setup_logging(verbose)
    from ddiloco_cli.learner import Learner, LearnerOptions
    from ddiloco_cli.live import learner_view
    from ddiloco_cli.runconfig import wait_for_run_config

    if shard is not None and num_shards is None or num_shards is not None and shard is None:
        raise UsageError("--shard and --num-shards go together")
    if shard is not None and not 0 <= shard < num_shards:
        raise UsageError(f"--shard must be in [0, {num_shards})")
    opts = LearnerOptions(learner_id=learner_id, device=device, steps=steps, shard=shard, num_shards=num_shards,
                          poll_s=poll, task=task, precision=precision, grad_accum=grad_accum, compile=compile_model,
                          parallel=parallel, key_path=key)
    opts.check()
    log = logging.getLogger("ddiloco")
    store = _store(url, storage_option)
    if wait_for_run is not None:
        wait_for_run_config(store, timeout_s=wait_for_run, on_wait=lambda waited_s: log.info(
            "no run at %s yet (waited %.0f s of %s): waiting for `ddiloco init`", store.url, waited_s,
            "no limit" if math.isinf(wait_for_run) else f"{wait_for_run:g} s"))
    if threads:
        import torch

        torch.set_num_threads(threads)
    _maybe_init_distributed(device)
    from ddiloco_cli import metrics

    writer = None
    finished = False
    try:
        with learner_view(console, learner_id) as on_progress:
            learner = Learner(store, options=opts, on_progress=on_progress)  # checks the id and the run first
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
    log.info("learner %s: %s", learner_id, reason)
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
    storage_option: StorageOpts = None,
    verbose: Verbose = False,
) -> None:
    """Serve fragments: claim the lease (or stand by), merge contributions at quorum plus
    grace (token-weighted RDA), take outer Nesterov steps and commit new versions."""
    import signal

    from ddiloco_cli import metrics
    from ddiloco_cli.evaluation import PeriodicEvaluator
    from ddiloco_cli.fragspec import parse_fragment_spec
    from ddiloco_cli.live import syncer_view
    from ddiloco_cli.syncer import Syncer, SyncerOptions

    frags = parse_fragment_spec(fragments)  # before any logging or bucket access: a typo fails fast
    _setup_logging(verbose)
    import torch

    # one intra-op thread: the merge and encode are passes over cache-sized ranges, too short to
    # share (at 2 threads on a busy host a merge took 7-50x the CPU); a syncer scales by
    # decode threads and by --fragments shards, one process per core
    torch.set_num_threads(1)
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


# -------------------------------------------------------------------- observe
@app.command()
def status(
    url: Url,
    json_out: JsonOut = False,
    watch: Annotated[bool, typer.Option("--watch", metavar="", help="Refresh every --interval seconds (a live "
                                        "view on a terminal, one plain line per refresh otherwise)")] = False,
    interval: Annotated[float, typer.Option(metavar="SECONDS", parser=_number("--interval", positive=True),
                                            help="Refresh interval for --watch")] = 2.0,
    check: Annotated[bool, typer.Option("--check", metavar="", help="For monitors: print the alerts (no syncer "
                                        "alive, contributions piling up) and exit 1 if there are any")] = False,
    storage_option: StorageOpts = None,
) -> None:
    """Learners, syncers, fragment versions, throughput, ETA, goodput, bytes moved and alerts. Read-only."""
    from ddiloco_cli.observe import run_status
    from ddiloco_cli.render import render_status, status_line, watch_status

    store = _store(url, storage_option)
    if watch:
        watch_status(out, lambda: run_status(store), interval_s=interval, live=sys.stdout.isatty())
        return
    status_ = run_status(store)
    if json_out:
        out.print_json(json.dumps(status_))
    elif check:
        out.print(status_line(status_), highlight=False, soft_wrap=True)
    else:
        out.print(render_status(status_))
    if check and status_["alerts"]:
        for alert in status_["alerts"]:
            console.print(f"[bold red]alert:[/] {escape(alert)}", highlight=False, soft_wrap=True)
        raise typer.Exit(1)


@app.command()
def inspect(
    url: Url,
    json_out: JsonOut = False,
    verify: Annotated[bool, typer.Option("--verify", metavar="", help="Check every manifest, payload size/sha256 "
                                         "and version contiguity; exit 1 on any problem")] = False,
    storage_option: StorageOpts = None,
) -> None:
    """Show the bucket by meaning: run config, fragments and versions, pending contributions,
    epochs, heartbeats, sizes, orphans. With --verify, exit 1 on any inconsistency."""
    from ddiloco_cli import ledger
    from ddiloco_cli.observe import inspect_run, verify_run
    from ddiloco_cli.render import render_inspect

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
                console.print(f"[red]problem:[/] {escape(problem)}", highlight=False, soft_wrap=True)
            console.print("[green]verify: consistent[/]" if not problems else f"[red]verify: {len(problems)} problem(s)[/]")
    if problems:
        raise typer.Exit(1)


# ----------------------------------------------------------------- maintenance
@app.command()
def gc(
    url: Url,
    dry_run: Annotated[bool, typer.Option("--dry-run", metavar="", help="List what would be deleted")] = False,
    storage_option: StorageOpts = None,
) -> None:
    """Delete merged contributions, old versions and orphans beyond the run's retention."""
    from ddiloco_cli.gc import collect_garbage
    from ddiloco_cli.runconfig import read_run_config

    store = _store(url, storage_option)
    report = collect_garbage(store, config=read_run_config(store), dry_run=dry_run)
    verb = "would delete" if dry_run else "deleted"
    out.print(f"{verb} {len(report.deleted)} objects, {report.bytes_freed / 1e6:.1f} MB")
    if dry_run:
        for key in report.deleted:
            out.print(f"  {key}")


@app.command()
def export(
    url: Url,
    output: Annotated[Optional[str], typer.Argument(metavar="OUT.safetensors", help="Output file (replaced if it exists)")] = None,
    hf_dir: Annotated[Optional[str], typer.Option(
        "--hf-dir", metavar="DIR",
        help="Write a Hugging Face save_pretrained directory instead (tasks built on transformers)")] = None,
    push_to_hub: Annotated[Optional[str], typer.Option(
        "--push-to-hub", metavar="OWNER/NAME",
        help="With --hf-dir: also upload the directory to this Hugging Face Hub model repository")] = None,
    task: TaskOverride = None,
    storage_option: StorageOpts = None,
) -> None:
    """Assemble the latest global model into one safetensors file (run config in its metadata),
    or with --hf-dir into a directory AutoModelForCausalLM.from_pretrained and AutoTokenizer load."""
    from ddiloco_cli.export import export_hf, export_model

    if (output is None) == (hf_dir is None):
        raise UsageError("give either OUT.safetensors or --hf-dir DIR")
    if push_to_hub and not hf_dir:
        raise UsageError("--push-to-hub uploads an --hf-dir export: add --hf-dir DIR")
    store = _store(url, storage_option)
    info = export_hf(store, hf_dir, task_spec=task) if hf_dir else export_model(store, output, task_spec=task)
    console.print(f"wrote {info['path']}: {info['num_params']:,} parameters, versions {info['versions']}", soft_wrap=True)
    if push_to_hub:
        from ddiloco_cli.hfexport import push_to_hub as push

        console.print(f"pushed {info['path']} to {push(hf_dir, push_to_hub)}", soft_wrap=True)


@app.command("eval")
def eval_(
    url: Url,
    max_batches: Annotated[Optional[int], typer.Option(
        metavar="N", min=1, help="Evaluate on the first N validation batches (default: all)")] = None,
    batch_size: Annotated[Optional[int], typer.Option(
        metavar="N", min=1, help="Validation batch size (default: the run's)")] = None,
    device: Annotated[str, typer.Option(metavar="cpu|cuda[:N]", envvar="DDILOCO_DEVICE", show_envvar=True,
                                        help="Device to evaluate on")] = "cpu",
    task: TaskOverride = None,
    json_out: JsonOut = False,
    storage_option: StorageOpts = None,
) -> None:
    """Evaluate the latest global model on the task's val_batches (mean loss per token)."""
    from ddiloco_cli.evaluation import evaluate_global

    result = evaluate_global(_store(url, storage_option), max_batches=max_batches, batch_size=batch_size,
                             device=device, task_spec=task)
    if json_out:
        out.print_json(json.dumps(result))
    else:
        out.print(f"val loss {result['val_loss']:.4f} (versions {result['versions']})")


@app.command()
def metrics(
    url: Url,
    tensorboard: Annotated[Optional[str], typer.Option(
        "--tensorboard", metavar="DIR", help="Write TensorBoard event files under DIR (one run per writer)")] = None,
    csv_path: Annotated[Optional[str], typer.Option("--csv", metavar="FILE", help="Write one CSV row per record")] = None,
    storage_option: StorageOpts = None,
) -> None:
    """Export the run's metrics history (learners' and syncers' records) to TensorBoard or CSV."""
    from ddiloco_cli import metrics as m

    if (tensorboard is None) == (csv_path is None):
        raise UsageError("give exactly one of --tensorboard DIR or --csv FILE")
    records = m.read_metrics(_store(url, storage_option))
    m.add_versions_behind(records)
    if tensorboard:
        n = m.write_tensorboard(records, tensorboard)
        console.print(f"wrote {n} scalars from {len(records)} records to {tensorboard} (tensorboard --logdir {tensorboard})", soft_wrap=True)
    else:
        console.print(f"wrote {m.write_csv(records, csv_path)} records to {csv_path}", soft_wrap=True)


@app.command()
def plot(
    url: Url,
    output: Annotated[str, typer.Argument(metavar="OUT.png", help="Output PNG file (replaced if it exists)")],
    storage_option: StorageOpts = None,
) -> None:
    """Draw training loss per learner and the global validation loss over time (PNG)."""
    from ddiloco_cli.metrics import plot_run

    info = plot_run(_store(url, storage_option), output)
    console.print(f"wrote {info['path']}: {info['learners']} learner(s), {info['global_points']} global val points", soft_wrap=True)


# ----------------------------------------------------------------------- tools
@app.command()
def demo(
    workdir: Annotated[str, typer.Option(metavar="DIR", help="Directory for the bucket, logs and plot")] = "runs/demo",
    learners: Annotated[int, typer.Option(metavar="N", min=1, help="Number of learners")] = 3,
    duration: Annotated[float, typer.Option(metavar="SECONDS", parser=_number("--duration", positive=True),
                                            help="Approximate training time")] = 150.0,
    kill: Annotated[bool, typer.Option("--kill/--no-kill", metavar="",
                                       help="kill -9 one learner half-way and restart it")] = True,
) -> None:
    """A real run on a local-directory bucket: init, one syncer and several learners as
    subprocesses on the built-in GPT and Shakespeare; ends with a summary and a plot."""
    from ddiloco_cli.demo import run_demo

    run_demo(workdir=workdir, num_learners=learners, duration_s=duration, kill=kill, console=console)


class SimMode(str, Enum):
    data_parallel = "data-parallel"
    elastic_data_parallel = "elastic-data-parallel"
    decoupled = "decoupled"


@app.command()
def simulate(
    mode: Annotated[SimMode, typer.Option(help="Training scheme to simulate")] = SimMode.decoupled,
    chips: Annotated[int, typer.Option(metavar="N", min=1, help="Number of chips")] = 1_200_000,
    learners: Annotated[Optional[int], typer.Option(metavar="M", min=1, help="Learners M (default 8; "
                                                    "--train: the scenario's)")] = None,
    mtbi_years: Annotated[float, typer.Option(metavar="YEARS", parser=_number("--mtbi-years", positive=True),
                                              help="Mean time between interruptions per chip, years")] = 1.0,
    quorum: Annotated[int, typer.Option(metavar="K", min=1, help="Quorum K (decoupled)")] = 1,
    seed: Annotated[Optional[int], typer.Option(metavar="N", min=0)] = None,
    train: Annotated[bool, typer.Option("--train", metavar="", help="Simulate a whole training run: the real syncer and "
                                        "learner code on a virtual clock (docs/simulation.md)")] = False,
    steps_per_learner: Annotated[Optional[int], typer.Option(metavar="N", min=1, help="--train: inner steps "
                                                             "per learner")] = None,
    scenario: Annotated[Optional[str], typer.Option(metavar="FILE", help="--train: a scenario (TOML)")] = None,
    quick: Annotated[bool, typer.Option("--quick", metavar="", help="--train: the small scenario CI runs")] = False,
    json_file: Annotated[Optional[str], typer.Option(metavar="PATH", help="--train: also write the report "
                                                     "(JSON) here")] = None,
    json_out: JsonOut = False,
) -> None:
    """Discrete-event goodput simulator of training at scale (see docs/simulator.md); with
    --train, a deterministic simulation of a whole run (see docs/simulation.md)."""
    if train:
        from ddiloco_cli.simtrain.cli import simulate_train_command

        simulate_train_command(out, scenario=scenario, quick=quick, learners=learners, seed=seed,
                               steps_per_learner=steps_per_learner, json_file=json_file, json_out=json_out)
        return
    from ddiloco_cli.simulate import simulate as run_sim

    learners = learners or 8
    result = run_sim(mode=mode.value, chips=chips, learners=learners if mode is SimMode.decoupled else 1,
                     mtbi_years=mtbi_years, quorum=quorum, seed=seed or 0)
    if json_out:
        out.print_json(json.dumps(result))
    else:
        out.print(f"{mode.value}: goodput {result['goodput']:.1%}, uptime {result['uptime']:.1%}")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
