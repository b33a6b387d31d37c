"""Golden trajectories of the numerics, through the real learner and syncer.

Two learners, two fragments, H = 2, quadratic inner loss with a constant
per-learner pull (grad = 0.5 * theta + g_m, plain SGD inner steps), different
token counts per step, a syncer with quorum K = M that merges (RDA, mean for the
embedding), steps the Nesterov outer optimizer and publishes; learners merge
the new fragment tau steps after sending, with alpha. Compared against
tests/unit/golden/*.json; regenerate with

    DDILOCO_REGEN_GOLDEN=1 .venv/bin/python -m pytest tests/unit/test_golden.py

(only when a change of the numerics is intended; say why in the commit).

Everything runs as in a real run, on an in-memory bucket: ``init_run`` writes
version 0, ``Syncer.serve`` (its own thread) merges, and each learner is a
plain training loop in its own thread wrapped in ``DiLoCoSync``. The fixtures
describe the schedule with a syncer that is never late: a learner always
receives the version that merged its send exactly tau steps later. A decoupled
learner never waits, so when a merge reaches it would depend on thread timing;
the learners here therefore run with their config's mode set to ``lockstep``,
which only makes them wait for the version that merged their own contribution
(and skip the flush on leaving). Their receive rule is a decoupled learner's
with ``keep_overlap_progress`` off, as the run sets it; the syncer reads
run.json as written (decoupled: RDA, none of lock-step's overrides).
"""

from __future__ import annotations

import functools
import json
import math
import os
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from ddiloco_cli.learner import DiLoCoSync, SyncOptions
from ddiloco_cli.numerics import codec
from ddiloco_cli.ops.runinit import RunSpec, init_run
from ddiloco_cli.protocol import ledger
from ddiloco_cli.protocol.published import FragmentReader
from ddiloco_cli.protocol.runconfig import read_run_config
from ddiloco_cli.store import open_store
from ddiloco_cli.store.memory import drop_bucket
from ddiloco_cli.syncer.core import Syncer, SyncerOptions

GOLDEN_DIR = Path(__file__).parent / "golden"
SHAPES = {"wte.weight": (6, 3), "h.0.w": (4, 5), "h.0.b": (5,), "ln.w": (3,)}
M, P, H, NUM_STEPS = 2, 2, 2, 8
TOKENS_PER_STEP = [64, 32]
INNER_LR = 0.1
WAIT_S = 120  # ceiling for a thread to finish (a run takes about a second)


def _pattern(shape, phase):
    n = math.prod(shape)
    return torch.sin(torch.arange(n, dtype=torch.float32) * 0.7 + phase).reshape(shape)


