"""Live terminal views for the long-running commands (CLI layer only).

On a terminal, learner and syncer show one Rich status line that updates in
place; otherwise they log plain lines through ``logging``.
"""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager
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


def learner_view(console: Console, learner_id: str):
    return _status_line(console, lambda p: (
        f"[bold]{learner_id}[/] step {p['step']} loss {p['loss']:.3f} "
        f"{p['tokens'] / max(p['step'], 1) / max(p['step_time_s'], 1e-9):,.0f} tok/s "
        f"up {p['bytes_up'] / 1e6:.1f} MB down {p['bytes_down'] / 1e6:.1f} MB fragments {_versions(p['versions'])}"
    ))


def syncer_view(console: Console):
    return _status_line(console, lambda p: (
        f"[bold]syncer[/] epoch {p['epoch']} merges {p['num_merges']} fragments {_versions(p['versions'])} "
        f"quorum {max(p['quorum_sizes'].values(), default=0)} live learners {p['live_learners']} "
        f"quarantined {p['num_quarantined']}"
    ))
