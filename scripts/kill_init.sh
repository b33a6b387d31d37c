#!/bin/bash
# kill -9 `ddiloco init` at N seeded random points after plan.json, rerun the same init, verify the run.
# Run from the repository root: scripts/kill_init.sh [N]. Prints how many runs ended in each state.
N=${1:-12}; RANDOM=7; D=$(mktemp -d); ARGS="--task $PWD/tests/support/wide_task.py:WideTask --fragments 8 --sync-every 8 --codec none"
trap "rm -rf $D" EXIT
declare -A out
for i in $(seq 1 $N); do
  U=$D/run$i
  python -m ddiloco_cli init $U $ARGS >/dev/null 2>&1 & P=$!
  while [ ! -f $U/plan.json ] && kill -0 $P 2>/dev/null; do sleep 0.01; done
  sleep $(python -c "print($RANDOM/32767*1.5)"); kill -9 $P 2>/dev/null; wait $P 2>/dev/null
  if [ -f $U/run.json ]; then state=complete; elif [ -f $U/plan.json ]; then state=half-made; else state=nothing; fi
  python -m ddiloco_cli init $U $ARGS >$D/log$i 2>&1; rc=$?
  python -m ddiloco_cli inspect $U --verify >/dev/null 2>&1; v=$?
  key="$state rerun_rc=$rc verify_rc=$v"; out[$key]=$(( ${out[$key]:-0} + 1 ))
done
for k in "${!out[@]}"; do echo "${out[$k]} x $k"; done
