"""Tests for the goodput simulator (ddiloco_cli/simtrain/goodput.py)."""

import json
import math

import pytest

from ddiloco_cli.errors import UsageError
from ddiloco_cli.simtrain.goodput import MODES, SECONDS_PER_YEAR, simulate

PAPER_CHIPS = 1_200_000
# Decoupled DiLoCo paper, 1.2M chips, 1-year MTBI per chip: (mode, M, goodput %).
PAPER_GOODPUT = [
    ("data-parallel", 1, 27),
    ("elastic-data-parallel", 1, 58),
    ("decoupled", 2, 70),
    ("decoupled", 4, 82),
    ("decoupled", 8, 88),
    ("decoupled", 16, 93),
]
TOLERANCE_POINTS = 5.0


@pytest.fixture(scope="module")
def paper_column():
    return {m: simulate(mode=mode, chips=PAPER_CHIPS, learners=m, mtbi_years=1.0) | {"paper": p}
            for mode, m, p in PAPER_GOODPUT if mode != "elastic-data-parallel"} | {
        "elastic": simulate(mode="elastic-data-parallel", chips=PAPER_CHIPS, mtbi_years=1.0)}


def test_json_keys_and_ranges():
    for mode in MODES:
        r = simulate(mode=mode, chips=50_000, learners=4 if mode == "decoupled" else 1, mtbi_years=1.0)
        json.dumps(r)  # JSON-ready
        assert r["mode"] == mode
        for key in ("goodput", "uptime", "mean_healthy_fraction"):
            assert 0.0 <= r[key] <= 1.0, (key, r[key])
        assert r["goodput"] <= r["uptime"] + 1e-12  # no work while the run is stalled
        assert r["num_failures"] > 1000  # auto horizon gives a stable estimate
        assert 0.0 <= r["mean_learners_up"] <= r["learners"]


@pytest.mark.parametrize("mode, m, paper", PAPER_GOODPUT)
def test_calibration_against_paper(paper_column, mode, m, paper):
    r = paper_column["elastic"] if mode == "elastic-data-parallel" else paper_column[m]
    assert r["mode"] == mode
    assert abs(100 * r["goodput"] - paper) <= TOLERANCE_POINTS, (mode, m, r["goodput"], paper)


def test_uptime_near_one_from_four_learners(paper_column):
    for m in (4, 8, 16):
        assert paper_column[m]["uptime"] >= 0.99
    # and it is a real effect: one synchronous job is down most of the time
    assert paper_column[1]["uptime"] < 0.5
    assert paper_column[2]["uptime"] < paper_column[4]["uptime"]


def test_goodput_rises_with_learners(paper_column):
    g = [paper_column["elastic"]["goodput"]] + [paper_column[m]["goodput"] for m in (2, 4, 8, 16)]
    assert paper_column[1]["goodput"] < g[0]
    assert g == sorted(g)


def test_monotone_in_mtbi_and_chips():
    for mode, m in (("data-parallel", 1), ("elastic-data-parallel", 1), ("decoupled", 8)):
        by_mtbi = [simulate(mode=mode, chips=100_000, learners=m, mtbi_years=y)["goodput"]
                   for y in (0.25, 0.5, 1.0, 2.0, 4.0)]
        assert by_mtbi == sorted(by_mtbi), (mode, by_mtbi)
        by_chips = [simulate(mode=mode, chips=n, learners=m, mtbi_years=1.0)["goodput"]
                    for n in (30_000, 100_000, 300_000, 1_200_000, 4_800_000)]
        assert by_chips == sorted(by_chips, reverse=True), (mode, by_chips)


def test_one_learner_is_elastic_dp_and_rule_of_thumb():
    elastic = simulate(mode="elastic-data-parallel", chips=300_000, mtbi_years=1.0)
    one = simulate(mode="decoupled", chips=300_000, learners=1, mtbi_years=1.0)
    assert one["goodput"] == pytest.approx(elastic["goodput"], abs=1e-9)
    # docs/simulator.md ("decoupled"): M learners on N chips ~ elastic DP on N/M chips
    four = simulate(mode="decoupled", chips=1_200_000, learners=4, mtbi_years=1.0)
    assert four["goodput"] == pytest.approx(elastic["goodput"], abs=0.02)


def test_quorum_costs_uptime():
    kw = dict(mode="decoupled", chips=1_200_000, learners=4, mtbi_years=1.0)
    k1, k4 = simulate(**kw, quorum=1), simulate(**kw, quorum=4)
    assert k4["uptime"] < k1["uptime"] - 0.2
    assert k4["goodput"] < k1["goodput"]


def test_dp_matches_renewal_formula():
    # No repair delay and negligible lost step: the job runs until a failure and
    # must then get restart_s without a failure, so goodput = exp(-rate * restart_s).
    chips, restart_s = 1000, 100.0
    mtbi_years = chips * restart_s * 2 / SECONDS_PER_YEAR  # rate * restart_s = 0.5
    r = simulate(mode="data-parallel", chips=chips, mtbi_years=mtbi_years, restart_s=restart_s,
                 recovery_s=0.0, step_s=1e-3)
    assert r["params"]["spare_slices"] == 0
    assert r["goodput"] == pytest.approx(math.exp(-0.5), abs=0.01)


def test_elastic_matches_slice_availability():
    # Free re-sharding and a negligible lost step: goodput is the fraction of
    # slices not under repair, 1 / (1 + slice_rate * recovery_s).
    slice_chips, recovery_s, mtbi_years = 100, 36_000.0, 1.0
    r = simulate(mode="elastic-data-parallel", chips=100_000, mtbi_years=mtbi_years, slice_chips=slice_chips,
                 recovery_s=recovery_s, reconfigure_s=0.0, step_s=1e-3)
    expected = 1 / (1 + slice_chips * recovery_s / (mtbi_years * SECONDS_PER_YEAR))
    assert r["goodput"] == pytest.approx(expected, abs=0.005)
    assert r["uptime"] == pytest.approx(1.0)


def test_never_above_one_when_failures_are_rare():
    for mode, m in (("data-parallel", 1), ("elastic-data-parallel", 1), ("decoupled", 16)):
        r = simulate(mode=mode, chips=1000, learners=m, mtbi_years=1000.0)
        assert 0.99 < r["goodput"] <= 1.0


def test_deterministic_for_a_seed():
    kw = dict(mode="decoupled", chips=200_000, learners=8, mtbi_years=0.5, quorum=2)
    assert simulate(**kw, seed=3) == simulate(**kw, seed=3)
    assert simulate(**kw, seed=3)["num_failures"] != simulate(**kw, seed=4)["num_failures"]


@pytest.mark.parametrize("kwargs, flag", [
    (dict(mode="sync"), "--mode"),
    (dict(chips=0), "--chips"),
    (dict(mtbi_years=0.0), "--mtbi-years"),
    (dict(mode="data-parallel", learners=4), "--learners"),
    (dict(learners=4, quorum=5), "--quorum"),
    (dict(restart_s=-1.0), "--restart-s"),
    (dict(mode="data-parallel", learners=1, spare_fraction=1.0), "--spare-fraction"),
])
def test_bad_flags_name_the_flag(kwargs, flag):
    base = dict(mode="decoupled", chips=1000, learners=4, mtbi_years=1.0)
    with pytest.raises(UsageError, match=flag):
        simulate(**(base | kwargs))
