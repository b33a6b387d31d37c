"""Smoke tests of the benchmarks: each script runs end to end with tiny settings and
writes the JSON keys its report promises. Nothing here asserts a timing.

Run: .venv/bin/python -m pytest tests/integration/test_bench_smoke.py -q
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from support import REPO

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _run(script: str, *args: str, timeout_s: float = 120) -> str:
    res = subprocess.run([sys.executable, str(REPO / "scripts" / script), *args], env=ENV, cwd=str(REPO),
                         capture_output=True, text=True, timeout=timeout_s)
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout


def test_bench_syncer_smoke(tmp_path):
    out = tmp_path / "syncer.json"
    text = _run("bench_syncer.py", "--width", "64", "--layers", "4", "--rounds", "1", "--warmup", "0",
                "--codecs", "int4,none", "--ms", "1,2", "--digest", "--json", str(out))
    assert "param-contrib" in text.lower() or "p-c/" in text
    rep = json.loads(out.read_text())
    assert rep["fragment_numel"] == 64 * 64 * 2  # 4 layers over 2 fragments
    assert [(r["codec"], r["m"]) for r in rep["results"]] == [("int4", 1), ("int4", 2), ("none", 1), ("none", 2)]
    assert [r["codec_qmax"] for r in rep["results"]] == [3, 3, None, None]  # the run's default bound, as learners send
    for r in rep["results"]:
        assert r["param_contribs_per_cpu_s"] > 0 and r["param_contribs_per_s"] > 0
        assert r["m_max_1b_h24_1s"] > 0 and r["cores_1b_16_learners"] == 16 / r["m_max_1b_h24_1s"]
        assert {"intake", "update", "commit", "io", "other"} <= set(r["split_s_per_merge"])
        assert r["split_s_per_merge"]["update"] > 0
        assert {"decode", "norm", "sha256", "merge", "publish", "io", "other"} <= set(r["cpu_split_s_per_merge"])
        assert r["cpu_split_s_per_merge"]["decode"] > 0
        assert (r["cpu_split_s_per_merge"]["publish"] > 0) == (r["codec"] == "int4")  # no delta with codec none
        assert r["published_payloads"] >= 1 and len(r["published_digest"]) == 64


def test_bench_syncer_on_s3_publishes_what_it_publishes_on_a_local_bucket(tmp_path):
    """--store s3 (moto; the lean GET/PUT path) and s3-s3fs: the syncer's published payloads are
    the same bytes as on a local bucket."""
    digests = {}
    for store in ("local", "s3", "s3-s3fs"):
        out = tmp_path / f"{store}.json"
        _run("bench_syncer.py", "--width", "64", "--layers", "4", "--rounds", "2", "--warmup", "1", "--codecs", "int4",
             "--ms", "2", "--digest", "--store", store, "--json", str(out), timeout_s=240)
        (r,) = json.loads(out.read_text())["results"]
        assert r["param_contribs_per_cpu_s"] > 0 and r["cpu_split_s_per_merge"]["io"] > 0
        digests[store] = (r["published_payloads"], r["published_digest"])
    assert digests["s3"] == digests["local"] == digests["s3-s3fs"]


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="pins to CPU 0 and CPU 1")
def test_bench_overhead_interference_smoke(tmp_path):
    """--interference: the plain loop alone and beside each neighbour, every round recorded."""
    out = tmp_path / "interference.json"
    _run("bench_overhead.py", "--interference", "--steps", "4", "--skip", "1", "--reps", "1", "--json", str(out),
         timeout_s=180)
    rep = json.loads(out.read_text())["interference"]
    assert set(rep) == {"alone", "cpu1-busy", "cpu1-duty", "cpu0-small", "cpu0-large"}
    assert rep["alone"]["main_cpu_vs_alone"] == 0.0
    assert all(len(v["rounds"]) == 1 and v["wall_ms"] > 0 and v["main_cpu_ms"] > 0 for v in rep.values())


def test_bench_overhead_smoke(tmp_path):
    out = tmp_path / "overhead.json"
    # the syncer-memory part (4 more processes) is left out to keep this test short
    _run("bench_overhead.py", "--steps", "5", "--skip", "1", "--reps", "1", "--skip-syncer-memory",
         "--json", str(out), timeout_s=180)
    rep = json.loads(out.read_text())
    arms = [r["arm"] for r in rep["records"]]
    assert arms == ["plain", "ddiloco"]
    dd = rep["records"][1]
    assert dd["send_calls"] == 5  # P = H = 24: one fragment goes up per step
    assert dd["step_calls"] == 5  # the main thread's machinery: timed once a step, in DiLoCoSync.step
    # then, on close, every fragment with steps not sent yet (all but the last one sent)
    assert dd["num_flushed"] == 23 and dd["num_contributions"] == 5 + 23
    assert dd["steps_measured"] == 4
    for key in ("overhead_median", "cpu_overhead_median", "plain_vm_hwm_kb", "ddiloco_vm_hwm_kb", "syncer_vm_hwm_kb"):
        assert key in rep
    assert set(rep["machinery_ms_per_step"]) >= {"main step CPU", "main send CPU", "ddiloco-uploader CPU",
                                                 "ddiloco-receiver CPU"}
    assert dd["polls"] >= 0 and dd["downloads"] >= 0
    assert "syncer_memory" not in rep
    h = rep["headline"]  # the A/B a user measures: medians over the rounds of ddiloco / plain
    assert h["rounds"] == 1 and h["task"] == "mid" and h["torch_threads"] == 1
    assert h["wall_ratio_per_round"] == [pytest.approx(dd["median_ms"] / rep["records"][0]["median_ms"])]
    assert h["cpu_ratio_median"] > 0 and h["memory_ratio_median"] > 0
    assert dd["main_involuntary_switches"] >= 0 and dd["main_voluntary_switches"] >= 0


def test_bench_inproc_smoke(tmp_path):
    out = tmp_path / "inproc.json"
    text = _run("bench_inproc.py", "--procs", "1", "--pairs", "2", "--steps", "6", "--skip", "1", "--task", "tiny",
                "--json", str(out), timeout_s=180)
    assert "median of 2 pairs" in text
    rep = json.loads(out.read_text())
    phases = rep["processes"][0]
    # A B B A: one learner session, its step() called in the ddiloco phases only
    assert [(r["arm"], r["pair"]) for r in phases] == [("plain", 0), ("ddiloco", 0), ("ddiloco", 1), ("plain", 1)]
    for key in ("median_ms", "p10_ms", "cpu_ms"):
        assert len(rep[key]["per_pair"]) == 2 and all(math.isfinite(x) for x in rep[key]["per_pair"])
        assert rep[key]["median"] == pytest.approx(sum(rep[key]["per_pair"]) / 2)
    # (the clocks are read one after the other: a few microseconds apart)
    assert all(r["median_ms"] > 0 and r["cpu_ms"] > 0 and 0 < r["main_cpu_ms"] <= r["cpu_ms"] + 0.05
               and r["main_off_cpu_ms"] >= -0.05 for r in phases)
    assert set(rep["main_off_cpu_ms"]) == {"plain", "ddiloco"}
    assert set(rep["off_cpu_ms_by_part"]["ddiloco"]) == {"forward", "backward", "optimizer", "ddiloco"}
    assert all(r["off_cpu_ms_by_part"]["ddiloco"] == 0.0 for r in phases if r["arm"] == "plain")  # no step() there


def test_bench_inproc_workers_cpu_smoke(tmp_path):
    """The learner's worker threads on a core of their own (where there are two)."""
    if (os.cpu_count() or 1) < 2:
        pytest.skip("needs 2 CPUs")
    out = tmp_path / "inproc.json"
    text = _run("bench_inproc.py", "--procs", "1", "--pairs", "1", "--steps", "6", "--skip", "1", "--task", "tiny",
                "--workers-cpu", "--switch-interval", "1", "--json", str(out), timeout_s=180)
    assert "worker threads on CPU 1" in text
    assert json.loads(out.read_text())["workers_cpu"] is True


