"""Every command's user errors: the exit code, one clean line (or click's usage box),
never a traceback, and nothing written to the bucket by a refused `init`.

Exit codes: 2 usage (bad flags, bad settings), 3 the bucket or the run is not there.
"""

from __future__ import annotations

import os

import pytest

from ddiloco_cli.errors import UsageError
from ddiloco_cli.protocol.fragspec import MAX_FRAGMENTS, format_fragment_spec, parse_fragment_spec

from support.built_run import build_run, invoke


@pytest.fixture(scope="module")
def run_url(tmp_path_factory) -> str:
    return build_run(str(tmp_path_factory.mktemp("errors") / "run"), rounds=1).url


def _assert_clean(result, exit_code: int, needle: str) -> None:
    assert result.exit_code == exit_code, (result.output, result.exception)
    assert isinstance(result.exception, SystemExit), f"traceback: {result.exception!r}"
    assert "Traceback" not in result.output
    assert needle in result.output, result.output
    if result.output.startswith("error:"):  # our own errors: exactly one line
        assert result.output.count("\n") == 1, result.output


# (args, exit code, text the message must contain); RUN is replaced by a real run's URL,
# NEW by a fresh directory, DIR by an existing directory
CASES = [
    # init: every setting is validated before anything is written
    (["init", "NEW", "--inner-lr", "nan"], 2, "--inner-lr: must be a finite number"),
    (["init", "NEW", "--outer-lr", "inf"], 2, "--outer-lr: must be a finite number"),
    (["init", "NEW", "--outer-momentum", "1"], 2, "--outer-momentum"),  # momentum in [0, 1): 0 is plain SGD
    (["init", "NEW", "--gc-grace", "-1"], 2, "--gc-grace: must be > 0"),
    (["init", "NEW", "--gc-grace", "0"], 2, "--gc-grace: must be > 0"),
    (["init", "NEW", "--grace-max", "nan"], 2, "--grace-max"),
    (["init", "NEW", "--lease", "1", "--heartbeat", "2"], 2, "--lease"),
    (["init", "NEW", "--fragments", "0"], 2, "--fragments"),
    (["init", "NEW", "--fragments", "5", "--sync-every", "4"], 2, "--fragments"),
    (["init", "NEW", "--overlap-steps", "24"], 2, "--overlap-steps"),
    (["init", "NEW", "--adam-betas", "0.9"], 2, "--adam-betas"),
    (["init", "NEW", "--adam-betas", "0.9,1.5"], 2, "--adam-betas"),
    (["init", "NEW", "--alpha", "2"], 2, "--alpha"),
    (["init", "NEW", "--batch-size", "0"], 2, "--batch-size"),
    (["init", "NEW", "--seed", "-1"], 2, "--seed"),
    (["init", "NEW", "--codec-block", "1"], 2, "--codec-block"),
    (["init", "NEW", "--codec", "int3"], 2, "int3"),
    (["init", "NEW", "--merge", "median"], 2, "median"),
    (["init", "NEW", "--config", "DIR/missing.toml"], 2, "--config"),
    (["init"], 2, "give the run URL"),
    (["init", "RUN"], 2, "a run already exists"),
    # learn
    (["learn", "RUN", "--learner-id", "a", "--steps", "-5"], 2, "--steps"),
    (["learn", "RUN", "--learner-id", "a", "--steps", "0"], 2, "--steps"),
    (["learn", "RUN", "--learner-id", "a", "--threads", "-1"], 2, "--threads"),
    (["learn", "RUN", "--learner-id", "a", "--poll", "-1"], 2, "--poll"),
    (["learn", "RUN", "--learner-id", "a", "--poll", "nan"], 2, "--poll"),
    (["learn", "RUN", "--learner-id", "a", "--wait-for-run", "-1"], 2, "--wait-for-run"),
    (["learn", "RUN", "--learner-id", "a", "--wait-for-run", "nan"], 2, "--wait-for-run"),
    (["learn", "RUN", "--learner-id", "a", "--shard", "1"], 2, "--shard and --num-shards"),
    (["learn", "RUN", "--learner-id", "a", "--shard", "3", "--num-shards", "2"], 2, "--shard"),
    (["learn", "RUN", "--learner-id", "../x"], 2, "--learner-id"),
    (["learn", "RUN"], 2, "--learner-id"),
    (["learn", "NEW", "--learner-id", "a"], 3, "no ddiloco run"),
    (["learn", "NEW", "--learner-id", "a"], 3, "--wait-for-run SECONDS"),
    # sync
    (["sync", "RUN", "--fragments", "-1"], 2, "--fragments"),
    (["sync", "RUN", "--fragments", "abc"], 2, "--fragments"),
    (["sync", "RUN", "--fragments", "3-1"], 2, "runs backwards"),
    (["sync", "RUN", "--fragments", "0-99999999999"], 2, "--fragments"),
    (["sync", "RUN", "--fragments", "0-99999"], 2, "not a fragment index"),
    (["sync", "RUN", "--poll", "-1"], 2, "--poll"),
    (["sync", "RUN", "--max-runtime", "0"], 2, "--max-runtime"),
    (["sync", "RUN", "--max-versions", "0"], 2, "--max-versions"),
    (["sync", "NEW", "--max-runtime", "5"], 3, "no ddiloco run"),
    # keys and admissions
    (["admit", "RUN", "a", "zz"], 2, "64 hex digits"),
    (["admit", "RUN", "a", "0" * 64, "--admin-key", "DIR/missing.pem"], 2, "no such file"),
    (["admit", "RUN", "a", "0" * 64, "--admin-key", "DIR/missing.pem"], 2, "the one `ddiloco init` made"),
    (["keys", "new", "RUN/run.json"], 2, "already exists"),
    # observers and maintenance
    (["status", "NEW"], 3, "no ddiloco run"),
    (["status", "RUN", "--watch", "--interval", "0"], 2, "--interval"),
    (["inspect", "NEW"], 3, "no ddiloco run"),
    (["gc", "NEW"], 3, "no ddiloco run"),
    (["export", "RUN", "DIR"], 2, "is a directory"),
    (["export", "RUN", "RUN/run.json/model.safetensors"], 2, "is a file, not a directory"),
    (["export", "NEW", "DIR/model.safetensors"], 3, "no ddiloco run"),
    (["export", "RUN"], 2, "give either OUT.safetensors or --hf-dir DIR"),
    (["export", "RUN", "DIR/m.safetensors", "--hf-dir", "DIR/hf"], 2, "give either"),
    (["export", "RUN", "--hf-dir", "RUN/run.json"], 2, "is a file, not a directory"),
    (["eval", "NEW"], 3, "no ddiloco run"),
    (["eval", "RUN", "--max-batches", "0"], 2, "--max-batches"),
    (["metrics", "RUN"], 2, "exactly one of --tensorboard DIR or --csv FILE"),
    (["metrics", "RUN", "--csv", "DIR/m.csv", "--tensorboard", "DIR/tb"], 2, "exactly one of"),
    (["metrics", "RUN", "--csv", "DIR"], 2, "is a directory"),
    (["metrics", "RUN", "--tensorboard", "RUN/run.json"], 2, "is a file, not a directory"),
    (["plot", "RUN", "DIR"], 2, "is a directory"),
    (["plot", "RUN", "DIR/loss.png"], 2, "no loss records"),
    (["learn", "RUN", "--learner-id", "a", "--log-with", "neptune"], 2, "--log-with"),
    (["sync", "RUN", "--eval-every", "0"], 2, "--eval-every"),
    (["status", "RUN", "-o", "no-equals-sign"], 2, "no-equals-sign"),
    # tools
    (["simulate", "--mode", "bogus"], 2, "bogus"),
    (["simulate", "--chips", "0"], 2, "--chips"),
    (["demo", "--learners", "0"], 2, "--learners"),
    (["demo", "--duration", "-3"], 2, "--duration"),
]


