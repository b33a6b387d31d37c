#!/usr/bin/env bash
# Shared set-up for scripts/test.sh and scripts/demo.sh: creates .venv if absent,
# installs the CPU torch wheel first (pinned so pip never pulls a CUDA build),
# then the package with its test extra. Idempotent; fast when already done.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# shellcheck disable=SC1091
source .venv/bin/activate
stamp=.venv/.ddiloco-installed
# setup.py and the C source too: an editable install compiles ddiloco_cli/numerics/_native.c in place
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ setup.py -nt "$stamp" ] \
   || [ ddiloco_cli/numerics/_native.c -nt "$stamp" ]; then
  python -m pip install -q --upgrade pip
  python -m pip install -q "torch==${DDILOCO_TORCH_VERSION:-2.13.0}"
  python -m pip install -q -e ".[test]"
  touch "$stamp"
fi
