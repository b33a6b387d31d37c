"""Helpers shared by the tests (tests/unit, tests/integration); fixtures are in tests/conftest.py.

* ``runs``: the tiny task, a recording store, runs and contributions made by hand, a
  ``Syncer`` stepped by hand;
* ``built_run``: a local run built through real merges, and ``ddiloco`` run in-process;
* ``hostile``: a JSON bomb and the one-line error check of the hostile-input tests;
* ``procs``: real ``ddiloco`` processes (the benchmarks' launcher) and waiting for events;
* ``moto_proc``: the S3 test server's own process; ``servers``: the S3 and GCS test servers;
* ``wide_task``: a task big enough that ``init`` can be killed halfway.
"""

from pathlib import Path

SUPPORT = Path(__file__).resolve().parent
REPO = SUPPORT.parents[1]  # the repository root
