"""The learner tells FSDP2's DTensor parameters apart without importing torch.distributed.tensor
itself: that import (sympy, torch.fx's symbolic shapes) cost every learner ~50 MB of memory and
0.6 s of start-up, and a DTensor can exist only once its module is imported."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from support import REPO


def _run(code: str) -> str:
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=str(REPO), capture_output=True, text=True,
                         timeout=240)
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout


def test_the_learner_does_not_import_dtensor_and_still_recognises_one(tmp_path):
    out = _run(f"""
        import sys
        import torch
        import ddiloco_cli.learner.learn, ddiloco_cli.learner.sync
        from ddiloco_cli.learner.island import _is_dtensor
        print("imported", "torch.distributed.tensor" in sys.modules)
        print("plain", _is_dtensor(torch.zeros(3)))
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, distribute_tensor
        dist.init_process_group("gloo", rank=0, world_size=1, init_method="file://{tmp_path / 'pg'}")
        dt = distribute_tensor(torch.zeros(4), init_device_mesh("cpu", (1,)), [Replicate()])
        print("dtensor", _is_dtensor(dt), _is_dtensor(dt.to_local()))
        dist.destroy_process_group()
    """)
    assert out.split("\n")[:3] == ["imported False", "plain False", "dtensor True False"]
