#!/usr/bin/env bash
# The CUDA path for real, on a machine with a CUDA device and PyTorch but without the package
# registries (a lent GPU machine): the CUDA tests (tests/unit/test_cuda_copies.py: pinned,
# non-blocking copies at a send and a receive, the same bits as blocking ones; and the ordering
# rules, test_copy_out.py), then scripts/bench_gpu.py: a learner on the GPU against a
# local-directory bucket with a CPU syncer, its wall time per step against the plain loop's
# (and against the same learner with blocking copies, and with its io helper process), its own
# report of its cost; and the io helper's session on a CUDA model against the worker threads'.
#
#   scripts/check_gpu.sh --fetch-wheels    # here, with the registries: ddiloco's dependencies that
#                                          # a PyTorch image lacks, as wheels in .whl/ (py3.12, x86-64)
#   scripts/check_gpu.sh [--reps N] [--steps N] [--task big|mid] [--out DIR]   # there
#
# There, the wheels in .whl/ (if any) are installed into /tmp/site first, and the compiled
# kernels are built in place when a compiler is there (optional: torch's ops stand in). The
# bench's JSON goes to --out (default: $OUT when set, else /tmp).
set -euo pipefail
cd "$(dirname "$0")/.."

WHEELS=(zstandard==0.25.0 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0
        rpds-py==2026.9.1 tenacity==9.2.1 cryptography==51.0.1 cffi==2.1.1 pycparser==3.12)

if [ "${1:-}" = "--fetch-wheels" ]; then
  grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
  for w in "${WHEELS[@]}"; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      --platform manylinux_2_34_x86_64 -d .whl "$w"
  done
  du -sh .whl
  exit 0
fi

reps=3 steps=150 task=big out="${OUT:-/tmp}"
while [ $# -gt 0 ]; do
  case "$1" in
    --reps) reps="$2"; shift 2 ;;
    --steps) steps="$2"; shift 2 ;;
    --task) task="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    *) echo "usage: scripts/check_gpu.sh [--fetch-wheels] [--reps N] [--steps N] [--task big|mid] [--out DIR]" >&2
       exit 2 ;;
  esac
done

py=python3
if ls .whl/*.whl >/dev/null 2>&1; then
  $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
$py setup.py -q build_ext --inplace >/dev/null 2>&1 || echo "compiled kernels not built: torch's ops stand in"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
$py -c "import torch; from ddiloco_cli.numerics import native; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else '-', '| kernels:', native.describe())"
$py -m pytest -q -p no:cacheprovider tests/unit/test_cuda_copies.py tests/unit/test_copy_out.py
$py -m pytest -q -p no:cacheprovider tests/integration/test_io_process.py -k "cuda or staged or same_contributions" \
  -m "not s3"  # the io helper on the device (no moto there)
$py scripts/bench_gpu.py --task "$task" --steps "$steps" --skip 30 --reps "$reps" --json "$out/gpu.json"
