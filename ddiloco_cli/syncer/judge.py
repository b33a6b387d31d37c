"""The one room that judges a contribution (PROTOCOL.md [V1]-[V3], [A2]).

Every check a syncer makes of a contribution is here, each answering with a ``Verdict``:

* ``accept``: it may be merged (with its staleness in cycles and staleness discount);
* ``refuse``: valid, but not merged now; it gets a ``refused`` ledger entry whose reason
  its learner reads (too stale, a base that can no longer be read); an accepted one whose
  norm is far above the running median carries the ``clip`` that scales it to the bound;
* ``quarantine``: invalid; no ledger entry (its key, seq and header cannot be trusted), a
  quarantine report is its record.

In the order a contribution meets them: its name (``name``), then its bytes (``payload``:
signature, decoding with the plan's shapes, header, codec, a known learner), then, when a
merge is near, its place in the fragment's history (``admission``: staleness, norm), and
last the merge itself (``non_finite``: a huge but finite contribution can overflow the
merged update, whose culprit is the largest). The callers (``intake``, ``decide``,
``commit``) act on the verdicts; nothing here writes to the bucket.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Callable, Collection, Sequence

from ddiloco_cli.errors import InvalidPayloadError, ProtocolError
from ddiloco_cli.numerics.quantized import DecodedTensors
from ddiloco_cli.protocol import layout, records
from ddiloco_cli.protocol.runconfig import RunConfig
from ddiloco_cli.protocol.signing import Trust
from ddiloco_cli.store.base import NotFound

ACCEPT, REFUSE, QUARANTINE = "accept", "refuse", "quarantine"
NORM_BOUND_FACTOR = 2.0  # a delta whose norm exceeds this many running medians is scaled down to it (clip)
NORM_WINDOW = 64  # accepted norms in the running median
NORM_MIN_SAMPLES = 2  # no bound before this many norms (merged, or other learners' pending) are known: two
# others bound the first merge of a learner that arrives with them (a sample of one would let one honest
# learner's norm alone bound another's)


@dataclass(frozen=True)
class Verdict:
    action: str  # ACCEPT, REFUSE or QUARANTINE
    reason: str = ""
    staleness: float = 0.0  # accepted by ``admission``: cycles behind, and its discount
    discount: float = 1.0
    clip: float = 1.0  # accepted by ``admission``: the factor that scales its delta to the norm bound

    @property
    def accepted(self) -> bool:
        return self.action == ACCEPT


ACCEPTED = Verdict(ACCEPT)


def norm_clip(norm: float, norms: Collection[float], floors: Sequence[Collection[float]] = ()) -> float:
    """The factor that scales a delta of ``norm`` down to NORM_BOUND_FACTOR medians of
    ``norms`` (the merged ones, as merged: a clipped one at the bound, and the other learners'
    pending ones); 1 within the bound or before NORM_MIN_SAMPLES norms are known. The median
    is never below that of any of ``floors`` (the other learners' pending norms; each other
    learner's newest norm): when every learner's norm grows at once (a learning-rate warmup,
    a loss spike) the older window does not cut them all, while one learner, never its own
    peer, still cannot raise its bound. Clipped, not refused: a learner whose data or
    learning rate makes bigger steps still counts, as far as an honest one could move it."""
    sample = list(norms)
    if len(sample) < NORM_MIN_SAMPLES or norm <= 0:
        return 1.0
    median = max([statistics.median(sample), *(statistics.median(f) for f in floors if f)])
    bound = NORM_BOUND_FACTOR * median
    return 1.0 if bound <= 0 or norm <= bound else bound / norm


def staleness_discount(staleness_cycles: float) -> float:
    """1 up to 2 cycles (a contribution normally trails by about one cycle: the others
    trained while it did; a learner 1.5x slower by about 1.5), then 2 / staleness."""
    return 1.0 if staleness_cycles <= 2.0 else 2.0 / staleness_cycles


class Judge:
    """The checks of one run (its settings, plan, trust) and the learners it knows."""

    def __init__(self, *, config: RunConfig, trust: Trust, is_known_learner: Callable[[str], bool]):
        self.config = config
        self.trust = trust
        self.is_known_learner = is_known_learner

    def name(self, key: str, fragment: int) -> tuple[Verdict, str, int]:
        """(verdict, learner id, seq) of a key listed under ``fragment``'s contributions."""
        parsed = layout.parse_contribution_key(key)
        if parsed is None or parsed[0] != fragment or not layout.valid_learner_id(parsed[1]):
            return Verdict(QUARANTINE, "not a valid contribution name"), "", -1
        return ACCEPTED, parsed[1], parsed[2]

    def admitted(self, learner_id: str, *, where: str) -> Verdict:
        """[A2] before the bytes are even read: in a run that requires signatures, a learner id
        with no admitted key cannot have signed anything (a flood under fake ids costs a LIST
        entry and a report each, never a download)."""
        try:
            self.trust.check_member(learner_id, role="learner", where=where)
        except ProtocolError as exc:
            return Verdict(QUARANTINE, str(exc))
        return ACCEPTED

    def signature(self, data: bytes, *, key: str, learner_id: str, where: str) -> Verdict:
        """[A2] on the raw bytes, before anything decodes them: signed by ``learner_id``'s
        admitted key (always accepted in a run that does not require signatures)."""
        try:
            self.trust.check_payload(data, kind="contribution", key=key, member_id=learner_id, where=where)
        except (InvalidPayloadError, ProtocolError) as exc:
            return Verdict(QUARANTINE, str(exc))
        return ACCEPTED

    def payload(self, data: bytes, *, fragment: int, key: str, learner_id: str, seq: int, where: str,
                decoded: tuple[DecodedTensors, dict[str, Any]] | InvalidPayloadError,
                signature_checked: bool = False) -> Verdict:
        """The bytes of a contribution: signed by its learner [A2] (checked first: a forged
        payload is reported as such), decoded within the plan's keys and shapes (``decoded``
        is the decoder's result or its error), a header that names its key and this run, the
        run's codec, and a learner the run knows (a heartbeat)."""
        try:
            if not signature_checked:  # intake checks it before decoding (``signature``)
                self.trust.check_payload(data, kind="contribution", key=key, member_id=learner_id, where=where)
            if isinstance(decoded, InvalidPayloadError):
                raise decoded
            tensors, header = decoded
            records.validate(header, "contribution", where=where)
            if header["run_id"] != self.config.run_id:
                raise InvalidPayloadError(f"{where}: belongs to run {header['run_id']}, not this run")
            if (header["fragment"], header["learner_id"], header["seq"]) != (fragment, learner_id, seq):
                raise InvalidPayloadError(f"{where}: header names fragment {header['fragment']} learner "
                                          f"{header['learner_id']} seq {header['seq']}, not its key")
            self._check_codec(tensors, where=where)
            if not self.is_known_learner(learner_id):
                raise InvalidPayloadError(f"{where}: unknown learner {learner_id!r} (no heartbeat in the run)")
        except (InvalidPayloadError, ProtocolError) as exc:
            return Verdict(QUARANTINE, str(exc))
        return ACCEPTED

    def _check_codec(self, tensors: DecodedTensors, *, where: str) -> None:
        """A contribution must use the run's codec (a learner may not upload fp32 in an int4 run):
        as its header declared it to the decoder (the header is parsed once)."""
        want = self.config.codec
        if tensors.codec != want:
            raise InvalidPayloadError(f"{where}: codec {tensors.codec!r}, but the run's codec is {want!r}")
        if want in ("int8", "int4", "sparse") and tensors.block_size != self.config.codec_block:
            raise InvalidPayloadError(f"{where}: block size {tensors.block_size}, but the run's is "
                                      f"{self.config.codec_block}")
        if want == "sparse" and tensors.topk != self.config.codec_topk:  # as dense as the run allows, no denser
            raise InvalidPayloadError(f"{where}: sparse topk {tensors.topk}, but the run's is {self.config.codec_topk}")

    def admission(self, *, base_version: int, version: int, staleness: Callable[[], float],
                  read_base: Callable[[], Any] | None, norm: float, norms: Collection[float],
                  floors: Sequence[Collection[float]] = ()) -> Verdict:
        """Whether a valid contribution on ``base_version`` may be merged into the version after
        ``version``: its base no more than ``max_staleness`` cycles behind (``staleness()``)
        and still readable (``read_base()``, when the merge reads it), and its norm within
        NORM_BOUND_FACTOR medians of ``norms``, floored by those of ``floors`` (``norm_clip``) [V2]."""
        max_stale = float(self.config.max_staleness)
        try:
            behind = staleness()
            if behind > max_stale:
                return Verdict(REFUSE, f"stale: base version {base_version} is {behind:.2f} cycles behind version "
                                       f"{version} (max_staleness {max_stale:g} cycles); re-base on the latest version")
            if read_base is not None:
                read_base()
        except (NotFound, ProtocolError, InvalidPayloadError) as exc:
            return Verdict(REFUSE, f"base version {base_version} can no longer be read ({exc}); "
                                   "re-base on the latest version")
        return Verdict(ACCEPT, staleness=behind, discount=staleness_discount(behind), clip=norm_clip(norm, norms, floors))

    @staticmethod
    def non_finite(norms: Sequence[float], error: Exception) -> tuple[int, Verdict]:
        """The merge of contributions with these norms was not finite (``error``): the index of
        the culprit (the largest outer gradient) and its verdict [V3]."""
        culprit = max(range(len(norms)), key=lambda i: norms[i])
        return culprit, Verdict(QUARANTINE, f"{error}; it had the largest outer gradient")