def test_bench_io_process_smoke(tmp_path):
    """Both benches with the learner's io helper process: its CPU in the all-thread CPU, its
    memory in the proportional-set-size ratio, every contribution counted through it."""
    out = tmp_path / "inproc.json"
    text = _run("bench_inproc.py", "--procs", "1", "--pairs", "1", "--steps", "6", "--skip", "1", "--task", "tiny",
                "--io-process", "--json", str(out), timeout_s=180)
    assert "io helper process" in text and json.loads(out.read_text())["io_process"] is True
    out = tmp_path / "overhead.json"
    _run("bench_overhead.py", "--steps", "5", "--skip", "1", "--reps", "1", "--skip-syncer-memory", "--io-process",
         "--json", str(out), timeout_s=180)
    rep = json.loads(out.read_text())
    dd = rep["records"][1]
    assert dd["num_flushed"] == 23 and dd["num_contributions"] == 5 + 23
    assert dd["pss_kb"] > 0 and dd["helper_vm_hwm_kb"] > 0
    assert rep["headline"]["io_process"] is True and rep["headline"]["pss_ratio_median"] > 0


def test_bench_gpu_runs_its_four_arms_on_the_cpu(tmp_path):
    """scripts/bench_gpu.py is for a CUDA device; --device cpu checks the script itself."""
    out = tmp_path / "gpu.json"
    _run("bench_gpu.py", "--device", "cpu", "--task", "tiny", "--steps", "8", "--skip", "2", "--reps", "1",
         "--json", str(out), timeout_s=240)
    rep = json.loads(out.read_text())
    assert sorted(r["arm"] for r in rep["records"]) == ["blocking", "ddiloco", "io", "plain"]
    assert all(r["ms_per_step"] > 0 for r in rep["records"])
    for arm in ("ddiloco", "blocking", "io"):
        assert len(rep[arm]["overhead_per_rep"]) == 1
    # P = H = 24: a fragment a step, then on close every fragment with steps not sent yet
    assert [r["num_contributions"] for r in rep["records"] if r["arm"] != "plain"] == [8 + 23] * 3


