"""`ddiloco init`: the typed RunConfig, config files, and interrupted inits (plan.json
without run.json) that the same `init` resumes and `init --force-clean` removes (a real
kill -9 in the middle of writing version 0: tests/integration/test_init_processes.py)."""

from __future__ import annotations

import json

import pytest

from ddiloco_cli.errors import ProtocolError, UsageError
from ddiloco_cli.ops.observe import verify_run
from ddiloco_cli.ops.runinit import PENDING_RUN, init_run
from ddiloco_cli.protocol import layout, ledger, records
from ddiloco_cli.cli.configfile import default_config_toml, load_config_file
from ddiloco_cli.protocol.runconfig import RunConfig, flag, hyperparameters, setting_key
from ddiloco_cli.store import open_store

from support import REPO
from support.built_run import invoke

SMALL = ["--fragments", "2", "--sync-every", "4", "--overlap-steps", "1"]


# ------------------------------------------------------------------ RunConfig
def test_run_config_round_trips_through_run_json():
    config = RunConfig(num_fragments=3, sync_every=6, codec="int8", adam_betas=(0.8, 0.9), extra={"future_key": 1})
    assert (config.codec_block, config.publish_codec) == (256, "int8")  # defaults filled in once
    record = config.to_record(run_id="abc")
    records.validate(record, "run", where="test")
    back = RunConfig.from_record(json.loads(records.dumps(record)))
    assert back.differences(config) == [] and back.run_id == "abc" and back.extra == {"future_key": 1}
    with pytest.raises(AttributeError):
        back.quorum = 5  # frozen: validated once, never changed


def test_codec_qmax_defaults_to_3_for_int4_and_binds_only_its_own_codec():
    """--codec-qmax: 3 for int4 and int8's full range by default, written into run.json; a
    run.json written before the setting existed means the codec's full range; it bounds
    published deltas only when they use the run's codec."""
    assert [RunConfig(codec=c).codec_qmax for c in ("int4", "int8", "none", "bf16")] == [3, 127, None, None]
    assert RunConfig().to_record(run_id="r")["codec_qmax"] == 3
    for codec_name, full in (("int4", 7), ("int8", 127), ("none", None)):
        record = RunConfig(codec=codec_name).to_record(run_id="r")
        del record["codec_qmax"]
        assert RunConfig.from_record(record).codec_qmax == full
    record = RunConfig().to_record(run_id="r")
    del record["codec_qmax"], record["codec"]  # neither: int4, the default codec, over its whole range
    assert RunConfig.from_record(record).codec_qmax == 7
    bounded = RunConfig(codec_qmax=3)
    assert (bounded.codec_qmax, bounded.publish_qmax) == (3, 3)
    assert RunConfig(codec_qmax=3, publish_codec="int8").publish_qmax is None
    assert RunConfig.from_record(json.loads(records.dumps(bounded.to_record(run_id="r")))).codec_qmax == 3
    for bad in ({"codec": "none", "codec_qmax": 3}, {"codec": "int8", "codec_qmax": 128}):
        with pytest.raises(UsageError, match="--codec-qmax"):
            RunConfig(**bad)


def _read_as_before(record: dict, key: str) -> list[RunConfig]:
    """``record`` read back with ``key`` null, then absent: a run.json from before the setting."""
    out = []
    for old in (None, "absent"):
        if old is None:
            record[key] = None
        else:
            del record[key]
        out.append(RunConfig.from_record(record))
    return out


def test_sparse_published_deltas_default_to_twice_the_upload_density_and_old_runs_keep_theirs():
    """A new sparse run publishes at 2 x --codec-density (at most 1), written into run.json; a
    run.json without publish_density, or with null, means the uploads' density (PROTOCOL), so
    runs made before 0.2.3 publish as they did; a given value is kept."""
    assert RunConfig(codec="sparse").publish_density == 0.04
    assert RunConfig(codec="sparse", codec_density=0.7).publish_density == 1.0
    assert RunConfig(codec="sparse", publish_density=0.02).publish_density == 0.02
    assert RunConfig(codec="int4").publish_density is None
    record = RunConfig(codec="sparse", codec_density=0.05).to_record(run_id="r")
    assert record["publish_density"] == 0.1 and RunConfig.from_record(record).publish_density == 0.1
    assert [c.publish_density for c in _read_as_before(record, "publish_density")] == [0.05, 0.05]


