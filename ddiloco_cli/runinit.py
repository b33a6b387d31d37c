"""`ddiloco init`: validate hyperparameters, plan fragments, write version 0."""

from __future__ import annotations

import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ddiloco_cli import ledger, records
from ddiloco_cli.errors import UsageError
from ddiloco_cli.fragments import gather_fragment, named_shapes_of, plan_fragments
from ddiloco_cli.published import encode_version, upload_payloads
from ddiloco_cli.store.base import Store
from ddiloco_cli.tasks import load_task

CODECS = ("none", "bf16", "int8", "int4")
DEFAULT_BLOCK = {"none": 64, "bf16": 64, "int8": 256, "int4": 64}


@dataclass
class RunSpec:
    """Every hyperparameter of a run; the fields of run.json (PROTOCOL.md, "Run config")."""

    task: str = "ddiloco_cli.tasks.gpt:tiny"
    num_fragments: int = 4
    sync_every: int = 24
    overlap_steps: int = 2
    quorum: int = 1
    alpha: float = 0.0
    keep_overlap_progress: bool = True
    merge: str = "rda"
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    outer_lr_scaling: str = "participation"
    codec: str = "int4"
    codec_block: int | None = None
    publish_codec: str | None = None
    mode: str = "decoupled"
    inner_lr: float = 1e-3
    adam_betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.1
    warmup_steps: int = 20
    lr_schedule: str = "cosine"
    total_steps: int = 1000
    grad_clip: float = 1.0
    batch_size: int = 16
    seed: int = 0
    grace_gamma: float = 0.5
    grace_max_s: float = 5.0
    max_staleness: int = 8
    checkpoint_every: int = 10
    keyframe_every: int = 8
    lease_s: float = 10.0
    heartbeat_s: float = 2.0
    retain_versions: int = 16
    gc_grace_s: float = 300.0
    extra: dict[str, Any] = field(default_factory=dict)

    def check(self) -> None:
        """Refuse invalid combinations with a message naming the flag."""
        def bad(flag: str, why: str) -> UsageError:
            return UsageError(f"{flag}: {why}")

        if self.num_fragments < 1:
            raise bad("--fragments", "must be >= 1")
        if self.sync_every < 1:
            raise bad("--sync-every", "must be >= 1")
        if self.num_fragments > self.sync_every:
            raise bad("--fragments", f"P={self.num_fragments} > H={self.sync_every}: each fragment needs its own "
                                     "step offset; use --fragments <= --sync-every")
        if self.overlap_steps < 0 or self.overlap_steps >= self.sync_every:
            raise bad("--overlap-steps", f"tau must be in [0, H) = [0, {self.sync_every})")
        if self.quorum < 1:
            raise bad("--quorum", "K must be >= 1")
        if not 0.0 <= self.alpha <= 1.0:
            raise bad("--alpha", "must be in [0, 1]")
        if self.merge not in ("rda", "mean"):
            raise bad("--merge", "use rda or mean")
        if self.outer_lr <= 0:
            raise bad("--outer-lr", "must be > 0")
        if self.outer_lr_scaling not in ("none", "participation"):
            raise bad("--outer-lr-scaling", "use none or participation")
        if not 0.0 <= self.outer_momentum < 1.0:
            raise bad("--outer-momentum", "must be in [0, 1)")
        for flag, c in (("--codec", self.codec), ("--publish-codec", self.publish_codec or self.codec)):
            if c not in CODECS:
                raise bad(flag, f"use one of {', '.join(CODECS)}")
        if self.mode not in ("decoupled", "lockstep"):
            raise bad("--mode", "use decoupled or lockstep")
        if self.inner_lr <= 0:
            raise bad("--inner-lr", "must be > 0")
        if len(self.adam_betas) != 2 or not all(0.0 <= b < 1.0 for b in self.adam_betas):
            raise bad("--adam-betas", "give two numbers in [0, 1), e.g. 0.9,0.95")
        if self.weight_decay < 0:
            raise bad("--weight-decay", "must be >= 0")
        if self.warmup_steps < 0:
            raise bad("--warmup-steps", "must be >= 0")
        if self.lr_schedule not in ("constant", "cosine"):
            raise bad("--lr-schedule", "use constant or cosine")
        if self.grad_clip < 0:
            raise bad("--grad-clip", "must be >= 0 (0 disables)")
        if self.batch_size < 1:
            raise bad("--batch-size", "must be >= 1")
        if self.total_steps < 0:
            raise bad("--total-steps", "must be >= 0 (0: no limit)")
        if self.codec_block is not None and self.codec_block < 2:
            raise bad("--codec-block", "must be >= 2")
        if not 0 <= self.grace_gamma < 1:
            raise bad("--grace-gamma", "must be in [0, 1)")
        if self.lease_s <= self.heartbeat_s:
            raise bad("--lease", "the lease must be longer than the heartbeat interval")

    def to_config(self, *, run_id: str) -> dict[str, Any]:
        d = asdict(self)
        extra = d.pop("extra")
        inner = {
            "lr": d.pop("inner_lr"), "betas": list(d.pop("adam_betas")), "weight_decay": d.pop("weight_decay"),
            "warmup_steps": d.pop("warmup_steps"), "lr_schedule": d.pop("lr_schedule"),
            "total_steps": d.pop("total_steps"), "grad_clip": d.pop("grad_clip"), "batch_size": d.pop("batch_size"),
        }
        d["codec_block"] = d["codec_block"] or DEFAULT_BLOCK[d["codec"]]
        d["publish_codec"] = d["publish_codec"] or d["codec"]
        return records.make("run", protocol_minor=records.PROTOCOL_MINOR, features=list(records.FEATURES),
                            run_id=run_id, created_s=time.time(), nonce=records.new_nonce(), inner=inner, **d, **extra)


def init_run(store: Store, spec: RunSpec) -> dict[str, Any]:
    """Create a run at ``store``: plan, version 0 of every fragment, then run.json.

    Returns the run config. Raises UsageError if a run exists (nothing changed).
    """
    spec.check()
    if ledger.run_exists(store):
        raise UsageError(f"a run already exists at {store.url}; nothing was changed (use another URL)")
    task = load_task(spec.task)
    torch.manual_seed(spec.seed)
    model = task.build_model()
    plan = plan_fragments(named_shapes_of(model), spec.num_fragments)
    run_id = uuid.uuid4().hex
    config = spec.to_config(run_id=run_id)
    plan_record = ledger.plan_record(plan, run_id=run_id)
    params = {k: v.detach() for k, v in model.named_parameters()}

    def write_version_zero() -> None:
        for p in range(plan.num_fragments):
            value = gather_fragment(plan, p, params)
            encoded = encode_version(fragment=p, version=0, new_value=value, prev_published=None,
                                     publish_codec=config["publish_codec"], block_size=config["codec_block"],
                                     keyframe_every=config["keyframe_every"])
            upload_payloads(store, encoded)
            manifest = records.make(
                "manifest", run_id=run_id, fragment=p, version=0, epoch=0, syncer_id="init",
                nonce=records.new_nonce(), created_s=time.time(), numel=plan.fragment_numel(p),
                payloads=[e for _, _, e in encoded.payloads], contributions=[], quorum_size=0, grace_s=0.0,
                outer_steps=0, high_water={},
            )
            if not ledger.commit_manifest(store, manifest):
                raise UsageError(f"fragment {p} version 0 already exists at {store.url}: another init raced; nothing more was written")

    ledger.create_run(store, config=config, plan=plan_record, before_commit=write_version_zero)
    return config