def test_bench_learner_memory_smoke(tmp_path):
    out = tmp_path / "mem.json"
    text = _run("bench_learner_memory.py", "--steps", "3", "--reps", "1", "--variants",
                "tuned,untuned:DDILOCO_MALLOC_TUNING=0", "--json", str(out), timeout_s=180)
    rep = json.loads(out.read_text())
    assert set(rep["arms"]) == {"plain", "tuned", "untuned"} and "peak MB" in text
    assert rep["arms"]["untuned"]["env"] == {"DDILOCO_MALLOC_TUNING": "0"}
    for arm in rep["arms"].values():
        (run,) = arm["runs"]
        assert run["peak_mb"] > 100 and set(run["peak_by_step"]) == {"1", "3"}
        if not math.isnan(arm["in_use_mb"]):  # glibc >= 2.33: the heap's own accounting
            assert 0 < arm["in_use_mb"] <= arm["heap_mb"] and arm["free_mb"] >= 0
    assert rep["arms"]["plain"]["ratio"] == 1.0


def test_bench_store_smoke(tmp_path):
    out = tmp_path / "store.json"
    text = _run("bench_store.py", "--puts", "2", "--sizes", "1024", "--latency-ms", "5", "--json", str(out))
    assert "no-expect" in text
    rep = json.loads(out.read_text())
    assert [(r["latency_ms_one_way"], r["size_bytes"]) for r in rep["expect_100_continue"]] == [(0.0, 1024), (5.0, 1024)]
    for r in rep["expect_100_continue"]:
        assert set(r["median_ms"]) == {"expect", "no-expect"} and all(v > 0 for v in r["median_ms"].values())


def test_bench_s3_client_smoke(tmp_path):
    """Client CPU per request of the S3 store, lean path and s3fs, every kind a learner makes."""
    out = tmp_path / "s3client.json"
    text = _run("bench_s3_client.py", "--requests", "6", "--block", "3", "--json", str(out))
    assert "S3 client CPU per request" in text and "SigV4 signing" in text
    rep = json.loads(out.read_text())
    assert len(rep["requests"]) == 5
    assert set(rep["signers"]) == {"GET", "PUT 21 kB"}
    assert all(v["ours"] > 0 and v["botocore"] > 0 for v in rep["signers"].values())
    for arms in rep["requests"].values():
        assert set(arms) == {"fast", "s3fs"}
        assert all(a["cpu_ms"] > 0 and a["wall_ms"] > 0 for a in arms.values())