def test_held_alpha_defaults_to_a_half_in_decoupled_runs_and_old_runs_keep_alpha():
    """A new decoupled run mixes a held version ([L8]) in with 0.5, written into run.json; a
    lockstep run never takes one (0); a run.json without held_alpha, or with null (runs before
    0.2.8), means the run's alpha, so those runs go on as they did; a given value is kept."""
    assert RunConfig().held_alpha == 0.5 and RunConfig(alpha=0.1).held_alpha == 0.5
    assert RunConfig(mode="lockstep").held_alpha == 0.0
    assert RunConfig(held_alpha=0.8).held_alpha == 0.8
    record = RunConfig(alpha=0.2).to_record(run_id="r")
    assert record["held_alpha"] == 0.5 and RunConfig.from_record(record).held_alpha == 0.5
    assert [c.held_alpha for c in _read_as_before(record, "held_alpha")] == [0.2, 0.2]
    with pytest.raises(UsageError, match="--held-alpha"):
        RunConfig(held_alpha=1.5)


@pytest.mark.parametrize("field,value", [("inner_lr", float("nan")), ("outer_lr", float("inf")), ("gc_grace_s", -5.0),
                                         ("quorum", 0), ("codec", "int3"), ("keep_overlap_progress", 1),
                                         ("codec_qmax", 8), ("codec_qmax", 0)])
def test_run_config_refuses_bad_values(field, value):
    with pytest.raises(UsageError):
        RunConfig(**{field: value})
    record = RunConfig().to_record(run_id="r")
    if field == "inner_lr":
        record["inner"]["lr"] = value
    else:
        record[field] = value
    with pytest.raises(ProtocolError, match="run.json"):  # the same checks on a record read from a bucket
        RunConfig.from_record(record)


def test_every_setting_is_an_init_flag_and_a_config_key():
    import tomllib
    import typer

    from ddiloco_cli.cli.app import app

    init = typer.main.get_command(app).commands["init"]
    by_name = {param.name: param for param in init.params}
    printed = tomllib.loads(default_config_toml())
    for f in hyperparameters():
        param = by_name[setting_key(f)]  # init reads its settings back by these names
        assert f"--{flag(f)}" in param.opts
        if f.default is not None:  # a default that depends on other settings is printed commented out
            assert flag(f) in printed, f.name


def test_config_file_with_flag_overrides(tmp_path):
    defaults = tmp_path / "defaults.toml"
    result = invoke("init", "--print-config")
    assert result.exit_code == 0
    defaults.write_text(result.output)
    assert RunConfig.from_flags(load_config_file(str(defaults))).differences(RunConfig()) == []
    # a setting whose default depends on others is a comment saying what it becomes (its own words)
    assert "# keyframe-rule =   (default: size with sparse published deltas, every otherwise)" in result.output
    assert "# max-tokens-per-step =   (default: none: no bound)" in result.output

    cfg = tmp_path / "run.toml"
    cfg.write_text('fragments = 2\nsync-every = 4\noverlap_steps = 1\ncodec = "int8"\ninner-lr = 0.002\n'
                   "adam-betas = [0.8, 0.9]\nkeep-overlap-progress = false\n")
    result = invoke("init", str(tmp_path / "run"), "--config", str(cfg), "--inner-lr", "0.005", "--json")
    assert result.exit_code == 0, result.output
    run = ledger.read_run(open_store(str(tmp_path / "run")))
    assert run["num_fragments"] == 2 and run["codec"] == "int8" and run["keep_overlap_progress"] is False
    assert run["inner"]["lr"] == 0.005 and run["inner"]["betas"] == [0.8, 0.9]  # the flag wins over the file

    yml = tmp_path / "run.yaml"
    yml.write_text("fragments: 2\nsync-every: 4\noverlap-steps: 1\nquorum: 2\n")
    result = invoke("init", str(tmp_path / "run2"), "--config", str(yml))
    assert result.exit_code == 0, result.output
    assert ledger.read_run(open_store(str(tmp_path / "run2")))["quorum"] == 2


@pytest.mark.parametrize("text,needle", [("bogus = 1\n", "unknown setting 'bogus'"), ("fragments = \n", "not valid TOML"),
                                         ('codec = "int3"\n', "--codec"), ("gc-grace = -1\n", "--gc-grace")])
