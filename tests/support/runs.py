"""Runs driven by hand, in-process: a tiny three-tensor task (every syncer step takes
milliseconds), a store that records its writes, and helpers that create runs, write
contributions and heartbeats the way learners do, and step a real ``Syncer``
(``poll_contributions`` / ``maybe_merge``) where a test needs to act between two steps."""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch

from ddiloco_cli.numerics import codec
from ddiloco_cli.ops.runinit import RunSpec, init_run
from ddiloco_cli.protocol import layout, ledger, records, signing
from ddiloco_cli.protocol.published import expected_shapes
from ddiloco_cli.syncer.core import Syncer, SyncerOptions

from support import REPO

if str(REPO / "scripts") not in sys.path:
    sys.path.insert(0, str(REPO / "scripts"))
import benchlib  # noqa: E402

TASK = "support.runs:TinyTask"  # a module name: learners never import a file path from run.json [L1]
LOCAL_BACKENDS = ["local", "memory"]
STORE_BACKENDS = ["local", "memory", pytest.param("s3", marks=pytest.mark.s3)]
ALL_BACKENDS = [*STORE_BACKENDS, pytest.param("gcs", marks=pytest.mark.gcs)]  # fake-gcs-server too


# ----------------------------------------------------------------- the tiny task
class _TinyModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin1 = torch.nn.Linear(6, 5, bias=False)
        self.lin2 = torch.nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(torch.tanh(self.lin1(x)))