def test_bench_join_smoke(tmp_path):
    """A starting learner's read of the model from moto S3 through a link proxy, both arms: the
    values are checked equal inside the script; the report has each chain length."""
    out = tmp_path / "join.json"
    text = _run("bench_join.py", "--fragments", "2", "--versions", "3", "--repeats", "1", "--latency-ms", "2",
                "--json", str(out), timeout_s=240)
    assert "speedup" in text
    (row,) = json.loads(out.read_text())["results"]
    assert row["versions"] == 3 and row["bytes"] > 0 and row["objects"] > 0
    assert len(row["one_at_a_time_s"]) == len(row["concurrent_s"]) == 1


def test_bench_junk_smoke(tmp_path):
    out = tmp_path / "junk.json"
    text = _run("bench_junk.py", "--junk", "40", "--junk-kb", "2", "--dir", str(tmp_path / "w"), "--json", str(out),
                timeout_s=600)
    assert "40 junk objects" in text
    rep = json.loads(out.read_text())
    phases = {r["phase"]: r for r in rep["phases"]}
    assert list(phases) == ["flood", "cold", "restart"]
    assert phases["flood"]["quarantined"] == phases["cold"]["quarantined"] == 40  # each judged, no report yet
    assert phases["restart"]["reports_believed"] == 40 and phases["restart"]["quarantined"] == 0
    for r in phases.values():  # only the honest contribution was downloaded and decoded
        assert r["decoded"] == 1 and r["verified"] == 1 and r["merge_after_upload_s"] > 0
        assert r["junk_bytes_read"] == 0


@pytest.mark.slow  # init, a syncer and two learners: ~50 s on a loaded 2-core machine
def test_bench_traffic_smoke(tmp_path):
    out = tmp_path / "traffic.json"
    text = _run("bench_traffic.py", "--learners", "2", "--steps", "24", "--skip-steps", "8", "-P", "4", "-H", "8",
                "--json", str(out), timeout_s=240)
    assert "vs DP" in text
    rep = json.loads(out.read_text())
    assert set(rep["learners"]) == {"l0", "l1"}
    assert rep["learners"]["l1"]["paced"] == 1.5
    assert rep["num_params"] > 0 and rep["dp_bytes_per_step"] == 2 * 2 * (1 / 2) * 4 * rep["num_params"]
    finite_positive = lambda x: isinstance(x, (int, float)) and 0 < x < math.inf  # noqa: E731
    finite = lambda x: isinstance(x, (int, float)) and 0 <= x < math.inf  # noqa: E731
    for r in rep["learners"].values():
        # a fast learner may write no two heartbeats inside so short a steady window: then its
        # figures are the whole run's, and the report says so
        assert r["steps"] > 0 and isinstance(r["steady_window"], bool)
        for key in ("bytes_up_per_step", "ratio_vs_dp", "total_ratio_vs_dp", "contribution_bytes"):
            assert finite_positive(r[key]), (key, r)
        # what a learner downloads inside the short steady window depends on how soon the syncer
        # merges, i.e. on the machine's load (a loaded CI run saw none): only the plumbing is checked
        for key in ("bytes_down_per_step", "versions_per_fragment_per_cycle"):
            assert finite(r[key]), (key, r)
    assert finite_positive(rep["ratio_vs_dp"])
    m = rep["manifests"]
    assert m["versions"] > 0 and m["delta_payloads"] > 0
    for key in ("versions_per_fragment_per_cycle", "delta_bytes_per_param", "contribution_bytes_per_param"):
        assert finite_positive(m[key]), (key, m)