def test_bad_config_files_are_usage_errors(tmp_path, text, needle):
    cfg = tmp_path / "bad.toml"
    cfg.write_text(text)
    result = invoke("init", str(tmp_path / "run"), "--config", str(cfg))
    assert result.exit_code == 2 and needle in result.output, result.output
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------ interrupted init
def _half_made(url: str, **spec) -> dict:
    """What an init killed after its plan and one version 0 leaves: plan.json (with the
    run.json it meant to write), fragment 0's version 0, no run.json."""
    store = open_store(url)
    init_run(store, RunConfig(**spec))
    run = ledger.read_run(store)
    for info in store.list(layout.fragment_prefix(1)):
        store.delete(info.key)
    store.delete(layout.RUN_CONFIG)
    return run


def test_sync_and_status_call_a_half_made_run_no_run(tmp_path):
    url = str(tmp_path / "run")
    _half_made(url, num_fragments=2, sync_every=4)
    for command in ("status", "inspect", "gc"):
        result = invoke(command, url)
        assert result.exit_code == 3 and "no ddiloco run" in result.output


def test_init_resumes_a_half_made_run_with_the_same_config(tmp_path):
    url = str(tmp_path / "run")
    run = _half_made(url, num_fragments=2, sync_every=4, overlap_steps=1)
    result = invoke("init", url, *SMALL)
    assert result.exit_code == 0, result.output
    assert "resuming the init of run" in result.output
    resumed = ledger.read_run(open_store(url))
    assert resumed["run_id"] == run["run_id"]
    assert verify_run(open_store(url)) == []


def test_init_with_another_config_says_how_to_recover(tmp_path):
    url = str(tmp_path / "run")
    _half_made(url, num_fragments=2, sync_every=4, overlap_steps=1)
    result = invoke("init", url, *SMALL, "--inner-lr", "0.01")
    assert result.exit_code == 2
    assert "interrupted init of another config" in result.output and "--inner-lr: 0.001 there, 0.01 here" in result.output
    assert "--force-clean" in result.output
    assert not ledger.run_exists(open_store(url))  # nothing changed

    result = invoke("init", url, *SMALL, "--inner-lr", "0.01", "--force-clean")
    assert result.exit_code == 0, result.output
    assert "removed an interrupted init" in result.output
    store = open_store(url)
    assert ledger.read_run(store)["inner"]["lr"] == 0.01 and verify_run(store) == []


def test_a_plan_without_its_pending_config_can_only_be_cleaned(tmp_path):
    url = str(tmp_path / "run")
    _half_made(url, num_fragments=2, sync_every=4, overlap_steps=1)
    store = open_store(url)
    plan = records.loads(store.get(layout.PLAN), "plan", where="plan")
    del plan[PENDING_RUN]  # as written by an older ddiloco
    store.put(layout.PLAN, records.dumps(plan))
    result = invoke("init", url, *SMALL)
    assert result.exit_code == 2 and "--force-clean" in result.output
    assert invoke("init", url, *SMALL, "--force-clean").exit_code == 0


def test_force_clean_never_removes_a_run(tmp_path):
    url = str(tmp_path / "run")
    assert invoke("init", url, *SMALL).exit_code == 0
    result = invoke("init", url, *SMALL, "--force-clean")
    assert result.exit_code == 2 and "a run already exists" in result.output
    assert verify_run(open_store(url)) == []


def test_identical_init_joins_the_run_and_another_config_is_refused(tmp_path):
    """Issue 26 item 12 (in one process; the concurrent case: test_init_processes.py)."""
    url = str(tmp_path / "run")
    first = invoke("init", url, *SMALL, "--json")
    assert first.exit_code == 0, first.output
    again = invoke("init", url, *SMALL)
    run_id = ledger.read_run(open_store(url))["run_id"]
    assert again.exit_code == 0 and f"run {run_id} exists at {url} with the same settings" in again.output
    other = invoke("init", url, *SMALL, "--quorum", "2")
    assert other.exit_code == 2 and "a run already exists" in other.output and "--quorum" in other.output
    assert ledger.read_run(open_store(url))["run_id"] == run_id and verify_run(open_store(url)) == []


