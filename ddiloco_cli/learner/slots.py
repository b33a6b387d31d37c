"""Fragment-sized blocks of memory that the training process and its io helper process
(``iohelper``) both map: a fragment's values at a send (theta), the base handed over at the
start, the increment of a received version. Each block is one file in ``/dev/shm`` (a
temporary directory where there is none), mapped shared by both processes and unlinked as soon
as the helper has mapped it, so nothing is left behind when either process dies. A block holds
any fragment (the largest one's size); ``views(slot, p)`` are fragment p's tensors in it, by
slice key, in the plan's order. Nothing here decides who may write a block: ``ioproc.IoProcess``
hands them out."""

from __future__ import annotations

import os
import tempfile
import uuid

import torch

from ddiloco_cli.protocol.fragments import FragmentPlan

Tensors = dict[str, torch.Tensor]


def shm_dir() -> str:
    """Where the blocks' files go: memory-backed ``/dev/shm`` on Linux, else the temp dir."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class SlotTable:
    """The blocks one process has mapped, and cached views of a fragment in each (the same dict
    object every time: the learner compares a flight's theta with a ready version's by
    identity)."""

    def __init__(self, plan: FragmentPlan):
        self.plan = plan
        self.numel = max(plan.fragment_numel(p) for p in range(plan.num_fragments))
        self.flat: dict[int, torch.Tensor] = {}
        self.paths: dict[int, str] = {}
        self._views: dict[tuple[int, int], Tensors] = {}
        self._owner: dict[int, tuple[int, int]] = {}  # id(views dict) -> (slot, fragment)

    def create(self) -> tuple[int, str]:
        """A new block (the creating side): its number and its file, to hand to ``attach``."""
        sid = len(self.flat)
        path = os.path.join(shm_dir(), f"ddiloco-{os.getpid()}-{uuid.uuid4().hex[:12]}-{sid}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, 4 * self.numel)
        finally:
            os.close(fd)
        self.flat[sid] = torch.from_file(path, shared=True, size=self.numel, dtype=torch.float32)
        self.paths[sid] = path
        return sid, path

    def attach(self, sid: int, path: str) -> None:
        """Map the block ``create`` made (the other side), then unlink its file: the two mappings
        keep the memory while they live."""
        self.flat[sid] = torch.from_file(path, shared=True, size=self.numel, dtype=torch.float32)
        self.paths[sid] = path
        _unlink(path)

    def unlink_all(self) -> None:
        """Remove the files still there (a helper that never mapped them)."""
        for path in self.paths.values():
            _unlink(path)

    def views(self, sid: int, p: int) -> Tensors:
        """{slice key: fragment p's tensor of that shape} in block ``sid``."""
        got = self._views.get((sid, p))
        if got is None:
            got, at = {}, 0
            for s in self.plan.fragments[p]:
                got[s.key] = self.flat[sid][at:at + s.numel].view(s.slice_shape)
                at += s.numel
            self._views[(sid, p)] = got
            self._owner[id(got)] = (sid, p)
        return got

    def slot_of(self, views: Tensors | None) -> int | None:
        """The block a ``views`` dict is in (None for any other dict)."""
        owner = None if views is None else self._owner.get(id(views))
        return None if owner is None else owner[0]


def copy_fragment_into(plan: FragmentPlan, p: int, params: dict[str, torch.Tensor], out: Tensors) -> Tensors:
    """Fragment p of ``params`` copied (as fp32) into ``out``'s tensors; returns ``out``."""
    with torch.no_grad():
        for s in plan.fragments[p]:
            out[s.key].copy_(s.view_of(params[s.name]).detach())
    return out
