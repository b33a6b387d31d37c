"""Fragment schedule and counters."""

import pytest

from ddiloco_cli.errors import UsageError
from ddiloco_cli.learner.schedule import FragmentCounters, aligned_offset, fragments_due


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
        t = (p * H) // P  # the offset t_p of the module docstring
        assert all((s - t) % H == 0 for s in steps)


def _first_sends(P: int, H: int) -> list[int]:
    first: dict[int, int] = {}
    for step in range(1, H + 1):
        for p in fragments_due(step, num_fragments=P, sync_every=H):
            first.setdefault(p, step)
    return [first[p] for p in range(P)]


def test_offsets_distinct_and_one_per_step_when_P_equals_H():
    assert _first_sends(24, 24) == [24] + list(range(1, 24))  # t_0 = 0: first send after H steps
    for step in range(1, 49):
        assert len(fragments_due(step, num_fragments=24, sync_every=24)) == 1
    assert _first_sends(4, 24) == [24, 6, 12, 18]


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
    c.on_step(5)
    c.reset(0, since=(3, 160))  # keeps what was counted after the snapshot
    assert c.snapshot(0) == (1, 5)


def test_aligned_offset_follows_the_circular_mean_of_the_running_phases():
    """The offset puts a learner's next step on the others' phase, averaged on the cycle (23.6
    and 0.4 of H = 24 average to 0, not to 12); nobody to follow, or phases that cancel, give 0."""
    H = 24
    assert aligned_offset(0, [10.3], sync_every=H) == 10
    assert aligned_offset(5, [10.3], sync_every=H) == 5
    assert aligned_offset(30, [10.3], sync_every=H) == 4  # (10 - 30) % 24
    assert aligned_offset(0, [23.6, 0.4], sync_every=H) == 0
    assert aligned_offset(0, [23.6, 0.4, 48.0], sync_every=H) == 0
    assert aligned_offset(0, [2.0, 4.0], sync_every=H) == 3
    assert aligned_offset(7, [], sync_every=H) == 0
    assert aligned_offset(7, [2.0, 14.0], sync_every=H) == 0  # opposite phases: no mean
    for own in range(H):  # the shifted schedule sends fragment p when a learner at that phase does
        o = aligned_offset(own, [9.0], sync_every=H)
        assert (own + 1 + o) % H == 10 % H
