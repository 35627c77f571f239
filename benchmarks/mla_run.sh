#!/bin/bash
# One GPU session for the MLA kernels: gpu tests of tests/test_mla.py (Pallas Triton, Triton through jax-triton,
# Mosaic GPU), the torch copy ceiling in its own process, then benchmarks/mla.py.
# Usage on the device machine (repo root, .whl carried): bash benchmarks/mla_run.sh [mla.py args...]
# Env: PYTEST_TIMEOUT (s, 0 = skip the tests), BENCH_TIMEOUT (s).
export PYTHONUNBUFFERED=1 HOME=/tmp TRITON_CACHE_DIR=/tmp/triton XLA_PYTHON_CLIENT_PREALLOCATE=false
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/jax_triton*.whl
export PYTHONPATH=$PWD:/tmp/site
if [ "${PYTEST_TIMEOUT:-150}" != 0 ]; then
  timeout ${PYTEST_TIMEOUT:-150} python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_mla.py > $OUT/pytest.log 2>&1
  echo "pytest rc $?"; tail -${PYTEST_TAIL:-8} $OUT/pytest.log
fi
python3 benchmarks/mla.py --torch-copy $OUT/torch_copy.json > /dev/null 2>&1; echo "torch copy rc $?"
timeout ${BENCH_TIMEOUT:-300} python3 benchmarks/mla.py --torch-copy-json $OUT/torch_copy.json --out $OUT/mla.json "$@" \
  > $OUT/mla.log 2>&1; echo "bench rc $?"
grep -v "^dsa " $OUT/mla.log | tail -${BENCH_TAIL:-40}
