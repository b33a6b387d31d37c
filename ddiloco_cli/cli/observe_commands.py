"""The read-only and maintenance commands: `status`, `inspect`, `gc`, `export`, `eval`,
`metrics`, `plot`."""

from __future__ import annotations

import json
import sys
from typing import Annotated, Optional

import typer
from rich.markup import escape  # messages quote bucket content: never read it as markup

from ddiloco_cli.cli.base import JsonOut, StorageOpts, TaskOverride, Url, _number, _store, app, console, out
from ddiloco_cli.errors import UsageError


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
    from ddiloco_cli.cli.render import render_status, status_line, watch_status
    from ddiloco_cli.ops.observe import run_status

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
    from ddiloco_cli.cli.render import render_inspect
    from ddiloco_cli.ops.observe import inspect_run
    from ddiloco_cli.protocol import ledger

    store = _store(url, storage_option)
    if not ledger.run_exists(store):
        raise ledger.RunNotFoundError(f"no ddiloco run at {store.url} (create one with `ddiloco init {url}`)")
    report = inspect_run(store)
    if verify:
        from ddiloco_cli.ops.verify import verify_run  # decodes payloads: torch
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
    from ddiloco_cli.protocol.runconfig import read_run_config
    from ddiloco_cli.syncer.gc import collect_garbage

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
    from ddiloco_cli.ops.export import export_hf, export_model

    if (output is None) == (hf_dir is None):
        raise UsageError("give either OUT.safetensors or --hf-dir DIR")
    if push_to_hub and not hf_dir:
        raise UsageError("--push-to-hub uploads an --hf-dir export: add --hf-dir DIR")
    store = _store(url, storage_option)
    info = export_hf(store, hf_dir, task_spec=task) if hf_dir else export_model(store, output, task_spec=task)
    console.print(f"wrote {info['path']}: {info['num_params']:,} parameters, versions {info['versions']}", soft_wrap=True)
    if push_to_hub:
        from ddiloco_cli.ops.hfexport import push_to_hub as push

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
    from ddiloco_cli.ops.evaluation import evaluate_global

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
    csv_path: Annotated[Optional[str], typer.Option(
        "--csv", metavar="FILE", help="Write one CSV row per record (-: to stdout)")] = None,
    storage_option: StorageOpts = None,
) -> None:
    """Export the run's metrics history (learners' and syncers' records) to TensorBoard or CSV."""
    from ddiloco_cli.ops import metrics as m

    if (tensorboard is None) == (csv_path is None):
        raise UsageError("give exactly one of --tensorboard DIR or --csv FILE")
    records = m.read_metrics(_store(url, storage_option))
    m.add_versions_behind(records)
    if tensorboard:
        n = m.write_tensorboard(records, tensorboard)
        console.print(f"wrote {n} scalars from {len(records)} records to {tensorboard} (tensorboard --logdir {tensorboard})", soft_wrap=True)
    else:
        where = "stdout" if csv_path == "-" else csv_path
        console.print(f"wrote {m.write_csv(records, csv_path)} records to {where}", soft_wrap=True)


@app.command()
def plot(
    url: Url,
    output: Annotated[str, typer.Argument(metavar="OUT.png", help="Output PNG file (replaced if it exists)")],
    storage_option: StorageOpts = None,
) -> None:
    """Draw training loss per learner and the global validation loss over time (PNG)."""
    from ddiloco_cli.ops.plot import plot_run

    info = plot_run(_store(url, storage_option), output)
    console.print(f"wrote {info['path']}: {info['learners']} learner(s), {info['global_points']} global val points", soft_wrap=True)
