"""Run moto's S3 app in its own process, one request at a time (see servers.py
``SerialMotoServer``), so the test process's GIL never slows the endpoint down.

    python tests/support/moto_proc.py        # prints the endpoint URL, then serves until killed
    DDILOCO_TEST_MOTO_LOG=requests.tsv python tests/support/moto_proc.py   # also logs every request:
        client app id (tests/support/procs.py names each process), method, path, seconds
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/

from support.servers import SerialMotoServer  # noqa: E402

if __name__ == "__main__":
    server = SerialMotoServer(request_log=os.environ.get("DDILOCO_TEST_MOTO_LOG"))
    server.start()
    print(server.endpoint_url, flush=True)
    while True:
        time.sleep(3600)
