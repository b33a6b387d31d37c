"""The built-in GPT task's token files under real processes: several learners that start
at once on an empty data directory. The in-process task tests are in tests/unit/test_tasks.py."""

import os
import subprocess
import sys
from pathlib import Path


def test_concurrent_builders_do_not_corrupt_token_files(tmp_path, excerpt_dir):
    """Several learner processes starting at once on an empty data dir."""
    shared = tmp_path / "data"
    code = ("import sys; from ddiloco_cli.tasks.gpt import ensure_token_files, write_token_files, excerpt_text\n"
            "for _ in range(3): write_token_files(excerpt_text(), sys.argv[1], source='race')\n"
            "print(ensure_token_files(sys.argv[1])['num_train_tokens'])\n")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(shared)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(4)]
    results = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err for _, err in results]
    for name in ("train.bin", "val.bin"):
        assert (shared / name).read_bytes() == Path(excerpt_dir, name).read_bytes(), name
    assert sorted(os.listdir(shared)) == ["meta.json", "train.bin", "val.bin"]  # no temp files left