@pytest.mark.slow  # a moto server, init, a syncer and a learner: ~40 s on a loaded 2-core machine
def test_bench_requests_smoke(tmp_path):
    out = tmp_path / "requests.json"
    text = _run("bench_requests.py", "-P", "4", "-H", "4", "--overlap-steps", "1", "--pace-ms", "50", "--heartbeat",
                "0.5", "--lease", "3", "--settle-s", "1", "--idle-s", "3", "--skip-steps", "4", "--window-s", "5",
                "--json", str(out), timeout_s=240)
    assert "requests per step" in text
    rep = json.loads(out.read_text())
    learner = rep["learner_per_step"]
    # every step sends a fragment (P = H): one create-only PUT each; the heartbeat is one PUT
    assert learner["PUT contribution"] == pytest.approx(1.0, abs=0.5), learner
    # a poll GETs the manifest after the version held (not the latest hint, which a learner never reads)
    assert learner["PUT learner heartbeat"] > 0 and learner["GET manifest"] > 0, learner
    assert "GET latest hint" not in learner, learner
    assert rep["idle_syncer_per_s"]["LIST contribution"] > 0 and "LIST contribution" in rep["serving_syncer_per_s"]
    assert rep["learner_total_per_step"] == pytest.approx(sum(learner.values()))


def test_bench_requests_names_each_request_by_method_and_key_family():
    sys.path.insert(0, str(REPO / "scripts"))
    from bench_requests import request_kind

    assert request_kind("GET", "/b/run/fragments/p00003/latest.json") == "GET latest hint"
    assert request_kind("GET", "/b?list-type=2&prefix=run%2Fcontributions%2F&delimiter=") == "LIST contribution"
    assert request_kind("PUT", "/b/run/contributions/p00001/a/00000000000000000007.safetensors") == "PUT contribution"
    assert request_kind("PUT", "/b/run/learners/a/heartbeat.json") == "PUT learner heartbeat"
    assert request_kind("HEAD", "/b/run/somewhere/else") == "HEAD other"


def test_bench_metrics_smoke(tmp_path):
    out = tmp_path / "metrics.json"
    script = str(REPO / "scripts" / "bench_metrics.py")
    res = subprocess.run([sys.executable, script, "--records", "50", "--backends", "memory", "--json", str(out)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    rep = json.loads(out.read_text())["results"]["memory"]
    assert rep["bytes_per_record"] > 0 and rep["max_records_kept"] == 32000
    assert "loop_us_per_record_median" in res.stdout


def test_validate_sim_smoke(tmp_path):
    """The simulator and real paced processes on the same tiny scenario: both arms give a
    finite val loss and the comparison's keys are there (no claim about which side wins)."""
    out = tmp_path / "validate.json"
    text = _run("validate_sim.py", "--learners", "2", "--steps", "24", "--seeds", "1", "--real-runs", "1",
                "--step-ms", "40", "--json", str(out), timeout_s=180)
    assert "simulator's [" in text
    rep = json.loads(out.read_text())
    assert {"settings", "sim", "real", "comparison"} <= set(rep)
    for arm in ("sim", "real"):
        assert len(rep[arm]["runs"]) == 1
        assert math.isfinite(rep[arm]["runs"][0]["val_loss"])
        assert {"val_loss", "merged_token_fraction", "mean_quorum"} <= set(rep[arm]["summary"])
    assert rep["real"]["runs"][0]["steps"] == {"l0": 24, "l1": 24}
    assert set(rep["comparison"]) == {"sim_val_loss_range", "real_inside", "all_inside", "real_mean_inside"}


def test_bench_codec_kernels_smoke(tmp_path):
    """`bench_codec.py --kernels`: the compiled kernels against the numpy passes, each call's
    figures and whether both made the same bytes (they must)."""
    from ddiloco_cli.numerics import native

    if native.kernels is None:
        pytest.skip(native.describe())
    out = tmp_path / "kernels.json"
    _run("bench_codec.py", "--kernels", "--codecs", "int4,int8", "--numel", "20000", "--repeats", "1",
         "--warmup-steps", "2", "--sync-every", "2", "--json", str(out))
    rep = json.loads(out.read_text())["kernels"]
    assert len(rep) == 4  # int4 and int8, a fragment and one large tensor
    for calls in rep.values():
        assert set(calls) == {"encode_with_residual", "apply_published_delta", "decode_from_codes"}
        for r in calls.values():
            assert r["same_bytes"] is True and r["compiled_ms"] > 0 and r["numpy_ms"] > 0
