"""The run config (``run.json``) as one typed, frozen value, validated once.

``RunConfig`` is what ``ddiloco init`` writes and what every reader of a run
gets back: ``RunConfig(...)`` (flags, a config file, code) and
``RunConfig.from_record`` (a run.json read from the bucket) run the same checks,
so a value that exists is valid. Each field's metadata is the single table that
names its command-line flag (also its key in an ``init --config`` file), its
place in run.json, its allowed range and its help text (``runflags`` makes `ddiloco
init`'s options from it: each setting is declared once); the codec names and default
block sizes come from ``ddiloco_cli.numerics.codec``.

Errors name the flag and what to do: ``UsageError`` for user input, ``ProtocolError`` for a run.json.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable, Mapping

from ddiloco_cli.errors import ProtocolError, UsageError
from ddiloco_cli.numerics import codecnames as codec
from ddiloco_cli.protocol import layout, ledger, records
from ddiloco_cli.protocol.runvalues import bad as _bad
from ddiloco_cli.protocol.runvalues import checked
from ddiloco_cli.store.base import Store

# -- choices of the enum fields (the CLI offers exactly these) --
Codec = Enum("Codec", {c: c for c in codec.CODECS}, type=str)  # type: ignore[misc]


class Merge(str, Enum):
    rda = "rda"
    mean = "mean"


class KeyframeRule(str, Enum):
    every = "every"
    size = "size"


class OuterLrScaling(str, Enum):
    participation = "participation"
    none = "none"


class Mode(str, Enum):
    decoupled = "decoupled"
    lockstep = "lockstep"


class LrSchedule(str, Enum):
    cosine = "cosine"
    constant = "constant"


# Help panels of `ddiloco init --help`; config files and --print-config group keys the same way.
PANELS = ("Task and fragments", "Schedule", "Merge and outer optimizer", "Inner optimizer", "Codec",
          "Fault tolerance")

_MAX_INT = 2**53  # JSON-safe: no reader loses precision below this

# Settings that lost (docs/results.md) and were retired in 0.2.0 (PROTOCOL.md "Retired settings"):
# run.json key -> the values this version refuses to run. A run.json naming one is refused with
# the last version that runs it; the retired keys' surviving values (outer_gradient = current,
# await_own_merge = true) are what this version always does, so they are read and dropped.
RETIRED_VALUES: dict[str, tuple[Any, ...]] = {
    "outer_gradient": ("delta",),
    "outer_lr_scaling": ("cycle",),
    "await_own_merge": (False,),
}
RETIRED_KEYS = ("outer_gradient", "await_own_merge")  # no longer settings at all
LAST_VERSION_WITH_RETIRED = "0.1.0"  # the last ddiloco that runs the retired values
# Settings whose default depends on the mode: (field, decoupled default (None: the run's codec),
# the one value of a lockstep run). init writes the value in run.json, so readers see it whole.
MODE_DEFAULTS: tuple[tuple[str, Any, Any], ...] = (
    ("merge", "rda", "mean"),
    ("keep_overlap_progress", True, False),
    ("outer_lr_scaling", "participation", "none"),
    ("publish_codec", None, "none"),
)
# The outer step's defaults by codec: DiLoCo's Nesterov (lr 0.7, momentum 0.9), and for sparse
# uploads SparseLoCo's plain averaged descent (the learners' decayed error-feedback accumulators
# are the momentum; with Nesterov on top a sparse run diverged, docs/sparse.md).
CODEC_OUTER_DEFAULTS: dict[str | None, dict[str, float]] = {
    None: {"outer_lr": 0.7, "outer_momentum": 0.9},
    # plain averaged descent, the learners' accumulators being the momentum; a step of 2.5 x the
    # merged delta since 0.2.9 (1.5 in 0.2.5-0.2.8, 1.0 before: docs/sparse.md, "Outer lr 2.5")
    "sparse": {"outer_lr": 2.5, "outer_momentum": 0.0},
}
SPARSE_KEYFRAME_EVERY = 64  # the longest delta chain of a run with sparse published deltas (rule size)
# Defaults by mode that a lockstep run may change: alpha (Streaming DiLoCo's mixing factor) is
# 0.3 in a decoupled run (docs/results.md "Outer loop": the learner keeps 0.3 of the gap
# between its own fragment and the new global one, which damps the outer Nesterov step's
# overshoot) and 0 in lockstep (torchft's default, so lockstep stays classic DiLoCo at M = 1).
# held_alpha, the alpha of a version lacking the learner's contribution in flight ([L8]), is 0.5
# since 0.2.8 (docs/sparse.md "With the syncer's cost per codec": on a link too thin for a cycle
# every receive is one, and 0.3 made int4 at M = 16 oscillate); lockstep never takes one.
MODE_DEFAULTS_FREE: tuple[tuple[str, Any, Any], ...] = (
    ("alpha", 0.3, 0.0),
    ("held_alpha", 0.5, 0.0),
)


def _spec(flag: str, panel: str, *, kind: type | str, lo: float | None = None, hi: float | None = None,
          lo_open: bool = False, hi_open: bool = False, choices: type[Enum] | None = None,
          json_key: str | None = None, optional: bool = False, help: str | None = None,
          metavar: str | None = None, short: str | None = None, off: str | None = None) -> dict[str, Any]:
    """Field metadata: flag (without ``--``; also the config-file key), panel, kind
    (int, float, bool, str, or tuple for a pair of floats), inclusive or open bounds, enum choices,
    the key in run.json ("inner.lr" for nested ones; default: the field name),
    and whether None is allowed (then a default is filled in after validation); for the
    command line (``runflags`` makes `ddiloco init`'s options from it): the help text, the
    metavar, a one-letter alias (``-H``) and a bool's off flag (without ``--``)."""
    return {"flag": flag, "panel": panel, "kind": kind, "lo": lo, "hi": hi, "lo_open": lo_open, "hi_open": hi_open,
            "choices": choices, "json_key": json_key, "optional": optional, "help": help, "metavar": metavar,
            "short": short, "off": off}


def _f(default: Any, flag: str, panel: str, **kw: Any) -> Any:
    return field(default=default, metadata=_spec(flag, panel, **kw))


_T, _S, _M, _I, _C, _F = PANELS


@dataclass(frozen=True)
class RunConfig:
    """Every hyperparameter of a run: the fields of run.json (PROTOCOL.md, "Run config").

    ``run_id`` and ``created_s`` are set on a config read from the bucket (empty /
    0 on one built from flags). ``extra`` keeps run.json keys this version does
    not know, so they survive a round trip.
    """

    task: str = _f("ddiloco_cli.tasks.gpt:tiny", "task", _T, kind=str,
                   metavar="MODULE:OBJECT", help="module:object (or path.py:object) giving the model, data and loss")
    num_fragments: int = _f(4, "fragments", _T, kind=int, lo=1, hi=99_999,
                            short="-P", metavar="P", help="Number of fragments P")  # keys hold 5 digits
    seed: int = _f(0, "seed", _T, kind=int, lo=0, hi=2**63 - 1,
                   metavar="N", help="Seed of the initial model")
    sync_every: int = _f(24, "sync-every", _S, kind=int, lo=1, hi=_MAX_INT,
                         short="-H", metavar="H", help="Inner steps between two syncs of a fragment (H)")
    overlap_steps: int = _f(2, "overlap-steps", _S, kind=int, lo=0, hi=_MAX_INT,
                            metavar="TAU", help="Steps a fragment's sync overlaps with compute (tau)")
    mode: str = _f("decoupled", "mode", _S, kind=str, choices=Mode,
                   help="decoupled, or lockstep (the streaming-DiLoCo baseline)")
    quorum: int = _f(1, "quorum", _M, kind=int, lo=1, hi=_MAX_INT,
                     short="-K", metavar="K", help="Minimum distinct learners per merge (K)")
    alpha: float | None = _f(None, "alpha", _M, kind=float, lo=0.0, hi=1.0, optional=True,
                             metavar="X", help="Learner-side merge: theta <- alpha*theta + (1-alpha)*(global + "
                                               "progress) (default: 0.3; lockstep: 0)")
    held_alpha: float | None = _f(None, "held-alpha", _M, kind=float, lo=0.0, hi=1.0, optional=True, metavar="X",
                                  help="alpha for a version without its own last contribution ([L8]; default: 0.5; lockstep: 0)")
    keep_overlap_progress: bool | None = _f(None, "keep-overlap-progress", _M, kind=bool, optional=True,
                                            off="discard-overlap-progress",
                                            help="On receive, keep the steps trained since the send (theta <- "
                                                 "Theta_new + progress) or overwrite them (default: keep; lockstep: "
                                                 "overwrite)")
    merge: str | None = _f(None, "merge", _M, kind=str, choices=Merge, optional=True,
                           help="Radial-Directional Averaging or a token-weighted mean (default: rda; lockstep: mean)")
    outer_lr: float | None = _f(None, "outer-lr", _M, kind=float, lo=0.0, lo_open=True, optional=True,
                                metavar="LR", help="Outer Nesterov learning rate (default: 0.7; sparse: 2.5)")
    # 0: plain averaged descent, no outer momentum (sparse runs: the learners' error-feedback accumulators are the momentum)
    outer_momentum: float | None = _f(None, "outer-momentum", _M, kind=float, lo=0.0, hi=1.0, hi_open=True,
                                      optional=True, metavar="X",
                                      help="Outer Nesterov momentum, 0: plain averaged descent (default: 0.9; "
                                           "sparse: 0)")
    outer_lr_scaling: str | None = _f(None, "outer-lr-scaling", _M, kind=str, choices=OuterLrScaling, optional=True,
                                      help="participation: a merge of m of M live learners uses lr*m/M (default: "
                                           "participation; lockstep: none)")
    inner_lr: float = _f(1e-3, "inner-lr", _I, kind=float, lo=0.0, lo_open=True, json_key="inner.lr",
                         metavar="LR", help="Inner AdamW peak learning rate")
    adam_betas: tuple[float, float] = _f((0.9, 0.95), "adam-betas", _I, kind=tuple, lo=0.0, hi=1.0, hi_open=True,
                                         json_key="inner.betas",
                                         metavar="B1,B2", help="Inner AdamW betas")
    weight_decay: float = _f(0.1, "weight-decay", _I, kind=float, lo=0.0, json_key="inner.weight_decay",
                             metavar="X", help="Inner AdamW weight decay")
    warmup_steps: int = _f(20, "warmup-steps", _I, kind=int, lo=0, hi=_MAX_INT, json_key="inner.warmup_steps",
                           metavar="N", help="Inner LR warmup steps")
    lr_schedule: str = _f("cosine", "lr-schedule", _I, kind=str, choices=LrSchedule, json_key="inner.lr_schedule",
                          help="Inner LR schedule after warmup")
    total_steps: int = _f(1000, "total-steps", _I, kind=int, lo=0, hi=_MAX_INT, json_key="inner.total_steps",
                          metavar="N", help="Inner steps per learner (schedule length; 0: unlimited)")
    grad_clip: float = _f(1.0, "grad-clip", _I, kind=float, lo=0.0, json_key="inner.grad_clip",
                          metavar="NORM", help="Gradient-norm clip (0 disables)")
    batch_size: int = _f(16, "batch-size", _I, kind=int, lo=1, hi=_MAX_INT, json_key="inner.batch_size",
                         metavar="N", help="Inner batch size per learner")
    codec: str = _f("int4", "codec", _C, kind=str, choices=Codec,
                    help="Outer-gradient codec")
    codec_block: int | None = _f(None, "codec-block", _C, kind=int, lo=2, hi=2**24, optional=True,
                                 metavar="N", help="Quantization block size (default 64 for int4, 256 for int8; sparse: chunk, 1024)")
    codec_qmax: int | None = _f(None, "codec-qmax", _C, kind=int, lo=1, hi=127, optional=True,
                                metavar="Q", help="Largest |code| the int4/int8 encoders write (default 3 for int4: "
                                                  "29% fewer bytes than its whole range, 7; 127 for int8)")
    codec_density: float | None = _f(None, "codec-density", _C, kind=float, lo=0.0, lo_open=True, hi=1.0, optional=True,
                                     metavar="X", help="Sparse codec: fraction of each chunk's values sent (Top-k; default 0.02)")
    publish_density: float | None = _f(None, "publish-density", _C, kind=float, lo=0.0, lo_open=True, hi=1.0,
                                       optional=True, metavar="X",
                                       help="Sparse published deltas: fraction of each chunk's values sent "
                                            "(default: 2 x --codec-density, at most 1)")
    publish_codec: str | None = _f(None, "publish-codec", _C, kind=str, choices=Codec, optional=True,
                                   help="Codec of published fragment deltas (default: --codec; lockstep: none)")
    keyframe_every: int | None = _f(None, "keyframe-every", _C, kind=int, lo=1, hi=_MAX_INT, optional=True,
                                    metavar="N", help="Full (exact) payload every N versions (rule every), or at "
                                                      "most N versions apart (rule size); default 8, 64 with "
                                                      "sparse published deltas")
    keyframe_rule: str | None = _f(None, "keyframe-rule", _C, kind=str, choices=KeyframeRule, optional=True,
                                   help="every: a keyframe each --keyframe-every versions; size: when the deltas "
                                        "since the last one add up to its size (default with sparse published "
                                        "deltas; every otherwise)")
    error_feedback: bool = _f(True, "error-feedback", _C, kind=bool,
                              off="no-error-feedback", help="Learners add what the codec dropped from their last "
                                                            "contribution of a fragment to the next one (both "
                                                            "modes; nothing to add under codec none)")
    error_feedback_decay: float | None = _f(None, "error-feedback-decay", _C, kind=float, lo=0.0, hi=1.0, optional=True,
                                            metavar="BETA", help="Learners carry BETA times that residual (e <- BETA*e + "
                                                                 "delta; default 0.9 for sparse, 1 otherwise)")
    grace_gamma: float = _f(0.5, "grace-gamma", _F, kind=float, lo=0.0, hi=1.0, hi_open=True,
                            metavar="X", help="Grace window = gamma * slack of the overlap window")
    grace_max_s: float = _f(30.0, "grace-max", _F, kind=float, lo=0.0,
                            metavar="SECONDS", help="Upper bound of the grace window")
    max_tokens_per_step: int | None = _f(None, "max-tokens-per-step", _F, kind=int, lo=1, hi=_MAX_INT, optional=True,
                                         metavar="N", help="Tokens per inner step (batch x sequence x accumulation); "
                                                           "a contribution counts at most 2x this per step")
    max_staleness: int = _f(8, "max-staleness", _F, kind=int, lo=0, hi=_MAX_INT,
                            metavar="N", help="Oldest base accepted, in cycles of the fragment behind the latest "
                                              "version (discounted beyond 2)")
    checkpoint_every: int = _f(10, "checkpoint-every", _F, kind=int, lo=1, hi=_MAX_INT,
                               metavar="N", help="Outer-state checkpoint every N versions")
    lease_s: float = _f(10.0, "lease", _F, kind=float, lo=0.0, lo_open=True,
                        metavar="SECONDS", help="Syncer lease")
    heartbeat_s: float = _f(2.0, "heartbeat", _F, kind=float, lo=0.0, lo_open=True,
                            metavar="SECONDS", help="Heartbeat interval")
    retain_versions: int = _f(16, "retain-versions", _F, kind=int, lo=1, hi=_MAX_INT,
                              metavar="N", help="Versions kept per fragment by GC")
    gc_grace_s: float = _f(300.0, "gc-grace", _F, kind=float, lo=0.0, lo_open=True,
                           metavar="SECONDS", help="Age before GC may delete an orphan (> 0)")
    run_id: str = ""
    created_s: float = 0.0
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for f in hyperparameters():
            object.__setattr__(self, f.name, checked(f, getattr(self, f.name)))
        # defaults that depend on other fields, filled in once so every reader sees the same value
        self._mode_defaults()
        if self.codec_block is None:
            object.__setattr__(self, "codec_block", codec.DEFAULT_BLOCK_SIZE.get(self.codec, 64))
        if self.codec_qmax is None:
            object.__setattr__(self, "codec_qmax", codec.DEFAULT_QMAX.get(self.codec))
        sparse_run = "sparse" in (self.codec, self.publish_codec)
        if self.codec_density is None and sparse_run:
            object.__setattr__(self, "codec_density", codec.SPARSE_DEFAULT_DENSITY)
        if self.publish_density is None and self.codec_density is not None:  # a new run's (from_record: old rule)
            object.__setattr__(self, "publish_density", min(1.0, codec.SPARSE_PUBLISH_FACTOR * self.codec_density))
        if self.keyframe_rule is None:  # a new run's (from_record: "every", the rule before 0.2.4)
            object.__setattr__(self, "keyframe_rule", "size" if self.publish_codec == "sparse" else "every")
        if self.keyframe_every is None:  # a sparse delta is ~1/60 of a keyframe: the size rule decides
            object.__setattr__(self, "keyframe_every", SPARSE_KEYFRAME_EVERY if self.publish_codec == "sparse" else 8)
        if self.error_feedback_decay is None:  # SparseLoCo's decayed accumulator; 1: plain error feedback
            object.__setattr__(self, "error_feedback_decay", 0.9 if self.codec == "sparse" else 1.0)
        for name, value in CODEC_OUTER_DEFAULTS["sparse" if self.codec == "sparse" else None].items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)
        if self.codec_density is not None and codec.topk(self.codec_density, self.codec_block) < 1:
            raise _bad("codec-density", "too small for the block size")
        try:
            codec.check_qmax(self.codec, self.codec_qmax)
        except UsageError as exc:
            raise _bad("codec-qmax", str(exc).removeprefix("--codec-qmax ")) from None
        if self.num_fragments > self.sync_every:
            raise _bad("fragments", f"P={self.num_fragments} > H={self.sync_every}: each fragment needs its own "
                                    "step offset; use --fragments <= --sync-every")
        if self.overlap_steps >= self.sync_every:
            raise _bad("overlap-steps", f"tau must be in [0, H) = [0, {self.sync_every})")
        if self.lease_s <= self.heartbeat_s:
            raise _bad("lease", f"the lease ({self.lease_s:g} s) must be longer than the heartbeat interval "
                                f"({self.heartbeat_s:g} s)")

    def with_mode(self, mode: str) -> "RunConfig":
        """This config in another mode: the settings a lockstep run fixes back to that mode's
        defaults; the others (alpha) as they were."""
        return dataclasses.replace(self, mode=mode, **{name: None for name, _, _ in MODE_DEFAULTS})

    def _mode_defaults(self) -> None:
        """Fill in the settings whose default depends on the mode. A lockstep run (Streaming
        DiLoCo: every live learner in every merge) has one value for each: a plain mean,
        overwrite on receive, no lr scaling, exact published values; another value given
        for one of them is refused, not silently replaced."""
        lockstep = self.mode == "lockstep"
        for name, decoupled, locked in MODE_DEFAULTS:
            value = getattr(self, name)
            if value is None:
                object.__setattr__(self, name, locked if lockstep else (self.codec if decoupled is None else decoupled))
            elif lockstep and value != locked:
                f = self.__dataclass_fields__[name]
                raise _bad(f.metadata["flag"], f"{json.dumps(value)}: a lockstep run always uses "
                                               f"{json.dumps(locked)} (leave it unset, or use --mode decoupled)")
        for name, decoupled, locked in MODE_DEFAULTS_FREE:
            if getattr(self, name) is None:
                object.__setattr__(self, name, locked if lockstep else decoupled)

    @property
    def publish_qmax(self) -> int | None:
        """The bound on the codes of published deltas: ``codec_qmax`` when they use the run's
        codec, else that codec's full range (None)."""
        return self.codec_qmax if self.publish_codec == self.codec else None

    @property
    def codec_topk(self) -> int | None:
        """Values per chunk of the sparse codec's uploads (None for the other codecs)."""
        return codec.topk(self.codec_density, self.codec_block) if self.codec == "sparse" else None

    # ----------------------------------------------------------- run.json
    def to_record(self, *, run_id: str, created_s: float | None = None) -> dict[str, Any]:
        """The run.json record of this config for run ``run_id``."""
        body: dict[str, Any] = {}
        for f in hyperparameters():
            value = getattr(self, f.name)
            path = _json_key(f).split(".")
            target = body
            for part in path[:-1]:
                target = target.setdefault(part, {})
            target[path[-1]] = list(value) if isinstance(value, tuple) else value
        features = [*records.FEATURES, *([records.KEYFRAMES_BY_SIZE] if self.keyframe_rule == "size" else [])]
        return records.make("run", protocol_minor=records.PROTOCOL_MINOR, features=features,
                            run_id=run_id, created_s=time.time() if created_s is None else created_s,
                            nonce=records.new_nonce(), **body, **self.extra)

    @classmethod
    def from_record(cls, record: Mapping[str, Any], *, where: str = layout.RUN_CONFIG) -> RunConfig:
        """The config of a schema-valid run.json record; ProtocolError naming ``where``
        if a value is out of range."""
        _refuse_retired(record, where=where)
        rest = {k: v for k, v in record.items() if k not in RETIRED_KEYS}
        values: dict[str, Any] = {}
        for f in hyperparameters():
            path = _json_key(f).split(".")
            source: Any = rest
            for part in path[:-1]:
                source = source.get(part, {}) if isinstance(source, Mapping) else {}
            if isinstance(source, Mapping) and path[-1] in source:
                values[f.name] = source[path[-1]]
        _absent_means(values, default_codec=cls.codec)
        for f in hyperparameters():
            rest.pop(_json_key(f).split(".")[0], None)
        for meta in ("format", "protocol_version", "protocol_minor", "features", "nonce"):
            rest.pop(meta, None)
        try:
            return cls(**values, run_id=str(rest.pop("run_id", "")), created_s=float(rest.pop("created_s", 0.0)),
                       extra=rest)
        except UsageError as exc:
            raise ProtocolError(f"{where}: invalid run config: {exc}") from None

    def differences(self, other: RunConfig) -> list[str]:
        """Flags whose values differ between two configs ([] when they are the same run)."""
        return [f"--{flag(f)}: {getattr(other, f.name)!r} there, {getattr(self, f.name)!r} here"
                for f in hyperparameters() if getattr(self, f.name) != getattr(other, f.name)]

    # ----------------------------------------------------------- flags and files
    @classmethod
    def from_flags(cls, values: Mapping[str, Any]) -> RunConfig:
        """A config from {flag: value} (flag names without ``--``, ``-`` or ``_``);
        missing flags keep their defaults. Unknown flags are a UsageError."""
        by_key = {setting_key(f): f for f in hyperparameters()}
        kwargs = {}
        for key, value in values.items():
            f = by_key.get(key.replace("-", "_"))
            if f is None:
                raise UsageError(f"unknown setting {key!r}; `ddiloco init --print-config` lists them")
            kwargs[f.name] = value
        return cls(**kwargs)


