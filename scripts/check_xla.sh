#!/usr/bin/env bash
# `ddiloco learn --device xla` for real: torch_xla 2.9 on the CPU PJRT backend.
#
# Creates a venv with torch 2.9.0 + torch_xla 2.9.0 once, outside the repo (about
# 7 GB: torch 2.9 pulls its CUDA libraries even where it only runs on CPU), installs
# this checkout into it, then on a local bucket in a temporary directory runs
# `ddiloco init` (tiny GPT), one syncer on CPU and one learner on `--device xla`
# (PJRT_DEVICE=CPU) for --steps inner steps. It checks that the syncer merged the
# XLA learner's contributions and that the loss fell (the learner's first vs last
# logged loss, and `ddiloco eval` of the global model before vs after), prints the
# figures and exits 1 when a check fails. Not part of scripts/test.sh (too big).
#
#   scripts/check_xla.sh [--steps 200]
#   DDILOCO_XLA_VENV=/path/to/venv   where the venv lives (default ~/.cache/ddiloco/xla-venv)
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD

steps=200
while [ $# -gt 0 ]; do
  case "$1" in
    --steps) steps="$2"; shift 2 ;;
    *) echo "usage: scripts/check_xla.sh [--steps N]" >&2; exit 2 ;;
  esac
done

venv="${DDILOCO_XLA_VENV:-$HOME/.cache/ddiloco/xla-venv}"
py="$venv/bin/python"
if ! "$py" -c "import torch_xla" 2>/dev/null; then
  echo "creating $venv (torch 2.9.0 + torch_xla 2.9.0, ~7 GB, several minutes)"
  python3 -m venv "$venv"
  nice "$py" -m pip install -q --upgrade pip
  nice "$py" -m pip install -q torch==2.9.0 torch_xla==2.9.0
fi
# editable, so the venv runs this checkout; torch>=2.4 is met by the venv's 2.9.0, which
# pip keeps (the xla extra only re-pins the same versions, so it is not needed here)
if ! nice "$py" -m pip install -q -e "$repo" > "$venv/ddiloco-install.log" 2>&1; then
  cat "$venv/ddiloco-install.log"; echo "FAIL: pip install -e $repo into $venv"; exit 1
fi
PJRT_DEVICE=CPU "$py" - <<'EOF'
import torch, torch_xla
assert torch.__version__.startswith("2.9.0"), f"the xla venv's torch became {torch.__version__}"
print(f"torch {torch.__version__}, torch_xla {torch_xla.__version__}")
EOF

work=$(mktemp -d -t ddiloco-xla.XXXXXX)
syncer_pid=""
cleanup() {
  if [ -n "$syncer_pid" ]; then kill "$syncer_pid" 2>/dev/null || true; wait "$syncer_pid" 2>/dev/null || true; fi
  rm -rf "$work"
}
trap cleanup EXIT
bucket="$work/bucket"
ddiloco="$venv/bin/ddiloco"
learner=xla0

# the demo's schedule (P=4, H=16, tau=6, constant lr 2e-3), at most --steps long
"$ddiloco" init "$bucket" --task ddiloco_cli.tasks.gpt:tiny -P 4 -H 16 --overlap-steps 6 --inner-lr 2e-3 \
  --warmup-steps 20 --lr-schedule constant --total-steps "$steps" --no-require-signatures > "$work/init.log" 2>&1
eval_loss() { nice "$ddiloco" eval "$bucket" --max-batches 8 --json | "$py" -c "import json,sys; print(json.load(sys.stdin)['val_loss'])"; }
eval_before=$(eval_loss)

# the syncer stays on torch's CPU device; --no-gc keeps every contribution for the checks below
nice "$ddiloco" sync "$bucket" --syncer-id xla-check --no-gc > "$work/sync.log" 2>&1 &
syncer_pid=$!

t0=$(date +%s)
if ! PJRT_DEVICE=CPU nice "$ddiloco" learn "$bucket" --learner-id "$learner" --device xla --steps "$steps" \
    --threads 1 > "$work/learn.log" 2>&1; then
  tail -n 40 "$work/learn.log"; echo "FAIL: the xla learner exited with an error"; exit 1
fi
learn_s=$(( $(date +%s) - t0 ))
if ! kill -0 "$syncer_pid" 2>/dev/null; then
  tail -n 20 "$work/sync.log"; echo "FAIL: the syncer exited before the learner finished"; exit 1
fi

# wait (up to 120 s) until every contribution the learner wrote is in a committed manifest
"$py" - "$bucket" "$learner" <<'EOF'
import json, pathlib, sys, time
bucket, learner = pathlib.Path(sys.argv[1]), sys.argv[2]
def pending():
    out = []
    for frag in sorted((bucket / "fragments").iterdir()):
        sent = [int(f.name.split(".")[0]) for f in (bucket / "contributions" / frag.name / learner).glob("*.safetensors")]
        latest = max(frag.glob("manifests/*.json"))
        seen = json.loads(latest.read_text()).get("high_water", {}).get(learner, -1)
        if sent and max(sent) > seen:
            out.append(frag.name)
    return out
deadline = time.monotonic() + 120
while (left := pending()) and time.monotonic() < deadline:
    time.sleep(0.5)
if left:
    print(f"WARNING: fragments {left}: the learner's last contribution is not merged after 120 s")
EOF
eval_after=$(eval_loss)

"$py" - "$bucket" "$learner" "$work/learn.log" "$steps" "$learn_s" "$eval_before" "$eval_after" <<'EOF'
import json, pathlib, re, sys
bucket, learner, log_path = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3]
steps, learn_s, eval_before, eval_after = int(sys.argv[4]), int(sys.argv[5]), float(sys.argv[6]), float(sys.argv[7])
logged = [(int(m[1]), float(m[2]), float(m[3]))
          for m in re.finditer(r"step (\d+) loss ([0-9.]+) lr \S+ ([0-9.]+) ms/step", pathlib.Path(log_path).read_text())]
versions = merged = 0
for manifest in sorted(bucket.glob("fragments/*/manifests/*.json")):
    entries = json.loads(manifest.read_text()).get("contributions", [])
    versions += bool(entries)
    merged += any(e["learner_id"] == learner and e.get("used") for e in entries)
failures = []
if not logged or logged[-1][0] != steps:
    failures.append(f"the learner logged {logged[-1][0] if logged else 'no'} steps, not {steps}")
first, last = (logged[0][1], logged[-1][1]) if logged else (float("nan"), float("nan"))
if not last < first:
    failures.append(f"the learner's loss did not fall ({first:.4f} -> {last:.4f})")
if not eval_after < eval_before:
    failures.append(f"the global model's eval loss did not fall ({eval_before:.4f} -> {eval_after:.4f})")
if merged == 0:
    failures.append("no committed version used a contribution of the xla learner")
print(f"steps            {logged[-1][0] if logged else 0} in {learn_s} s (with XLA compiles)")
print(f"step time        {logged[-1][2] if logged else float('nan'):.1f} ms (moving average at the last step)")
print(f"learner loss     {first:.4f} -> {last:.4f} (steps {logged[0][0] if logged else '-'} -> {logged[-1][0] if logged else '-'})")
print("loss by step     " + " ".join(f"{step}:{loss:.2f}" for step, loss, _ in logged))
print(f"eval loss        {eval_before:.4f} -> {eval_after:.4f} (global model, 8 val batches)")
print(f"versions merged  {merged} of {versions} committed versions used the xla learner's contributions")
for f in failures:
    print("FAIL:", f)
sys.exit(1 if failures else 0)
EOF
echo "OK: ddiloco learn --device xla trained and its contributions were merged"
