"""Live terminal views for the long-running commands (CLI layer only).

On a terminal, the learner shows a Rich progress bar and the syncer one Rich status
line, updated in place; otherwise they log plain lines through ``logging``.
"""

from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, Iterator

from rich.console import Console

Progress = Callable[[dict[str, Any]], None]


@contextmanager
def _status_line(console: Console, format_line: Callable[[dict[str, Any]], str]) -> Iterator[Progress | None]:
    if not sys.stderr.isatty():
        yield None
        return
    last = [0.0]
    with console.status("starting...") as status:
        def update(progress: dict[str, Any]) -> None:
            now = time.monotonic()
            if now - last[0] >= 0.25:
                last[0] = now
                status.update(format_line(progress))

        yield update


def _versions(versions: dict) -> str:
    if not versions:
        return "-"
    vs = list(versions.values())
    return f"v{min(vs)}..{max(vs)}" if len(set(vs)) > 1 else f"v{vs[0]}"


def learner_view(console: Console, learner_id: str, *, session_steps: int | None = None, total_steps: int = 0,
                 live: bool | None = None):
    """On a terminal (``live``; default: stderr is one), a Rich progress bar: step/total,
    tokens/s, loss, bytes and the ETA; the total is this session's end (``--steps``) or
    the run's ``total_steps`` (none: no bar length, no ETA). Off a terminal: None (the
    learner logs plain lines)."""
    if live is None:  # under torchrun only rank 0 draws
        live = sys.stderr.isatty() and os.environ.get("RANK", "0") in ("", "0")
    if not live:
        return nullcontext(None)
    return _learner_bar(console, learner_id, session_steps=session_steps, total_steps=total_steps)


@contextmanager
def _learner_bar(console: Console, learner_id: str, *, session_steps: int | None, total_steps: int):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("{task.fields[info]}"), console=console, transient=False)
    task_id, last = None, [0.0]
    with bar:
        def update(p: dict[str, Any]) -> None:
            nonlocal task_id
            step = p["step"]
            if task_id is None:  # the first step of this session fixes where it ends
                total = step - 1 + session_steps if session_steps else (total_steps or None)
                task_id = bar.add_task(learner_id, total=total, completed=step, info="starting...")
            now = time.monotonic()
            if now - last[0] < 0.25:
                return
            last[0] = now
            total = bar.tasks[task_id].total
            tok_s = p["tokens"] / max(step, 1) / max(p["step_time_s"], 1e-9)
            eta = f" ETA {_duration((total - step) * p['step_time_s'])}" if total else ""
            loss = "-" if p["loss"] is None else f"{p['loss']:.3f}"
            share = p.get("ddiloco_share")
            cost = "" if share is None else f" ddiloco {share:.1%}"
            bar.update(task_id, completed=step, info=(
                f"{tok_s:,.0f} tok/s loss {loss} up {p['bytes_up'] / 1e6:.1f} MB "
                f"down {p['bytes_down'] / 1e6:.1f} MB{cost} fragments {_versions(p['versions'])}{eta}"))

        yield update


def _duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    h, rest = divmod(seconds, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}"


def syncer_view(console: Console):
    return _status_line(console, lambda p: (
        f"[bold]syncer[/] epoch {p['epoch']} merges {p['num_merges']} fragments {_versions(p['versions'])} "
        f"quorum {max(p['quorum_sizes'].values(), default=0)} live learners {p['live_learners']} "
        f"quarantined {p['num_quarantined']}"
    ))
