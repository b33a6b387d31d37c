"""What the hostile-input tests share: a JSON nesting bomb, the CLI's real entry point
run in-process, and the check that its output is one clean error line."""

from __future__ import annotations

import logging
import sys

from ddiloco_cli.cli import app as cli

DEEP = 100_000  # far beyond Python's recursion limit


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def run_cli(monkeypatch, capsys, *args: str) -> tuple[int, str]:
    """Run the CLI's real entry point in-process: (exit code, stdout + stderr). An
    exception other than the clean exit propagates and fails the test with its traceback."""
    monkeypatch.setattr(sys, "argv", ["ddiloco", *args])
    monkeypatch.delenv("DDILOCO_TRACEBACK", raising=False)
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level  # the CLI points logging at this test's captured stderr
    try:
        cli.main()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        root.handlers[:], root.level = handlers, level
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def one_error(output: str, *, naming: str) -> bool:
    """One `error:` message (rich may wrap it over lines) that names ``naming``, no traceback."""
    squeezed = "".join(output.split())
    return output.count("error:") == 1 and naming in squeezed and "Traceback" not in output
