"""Real local-directory runs for the CLI and observability tests.

``build_run`` creates a run with the tiny GPT task and drives the real ``Syncer``
in-process through ``rounds`` merges per fragment, from contributions written the
way a learner writes them; ``invoke`` runs a ``ddiloco`` command in-process."""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass

import torch
from typer.testing import CliRunner

from ddiloco_cli.cli.app import app
from ddiloco_cli.numerics import codec
from ddiloco_cli.ops.runinit import RunSpec, init_run
from ddiloco_cli.protocol import layout, ledger, records
from ddiloco_cli.protocol.fragments import FragmentPlan
from ddiloco_cli.protocol.published import FragmentReader, expected_shapes
from ddiloco_cli.store import open_store
from ddiloco_cli.store.base import Store
from ddiloco_cli.syncer.core import Syncer, SyncerOptions

LEARNER = "alice"


@dataclass
class BuiltRun:
    url: str
    store: Store
    run: dict
    plan: FragmentPlan
    syncer: Syncer


def write_learner_heartbeat(store: Store, run: dict, learner_id: str, *, step: int = 10, state: str = "running",
                            bytes_up: int = 1000, bytes_down: int = 2000, **fields) -> None:
    rec = records.make("learner_heartbeat", run_id=run["run_id"], learner_id=learner_id, state=state, step=step,
                       tokens=step * 64, step_time_s=0.5, loss=2.5, bytes_up=bytes_up, bytes_down=bytes_down,
                       num_contributions=1, **{"blocked_s": 0.25, "time_s": time.time(), **fields})
    store.put(layout.learner_heartbeat_key(learner_id), records.dumps(rec))


def write_contribution(store: Store, run: dict, plan: FragmentPlan, *, fragment: int, seq: int, base_version: int,
                       learner_id: str = LEARNER, scale: float = 1e-2) -> str:
    shapes = expected_shapes(plan, fragment)
    delta = {k: scale * torch.randn(shape) for k, shape in shapes.items()}
    header = records.make("contribution", run_id=run["run_id"], fragment=fragment, learner_id=learner_id, seq=seq,
                          base_version=base_version, c_tokens=64 * 4, c_steps=4, step=seq,
                          nonce=records.new_nonce(), created_s=time.time())
    data = codec.encode_tensors(delta, codec=run["codec"], block_size=run["codec_block"], metadata=header)
    key = layout.contribution_key(fragment, learner_id, seq)
    assert store.put_if_absent(key, data)
    return key


def merge_round(built: BuiltRun, seq: int) -> None:
    """One contribution per fragment from LEARNER, then one real syncer merge each."""
    for p, state in built.syncer.states.items():
        write_contribution(built.store, built.run, built.plan, fragment=p, seq=seq, base_version=state.version)
    for state in built.syncer.states.values():
        built.syncer.poll_contributions()
        assert built.syncer.maybe_merge(state), "quorum 1 with the only live learner reported: must merge"


def build_run(root: str, *, rounds: int = 3, num_fragments: int = 2, **spec) -> BuiltRun:
    torch.manual_seed(0)
    store = open_store(str(root))
    spec = {"sync_every": 4, "overlap_steps": 1, "codec": "int8", "keyframe_every": 2, "checkpoint_every": 3,
            **spec}
    run = init_run(store, RunSpec(num_fragments=num_fragments, **spec))
    plan = ledger.read_plan(store, run_id=run["run_id"])
    write_learner_heartbeat(store, run, LEARNER)
    syncer = Syncer(store, options=SyncerOptions(syncer_id="test-syncer", gc=False))
    assert syncer.acquire()
    syncer.restore()
    built = BuiltRun(str(root), store, run, plan, syncer)
    for seq in range(rounds):
        merge_round(built, seq)
    syncer.heartbeat(force=True)
    return built


def latest_values(built: BuiltRun) -> dict[int, dict[str, torch.Tensor]]:
    out = {}
    for p in range(built.plan.num_fragments):
        reader = FragmentReader(built.store, run_id=built.run["run_id"], plan=built.plan, fragment=p)
        out[p] = reader.read(ledger.latest_version(built.store, p))
    return out


def invoke(*args: str):
    return CliRunner().invoke(app, list(args))


def copy_run(template: BuiltRun, root: str) -> BuiltRun:
    """A copy of a built run in a fresh directory (its own store; the template's syncer)."""
    shutil.copytree(template.url, root)
    return BuiltRun(root, open_store(root), template.run, template.plan, template.syncer)
