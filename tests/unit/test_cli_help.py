"""The command line's help and usage errors (issue 26 item 10): proper metavars, whole
sentences in the command list, learn's options grouped, completion on, and one error
style (``error: ...`` on one line) for click's usage errors as for ours."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from ddiloco_cli.cli.app import app

REPO = Path(__file__).resolve().parents[2]


def _run(*args: str, **env: str):
    return CliRunner().invoke(app, list(args), prog_name="ddiloco", env={"COLUMNS": "200", **env})


def test_usage_shows_plain_metavars():
    text = _run("status", "--help").output
    assert "Usage: ddiloco status [OPTIONS] URL" in text, text
    assert "{URL}" not in text and "<str>" not in text
    assert "ddiloco export [OPTIONS] URL [OUT.safetensors]" in _run("export", "--help").output


def test_command_summaries_are_whole_sentences():
    text = _run("--help").output
    line = next(line for line in text.splitlines() if " export " in line)
    assert "metadata), or with" in line, "one summary is one wrapped paragraph, not the docstring's lines"


def test_learn_options_are_grouped():
    text = _run("learn", "--help").output
    for panel in ("Learner", "Data", "Bucket", "Logging"):
        assert f"─ {panel} ─" in text, panel
    assert text.index("─ Data ─") < text.index("--shard") < text.index("─ Bucket ─") < text.index("--wait-for-run")


def test_completion_is_on():
    assert "--show-completion" in _run("--help").output
    env = {**os.environ, "PYTHONPATH": str(REPO), "_DDILOCO_COMPLETE": "complete_bash",
           "COMP_WORDS": "ddiloco sta", "COMP_CWORD": "1"}
    done = subprocess.run([sys.executable, "-c", "import sys; sys.argv[0] = 'ddiloco'; "
                           "from ddiloco_cli.cli.base import main; main()"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert "status" in done.stdout.split(), (done.stdout, done.stderr)


def test_click_usage_errors_are_one_error_line():
    for args, needle in ((["status"], "Missing argument 'URL'"), (["status", "x", "--bogus"], "No such option: --bogus"),
                         (["bogus"], "No such command 'bogus'")):
        result = _run(*args)
        assert result.exit_code == 2, result.output
        assert result.output.startswith(f"error: {needle}") and result.output.count("\n") == 1, result.output
        assert "╭" not in result.output and "--help" in result.output