def _absent_means(values: dict[str, Any], *, default_codec: str) -> None:
    """Fill in the settings a run.json from before them lacks (or gives as null) with what
    they meant then (PROTOCOL.md, the run.json table)."""
    if "codec_qmax" not in values:  # the codec's whole range
        values["codec_qmax"] = codec.QMAX.get(values.get("codec", default_codec))
    if values.get("publish_density") is None and values.get("codec_density") is not None:
        values["publish_density"] = values["codec_density"]  # the uploads' density
    values.setdefault("keyframe_rule", "every")  # a run from before the size rule
    if values.get("held_alpha") is None:  # before 0.2.8: alpha (always in run.json)
        values["held_alpha"] = values.get("alpha")


def _refuse_retired(record: Mapping[str, Any], *, where: str) -> None:
    """ProtocolError when ``record`` (a run.json) names a retired setting's value."""
    for key, retired in RETIRED_VALUES.items():
        value = record.get(key)
        if key in record and any(value == r and type(value) is type(r) for r in retired):
            raise ProtocolError(
                f"{where}: {key} = {json.dumps(value)} was retired in ddiloco 0.2.0 (PROTOCOL.md \"Retired "
                f"settings\"); ddiloco {LAST_VERSION_WITH_RETIRED} still runs it: "
                f"pip install 'ddiloco=={LAST_VERSION_WITH_RETIRED}'")


