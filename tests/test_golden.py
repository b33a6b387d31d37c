"""Golden trajectories of the numerics, simulated in process.

Two learners, two fragments, H = 2, quadratic inner loss with a constant
per-learner pull (grad = 0.5 * theta + g_m, plain SGD inner steps), different
token counts per step, a syncer with quorum K = M that merges (RDA, mean for the
embedding), steps the Nesterov outer optimizer and publishes; learners merge
the new fragment tau steps after sending, with alpha. Compared against
tests/golden/*.json; regenerate with

    DDILOCO_REGEN_GOLDEN=1 .venv/bin/python -m pytest tests/test_golden.py

(only when a change of the numerics is intended; say why in the commit).
"""

import json
import math
import os
from pathlib import Path

import pytest
import torch

from ddiloco_cli.fragments import gather_fragment, plan_fragments, scatter_fragment
from ddiloco_cli.merge import alpha_merge, is_embedding_key, merge_outer_gradients, token_weight
from ddiloco_cli.outer import OuterOptimizer
from ddiloco_cli.schedule import FragmentCounters, fragments_due

GOLDEN_DIR = Path(__file__).parent / "golden"
SHAPES = {"wte.weight": (6, 3), "h.0.w": (4, 5), "h.0.b": (5,), "ln.w": (3,)}
M, P, H, NUM_STEPS = 2, 2, 2, 8
TOKENS_PER_STEP = [64, 32]
INNER_LR = 0.1


def _pattern(shape, phase):
    n = math.prod(shape)
    return torch.sin(torch.arange(n, dtype=torch.float32) * 0.7 + phase).reshape(shape)


def simulate(*, tau: int, alpha: float) -> dict:
    plan = plan_fragments({k: (s, "float32") for k, s in SHAPES.items()}, P)
    init = {k: _pattern(s, 0.0) for k, s in SHAPES.items()}
    learners = [{k: v.clone() for k, v in init.items()} for _ in range(M)]
    pulls = [{k: _pattern(s, 1.0 + m) for k, s in SHAPES.items()} for m in range(M)]
    counters = [FragmentCounters(P) for _ in range(M)]
    global_values = [gather_fragment(plan, p, init) for p in range(P)]
    versions = [0] * P
    outers = [OuterOptimizer(lr=0.7, momentum=0.9) for _ in range(P)]
    bases = [[(0, {k: v.clone() for k, v in global_values[p].items()}) for p in range(P)] for _ in range(M)]
    pending: dict[int, list] = {p: [] for p in range(P)}  # contributions waiting for quorum
    deliveries = []  # (due step, learner, fragment)
    commits = []

    for step in range(1, NUM_STEPS + 1):
        for m in range(M):  # inner step
            for k, theta in learners[m].items():
                theta.sub_(INNER_LR * (0.5 * theta + pulls[m][k]))
            counters[m].on_step(TOKENS_PER_STEP[m])
        for p in fragments_due(step, num_fragments=P, sync_every=H):
            for m in range(M):  # send: delta = base - theta
                base_version, base = bases[m][p]
                theta = gather_fragment(plan, p, learners[m])
                delta = {k: base[k] - theta[k] for k in theta}
                pending[p].append((m, base_version, {k: v.clone() for k, v in base.items()}, delta,
                                   counters[m].snapshot(p)))
                deliveries.append((step + tau, m, p))
            if len(pending[p]) >= M:  # syncer: merge, outer step, publish
                current = global_values[p]
                grads, weights = [], []
                for m, _, base, delta, (c_steps, c_tokens) in pending[p]:
                    grads.append({k: (current[k] - base[k]) + delta[k] for k in delta})
                    weights.append(token_weight(c_tokens, c_steps))
                merged = merge_outer_gradients(grads, weights, mean_keys={k for k in current if is_embedding_key(k)})
                outers[p].step(current, merged)
                versions[p] += 1
                pending[p] = []
                commits.append({"step": step, "fragment": p, "version": versions[p],
                                "values": {k: v.flatten().tolist() for k, v in current.items()}})
        for due, m, p in [d for d in deliveries if d[0] <= step]:  # receive
            deliveries.remove((due, m, p))
            if bases[m][p][0] < versions[p]:
                local = gather_fragment(plan, p, learners[m])
                for k in local:
                    alpha_merge(local[k], global_values[p][k], alpha)
                scatter_fragment(plan, p, learners[m], local)
                bases[m][p] = (versions[p], {k: v.clone() for k, v in global_values[p].items()})
                counters[m].reset(p)
                if alpha == 0:
                    got = gather_fragment(plan, p, learners[m])
                    assert all(torch.equal(got[k], global_values[p][k]) for k in got)
    return {
        "config": {"M": M, "P": P, "H": H, "tau": tau, "alpha": alpha, "num_steps": NUM_STEPS},
        "commits": commits,
        "final_learners": [{k: v.flatten().tolist() for k, v in lr.items()} for lr in learners],
    }


def _close(a, b, path=""):
    if isinstance(a, dict):
        assert set(a) == set(b), path
        for k in a:
            _close(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _close(x, y, f"{path}[{i}]")
    elif isinstance(a, float):
        assert math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-6), (path, a, b)
    else:
        assert a == b, path


@pytest.mark.parametrize("tau,alpha", [(0, 0.0), (1, 0.0), (0, 0.5), (1, 0.5)])
def test_golden_trajectory(tau, alpha):
    got = simulate(tau=tau, alpha=alpha)
    assert len(got["commits"]) == P * NUM_STEPS // H  # every fragment merged every H steps
    path = GOLDEN_DIR / f"ddiloco_tau{tau}_alpha{alpha}.json"
    if os.environ.get("DDILOCO_REGEN_GOLDEN") == "1":
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps(got, indent=1) + "\n")
    want = json.loads(path.read_text())
    _close(got, want)


def test_overlap_and_alpha_change_the_trajectory():
    """The four fixtures must differ, or they would not test tau and alpha."""
    runs = {(t, a): simulate(tau=t, alpha=a)["final_learners"][0]["h.0.w"] for t in (0, 1) for a in (0.0, 0.5)}
    values = list(runs.values())
    assert all(values[i] != values[j] for i in range(4) for j in range(i + 1, 4))
