"""Create-only writes under real contention: 8 processes, one key per round
(the race itself is in tests/support/races.py).

Run: ``pytest -s tests/integration/test_store_races.py`` (prints per-backend figures);
``python scripts/race_stores.py`` prints the same table.
"""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from support.races import NUM_ROUNDS, NUM_WORKERS, format_figures, run_race


@pytest.mark.slow
@pytest.mark.parametrize(
    "backend",
    [
        pytest.param("local", id="local"),
        pytest.param("s3", id="s3", marks=pytest.mark.s3),
        pytest.param("gcs", id="gcs", marks=pytest.mark.gcs),
    ],
)
def test_exactly_one_winner_per_round_and_no_torn_reads(backend, store_url):
    # memory:// cannot be shared across processes, so it is not raced here
    url = store_url(backend)
    figs = run_race(url, backend=backend)
    print("\n" + format_figures(figs) + "\n" + json.dumps(asdict(figs)))
    assert figs.num_multi_winner_rounds == 0, figs
    assert figs.num_no_winner_rounds == 0, figs
    assert figs.num_winners == figs.num_rounds, figs
    assert figs.num_bad_reads == 0, figs
    assert figs.num_reads == 2 * NUM_WORKERS * NUM_ROUNDS
