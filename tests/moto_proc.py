"""Run moto's S3 app in its own process, one request at a time (see conftest.py
``_SerialMotoServer``), so the test process's GIL never slows the endpoint down.

    python tests/moto_proc.py        # prints the endpoint URL, then serves until killed
    DDILOCO_TEST_MOTO_LOG=requests.tsv python tests/moto_proc.py   # also logs every request:
        client app id (tests/procs.py names each process), method, path, seconds
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from conftest import _SerialMotoServer  # noqa: E402

if __name__ == "__main__":
    server = _SerialMotoServer(request_log=os.environ.get("DDILOCO_TEST_MOTO_LOG"))
    server.start()
    print(server.endpoint_url, flush=True)
    while True:
        time.sleep(3600)
