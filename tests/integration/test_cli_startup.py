"""Issue 26 item 9: the console script imports only the command it runs, so `--version`,
`status`, `inspect`, `keys` and `admit` never import torch (monitors run `status --check`
every few seconds). Each command runs in a fresh interpreter through ``cli.base.main``
(what the `ddiloco` script calls), which then reports whether torch was imported."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from support.built_run import build_run

PROBE = """
import json, sys
sys.argv = ["ddiloco", *json.loads(sys.argv[1])]
from ddiloco_cli.cli.base import main
try:
    main()
    code = 0
except SystemExit as exc:
    code = exc.code or 0
print("PROBE " + json.dumps({"code": code, "torch": "torch" in sys.modules,
                             "heavy": [m for m in ("numpy", "jsonschema", "tenacity") if m in sys.modules]}))
"""


def _probe(args: list[str], env=None) -> dict:
    r = subprocess.run([sys.executable, "-c", PROBE, json.dumps(args)], capture_output=True, text=True, timeout=120)
    line = next(x for x in r.stdout.splitlines() if x.startswith("PROBE "))
    return {**json.loads(line[6:]), "output": r.stdout + r.stderr}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return build_run(tmp_path_factory.mktemp("startup"), rounds=1)


@pytest.mark.parametrize("args", [
    ["--version"], ["status", "{url}"], ["status", "{url}", "--check"], ["status", "{url}", "--json"],
    ["inspect", "{url}"], ["keys", "list", "{url}"], ["keys", "new", "{tmp}/k.pem"], ["admit", "--help"],
    ["keys", "--help"],
])
def test_light_commands_do_not_import_torch(built, tmp_path, args):
    argv = [a.format(url=built.url, tmp=tmp_path) for a in args]
    got = _probe(argv)
    assert got["code"] in (0, 1), got["output"]  # status --check exits 1 on alerts (no syncer alive)
    assert not got["torch"], f"`ddiloco {' '.join(args)}` imported torch:\n{got['output']}"
    # nor numpy, jsonschema (only to explain a refused record) or tenacity (only once a call failed)
    assert got["heavy"] == [] or args[0] in ("keys",) and args[1] == "new", got["heavy"]


def test_training_commands_and_the_full_help_still_load():
    got = _probe(["--help"])
    assert got["code"] == 0
    for command in ("init", "keys", "admit", "learn", "sync", "status", "inspect", "export", "simulate"):
        assert command in got["output"], command
    got = _probe(["learn", "--help"])
    assert got["code"] == 0 and "--learner-id" in got["output"]


@pytest.mark.parametrize("url", ["gs://ddiloco-nowhere/run", "s3://ddiloco-nowhere/run"])
def test_an_unreachable_bucket_is_one_line_on_every_backend(url):
    """Issue 26 item 8: with the endpoint unreachable, `status` prints one error line (gcsfs
    used to log a traceback per exhausted retry, about 8 of them)."""
    env = {**os.environ, "STORAGE_EMULATOR_HOST": "http://127.0.0.1:9", "AWS_ENDPOINT_URL": "http://127.0.0.1:9",
           "AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "x"}
    r = subprocess.run([sys.executable, "-m", "ddiloco_cli", "status", url, "-o", "retry_attempts=2",
                        "-o", "retry_base_delay_s=0.01", "-o", "connect_timeout_s=1"], env=env, capture_output=True,
                       text=True, timeout=120)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode in (3, 75) and len(lines) == 1 and lines[0].startswith("error:"), r.stderr
