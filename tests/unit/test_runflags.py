"""Each run setting is declared once (a RunConfig field); `ddiloco init`'s options are made
from the fields, so every field is an option with its flag, default and help."""

from __future__ import annotations

import typing

from ddiloco_cli.cli.runflags import run_setting_options
from ddiloco_cli.protocol.runconfig import RunConfig, hyperparameters, setting_key


def test_every_setting_is_one_option_with_its_flag_default_and_help():
    options = {p.name: p for p in run_setting_options()}
    assert list(options) == [setting_key(f) for f in hyperparameters()]
    defaults = RunConfig()
    for f in hyperparameters():
        p = options[setting_key(f)]
        info = typing.get_args(p.annotation)[1]
        assert f.metadata["help"], f.name
        assert info.default.split("/")[0] == f"--{f.metadata['flag']}"  # Option's first name (its `default`)
        default = p.default.value if hasattr(p.default, "value") else p.default
        if f.metadata["kind"] is tuple:
            default = tuple(float(x) for x in default.split(","))
        if not f.metadata["optional"]:
            assert default == getattr(defaults, f.name), f.name


def test_init_takes_a_setting_from_its_generated_option(tmp_path):
    from typer.testing import CliRunner

    from ddiloco_cli.cli.app import app
    from ddiloco_cli.protocol.runconfig import read_run_config
    from ddiloco_cli.store import open_store

    url = str(tmp_path / "run")
    result = CliRunner().invoke(app, ["init", url, "-H", "12", "--fragments", "3", "--discard-overlap-progress",
                                      "--adam-betas", "0.8,0.9", "--codec", "int8", "--task", "support.runs:TinyTask"])
    assert result.exit_code == 0, result.output
    config = read_run_config(open_store(url))
    assert (config.sync_every, config.num_fragments, config.keep_overlap_progress, config.adam_betas, config.codec) \
        == (12, 3, False, (0.8, 0.9), "int8")
