"""Storage options: an unknown key is refused with the closest known one, and a GCS
failure is the same single line as an S3 one (no gcsfs tracebacks)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ddiloco_cli.errors import UsageError
from ddiloco_cli.store import open_store


@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_a_typo_is_refused_with_the_known_name(scheme):
    with pytest.raises(UsageError, match="did you mean endpoint_url"):
        open_store(f"{scheme}://bucket/run", options={"endpoint": "http://127.0.0.1:9"})


def test_a_retry_option_typo_names_the_retry_option():
    with pytest.raises(UsageError, match="did you mean retry_attempts"):
        open_store("s3://bucket/run", options={"retry_atempts": 1})


def test_an_unreachable_gcs_endpoint_gives_one_line(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    env.pop("GCSFS_DEBUG", None)
    proc = subprocess.run(
        [sys.executable, "-m", "ddiloco_cli", "status", "gs://bucket/run", "-o", "endpoint_url=http://127.0.0.1:9",
         "-o", "retry_attempts=1", "-o", "connect_timeout_s=2"],
        capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path,
    )
    assert proc.returncode == 3, proc.stderr
    assert proc.stderr.startswith("error: cannot reach gs://bucket/run"), proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
