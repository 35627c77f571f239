#!/bin/bash
# One GPU session for the GDN kernels: gpu tests, then fla (compiled, autotuned and timed alone on the GPU: an
# autotune that shares the GPU with other work picks bad configurations), then the kvjax benchmark.
# Usage on the device machine (repo root, .whl carried): bash benchmarks/gdn_run.sh [jax_timeout_s]
# Env: PYTEST_TIMEOUT (s, 0 = skip the tests), PYTEST_K (-k filter), FLA_TIMEOUT (s), GDN_ARGS (extra gdn.py
# arguments for both halves, e.g. "--only decode").
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/fla*.whl .whl/flash*.whl
if [ "${PYTEST_TIMEOUT:-90}" != 0 ]; then
  PYTHONPATH=$PWD timeout ${PYTEST_TIMEOUT:-90} python -m pytest -q tests/test_gdn_kernels.py -m gpu -p no:cacheprovider ${PYTEST_K:+-k "$PYTEST_K"} > $OUT/pytest.log 2>&1
  echo "pytest rc $?"; tail -${PYTEST_TAIL:-12} $OUT/pytest.log
fi
(export PYTHONPATH=$PWD:/tmp/site HOME=/tmp TRITON_CACHE_DIR=/tmp/triton FLA_CACHE_RESULTS=0
 timeout ${FLA_TIMEOUT:-240} python benchmarks/gdn.py --fla --out $OUT/gdn_fla.json $GDN_ARGS > $OUT/fla.log 2>&1); echo "fla rc $?"
PYTHONPATH=$PWD timeout ${1:-150} python benchmarks/gdn.py --out $OUT/gdn.json $GDN_ARGS > $OUT/jax.log 2>&1; echo "jax rc $?"
grep -v "^decode {\|^prefill [0-9]" $OUT/jax.log | tail -${JAX_TAIL:-12}
PYTHONPATH=$PWD python benchmarks/gdn.py --table $OUT/gdn.json --fla-json $OUT/gdn_fla.json
