"""`ddiloco init --config FILE`: a TOML or YAML file of run settings (keys are init's flag
names), and the defaults written as one (`init --print-config`)."""

from __future__ import annotations

import json
from typing import Any

from ddiloco_cli.errors import UsageError
from ddiloco_cli.protocol.runconfig import PANELS, RunConfig, flag, hyperparameters, setting_key


def load_config_file(path: str) -> dict[str, Any]:
    """{flag: value} from a TOML (``.toml``) or YAML (``.yaml``/``.yml``, needs PyYAML)
    file whose keys are init's flag names (``sync-every`` or ``sync_every``).
    UsageError on a missing file, a parse error or an unknown key."""
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as exc:
        raise UsageError(f"--config {path}: {exc.strerror or exc}") from None
    try:
        if path.endswith((".yaml", ".yml")):
            try:
                import yaml
            except ImportError:
                raise UsageError(f"--config {path}: YAML needs PyYAML (pip install 'ddiloco[yaml]'); "
                                 "or use a .toml file") from None
            parsed = yaml.safe_load(data.decode("utf-8")) or {}
        else:
            parsed = _tomllib().loads(data.decode("utf-8"))
    except UsageError:
        raise
    except Exception as exc:  # noqa: BLE001 - every parser error is the user's file
        raise UsageError(f"--config {path}: not valid {'YAML' if path.endswith(('.yaml', '.yml')) else 'TOML'}: "
                         f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
    if not isinstance(parsed, dict):
        raise UsageError(f"--config {path}: expected a table of settings, e.g. sync-every = 24")
    known = {setting_key(f) for f in hyperparameters()}
    for key in parsed:
        if not isinstance(key, str) or key.replace("-", "_") not in known:
            raise UsageError(f"--config {path}: unknown setting {key!r}; `ddiloco init --print-config` lists them")
    return {k.replace("-", "_"): v for k, v in parsed.items()}


def _tomllib() -> Any:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    return tomllib


# What a setting left unset becomes, for those whose default depends on other settings
DEPENDENT_DEFAULTS = {
    "publish_codec": "the run's codec; lockstep: none", "merge": "rda; lockstep: mean",
    "keep_overlap_progress": "true; lockstep: false", "outer_lr_scaling": "participation; lockstep: none",
    "codec_block": "64 for int4, 256 for int8, 1024 for sparse",
    "codec_qmax": "3 for int4, 127 for int8 (the codec's largest: 7, 127)",
    "codec_density": "0.02 for sparse", "publish_density": "2 x --codec-density",
    "keyframe_every": "8; 64 with sparse published deltas",
    "keyframe_rule": "size with sparse published deltas, every otherwise",
    "error_feedback_decay": "0.9 for sparse, 1 otherwise", "max_tokens_per_step": "none: no bound",
    "alpha": "0.3; lockstep: 0", "held_alpha": "0.5; lockstep: 0", "outer_lr": "0.7; sparse: 2.5", "outer_momentum": "0.9; sparse: 0",
}


def default_config_toml() -> str:
    """The defaults as a TOML config file for ``init --config``, grouped by panel."""
    lines = ["# ddiloco init --config FILE: every key is a flag of `ddiloco init`; flags given on",
             "# the command line override the file."]
    defaults = RunConfig.__dataclass_fields__
    for panel in PANELS:
        lines += ["", f"# -- {panel} --"]
        for f in hyperparameters():
            if f.metadata["panel"] != panel:
                continue
            value = defaults[f.name].default
            if value is None:
                note = DEPENDENT_DEFAULTS[f.name]  # every setting whose default depends on others has a line
                lines.append(f"# {flag(f)} =   (default: {note})")
            else:
                lines.append(f"{flag(f)} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    return repr(value)


__all__ = ["load_config_file", "default_config_toml"]
