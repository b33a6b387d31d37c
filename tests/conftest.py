"""Shared fixtures: real storage backends for tests (the servers: ``support.servers``;
the other shared helpers: the ``support`` package beside this file).

* ``moto_server`` (session): an S3 endpoint over HTTP (moto) with bucket
  ``S3_TEST_BUCKET``; while it runs, ``AWS_ENDPOINT_URL`` and dummy AWS
  credentials are set in ``os.environ`` so ``open_store("s3://...")`` and any
  child process inherit them.
* ``gcs_server`` (session): fake-gcs-server (the bundled Go binary) with bucket
  ``GCS_TEST_BUCKET``; sets ``STORAGE_EMULATOR_HOST``. Skips (with the reason)
  only if the binary cannot run here.
* ``s3_url`` / ``gcs_url``: a fresh, empty ``BucketURL(url, env)`` per test; ``env``
  is a complete environment for a subprocess (``subprocess.run([...], env=env)``).
* ``store_url``: factory ``store_url("local" | "memory" | "s3" | "gcs") -> str``,
  a fresh empty URL; starts a server only when asked for that backend.
* ``store``: an opened ``Store``, parametrized over all four backends (the S3
  and GCS cases carry the ``s3`` / ``gcs`` markers).
"""

from __future__ import annotations

import logging
import os
import uuid
from pathlib import Path
from typing import NamedTuple

import pytest

from support.servers import MOTO_PROC, FakeGCSServer, s3_env

S3_TEST_BUCKET = "ddiloco-test"
GCS_TEST_BUCKET = "ddiloco-test"


UNIT_DIR = Path(__file__).resolve().parent / "unit"
SERVER_FIXTURES = {"moto_server", "gcs_server", "s3_url", "gcs_url"}


def pytest_configure(config: pytest.Config) -> None:
    """With pytest-xdist workers (scripts/test.sh), each worker's in-process torch gets its
    share of the cores, not all of them: N workers with N threads each on N cores only
    trade places. (The processes the tests start run one thread each: support.procs.)"""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


MISPLACED = pytest.StashKey[bool]()

# Seconds a test takes, roughly (`scripts/test.sh --durations=60`, 2 workers): only the order they give
# matters. The suite runs longest first, each worker taking the next test when it is free
# (scripts/test.sh: --dist load --maxschedchunk 1), so the last tests to start are the short ones and
# no worker idles while the other runs a long one. A test not named here counts as DEFAULT_S by kind.
# Keys: the test's name, with its parameters or without (then for all of them).
EXPECTED_S = {
    "test_same_seed_is_bit_identical_even_under_load_and_seeds_differ": 60,
    "test_quick_scenario_reports_every_arm_with_the_stable_keys": 40,
    "test_the_simulation_refuses_nothing_through_a_syncer_outage": 25,
    "test_signed_run_with_real_processes_A1_A2": 200,
    "test_survives_kill9_of_learner_and_syncer": 182,
    "test_syncer_kill9_at_random_points_loses_nothing_and_replays_bit_exactly": 155,
    "test_yaml_run_scripts_train_against_a_local_bucket_and_rejoin_under_the_same_id": 120,
    "test_fsdp2_island_matches_a_ddp_island": 107,
    "test_second_live_session_is_refused_and_a_woken_zombie_stops": 91,
    "test_bench_requests_smoke": 90,
    "test_learner_under_the_policy_needs_no_other_write_A7": 90,
    "test_training_through_injected_faults_loses_and_corrupts_nothing": 81,
    "test_hf_trainer_example": 74,
    "test_stale_syncer_is_fenced_after_takeover_F1_F2_F3": 68,
    "test_kill_9_mid_init_then_resume_or_clean": 65,
    "test_bench_overhead_smoke": 60,
    "test_bench_overhead_interference_smoke": 40,
    "test_bench_gpu_runs_its_three_arms_on_the_cpu": 40,
    "test_bench_inproc_smoke": 20,
    "test_thawed_syncer_writes_nothing_and_exits_F5": 57,
    "test_exactly_one_winner_per_round_and_no_torn_reads[s3]": 54,
    "test_island_of_two_ranks_trains_and_contributes": 49,
    "test_bench_traffic_smoke": 44,
    "test_learn_wait_for_run_starts_when_the_run_appears": 39,
    "test_own_loop_example": 39,
    "test_status_check_fails_when_the_syncer_is_killed": 37,
    "test_learner_warns_within_2h_steps_when_the_syncer_dies": 36,
    "test_goodput_counts_from_the_first_session_across_a_kill_and_restart": 50,
    "test_six_concurrent_identical_inits_all_succeed_on_one_run": 45,
    "test_deployments_start_admitted_learners_in_a_signed_run": 90,
    "test_concurrent_builders_do_not_corrupt_token_files": 31,
    "test_exactly_one_winner_per_round_and_no_torn_reads[gcs]": 30,
    "test_env_vars_name_the_run_and_show_in_help": 26,
    "test_bench_store_smoke": 22,
    "test_bench_syncer_smoke": 17,
    "test_monotone_in_mtbi_and_chips": 16,
    "test_fuzz_every_reader_survives_hostile_objects_R7[syncer heartbeat]": 14,
    "test_bench_metrics_smoke": 13,
    "test_lockstep_learner_warns_while_it_waits_for_a_merge_that_does_not_come": 10,
    "test_newer_protocol_epoch_says_upgrade_F4_R2[s3]": 8,
    "test_watch_piped_from_the_cli_prints_lines": 7,
    "test_golden_trajectory": 7,
    "test_lockstep_m1_reproduces_classic_diloco_bit_for_bit": 6,
    "test_bucket_url_fixture_reaches_the_emulator_from_a_subprocess": 6,
    "test_lockstep_m2_p2_is_streaming_diloco_bit_for_bit": 6,
    "test_exactly_one_winner_per_round_and_no_torn_reads[local]": 5,
}
DEFAULT_S = {"slow": 30.0, "integration": 1.5, "unit": 0.5}


