"""The whole `ddiloco` command line. The commands live in setup_commands.py,
train_commands.py, observe_commands.py and tool_commands.py, on base.py's app. ``main`` (the console script) loads
only the command it runs; ``app`` here (for tests) has every command loaded."""

from __future__ import annotations

from typing import Any

from ddiloco_cli.cli.base import ALL_MODULES, load_commands, main


def __getattr__(name: str) -> Any:
    if name == "app":  # every command, in help order
        from ddiloco_cli.cli.base import app

        load_commands([])
        return app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["ALL_MODULES", "app", "main"]


if __name__ == "__main__":
    main()
