#!/usr/bin/env bash
# The test command (README): set up .venv on a fresh machine if needed, then run pytest.
#   scripts/test.sh                 # the whole suite (~minutes on 2 cores)
#   scripts/test.sh -k store -x     # extra arguments go to pytest
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
source .venv/bin/activate
exec python -m pytest -q -p no:cacheprovider "$@"
