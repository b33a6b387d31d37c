"""Settings retired in 0.2.0 (PROTOCOL.md "Retired settings"): a run.json naming a retired
value is refused with the version that still runs it; the retired keys' surviving values
are read and dropped; the flags are gone."""

from __future__ import annotations

import pytest

from ddiloco_cli.errors import ProtocolError, UsageError
from ddiloco_cli.protocol.runconfig import LAST_VERSION_WITH_RETIRED, RETIRED_VALUES, RunConfig


def _record(**fields):
    rec = RunConfig().to_record(run_id="r")
    rec.update(fields)
    return rec


@pytest.mark.parametrize("key,value", [(k, v) for k, vs in RETIRED_VALUES.items() for v in vs])
def test_a_run_naming_a_retired_value_is_refused_with_the_version_that_runs_it(key, value):
    with pytest.raises(ProtocolError) as err:
        RunConfig.from_record(_record(**{key: value}), where="b/run.json")
    message = str(err.value)
    assert key in message and f"ddiloco=={LAST_VERSION_WITH_RETIRED}" in message and message.startswith("b/run.json")


def test_the_surviving_values_of_retired_keys_are_read_and_dropped():
    config = RunConfig.from_record(_record(outer_gradient="current", await_own_merge=True, outer_lr_scaling="none"))
    assert config.outer_lr_scaling == "none"
    assert "outer_gradient" not in config.extra and "await_own_merge" not in config.extra
    assert "outer_gradient" not in config.to_record(run_id="r")


@pytest.mark.parametrize("flag", ["outer-gradient", "await-own-merge"])
def test_retired_settings_are_no_longer_flags(flag):
    with pytest.raises(UsageError, match="unknown setting"):
        RunConfig.from_flags({flag: "current" if flag == "outer-gradient" else True})
    with pytest.raises(UsageError, match="--outer-lr-scaling"):
        RunConfig.from_flags({"outer-lr-scaling": "cycle"})