class TinyTask:
    def build_model(self) -> torch.nn.Module:
        return _TinyModel()

    def batches(self, *, shard: int, num_shards: int, seed: int, batch_size: int):
        g = torch.Generator().manual_seed(seed * 1000 + shard)
        while True:
            yield torch.randn(batch_size, 6, generator=g)

    def loss(self, model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
        return model(batch).pow(2).mean()

    def num_tokens(self, batch: torch.Tensor) -> int:
        return int(batch.shape[0])


# --------------------------------------------------------------------- helpers
class RecordingStore:
    """A Store that delegates to another and logs every write (and can shift its clock)."""

    def __init__(self, inner, *, clock_shift_s: float = 0.0):
        self.inner, self.url, self.clock_shift_s = inner, inner.url, clock_shift_s
        self.log: list[tuple[str, str]] = []

    def put_if_absent(self, key: str, data: bytes) -> bool:
        self.log.append(("create", key))
        return self.inner.put_if_absent(key, data)

    def put(self, key: str, data: bytes) -> None:
        self.log.append(("put", key))
        self.inner.put(key, data)

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        return self.inner.get(key, max_bytes=max_bytes)

    def list(self, prefix: str = ""):
        return self.inner.list(prefix)

    def delete(self, key: str) -> None:
        self.log.append(("delete", key))
        self.inner.delete(key)

    def remove_stale_temp(self, *, older_than_s: float, dry_run: bool = False):
        return self.inner.remove_stale_temp(older_than_s=older_than_s, dry_run=dry_run)

    def now(self) -> float:
        return self.inner.now() + self.clock_shift_s


def make_run(store, **overrides: Any) -> dict[str, Any]:
    spec = dict(task=TASK, num_fragments=2, sync_every=2, overlap_steps=1, codec="none", publish_codec="none",
                checkpoint_every=2, keyframe_every=2, lease_s=2.0, heartbeat_s=0.5, max_staleness=4,
                retain_versions=1, gc_grace_s=0.001, outer_lr=0.7, outer_momentum=0.9)
    spec.update(overrides)
    return init_run(store, RunSpec(**spec))


def beat(store, learner_id: str, *, state: str = "running", step_time_s: float = 0.01) -> None:
    run = ledger.read_run(store)
    rec = records.make("learner_heartbeat", run_id=run["run_id"], learner_id=learner_id, state=state, step=1,
                       tokens=1, step_time_s=step_time_s)
    store.put(layout.learner_heartbeat_key(learner_id), records.dumps(rec))


def delta_for(store, p: int, seed: int) -> dict[str, torch.Tensor]:
    plan = ledger.read_plan(store, run_id=ledger.read_run(store)["run_id"])
    g = torch.Generator().manual_seed(seed)
    return {k: 0.01 * torch.randn(shape, generator=g) for k, shape in expected_shapes(plan, p).items()}


def contribution(store, p: int, learner_id: str, seq: int, *, base_version: int = 0, c_tokens: int = 64,
                 c_steps: int = 2, tensors: dict | None = None, key: str | None = None, codec_name: str = "none",
                 header: dict[str, Any] | None = None) -> tuple[str, bytes, dict[str, torch.Tensor]]:
    """Create a contribution object; returns (key, bytes, its tensors)."""
    run = ledger.read_run(store)
    tensors = delta_for(store, p, seq) if tensors is None else tensors
    meta = records.make("contribution", run_id=run["run_id"], fragment=p, learner_id=learner_id, seq=seq,
                        base_version=base_version, c_tokens=c_tokens, c_steps=c_steps, step=1,
                        nonce=f"n{seq}", created_s=0.0)
    meta.update(header or {})
    data = codec.encode_tensors(tensors, codec=codec_name, metadata=meta)
    key = key or layout.contribution_key(p, learner_id, seq)
    assert store.put_if_absent(key, data)
    return key, data, tensors


def live_syncer(store, *, syncer_id: str = "live", fragments: list[int] | None = None) -> Syncer:
    """A syncer that has claimed its epoch and restored, ready to be stepped by hand."""
    s = Syncer(store, options=SyncerOptions(fragments=fragments, syncer_id=syncer_id, poll_s=0.01, gc=False))
    assert s.acquire()
    s.check_fence()
    s.restore()
    return s


def step(s: Syncer, p: int) -> bool:
    state = s.states[p]
    s.poll_contributions()
    return s.maybe_merge(state)


def manifests(store, p: int) -> list[dict[str, Any]]:
    return [ledger.read_manifest(store, p, v) for v in ledger.list_versions(store, p)]


def drive(store, s: Syncer, *, rounds: int) -> None:
    """`rounds` versions of both fragments from learners a and b; b lags one version behind
    (its contributions use an older base), so replay must use base values from the ledger."""
    for _ in range(rounds):
        for p in (0, 1):
            v = s.states[p].version
            n = 100 * (v + 1) + p
            contribution(store, p, "a", n, base_version=v, c_tokens=64, c_steps=2)
            contribution(store, p, "b", n + 1, base_version=max(0, v - 1), c_tokens=48, c_steps=3)
            assert step(s, p)
            assert s.states[p].version == v + 1


def restored(store) -> Syncer:
    r = Syncer(store, options=SyncerOptions(syncer_id="restorer", gc=False))
    r.restore()
    return r


def assert_same_state(a: Syncer, b: Syncer) -> None:
    for p in a.fragments:
        sa, sb = a.states[p], b.states[p]
        assert sb.version == sa.version
        assert sb.outer.num_steps == sa.outer.num_steps
        assert sb.high_water == sa.high_water
        for k, t in sa.current.raw.items():  # the unpublished residual too
            assert torch.equal(t, sb.current.raw[k]), k
        ma, mb = sa.outer.state_tensors(), sb.outer.state_tensors()
        assert ma.keys() == mb.keys() and ma
        for k in ma:
            assert torch.equal(ma[k], mb[k]), k
        for k in sa.value:
            assert torch.equal(sa.value[k], sb.value[k]), k


def fragment0_contribution(store, run, learner_id: str, seq: int, *, signer: "signing.Signer | None") -> tuple[str, bytes]:
    """(key, bytes) of a contribution to fragment 0 on base 0 (seeded by ``seq``), signed by
    ``signer`` (None: unsigned): the input of the signature and admission tests."""
    plan = ledger.read_plan(store, run_id=run["run_id"])
    g = torch.Generator().manual_seed(seq)
    tensors = {k: 0.01 * torch.randn(s, generator=g) for k, s in expected_shapes(plan, 0).items()}
    header = records.make("contribution", run_id=run["run_id"], fragment=0, learner_id=learner_id, seq=seq,
                          base_version=0, c_tokens=64, c_steps=2, nonce=records.new_nonce())
    data = codec.encode_tensors(tensors, codec="none", metadata=header)
    key = layout.contribution_key(0, learner_id, seq)
    if signer is not None:
        data = signing.sign_payload(data, kind="contribution", run_id=run["run_id"], key=key, signer=signer)
    return key, data


def signed_run(store, keys: dict[str, "signing.Signer"], *, task: str = "ddiloco_cli.tasks.gpt:tiny") -> dict[str, Any]:
    """A run that requires signatures (admin key ``keys["admin"]``), learner ``a`` admitted
    (``keys["a"]``) with a signed, live heartbeat, syncer ``s`` admitted (``keys["syncer"]``)."""
    return benchlib.signed_run(store, keys, task=task, lease_s=60.0)


def signed_syncer(store, keys: dict[str, "signing.Signer"], name: str) -> Syncer:
    """A syncer of a ``signed_run`` that has claimed its epoch and restored (one decode thread)."""
    s = Syncer(store, options=SyncerOptions(syncer_id=name, poll_s=0.01, gc=False, decode_threads=1,
                                            key_path=str(keys["syncer"].path)))
    assert s.acquire()
    s.check_fence()
    s.restore()
    return s


def commit_by_hand(store, *, version: int, value: dict, prev: dict, high_water: dict) -> None:
    """Commit ``value`` as version ``version`` of fragment 0 (a delta from ``prev``, codec none, no
    contributions, the given high-water marks), as a syncer merging other learners would."""
    from ddiloco_cli.protocol.published import encode_version, upload_payloads

    run = ledger.read_run(store)
    plan = ledger.read_plan(store, run_id=run["run_id"])
    encoded = encode_version(fragment=0, version=version, new_value=value, prev_published=prev,
                             publish_codec="none", block_size=64, keyframe=False)
    upload_payloads(store, encoded)
    assert ledger.commit_manifest(store, records.make(
        "manifest", run_id=run["run_id"], fragment=0, version=version, epoch=1, syncer_id="s",
        nonce=records.new_nonce(), numel=plan.fragment_numel(0), payloads=[e for _, _, e in encoded.payloads],
        contributions=[], quorum_size=0, outer_steps=version, high_water=high_water))
