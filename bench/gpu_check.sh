#!/usr/bin/env bash
# GPU check, for a lent GPU machine (torch with CUDA, Triton, pytest; no internet). One run, sized to
# fit one 10-minute device call with room to spare (BUDGET seconds in all, 480 by default):
#
#   0. refuse at once (exit 2) when no CUDA GPU is usable, saying what is missing;
#   1. build the native library (latentfast/_native.so: the CPU kernels; the GPU kernels are Triton,
#      which needs no build), capped in time;
#   2. run every `gpu` test (`multigpu` ones too when there are two GPUs); a skipped test fails the check;
#   3. run the GPU benchmark suites, quick sweeps by default (FULL=1 for the full ones);
#   4. print the results table, also when a step failed.
#
#   bash bench/gpu_check.sh                 # exit 0: everything ran and passed; 1: a step failed; 2: no GPU
#   FULL=1 BUDGET=560 bash bench/gpu_check.sh
#
# Logs and the suites' JSON go to $OUT (the device tool's output folder) or bench/out/gpu. A Python
# that refuses `pip install` (PEP 668) gets a venv with --system-site-packages first.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-bench/out/gpu}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
BUDGET="${BUDGET:-480}"
export PYTHONUNBUFFERED=1
status=0
declare -A RESULT=()
step() { echo; echo "### $* ($(date +%T), ${SECONDS}s of ${BUDGET}s)"; }
# seconds a step may take: what it asks for, but never into the last 30 s (kept for the table)
cap() { local left=$((BUDGET - SECONDS - 30)); ((left < $1)) && echo $((left > 5 ? left : 5)) || echo "$1"; }

step "GPU"
gpu=$(timeout 90 "$PY" - 2>/dev/null <<'PY'
import sys
try:
    import torch
except Exception as exc:
    print(f"torch cannot be imported ({exc})")
    sys.exit(1)
if torch.version.cuda is None:
    print(f"torch {torch.__version__} is built without CUDA")
    sys.exit(1)
if not torch.cuda.is_available():
    print(f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA GPU: no device or no driver")
    sys.exit(1)
print(f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}; torch {torch.__version__}, CUDA {torch.version.cuda}")
PY
) || {
  echo "gpu_check: FAILED, no CUDA GPU: ${gpu:-$PY could not run (timeout or crash)}" | tee "$OUT/gpu_check.txt"
  exit 2
}
echo "$gpu" | tee "$OUT/gpu_check.txt"
n_gpus=${gpu%% x *}  # from the line above: "N x NAME; torch V, CUDA X.Y"

step "python environment"
managed=$("$PY" -c 'import os, sys, sysconfig; print(int(sys.prefix == sys.base_prefix and os.path.exists(os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED"))))')
if [ "$managed" = 1 ]; then  # PEP 668: pip refuses to install into this Python; a venv that sees its packages
  "$PY" -m venv --system-site-packages --without-pip /tmp/latentfast-gpu-venv && PY=/tmp/latentfast-gpu-venv/bin/python
fi
echo "python: $PY"
timeout_flag=()
"$PY" -c "import pytest_timeout" 2>/dev/null && timeout_flag=(--timeout 120)  # else the step's own cap

step "build"
# The native library holds the CPU kernels only (the GPU kernels are Triton, compiled when first
# called against this machine's CUDA), so the build needs no nvcc and no torch: a few seconds.
if timeout "$(cap 150)" "$PY" -m pip install --no-build-isolation --no-deps --no-index -e . >>"$OUT/build.log" 2>&1; then
  RESULT[build]="native library (CPU kernels); GPU kernels: Triton"
else
  RESULT[build]="FAILED"
  status=1
  tail -30 "$OUT/build.log"
fi
"$PY" -c "import latentfast; print(latentfast.describe())" 2>&1 | tee -a "$OUT/gpu_check.txt"

step "GPU tests"
marker="gpu"
[ "$n_gpus" -lt 2 ] && marker="gpu and not multigpu" && echo "one GPU: the multigpu tests are not run"
rm -f /tmp/latentfast-gpu-tests.xml
timeout "$(cap 150)" "$PY" -m pytest tests -q -m "$marker" -p no:cacheprovider -rs "${timeout_flag[@]}" \
  --junitxml=/tmp/latentfast-gpu-tests.xml 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
tests_rc=${PIPESTATUS[0]}
RESULT[tests]=$("$PY" -m latentfast.bench.gpu_check_summary tests /tmp/latentfast-gpu-tests.xml "$tests_rc")
case "${RESULT[tests]}" in passed*) ;; *) status=1 ;; esac
echo "${RESULT[tests]}"

step "GPU benchmarks"
quick_flag="--quick"
[ "${FULL:-0}" = 1 ] && quick_flag=""
# normalize (vs eager and vs a device copy), decode (batch to device vs pinned H2D), replay (peak
# memory; scatter one launch vs the loop), build (image build with an SDXL-class VAE vs the encoder
# alone on device batches: the build target, >= 0.9x); cache and balance have no GPU side
for suite in normalize decode replay build; do
  rm -rf "/tmp/latentfast-bench-$suite"
  timeout "$(cap 120)" "$PY" -m latentfast.cli bench $quick_flag --suite "$suite" --out "/tmp/latentfast-bench-$suite" \
    >>"$OUT/bench.log" 2>&1
  rc=$?
  cp "/tmp/latentfast-bench-$suite/bench.json" "$OUT/bench_$suite.json" 2>/dev/null
  # (keyed bench-<suite>: RESULT[build] is the native library's build above)
  if [ $rc = 0 ]; then RESULT[bench-$suite]="ran"; else RESULT[bench-$suite]="FAILED (exit $rc; see bench.log)" status=1; fi
done
grep -v "^\s*$" "$OUT/bench.log" | grep -A14 "^normalize_uint8\|^hot: B=\|^pinned-h2d\|^latentfast-cuda\|^scatter\|^replay\|^image build\|^vae-build" | head -120

step "results"
"$PY" -m latentfast.bench.gpu_check_summary bench "$OUT"
for key in build tests bench-normalize bench-decode bench-replay bench-build; do
  printf '  %-16s %s\n' "$key" "${RESULT[$key]:-not run}"
done
echo "gpu_check: $([ $status = 0 ] && echo PASSED || echo FAILED) in ${SECONDS}s"
exit $status
