#!/bin/bash
# One GPU session of the benchmarks (what the device machine runs): optional GPU tests, the torch half
# (fla compiled, autotuned and timed alone on the GPU; torch copies of every case's bytes), the JAX half
# (benchmarks/runner.py: checks, interleaved timing, JSON), then the table.
# Usage on the device machine (repo root; .whl/ may carry fla-core, flash-linear-attention, jax_triton wheels):
#   bash benchmarks/run_gpu.sh [SUBJECT ...]     (default: gdn conv attention mla mlp; also engine, prefix, sched_overhead)
# Env: OUT (output folder), PYTEST_TIMEOUT (s; 0 = skip the GPU tests, the default), ANCHOR_TIMEOUT (s),
#      BENCH_TIMEOUT (s), BENCH_ARGS (extra runner.py arguments, e.g. "--cases decode --rounds 5").
export PYTHONUNBUFFERED=1 HOME=/tmp TRITON_CACHE_DIR=/tmp/triton XLA_PYTHON_CLIENT_PREALLOCATE=false FLA_CACHE_RESULTS=0
OUT=${OUT:-/tmp/bench}
mkdir -p "$OUT"
TAG=$(echo "${*:-ops}" | tr ' ' '_')
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=$PWD:/tmp/site
if [ "${PYTEST_TIMEOUT:-0}" != 0 ]; then
  timeout "$PYTEST_TIMEOUT" python3 -m pytest -q -m gpu -p no:cacheprovider tests > "$OUT/pytest.log" 2>&1
  echo "pytest rc $?"; tail -8 "$OUT/pytest.log"
fi
timeout "${ANCHOR_TIMEOUT:-240}" python3 benchmarks/runner.py --anchors-only "$@" --out "$OUT/anchors_$TAG.json" \
  > "$OUT/anchors_$TAG.log" 2>&1; echo "anchors rc $?"
# shellcheck disable=SC2086
timeout "${BENCH_TIMEOUT:-480}" python3 benchmarks/runner.py "$@" --anchors-json "$OUT/anchors_$TAG.json" \
  --out "$OUT/bench_$TAG.json" $BENCH_ARGS > "$OUT/bench_$TAG.log" 2>&1; echo "bench rc $?"
grep -i "error\|failed" "$OUT/bench_$TAG.log" | head -20
python3 benchmarks/runner.py --table "$OUT/bench_$TAG.json"