def expected_s(item: pytest.Item) -> float:
    for key in (item.name, item.name.split("[")[0]):
        if key in EXPECTED_S:
            return float(EXPECTED_S[key])
    if item.get_closest_marker("slow") is not None:
        return DEFAULT_S["slow"]
    return DEFAULT_S["unit" if UNIT_DIR in item.path.parents else "integration"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """tests/unit holds in-process tests only (the quick run, `scripts/test.sh unit`): a test
    there that needs a storage server or is marked slow fails at set-up, before any fixture
    starts, with a message naming it (a collection error would only crash a pytest-xdist
    worker, its message lost).

    Then the longest tests go first (EXPECTED_S): with pytest-xdist's `--dist load
    --maxschedchunk 1` (scripts/test.sh) each worker takes the next one when it is free, so
    the long runs spread over the workers and the run ends on short tests. The sort is
    stable (ties keep pytest's order) and the same in every worker, as xdist requires."""
    for item in items:
        if UNIT_DIR in item.path.parents and (SERVER_FIXTURES & set(getattr(item, "fixturenames", ()))
                                              or any(item.get_closest_marker(m) for m in ("s3", "gcs", "slow"))):
            item.stash[MISPLACED] = True
    items.sort(key=lambda item: -expected_s(item))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.stash.get(MISPLACED, False):
        pytest.fail(f"{item.nodeid} needs a storage server or is marked slow: move it to tests/integration",
                    pytrace=False)


@pytest.fixture(autouse=True)
def _restore_root_logging():
    """CLI commands run in-process (CliRunner) install a root handler on the sys.stderr of
    that moment: a captured stream that is closed after the test. Put the root logger
    back after every test, or a later test's log line lands in a closed stream and
    logging prints "--- Logging error ---" with a traceback into that test's output."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


class BucketURL(NamedTuple):
    url: str
    env: dict[str, str]


@pytest.fixture(scope="session")
def moto_server():
    """Endpoint URL of a running moto S3 server holding bucket ``S3_TEST_BUCKET``.

    The server runs in its own process (tests/support/moto_proc.py) so that it is not
    starved by the test process's own work under the GIL."""
    import subprocess
    import sys

    import boto3

    proc = subprocess.Popen([sys.executable, str(MOTO_PROC)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        endpoint_url = proc.stdout.readline().strip()
        assert endpoint_url.startswith("http://"), "moto server did not start"
        with pytest.MonkeyPatch.context() as mp:
            for k, v in s3_env(endpoint_url).items():
                mp.setenv(k, v)
            mp.delenv("AWS_ENDPOINT_URL_S3", raising=False)
            mp.delenv("AWS_PROFILE", raising=False)
            mp.delenv("AWS_SESSION_TOKEN", raising=False)
            boto3.client("s3", endpoint_url=endpoint_url).create_bucket(Bucket=S3_TEST_BUCKET)
            yield endpoint_url
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="session")
def gcs_server(tmp_path_factory):
    """Endpoint URL of a running fake-gcs-server holding bucket ``GCS_TEST_BUCKET``."""
    server = FakeGCSServer(str(tmp_path_factory.mktemp("fake-gcs") / "server.log"))
    try:
        server.start()
    except (OSError, RuntimeError) as exc:  # no binary for this platform, cannot exec, ...
        pytest.skip(f"fake-gcs-server binary cannot run on this machine: {exc}")
    try:
        server.create_bucket(GCS_TEST_BUCKET)
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("STORAGE_EMULATOR_HOST", server.url)
            mp.setenv("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
            yield server.url
    finally:
        server.stop()


def _fresh_prefix() -> str:
    return f"t-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def s3_url(moto_server) -> BucketURL:
    """A fresh, empty ``s3://`` run root in its own bucket on the moto server, plus a
    subprocess env. (moto's LIST scans every key of a bucket, so a bucket per test
    keeps one test's objects from slowing down the next.)"""
    import boto3

    bucket = f"ddiloco-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=moto_server).create_bucket(Bucket=bucket)
    return BucketURL(f"s3://{bucket}/{_fresh_prefix()}", {**os.environ, **s3_env(moto_server)})


@pytest.fixture
def gcs_url(gcs_server) -> BucketURL:
    """A fresh, empty ``gs://`` run root on fake-gcs-server, plus a subprocess env."""
    env = {**os.environ, "STORAGE_EMULATOR_HOST": gcs_server, "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}
    return BucketURL(f"gs://{GCS_TEST_BUCKET}/{_fresh_prefix()}", env)


@pytest.fixture
def store_url(request, tmp_path):
    """Factory: ``store_url(backend)`` returns a fresh, empty URL for that backend."""
    memory_names = []

    def make(backend: str) -> str:
        prefix = _fresh_prefix()
        if backend == "local":
            return str(tmp_path / prefix)
        if backend == "memory":
            memory_names.append(prefix)
            return f"memory://{prefix}"
        if backend == "s3":
            request.getfixturevalue("moto_server")
            return f"s3://{S3_TEST_BUCKET}/{prefix}"
        if backend == "gcs":
            request.getfixturevalue("gcs_server")
            return f"gs://{GCS_TEST_BUCKET}/{prefix}"
        raise ValueError(f"unknown backend {backend!r}")

    yield make
    from ddiloco_cli.store.memory import drop_bucket

    for name in memory_names:
        drop_bucket(name)


BACKENDS = [
    pytest.param("local", id="local"),
    pytest.param("memory", id="memory"),
    pytest.param("s3", id="s3", marks=pytest.mark.s3),
    pytest.param("gcs", id="gcs", marks=pytest.mark.gcs),
]


@pytest.fixture(params=BACKENDS)
def store(request, store_url):
    """An opened, empty ``Store`` on each backend in turn."""
    from ddiloco_cli.store import open_store

    return open_store(store_url(request.param))


@pytest.fixture(scope="module")
def excerpt_dir(tmp_path_factory) -> str:
    """Token files of the built-in GPT task, built from the shipped excerpt, shared by a module's tests."""
    from ddiloco_cli.tasks.gpt import ensure_token_files

    data_dir = str(tmp_path_factory.mktemp("excerpt"))
    ensure_token_files(data_dir)
    return data_dir