@pytest.mark.parametrize("args,exit_code,needle", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_user_errors_exit_cleanly(args, exit_code, needle, run_url, tmp_path):
    new = str(tmp_path / "new")
    real = [a.replace("RUN", run_url).replace("NEW", new).replace("DIR", str(tmp_path)) for a in args]
    _assert_clean(invoke(*real), exit_code, needle)
    assert not os.path.exists(new) or os.listdir(new) == [], f"a refused command wrote {os.listdir(new)}"


def test_every_command_has_an_error_case():
    from ddiloco_cli.cli.app import app

    names = {c.name or c.callback.__name__ for c in app.registered_commands} | {g.name for g in app.registered_groups}
    covered = {args[0] for args, _, _ in CASES}
    assert names <= covered, f"commands without a user-error case: {names - covered}"


def test_fragment_spec_grammar():
    assert parse_fragment_spec("0-3,7, 2") == [0, 1, 2, 3, 7]
    assert parse_fragment_spec(None) is None and parse_fragment_spec("all") is None
    assert parse_fragment_spec(f"0-{MAX_FRAGMENTS - 1}") == list(range(MAX_FRAGMENTS))
    for bad in ("-1", "abc", "3-1", "1-", "0-99999999999", "1,,2", "1.5", "٣"):
        with pytest.raises(UsageError, match="--fragments"):
            parse_fragment_spec(bad)
    for frags in ([], [0], [0, 1, 2, 5], [3, 5, 6, 7, 9]):
        assert parse_fragment_spec(format_fragment_spec(frags) or None) == (frags or None)


@pytest.mark.parametrize("entry", ["payloads", "contributions"])
def test_a_dotdot_key_in_a_manifest_is_a_clean_error(tmp_path, entry):
    """A manifest naming "../" (or any key outside its fragment) makes readers stop with
    one protocol-error line (exit 4), not an assertion deep in the store."""
    import json

    from ddiloco_cli.protocol import layout

    built = build_run(str(tmp_path / "run"), rounds=1)
    key = layout.manifest_key(0, 1)
    manifest = json.loads(built.store.get(key))
    if not manifest[entry]:
        pytest.skip(f"no {entry} entry to corrupt")
    manifest[entry][0]["key"] = f"{manifest[entry][0]['key'].rsplit('/', 1)[0]}/../../../run.json"
    built.store.put(key, json.dumps(manifest).encode())
    for args in (["export", built.url, str(tmp_path / "model.safetensors")],
                 ["learn", built.url, "--learner-id", "z", "--steps", "1"]):
        _assert_clean(invoke(*args), 4, "../../../run.json")


def test_help_of_every_command_names_no_bool_placeholder():
    """Flags take no value, so no help line may show a "<bool>" placeholder for one."""
    import typer

    from ddiloco_cli.cli.app import app

    def paths(command, prefix):
        yield prefix
        for name, sub in getattr(command, "commands", {}).items():
            yield from paths(sub, [*prefix, name])

    for path in paths(typer.main.get_command(app), []):
        result = invoke(*path, "--help")
        assert result.exit_code == 0 and "<bool>" not in result.output, (path, result.output)
