"""Fragment schedule and counters."""

import pytest

from ddiloco_cli.errors import ProtocolError, UsageError
from ddiloco_cli.schedule import FragmentCounters, fragment_offset, fragments_due, next_due_step


@pytest.mark.parametrize("P,H", [(24, 24), (4, 24), (1, 1), (3, 7), (30, 24), (8, 100), (5, 5)])
def test_each_fragment_once_every_H_steps(P, H):
    sends = {p: [] for p in range(P)}
    for step in range(0, 5 * H + 1):
        for p in fragments_due(step, num_fragments=P, sync_every=H):
            sends[p].append(step)
    for p, steps in sends.items():
        assert steps[0] >= 1
        assert steps[0] <= H
        assert all(b - a == H for a, b in zip(steps, steps[1:]))
        assert len(steps) == 5
        t = fragment_offset(p, num_fragments=P, sync_every=H)
        assert 0 <= t < H and all((s - t) % H == 0 for s in steps)
        assert next_due_step(p, 0, num_fragments=P, sync_every=H) == steps[0]
        assert next_due_step(p, steps[0], num_fragments=P, sync_every=H) == steps[1]


def test_offsets_distinct_and_one_per_step_when_P_equals_H():
    offsets = [fragment_offset(p, num_fragments=24, sync_every=24) for p in range(24)]
    assert offsets == list(range(24))
    for step in range(1, 49):
        assert len(fragments_due(step, num_fragments=24, sync_every=24)) == 1
    offsets = [fragment_offset(p, num_fragments=4, sync_every=24) for p in range(4)]
    assert offsets == [0, 6, 12, 18]


def test_bad_flags():
    with pytest.raises(UsageError, match="--sync-every"):
        fragments_due(1, num_fragments=2, sync_every=0)
    with pytest.raises(UsageError, match="--fragments"):
        fragments_due(1, num_fragments=0, sync_every=2)


def test_counters():
    c = FragmentCounters(3)
    c.on_step(100)
    c.on_step(50)
    c.reset(1)
    c.on_step(10)
    assert c.snapshot(0) == (3, 160)
    assert c.snapshot(1) == (1, 10)
    d = c.to_json()
    assert FragmentCounters.from_json(d).to_json() == d
    for bad in ({"c_steps": [1], "c_tokens": [1, 2]}, {"c_steps": [-1], "c_tokens": [0]}, None,
                {"c_steps": [True], "c_tokens": [1]}):
        with pytest.raises(ProtocolError):
            FragmentCounters.from_json(bad)
