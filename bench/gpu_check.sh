#!/usr/bin/env bash
# GPU check, for a lent GPU machine (torch + CUDA toolkit + ninja + pytest already installed, no
# internet). One run: build latentfast._C with the CUDA kernels, run the GPU tests of every op,
# run every benchmark suite on the GPU, print a results table last. Logs go to $OUT (the device
# tool's output folder) or bench/out/gpu. Sized to finish in under 8 minutes on an H200.
#
#   bash bench/gpu_check.sh            # full
#   QUICK=1 bash bench/gpu_check.sh    # smaller benchmark sweeps
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-bench/out/gpu}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" MAX_JOBS="${MAX_JOBS:-16}" PYTHONUNBUFFERED=1
status=0
step() { echo; echo "### $* ($(date +%T))"; }

step environment
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; "$PY" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"; } 2>&1 | tee "$OUT/env.txt"

step build
if ! LATENTFAST_BUILD_CUDA=1 "$PY" -m pip install --no-build-isolation --no-deps --no-index -e . >"$OUT/build.log" 2>&1; then
  tail -60 "$OUT/build.log"; echo "BUILD FAILED"; exit 1
fi
grep -A6 "latentfast build configuration" "$OUT/build.log" | head -8
"$PY" -c "import latentfast; print(latentfast.describe())" | tee -a "$OUT/env.txt"

step "GPU tests"
# every test that can use a GPU: the gpu-marked parity tests plus the suites' own CUDA paths
timeout 240 "$PY" -m pytest tests -q -m gpu -p no:cacheprovider --timeout 120 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

step "GPU benchmarks"
quick_flag=""; [ "${QUICK:-0}" = "1" ] && quick_flag="--quick"
# the suites with a GPU side: normalize (vs eager and vs D2D copy), decode (batch-to-device vs
# pinned H2D), replay (peak memory; scatter one launch vs loop). cache and balance are CPU-only.
timeout 300 "$PY" -m latentfast.cli bench $quick_flag --suite normalize --suite decode --suite replay --out "$OUT" 2>&1 \
  | tee "$OUT/bench.log" | tail -80
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

step "results"
"$PY" - "$OUT/bench.json" <<'PY'
import json, sys
data = json.load(open(sys.argv[1]))
for suite, report in data.get("suites", {}).items():
    print(f"[{suite}]")
    for key, value in (report.get("summary") or {}).items():
        print(f"  {key:<48} {value}")
for suite, err in data.get("errors", {}).items():
    print(f"[{suite}] FAILED: {err}")
PY
grep -E "passed|failed|error" "$OUT/gpu_tests.log" | tail -1
exit $status