def test_init_that_finds_the_run_made_after_it_looked_joins_it(tmp_path, monkeypatch):
    """The race the concurrent test hit on S3: the run.json appears between init's look and
    its create_run (a faster identical init finished): that init joins, not fails."""
    from ddiloco_cli.ops import runinit

    url = str(tmp_path / "run")
    spec = RunConfig(num_fragments=2, sync_every=4, overlap_steps=1)
    made = init_run(open_store(url), spec)
    looks = []
    real = runinit._existing_run
    monkeypatch.setattr(runinit, "_existing_run", lambda store: None if not looks.append(1) and len(looks) == 1
                        else real(store))
    run, created = runinit.init_or_join(open_store(url), spec)
    assert run["run_id"] == made["run_id"] and not created and len(looks) == 2


def test_wait_for_run_backs_off_then_gives_up():
    from ddiloco_cli.protocol.ledger import RunNotFoundError
    from ddiloco_cli.protocol.runconfig import wait_for_run_config

    store = open_store("memory://wait-for-run-backoff")
    slept: list[float] = []
    with pytest.raises(RunNotFoundError):
        wait_for_run_config(store, timeout_s=0.0, sleep=slept.append)
    assert slept == []
    waits: list[float] = []

    def sleep(s: float) -> None:
        slept.append(s)
        if len(slept) == 6:
            init_run(store, RunConfig(num_fragments=2, sync_every=4))

    config = wait_for_run_config(store, timeout_s=float("inf"), sleep=sleep, on_wait=waits.append)
    assert config.num_fragments == 2
    assert slept == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0] and len(waits) == 6


def test_version_flag():
    from ddiloco_cli import __version__

    result = invoke("--version")
    from ddiloco_cli.numerics import native

    assert result.exit_code == 0 and result.output.splitlines() == [f"ddiloco {__version__}", native.describe()]


def test_init_says_what_a_learner_moves_per_cycle(tmp_path):
    """`init` prints the traffic per learner and cycle from the measured bytes per parameter
    of the run's codecs, and the link that carries it at 1 s per step; past 100 Mbps with a
    dense codec it points to the sparse codec."""
    from ddiloco_cli.cli.render import traffic_line
    from ddiloco_cli.ops.runfigures import MEASURED_B_PER_PARAM, traffic_per_cycle

    url = str(tmp_path / "run")
    result = invoke("init", url, *SMALL)
    assert result.exit_code == 0, result.output
    run = ledger.read_run(open_store(url))
    n = ledger.read_plan(open_store(url), run_id=run["run_id"]).total_numel()
    up = MEASURED_B_PER_PARAM["int4"][0] * n
    assert f"traffic per learner: about {up / 1e3:.1f} kB up" in " ".join(result.output.split())
    t = traffic_per_cycle(codec="int4", publish_codec="int4", codec_qmax=3, codec_density=None, publish_density=None,
                          num_params=10**9, sync_every=24)
    assert t["mbps_at_1s"] == pytest.approx(0.348e9 * 8 / 24 / 1e6)
    config = RunConfig.from_record(run)
    assert "--codec sparse" in traffic_line(config, num_params=10**9)  # 116 Mbps at 1 s per step
    assert "--codec sparse" not in traffic_line(config, num_params=10**8)
    sparse = traffic_per_cycle(codec="sparse", publish_codec="sparse", codec_qmax=None, codec_density=0.04,
                               publish_density=0.08, num_params=10**9, sync_every=24)
    assert (sparse["up_b_per_param"], sparse["down_b_per_param"]) == pytest.approx((0.060, 0.094))  # 2x the measured densities


@pytest.mark.parametrize("path", sorted((REPO / "examples" / "configs").glob("*.toml")), ids=lambda p: p.name)
def test_the_example_configs_make_runs(tmp_path, path):
    """Every `init --config` example in examples/configs makes a run with the settings it names."""
    result = invoke("init", str(tmp_path / "run"), "--config", str(path), "--json")
    assert result.exit_code == 0, result.output
    made = RunConfig.from_record(json.loads(result.output))
    assert made.differences(RunConfig.from_flags(load_config_file(str(path)))) == []
    if path.name == "thin-link.toml":  # what that example is for
        assert made.codec == "sparse" and made.keyframe_rule == "size" and made.overlap_steps == 8