class GoldenTask:
    """The quadratic task: the model holds the ``SHAPES`` tensors (initialised to a fixed
    pattern), learner m's batches are its constant pull g_m and its token count, and the
    loss is sum(0.25 * theta^2 + g_m * theta), so grad = 0.5 * theta + g_m."""

    def build_model(self) -> torch.nn.Module:
        root = torch.nn.Module()
        for name, shape in SHAPES.items():
            *path, leaf = name.split(".")
            module = root
            for part in path:
                if not hasattr(module, part):
                    module.add_module(part, torch.nn.Module())
                module = getattr(module, part)
            module.register_parameter(leaf, torch.nn.Parameter(_pattern(shape, 0.0)))
        return root

    def batches(self, *, shard: int, num_shards: int, seed: int, batch_size: int):
        pull = {k: _pattern(s, 1.0 + shard) for k, s in SHAPES.items()}
        while True:
            yield {"pull": pull, "tokens": TOKENS_PER_STEP[shard]}

    def loss(self, model: torch.nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        return sum((0.25 * t.pow(2) + batch["pull"][k] * t).sum() for k, t in model.named_parameters())

    def num_tokens(self, batch: dict[str, Any]) -> int:
        return batch["tokens"]


def _train(store, m: int, *, syncer_done: threading.Event, alpha: float) -> dict[str, torch.Tensor]:
    """Learner m: NUM_STEPS plain SGD steps in a user's own loop, wrapped in DiLoCoSync."""
    task = GoldenTask()
    model = task.build_model()  # its values are replaced by version 0 on entry
    opt = torch.optim.SGD(model.parameters(), lr=INNER_LR)
    config = read_run_config(store).with_mode("lockstep")  # wait for each merge (docstring)
    options = SyncOptions(min_poll_s=0.005, stall_alert=False)
    with DiLoCoSync(store, model, learner_id=f"l{m}", config=config, options=options) as sync:
        batches = task.batches(shard=m, num_shards=M, seed=0, batch_size=1)
        for _ in range(NUM_STEPS):
            batch = next(batches)
            task.loss(model, batch).backward()
            opt.step()
            opt.zero_grad()
            for p in sync.step(num_tokens=task.num_tokens(batch)):
                if alpha == 0:  # alpha = 0 overwrites the fragment with the global value, bit for bit
                    version, value = sync.base[p]
                    got = dict(model.named_parameters())
                    assert all(torch.equal(got[k].detach(), t) for k, t in value.items()), (m, p, version)
        # live (heartbeats) until the syncer has merged the last sends, as a learner that
        # trained on would be
        assert syncer_done.wait(WAIT_S), "the syncer did not commit every version"
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _commits(store) -> list[dict[str, Any]]:
    """Every committed version above 0, with the learner step whose sends it merged (from the
    merged contributions' headers) and its published value."""
    run_id = ledger.read_run(store)["run_id"]
    plan = ledger.read_plan(store, run_id=run_id)
    commits = []
    for p in range(P):
        reader = FragmentReader(store, run_id=run_id, plan=plan, fragment=p)
        for v in ledger.list_versions(store, p)[1:]:
            entries = [e for e in reader.manifest(v)["contributions"] if e["used"]]
            assert sorted(e["learner_id"] for e in entries) == [f"l{m}" for m in range(M)]  # quorum K = M
            steps = {codec.decode_tensors(store.get(e["key"]), max_numel=plan.fragment_numel(p))[1]["step"]
                     for e in entries}
            assert len(steps) == 1, (p, v, steps)  # both learners' sends of the same step
            commits.append({"step": steps.pop(), "fragment": p, "version": v,
                            "values": {k: t.flatten().tolist() for k, t in reader.read(v).items()}})
    return sorted(commits, key=lambda c: (c["step"], c["fragment"]))


@functools.cache
def run(*, tau: int, alpha: float) -> dict:
    """One golden run (cached: the last test compares all four)."""
    name = f"golden-{uuid.uuid4().hex[:12]}"
    store = open_store(f"memory://{name}")
    try:
        init_run(store, RunSpec(task="test_golden:GoldenTask", num_fragments=P, sync_every=H, overlap_steps=tau,
                                quorum=M, alpha=alpha, keep_overlap_progress=False, merge="rda", codec="none",
                                publish_codec="none", outer_lr=0.7, outer_momentum=0.9, total_steps=NUM_STEPS,
                                heartbeat_s=0.2, lease_s=30.0))
        syncer = Syncer(store, options=SyncerOptions(poll_s=0.005, gc=False, max_versions=P * NUM_STEPS // H))
        syncer_done = threading.Event()
        results: dict[Any, Any] = {}

        def serve() -> None:
            try:
                results["syncer"] = syncer.serve()
            finally:
                syncer_done.set()

        def learn(m: int) -> None:
            try:
                results[m] = _train(store, m, syncer_done=syncer_done, alpha=alpha)
            except BaseException as exc:  # noqa: BLE001 - raised again in the test's thread
                results[m] = exc

        threads = [threading.Thread(target=serve, daemon=True)]
        threads += [threading.Thread(target=learn, args=(m,), daemon=True) for m in range(M)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=WAIT_S)
        assert not any(t.is_alive() for t in threads), "a learner or the syncer did not finish"
        for m in range(M):
            if isinstance(results[m], BaseException):
                raise results[m]
        assert results["syncer"] == "limit"
        return {
            "config": {"M": M, "P": P, "H": H, "tau": tau, "alpha": alpha, "num_steps": NUM_STEPS},
            "commits": _commits(store),
            "final_learners": [{k: v.flatten().tolist() for k, v in results[m].items()} for m in range(M)],
        }
    finally:
        drop_bucket(name)


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
    got = run(tau=tau, alpha=alpha)
    assert len(got["commits"]) == P * NUM_STEPS // H  # every fragment merged every H steps
    path = GOLDEN_DIR / f"ddiloco_tau{tau}_alpha{alpha}.json"
    if os.environ.get("DDILOCO_REGEN_GOLDEN") == "1":
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps(got, indent=1) + "\n")
    want = json.loads(path.read_text())
    _close(got, want)


def test_overlap_and_alpha_change_the_trajectory():
    """The four fixtures must differ, or they would not test tau and alpha."""
    runs = {(t, a): run(tau=t, alpha=a)["final_learners"][0]["h.0.w"] for t in (0, 1) for a in (0.0, 0.5)}
    values = list(runs.values())
    assert all(values[i] != values[j] for i in range(4) for j in range(i + 1, 4))
