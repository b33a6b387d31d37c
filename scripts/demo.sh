#!/usr/bin/env bash
# The main job (README): a real Decoupled DiLoCo run on a local-directory bucket.
# Sets up .venv if needed, then: init + one syncer + three learners on the built-in
# GPT and Shakespeare (~3 minutes on 2 CPU cores), kill -9 of one learner half-way
# and its restart, a summary and a loss plot under runs/demo/.
#   scripts/demo.sh [--duration 150] [--learners 3] [--workdir runs/demo]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
source .venv/bin/activate
exec ddiloco demo "$@"
