#!/usr/bin/env bash
# The GPU suite in one command, for a machine with a CUDA GPU and the packages installed system-wide
# (torch with CUDA, lightning, pytest; no venv, no network):
#
#     bash scripts/gpu_check.sh            # PYTHON=/path/to/python3 to pick another interpreter
#
# 1. prints nvidia-smi and the torch / lightning versions;
# 2. runs the GPU tests (python3 -m pytest -m gpu -v tests/gpu; with pytest-xdist installed,
#    GPU_CHECK_WORKERS of them at once, 12 by default), log and junit xml in
#    benchmarks/results/gpu_tests.{log,xml};
# 3. runs benchmarks/bench_gpu.py (benchmarks/results/gpu.json, gpu.md; log in gpu_bench.log),
#    whether or not the tests passed.
# If $OUT is set, the results and logs are copied there too. Exits non-zero if the tests failed
# (or the benchmark did). Without a CUDA device it says so and exits 2 before running anything;
# GPU_CHECK_ALLOW_CPU=1 runs the steps anyway (tests skipped, benchmark with --quick --device cpu).
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-python3}"
export PYTHONPATH=".:examples${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
RESULTS=benchmarks/results
mkdir -p "$RESULTS"

copy_out() {
  if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT"
    for f in gpu.json gpu.md gpu_tests.log gpu_tests.xml gpu_bench.log gpu_env.txt; do
      if [ -f "$RESULTS/$f" ]; then cp "$RESULTS/$f" "$OUT/"; fi
    done
  fi
}

{
  echo "== $(date -u '+%Y-%m-%d %H:%M:%S UTC') $(hostname)"
  echo "== nvidia-smi"
  nvidia-smi || echo "nvidia-smi: not available"
  echo "== versions"
  "$PY" - <<'PYEOF' || echo "gpu_check: $PY could not report the versions (is torch installed for it?)"
import platform, sys
import torch
import lightning
print(f"python {platform.python_version()} ({sys.executable})")
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), lightning {lightning.__version__}")
print(f"torch.optim.Muon: {'yes' if hasattr(torch.optim, 'Muon') else 'no'}")
print(f"cuda available: {torch.cuda.is_available()}")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"device 0: {p.name}, {p.total_memory / 2**30:.1f} GiB, {p.multi_processor_count} SMs")
    import torch.distributed as dist
    print(f"nccl available: {dist.is_nccl_available()}, version {'.'.join(map(str, torch.cuda.nccl.version()))}")
PYEOF
} 2>&1 | tee "$RESULTS/gpu_env.txt"

bench_args=()
if ! "$PY" -c 'import torch, lightning' >/dev/null 2>&1; then
  echo "gpu_check: $PY cannot import torch and lightning; install them or point PYTHON at an interpreter that has them." >&2
  copy_out
  exit 2
fi
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  if [ "${GPU_CHECK_ALLOW_CPU:-0}" != "1" ]; then
    echo "gpu_check: $PY sees no CUDA device; the GPU tests would all be skipped and the benchmark needs a GPU." >&2
    echo "gpu_check: nothing was run (set GPU_CHECK_ALLOW_CPU=1 to run the steps anyway as a smoke test)." >&2
    copy_out
    exit 2
  fi
  echo "gpu_check: no CUDA device; GPU_CHECK_ALLOW_CPU=1, so the tests run (and skip) and the benchmark runs --quick on CPU"
  bench_args=(--quick --device cpu)
fi

echo "== GPU tests"
# Each test runs its body in a fresh child process, so they run side by side where pytest-xdist is
# installed (21 tests: about 100 s with 12 workers on one H200 against about 470 s one after another).
xdist_args=()
if "$PY" -c 'import xdist' >/dev/null 2>&1; then
  xdist_args=(-n "${GPU_CHECK_WORKERS:-12}" -p no:benchmark)
fi
set +e
"$PY" -m pytest -m gpu -v -rA ${xdist_args[@]+"${xdist_args[@]}"} tests/gpu --junitxml="$RESULTS/gpu_tests.xml" 2>&1 | tee "$RESULTS/gpu_tests.log"
test_rc=${PIPESTATUS[0]}
set -e
echo "gpu_check: tests exited with $test_rc"

echo "== GPU benchmark"
set +e
"$PY" benchmarks/bench_gpu.py ${bench_args[@]+"${bench_args[@]}"} 2>&1 | tee "$RESULTS/gpu_bench.log"
bench_rc=${PIPESTATUS[0]}
set -e
echo "gpu_check: benchmark exited with $bench_rc"

copy_out
if [ "$test_rc" -ne 0 ]; then
  echo "gpu_check: FAILED (tests exited with $test_rc; see $RESULTS/gpu_tests.log)" >&2
  exit "$test_rc"
fi
if [ "$bench_rc" -ne 0 ]; then
  echo "gpu_check: FAILED (benchmark exited with $bench_rc; see $RESULTS/gpu_bench.log)" >&2
  exit "$bench_rc"
fi
echo "gpu_check: OK"
