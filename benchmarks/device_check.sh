#!/usr/bin/env bash
# The GPU checks of the runtime, as one prepared run for a lent GPU machine (the device tool):
# the CUDA-marked tests and the runtime benchmark on CUDA, results written under $OUT.
#
#   device run:  bash benchmarks/device_check.sh            (timeout_s 540 leaves time to rerun)
#   locally:     OUT=/tmp/gpu bash benchmarks/device_check.sh
#   dry run:     DEVICE=cpu PYTHON=.venv/bin/python bash benchmarks/device_check.sh   (the same steps on the CPU)
#
# It runs from the repository root with the machine's own Python (PYTHON, default python3, which
# on the lent machines holds a CUDA build of PyTorch) and PYTHONPATH=. — nothing is installed:
# the runtime needs torch, numpy, scikit-learn, xxhash, pyyaml (pytest and psutil for the tests),
# not Airflow, boto3 or tenacity. Without a GPU it stops at once, saying so.
set -uo pipefail
OUT=${OUT:-/tmp/elastic-ops-device}
PY=${PYTHON:-python3}
ITERATIONS=${ITERATIONS:-300}
REPEATS=${REPEATS:-3}
DEVICE=${DEVICE:-cuda}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
log() { echo "[device_check $(date -u +%H:%M:%S)] $*"; }

{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || true
  "$PY" - <<'EOF'
import platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda)
print("gpus", [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
print("nccl", torch.cuda.nccl.version() if torch.cuda.is_available() else None)
EOF
} | tee "$OUT/environment.txt"

missing=$("$PY" - <<'EOF'
import importlib.util
need = ["torch", "numpy", "sklearn", "xxhash", "yaml", "psutil", "pytest"]
print(" ".join(n for n in need if importlib.util.find_spec(n) is None))
EOF
)
if [ -n "$missing" ]; then
  log "missing Python packages: $missing (carry them as wheels: /work/.library/device/README.md)"
  exit 2
fi
gpus=$("$PY" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)')
if [ "$DEVICE" = cuda ] && [ "$gpus" -lt 1 ]; then
  log "no CUDA GPU visible here: nothing to check"
  exit 3
fi

status=0
# the single-GPU tests (tests/runtime/test_cuda.py) run their steps on the CPU in a dry run
[ "$DEVICE" = cpu ] && export ELASTIC_OPS_TEST_DEVICE=cpu
log "CUDA tests ($gpus GPU(s))"
"$PY" -m pytest -m cuda -q -p no:cacheprovider -rs --durations=0 tests/runtime 2>&1 | tee "$OUT/cuda_tests.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

workers=1
[ "$gpus" -ge 2 ] || [ "$DEVICE" = cpu ] && workers=1,2
log "runtime benchmark on $DEVICE, workers $workers, $ITERATIONS iterations x $REPEATS repeats"
"$PY" -m benchmarks.runtime_overhead --device "$DEVICE" --workers "$workers" \
  --iterations "$ITERATIONS" --repeats "$REPEATS" --out "$OUT/runtime_overhead_$DEVICE.json" \
  2>&1 | tee "$OUT/runtime_overhead_$DEVICE.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

log "done (status $status); results in $OUT"
exit $status