def hyperparameters() -> list[dataclasses.Field]:
    """The fields that are flags of `ddiloco init` (all but run_id, created_s and extra)."""
    return [f for f in dataclasses.fields(RunConfig) if "flag" in f.metadata]


def flag(f: dataclasses.Field) -> str:
    """The field's flag of `ddiloco init`, without ``--``."""
    return f.metadata["flag"]


def setting_key(f: dataclasses.Field) -> str:
    """The field's key in ``from_flags`` and config files: its flag with ``_`` for ``-``
    (also the name of init's parameter)."""
    return flag(f).replace("-", "_")


def _json_key(f: dataclasses.Field) -> str:
    return f.metadata["json_key"] or f.name


# ----------------------------------------------------------------- reading
def read_run_config(store: Store) -> RunConfig:
    """The validated config of the run at ``store`` (RunNotFoundError, ProtocolError)."""
    return RunConfig.from_record(ledger.read_run(store), where=f"{store.url}/{layout.RUN_CONFIG}")


def wait_for_run_config(store: Store, *, timeout_s: float, on_wait: Callable[[float], None] = lambda _: None,
                        sleep: Callable[[float], None] = time.sleep, first_delay_s: float = 0.5,
                        max_delay_s: float = 10.0) -> RunConfig:
    """``read_run_config``, waiting up to ``timeout_s`` (may be inf) for run.json to
    appear: polls with exponential backoff from ``first_delay_s`` to ``max_delay_s``,
    calling ``on_wait(waited_s)`` before each sleep. A present but invalid run.json
    is an error at once; after the timeout, RunNotFoundError."""
    start = time.monotonic()
    delay = first_delay_s
    while True:
        try:
            return read_run_config(store)
        except ledger.RunNotFoundError:
            waited = time.monotonic() - start
            if waited + delay > timeout_s:
                raise
        on_wait(waited)
        sleep(delay)
        delay = min(max_delay_s, delay * 2)


__all__ = ["RunConfig", "Codec", "Merge", "OuterLrScaling", "Mode", "LrSchedule", "PANELS", "hyperparameters",
           "flag", "setting_key", "read_run_config", "wait_for_run_config", "MODE_DEFAULTS", "MODE_DEFAULTS_FREE", "CODEC_OUTER_DEFAULTS"]
