"""The `ddiloco` command line's base: the Typer app, the options several commands share,
the one error style, and ``main`` (the console script), which imports only the module of
the command it runs: `ddiloco --version`, `status`, `inspect`, `keys` and `admit` never
import torch (a monitor runs `status --check` every few seconds).

A new command is one ``@app.command()`` function in the command module it belongs to
(``COMMAND_MODULES`` names each command's module), taking the shared ``Url`` /
``StorageOpts`` / ``JsonOut`` options and calling one library function; errors it
should report are ``DdilocoError`` subclasses (``UsageError`` for bad flags), which
``_Commands`` turns into one line and an exit code. Set DDILOCO_TRACEBACK=1 to see full
tracebacks instead.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import math
import os
import sys
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape  # messages quote bucket content: never read it as markup
from typer._click.exceptions import ClickException
from typer.core import TyperArgument, TyperGroup

from ddiloco_cli.errors import DdilocoError, StoreUnavailableError
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
            _fail(f"the bucket kept failing after retries: {exc}", StoreUnavailableError.exit_code)
        except KeyboardInterrupt:
            console.print("interrupted")
            raise typer.Exit(130) from None

    # --help is a flag: show no "<bool>" value placeholder for it (Typer's own option
    # has no metavar), here and in every command
    def get_help_option(self, ctx: typer.Context):  # type: ignore[override]
        return _flag(super().get_help_option(ctx))

    def get_params(self, ctx: typer.Context):  # type: ignore[override]
        params = super().get_params(ctx)
        for param in params:  # --install-completion / --show-completion are flags too
            if getattr(param, "is_flag", False) and param.metavar is None:
                param.metavar = ""
        return params

    def get_command(self, ctx: typer.Context, cmd_name: str):  # type: ignore[override]
        command = super().get_command(ctx, cmd_name)
        if command is not None:
            _flag(command.get_help_option(ctx))
            _tidy(command)
        return command

    def main(self, *args, standalone_mode: bool = True, **kwargs):  # type: ignore[override]
        """Click's usage errors (a missing argument, an unknown option) in the same one-line
        ``error:`` style as ours, exit code 2, instead of Typer's boxed panel."""
        if not standalone_mode:
            return super().main(*args, standalone_mode=False, **kwargs)
        try:
            rv = super().main(*args, standalone_mode=False, **kwargs)
        except ClickException as exc:
            _usage_error(exc)
        except typer.Abort:
            console.print("aborted")
            sys.exit(1)
        sys.exit(rv if isinstance(rv, int) else 0)


def _usage_error(exc: ClickException) -> None:
    if type(exc).__name__ != "NoArgsIsHelpError":  # that one has shown the help already
        ctx = getattr(exc, "ctx", None)
        where = f"{ctx.command_path} --help" if ctx is not None else "ddiloco --help"
        console.print(f"[bold red]error:[/] {escape(exc.format_message())} (see `{escape(where)}`)",
                      highlight=False, soft_wrap=True)
    sys.exit(exc.exit_code)


def help_panels(panels: dict[str, list[str]]):
    """Group a command's options in its --help: ``{"Panel": ["param_name", ...]}``."""
    def mark(fn):
        fn.help_panels = {name: panel for panel, names in panels.items() for name in names}
        return fn

    return mark


def _tidy(command) -> None:
    """Help as the tools users know it: a command's summary on whole lines (Rich keeps a
    docstring's line breaks), arguments as ``URL`` / ``[OUT]`` in the usage line and
    without a ``<str>`` type, options grouped by the command's ``help_panels``."""
    if command.help and not command.short_help:
        command.short_help = " ".join(inspect.cleandoc(command.help).split("\n\n")[0].split())
    panels = getattr(command.callback, "help_panels", {})
    for param in command.params:
        if isinstance(param, TyperArgument):
            name = param.display_name_raw if param.required else f"[{param.display_name_raw}]"
            param._usage_display_name = lambda name=name, many=param.nargs != 1: name + ("..." if many else "")
            param.display_type_rich = lambda ctx: None
        if param.name in panels:
            param.rich_help_panel = panels[param.name]


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
    add_completion=True,
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
TaskOverride = Annotated[Optional[str], typer.Option(
    metavar="MODULE:OBJECT", help="This machine's task, module:object or path/to/file.py:object (default: the "
                                  "module run.json names); its source must match the run's")]


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
        from ddiloco_cli.numerics import native  # (imports neither numpy nor torch)

        typer.echo(f"ddiloco {_installed_version()}\n{native.describe()}")
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
    quiet_libraries()


def _store(url: str, opts: list[str] | None):
    from ddiloco_cli.store import open_store, parse_storage_options

    return open_store(url, options=parse_storage_options(opts or []))


def _setup_logging(verbose: bool) -> None:
    """Log lines to stderr (Rich on a terminal). Under torchrun, ranks other than 0 log
    warnings and errors only, so an island's lines are not repeated per rank."""
    level = logging.DEBUG if verbose else logging.INFO
    if os.environ.get("RANK", "0") not in ("", "0") and not verbose:
        level = logging.WARNING
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
    quiet_libraries()
    logging.getLogger(RETRY_LOGGER).setLevel(logging.NOTSET)  # a long-running process shows its retries


RETRY_LOGGER = "ddiloco_cli.store.retry"


def quiet_libraries() -> None:
    """The storage libraries' own loggers to warnings and above, gcsfs's off (it logs a
    traceback per exhausted retry), and the store's retry notes off until a command sets
    up logging (``_setup_logging``: learn, sync): a one-shot command (status, inspect, ...)
    that fails on the bucket prints one line on every backend, the error ddiloco reports.
    Every command runs this first (``_main``)."""
    logging.getLogger(RETRY_LOGGER).setLevel(logging.ERROR)
    for noisy in ("botocore", "s3fs", "aiobotocore", "urllib3", "fsspec", "google", "aiohttp"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    logging.getLogger("gcsfs").setLevel(logging.CRITICAL)


# each command's module: `main` imports only the one it runs (all of them for help and completion)
COMMAND_MODULES = {
    "init": "setup_commands", "keys": "setup_commands", "admit": "setup_commands",
    "learn": "train_commands", "sync": "train_commands",
    "status": "observe_commands", "inspect": "observe_commands", "gc": "observe_commands", "export": "observe_commands",
    "eval": "observe_commands", "metrics": "observe_commands", "plot": "observe_commands",
    "demo": "tool_commands", "simulate": "tool_commands",
}
ALL_MODULES = ("setup_commands", "train_commands", "observe_commands", "tool_commands")  # in the order help lists them


def load_commands(argv: list[str]) -> None:
    """Import the command modules ``argv`` (the arguments after the program name) needs:
    the one of its command, or every one when it names none (help, --version's neighbours,
    an unknown command: the usage error lists them all) or when the shell asks to complete."""
    command = next((a for a in argv if not a.startswith("-")), None)
    completing = any(k.startswith("_DDILOCO") and k.endswith("_COMPLETE") for k in os.environ)
    wanted = [COMMAND_MODULES[command]] if command in COMMAND_MODULES and not completing else ALL_MODULES
    if "--version" in argv and command is None:
        wanted = []  # the eager --version callback needs no command
    for name in wanted:
        importlib.import_module(f"ddiloco_cli.cli.{name}")


def main() -> None:
    """The `ddiloco` console script."""
    load_commands(sys.argv[1:])
    app()


__all__ = ["app", "console", "main", "out"]
