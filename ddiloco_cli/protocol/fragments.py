"""Balanced fragmentation of a model into P fragments (docs/design.md, "Fragments and
the schedule"; PROTOCOL.md "Fragment plan").

A fragment is a tuple of `TensorSlice`s: whole parameters, or row ranges (dim 0)
of parameters too large for one fragment. The plan is a pure function of the
parameter names, shapes and P, so every learner and syncer that sees the same
model computes the same plan; the syncer still writes it to the bucket and
learners check their model against it (`FragmentPlan.check_model`).

Balance is by element count (all payloads are encoded from fp32 values, so the
byte size on the wire is proportional to numel for a given codec).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:  # torch is imported where tensors are touched: `status` and `inspect` read plans without it
    import torch

from ddiloco_cli.errors import ProtocolError, UsageError

PLAN_FORMAT_VERSION = 1


def dtype_name(dtype: torch.dtype | str) -> str:
    """'float32' for torch.float32 or 'torch.float32'."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class TensorSlice:
    """Rows [row_start, row_end) along dim 0 of parameter `name`.

    A 0-d parameter has one "row": row_start=0, row_end=1.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    row_start: int
    row_end: int

    @property
    def num_rows(self) -> int:
        return self.shape[0] if self.shape else 1

    @property
    def is_whole(self) -> bool:
        return self.row_start == 0 and self.row_end == self.num_rows

    @property
    def key(self) -> str:
        """Tensor key in payloads: the name, or 'name[a:b]' for a row slice."""
        return self.name if self.is_whole else f"{self.name}[{self.row_start}:{self.row_end}]"

    @property
    def slice_shape(self) -> tuple[int, ...]:
        if not self.shape:
            return ()
        return (self.row_end - self.row_start, *self.shape[1:])

    @property
    def numel(self) -> int:
        return math.prod(self.slice_shape)

    def view_of(self, tensor: torch.Tensor) -> torch.Tensor:
        """The part of `tensor` (the whole parameter) this slice covers, as a view."""
        if not self.shape or self.is_whole:
            return tensor
        return tensor[self.row_start : self.row_end]


@dataclass(frozen=True)
class FragmentPlan:
    num_fragments: int
    fragments: tuple[tuple[TensorSlice, ...], ...]

    # --- serialisation -------------------------------------------------------

    def to_json(self) -> dict:
        return {
            "format": PLAN_FORMAT_VERSION,
            "num_fragments": self.num_fragments,
            "fragments": [
                [
                    {
                        "name": s.name,
                        "shape": list(s.shape),
                        "dtype": s.dtype,
                        "row_start": s.row_start,
                        "row_end": s.row_end,
                    }
                    for s in frag
                ]
                for frag in self.fragments
            ],
        }

    @classmethod
    def from_json(cls, d: Any) -> "FragmentPlan":
        """Parse and validate a plan read from the bucket; raises ProtocolError."""

        def bad(msg: str) -> ProtocolError:
            return ProtocolError(f"invalid fragment plan: {msg}")

        def is_int(x: Any) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        if not isinstance(d, dict):
            raise bad("expected a JSON object")
        fmt = d.get("format", PLAN_FORMAT_VERSION)
        if not is_int(fmt) or fmt > PLAN_FORMAT_VERSION:
            raise bad(f"format {fmt!r} is newer than this ddiloco understands; upgrade ddiloco")
        num = d.get("num_fragments")
        frags = d.get("fragments")
        if not is_int(num) or num < 1:
            raise bad(f"num_fragments must be a positive integer, got {num!r}")
        if not isinstance(frags, list) or len(frags) != num:
            raise bad(f"expected {num} fragments")
        out: list[tuple[TensorSlice, ...]] = []
        tensors: dict[str, tuple[tuple[int, ...], str]] = {}
        rows_seen: dict[str, list[tuple[int, int]]] = {}
        for p, frag in enumerate(frags):
            if not isinstance(frag, list) or not frag:
                raise bad(f"fragment {p} must be a non-empty list")
            slices = []
            for item in frag:
                if not isinstance(item, dict):
                    raise bad(f"fragment {p}: slice must be an object")
                name, shape, dtype = item.get("name"), item.get("shape"), item.get("dtype")
                a, b = item.get("row_start"), item.get("row_end")
                if not isinstance(name, str) or not name:
                    raise bad(f"fragment {p}: bad tensor name {name!r}")
                if not isinstance(shape, list) or not all(is_int(x) and x >= 0 for x in shape):
                    raise bad(f"{name}: bad shape {shape!r}")
                if not isinstance(dtype, str):
                    raise bad(f"{name}: bad dtype {dtype!r}")
                rows = shape[0] if shape else 1
                if not (is_int(a) and is_int(b) and 0 <= a < b <= rows):
                    raise bad(f"{name}: bad row range [{a!r}:{b!r}] for {rows} rows")
                prev = tensors.setdefault(name, (tuple(shape), dtype))
                if prev != (tuple(shape), dtype):
                    raise bad(f"{name}: slices disagree on shape/dtype")
                rows_seen.setdefault(name, []).append((a, b))
                slices.append(TensorSlice(name, tuple(shape), dtype, a, b))
            out.append(tuple(slices))
        for name, ranges in rows_seen.items():
            ranges.sort()
            rows = tensors[name][0][0] if tensors[name][0] else 1
            pos = 0
            for a, b in ranges:
                if a != pos:
                    raise bad(f"{name}: row ranges overlap or leave a gap at row {pos}")
                pos = b
            if pos != rows:
                raise bad(f"{name}: row ranges cover {pos} of {rows} rows")
        return cls(num_fragments=num, fragments=tuple(out))

    # --- queries ---------------------------------------------------------------

    def fragment_numel(self, p: int) -> int:
        return sum(s.numel for s in self.fragments[p])

    def fragment_nbytes(self, p: int) -> int:
        """Size of fragment p in fp32 bytes."""
        return 4 * self.fragment_numel(p)

    def fragment_shapes(self, p: int) -> dict[str, tuple[int, ...]]:
        """{TensorSlice.key: slice shape} of fragment p (what `codec.decode_tensors`
        should be given as `expected`)."""
        return {s.key: s.slice_shape for s in self.fragments[p]}

    def tensor_shapes(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """{parameter name: (full shape, dtype)} of every parameter in the plan."""
        out: dict[str, tuple[tuple[int, ...], str]] = {}
        for frag in self.fragments:
            for s in frag:
                out.setdefault(s.name, (s.shape, s.dtype))
        return out

    def total_numel(self) -> int:
        return sum(self.fragment_numel(p) for p in range(self.num_fragments))

    def check_model(self, named_params: Mapping[str, Any]) -> None:
        """Raise UsageError naming the first tensor where `named_params` (tensors, or
        (shape, dtype) pairs) differs from the plan: missing, extra, shape or dtype."""
        want = self.tensor_shapes()
        have: dict[str, tuple[tuple[int, ...], str]] = {}
        for name, v in named_params.items():
            if hasattr(v, "shape") and hasattr(v, "dtype"):  # a tensor
                have[name] = (tuple(v.shape), dtype_name(v.dtype))
            else:
                shape, dtype = v
                have[name] = (tuple(shape), dtype_name(dtype))
        hint = ("the learner's model must be the run's: the task `ddiloco init --task` named (run.json's "
                "`task`, and its arguments after `?`; `ddiloco inspect URL` shows it), with the same source")
        for name, (shape, dtype) in want.items():
            if name not in have:
                raise UsageError(f"model mismatch: tensor {name!r} of the run is missing from this model; {hint}")
            hshape, hdtype = have[name]
            if hshape != shape:
                raise UsageError(
                    f"model mismatch: tensor {name!r} has shape {list(hshape)} here but "
                    f"{list(shape)} in the run; {hint}"
                )
            if hdtype != dtype:
                raise UsageError(
                    f"model mismatch: tensor {name!r} has dtype {hdtype} here but {dtype} in the run; {hint}"
                )
        for name in have:
            if name not in want:
                raise UsageError(f"model mismatch: this model has a tensor {name!r} the run does not; {hint}")


def named_shapes_of(model: torch.nn.Module) -> dict[str, tuple[tuple[int, ...], str]]:
    """{name: (shape, dtype)} of the model's parameters, in model order (tied
    parameters appear once, as in `named_parameters()`)."""
    return {n: (tuple(p.shape), dtype_name(p.dtype)) for n, p in model.named_parameters()}


def plan_fragments(
    named_shapes: Mapping[str, tuple[tuple[int, ...], str]],
    num_fragments: int,
    *,
    split_rows: bool = True,
) -> FragmentPlan:
    """Greedy balanced bin-packing of parameters into `num_fragments` fragments.

    With split_rows, a parameter larger than the fair share ceil(total / P) is cut
    along dim 0 into near-equal row ranges of at most the fair share each (a single
    row may still exceed it). Pieces are then placed largest first into the
    currently lightest fragment; ties are broken by model order and then by the
    lowest fragment index, so the plan is deterministic. Inside a fragment, slices
    are listed in model order.

    Raises UsageError when P < 1 or P exceeds the number of pieces.
    """
    if num_fragments < 1:
        raise UsageError(f"--fragments must be >= 1, got {num_fragments}")
    order = {name: i for i, name in enumerate(named_shapes)}
    total = sum(math.prod(shape) for shape, _ in named_shapes.values())
    fair = max(1, -(-total // num_fragments))

    pieces: list[TensorSlice] = []
    for name, (shape, dtype) in named_shapes.items():
        shape = tuple(int(x) for x in shape)
        dtype = dtype_name(dtype)
        numel = math.prod(shape)
        rows = shape[0] if shape else 1
        if split_rows and shape and numel > fair and rows > 1:
            row_numel = max(1, numel // rows)
            max_rows = max(1, fair // row_numel)
            num_pieces = -(-rows // max_rows)
            # near-equal row ranges: the first `rows % num_pieces` get one more row
            base, extra = divmod(rows, num_pieces)
            start = 0
            for i in range(num_pieces):
                end = start + base + (1 if i < extra else 0)
                pieces.append(TensorSlice(name, shape, dtype, start, end))
                start = end
        else:
            pieces.append(TensorSlice(name, shape, dtype, 0, rows))

    if num_fragments > len(pieces):
        raise UsageError(
            f"--fragments {num_fragments} too large for this model: it splits into only "
            f"{len(pieces)} pieces; use --fragments <= {len(pieces)}"
        )

    pieces.sort(key=lambda s: (-s.numel, order[s.name], s.row_start))
    loads = [0] * num_fragments
    members: list[list[TensorSlice]] = [[] for _ in range(num_fragments)]
    for s in pieces:
        p = min(range(num_fragments), key=lambda i: (loads[i], i))
        loads[p] += s.numel
        members[p].append(s)
    frags = tuple(
        tuple(sorted(m, key=lambda s: (order[s.name], s.row_start))) for m in members
    )
    return FragmentPlan(num_fragments=num_fragments, fragments=frags)


class CopyOut(dict):
    """{slice key: fp32 CPU tensor} of a fragment whose device-to-host copies may still be
    running: on CUDA a send copies into pinned memory with ``non_blocking`` (the training thread
    does not wait for the device to reach the send), and whoever reads the values first waits
    for the copies (``landed``). ``event`` is None once they are done, or for a copy made on
    the host."""

    event: Any = None

    def done(self) -> bool:
        """Whether the copies have landed, without waiting for them."""
        if self.event is not None and self.event.query():
            self.event = None
        return self.event is None

    def landed(self) -> "CopyOut":
        ev = self.event
        if ev is not None:
            ev.synchronize()  # any thread; a finished event returns at once
            self.event = None
        return self


def landed(values: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    """``values``, their device-to-host copies finished (a ``CopyOut``: waits for them; any
    other mapping is returned as it is)."""
    return values.landed() if isinstance(values, CopyOut) else values


def gather_fragment(plan: FragmentPlan, p: int, params: Mapping[str, torch.Tensor], *,
                    non_blocking: bool = False) -> CopyOut:
    """{slice key: fp32 CPU copy} of fragment p of `params` (detached, contiguous).
    ``non_blocking``: a fragment on a CUDA device is copied into pinned memory without waiting
    for the copies; the ``CopyOut``'s values are valid once ``landed`` (the stream's order makes
    them the values at this point of the step, whatever the device runs after)."""
    import torch

    out = CopyOut()
    devices = set()
    for s in plan.fragments[p]:
        view = s.view_of(params[s.name]).detach()
        if non_blocking and view.device.type == "cuda":
            dst = out[s.key] = torch.empty(view.shape, dtype=torch.float32, pin_memory=True)
            dst.copy_(view, non_blocking=True)  # a bf16 view is cast on the device, then copied
            devices.add(view.device)
        else:
            out[s.key] = view.to(device="cpu", dtype=torch.float32, copy=True).contiguous()
    if devices:
        if len(devices) > 1:  # one event marks one stream: a fragment on several devices is waited for here
            for d in devices:
                torch.cuda.synchronize(d)
        else:
            out.event = torch.cuda.Event()
            # after the copies, on the stream they were queued on (the parameters' device's, which
            # need not be the current device: --device cuda:1 in one process)
            out.event.record(torch.cuda.current_stream(devices.pop()))
    return out


def scatter_fragment(
    plan: FragmentPlan,
    p: int,
    params: Mapping[str, torch.Tensor],
    values: Mapping[str, torch.Tensor],
) -> None:
    """Copy `values` (keyed by slice key) into fragment p of `params` in place,
    casting to each parameter's dtype and device. Every key must be present."""
    import torch

    with torch.no_grad():
        for s in plan.fragments[p]:
            v = values[s.key]
            dst = s.view_of(params[s.name])
            assert tuple(v.shape) == tuple(dst.shape), (s.key, tuple(v.shape), tuple(dst.shape))
            dst.copy_(v)


def assemble_parameters(plan: FragmentPlan, values: dict[int, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Full fp32 parameters {name: tensor} from per-fragment values keyed by slice key
    (``TensorSlice.key``); row slices are written into rows [row_start, row_end)."""
    import torch

    out: dict[str, torch.Tensor] = {}
    for name, (shape, _) in plan.tensor_shapes().items():
        out[name] = torch.empty(shape, dtype=torch.float32)
    for p, frag in enumerate(plan.fragments):
        for s in frag:
            v = values[p][s.key]
            s.view_of(out[s.name]).copy_(v.reshape(s.slice_shape))
    return out
