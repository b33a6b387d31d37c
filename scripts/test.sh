#!/usr/bin/env bash
# The test command (README): set up .venv on a fresh machine if needed, then run pytest.
#   scripts/test.sh                 # the whole suite: tests/unit and tests/integration, slow runs included (CI)
#   scripts/test.sh unit            # tests/unit only: in-process, no servers, no processes (the quick check)
#   scripts/test.sh integration     # tests/integration only: S3/GCS servers, real processes, end-to-end runs
#   scripts/test.sh -m "not slow"   # without the multi-process end-to-end runs
#   scripts/test.sh unit -k store -x  # extra arguments go to pytest
#   scripts/test.sh --under-load    # the same with two busy `yes > /dev/null` processes beside it, which
#                                   # it stops at exit: no test may depend on the machine's speed
# DDILOCO_VENV=PATH uses an existing environment as it is (no set-up), e.g. one shared by worktrees.
# Tests run in DDILOCO_TEST_WORKERS pytest-xdist workers (default: one per core, at most 4; 0: all in
# this process): most of the multi-process tests wait on leases, polls and process start-up, which
# another worker's tests fill. `-n N` among the extra arguments overrides it.
set -euo pipefail
cd "$(dirname "$0")/.."

under_load=0
if [ "${1:-}" = "--under-load" ]; then
  under_load=1
  shift
fi

part=()  # empty: pyproject's testpaths (both parts)
if [ "${1:-}" = "unit" ] || [ "${1:-}" = "integration" ]; then
  part=("tests/$1")
  shift
fi

if [ -n "${DDILOCO_VENV:-}" ]; then
  # shellcheck disable=SC1091
  source "$DDILOCO_VENV/bin/activate"
else
  bash scripts/setup_env.sh
  # shellcheck disable=SC1091
  source .venv/bin/activate
fi

workers=${DDILOCO_TEST_WORKERS:-$(nproc)}
if [ -z "${DDILOCO_TEST_WORKERS:-}" ] && [ "$workers" -gt 4 ]; then
  workers=4
fi
# load with chunks of one: a worker takes the next test when it is free; tests/conftest.py puts the
# longest first, so the long runs spread over the workers and the run ends on short tests (worksteal
# split the list in halves up front: one worker got every long run and ran them one after another)
pytest_cmd=(python -m pytest -q -p no:cacheprovider -n "$workers" --dist load --maxschedchunk 1)

if [ "$under_load" = 0 ]; then
  exec "${pytest_cmd[@]}" ${part[@]+"${part[@]}"} "$@"
fi

hogs=()
stop_hogs() {
  for pid in "${hogs[@]}"; do
    kill "$pid" 2>/dev/null || true
  done
}
trap stop_hogs EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
for _ in 1 2; do
  yes > /dev/null &
  hogs+=("$!")
done
echo "under load: yes > /dev/null as pids ${hogs[*]}; $(uptime)"
start_s=$(date +%s)
rc=0
"${pytest_cmd[@]}" ${part[@]+"${part[@]}"} "$@" || rc=$?
echo "under load: pytest exit $rc after $(( $(date +%s) - start_s )) s; $(uptime)"
exit "$rc"
