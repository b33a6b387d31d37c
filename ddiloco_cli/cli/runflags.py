"""`ddiloco init`'s run-setting options, made from ``RunConfig``'s fields.

Each run setting is declared once, as a ``RunConfig`` field whose metadata holds its flag,
panel, range, help text and metavar (``runconfig._spec``). ``with_run_settings`` appends
one Typer option per field to a command's signature, in the fields' order, so the command
line, ``init --config`` files, ``--print-config`` and run.json cannot drift apart. The
command receives them as keyword arguments named ``setting_key(field)``.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Annotated, Any, Callable, Optional

import typer

from ddiloco_cli.protocol.runconfig import hyperparameters, setting_key


def _option(f: dataclasses.Field) -> inspect.Parameter:
    """The Typer option of one run setting."""
    m = f.metadata
    decls = [f"--{m['flag']}/--{m['off']}" if m["off"] else f"--{m['flag']}"] + ([m["short"]] if m["short"] else [])
    default: Any = f.default
    if m["kind"] is tuple:
        kind: Any = str
        default = ",".join(map(str, default))
    elif m["choices"] is not None:
        kind = m["choices"]
        default = None if default is None else kind(default)
    else:
        kind = m["kind"]
    if m["optional"]:
        kind = Optional[kind]
    option = typer.Option(*decls, metavar="" if m["kind"] is bool else m["metavar"], help=m["help"],
                          rich_help_panel=m["panel"])
    return inspect.Parameter(setting_key(f), inspect.Parameter.KEYWORD_ONLY, default=default,
                             annotation=Annotated[kind, option])


def run_setting_options() -> list[inspect.Parameter]:
    return [_option(f) for f in hyperparameters()]


def with_run_settings(*, before: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Insert the run-setting options into the decorated command's signature just before its
    parameter ``before``; the command takes them through ``**settings``."""
    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        sig = inspect.signature(fn, eval_str=True)
        params = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
        names = [p.name for p in params]
        at = names.index(before)
        head = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) if i >= at else p for i, p in enumerate(params)]
        fn.__signature__ = sig.replace(parameters=head[:at] + run_setting_options() + head[at:])  # type: ignore[attr-defined]
        return fn
    return decorate


def settings_of(values: dict[str, Any]) -> dict[str, Any]:
    """The run settings among a command's parameters (by ``setting_key``)."""
    keys = {setting_key(f) for f in hyperparameters()}
    return {k: v for k, v in values.items() if k in keys}

