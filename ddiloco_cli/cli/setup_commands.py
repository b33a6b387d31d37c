"""`ddiloco init`, `keys` and `admit`: creating a run and admitting its members."""

from __future__ import annotations

import json
from typing import Annotated, Any, Optional

import typer

from ddiloco_cli.cli.base import JsonOut, StorageOpts, Url, _Commands, _store, app, console, out
from ddiloco_cli.cli.runflags import settings_of, with_run_settings
from ddiloco_cli.errors import UsageError
from ddiloco_cli.protocol.runconfig import RunConfig

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
    from ddiloco_cli.ops.runinit import init_or_join
    from ddiloco_cli.cli.configfile import default_config_toml, load_config_file
    from ddiloco_cli.cli.render import traffic_line
    from ddiloco_cli.protocol import ledger
    from ddiloco_cli.protocol.signing import default_require_signatures, load_admin_key

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
    store = _store(url, storage_option)
    run, created = init_or_join(store, spec, force_clean=force_clean,
                                note=lambda line: console.print(line, highlight=False, soft_wrap=True), admin=admin)
    if json_out:
        out.print_json(json.dumps(run))
    elif not created:
        console.print(f"run {run['run_id']} exists at {url} with the same settings; nothing was changed",
                      highlight=False, soft_wrap=True)
    else:
        console.print(f"[green]created run {run['run_id']}[/] at {url}: P={spec.num_fragments} H={spec.sync_every} "
                      f"tau={spec.overlap_steps} K={spec.quorum} codec={spec.codec} mode={spec.mode}",
                      highlight=False, soft_wrap=True)
        console.print(traffic_line(spec, num_params=ledger.read_plan(store, run_id=run["run_id"]).total_numel()),
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
    from ddiloco_cli.protocol.signing import new_key

    signer = new_key(path)
    console.print(f"wrote private key {path} and public key {path}.pub", highlight=False, soft_wrap=True)
    out.print(signer.public_key)


@keys_app.command("list")
def keys_list(url: Url, json_out: JsonOut = False, storage_option: StorageOpts = None) -> None:
    """The run's admissions: id, role, key fingerprint, when admitted; and whether it requires signatures."""
    from ddiloco_cli.cli.render import render_admissions
    from ddiloco_cli.ops.admission import list_admissions
    from ddiloco_cli.protocol import ledger

    store = _store(url, storage_option)
    run = ledger.read_run(store)
    admissions = list_admissions(store, run=run)
    if json_out:
        out.print_json(json.dumps({"require_signatures": run.get("require_signatures") is True,
                                   "admissions": admissions}))
    else:
        out.print(render_admissions(run, admissions))


@app.command()
def admit(
    url: Url,
    member_id: Annotated[Optional[str], typer.Argument(
        metavar="ID", help="Learner id (or syncer name with --role syncer)", show_default=False)] = None,
    public_key: Annotated[Optional[str], typer.Argument(
        metavar="PUBKEY", help="Public key printed by `ddiloco keys new`", show_default=False)] = None,
    role: Annotated[str, typer.Option(metavar="learner|syncer", help="What the key may sign")] = "learner",
    from_file: Annotated[Optional[str], typer.Option(
        "--from-file", metavar="FILE", help="Admit a fleet: one `ID PUBKEY [learner|syncer]` per line "
        "(# comments), instead of ID PUBKEY")] = None,
    revoke: Annotated[bool, typer.Option("--revoke", metavar="", help="Remove ID's admission instead (no PUBKEY): its "
                                                                      "key stops being accepted within seconds")] = False,
    admin_key: Annotated[Optional[str], typer.Option(
        "--admin-key", metavar="PATH", envvar="DDILOCO_ADMIN_KEY", show_envvar=True,
        help="The run's admin key (default ~/.config/ddiloco/admin.pem)")] = None,
    storage_option: StorageOpts = None,
) -> None:
    """Let PUBKEY sign as ID in a run that requires signatures (re-admitting an id replaces its key);
    with --revoke, stop accepting ID's key."""
    from ddiloco_cli.ops.admission import parse_admissions_file
    from ddiloco_cli.protocol import ledger
    from ddiloco_cli.protocol.signing import admit as admit_key
    from ddiloco_cli.protocol.signing import load_admin_key, parse_public_key
    from ddiloco_cli.protocol.signing import revoke as revoke_key

    if revoke:
        if member_id is None or public_key is not None or from_file:
            raise UsageError("--revoke takes an ID and no PUBKEY or --from-file")
        store = _store(url, storage_option)
        revoke_key(store, run=ledger.read_run(store), member_id=member_id, admin=load_admin_key(admin_key, create=False))
        console.print(f"revoked {member_id}: its key is no longer accepted", highlight=False, soft_wrap=True)
        return
    if (from_file is None) == (member_id is None or public_key is None) or (from_file and member_id):
        raise UsageError("give ID PUBKEY, or --from-file FILE")
    # a typo fails before any key file or bucket is read
    members = parse_admissions_file(from_file) if from_file else [(member_id, parse_public_key(public_key), role)]
    store = _store(url, storage_option)
    run, admin = ledger.read_run(store), load_admin_key(admin_key, create=False)
    for mid, key, member_role in members:
        record = admit_key(store, run=run, member_id=mid, public_key=key, role=member_role, admin=admin)
        console.print(f"admitted {member_role} {mid} with key {record['public_key']}", highlight=False, soft_wrap=True)
