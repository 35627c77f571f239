#!/bin/bash
# One GPU session for the GDN kernels: gpu tests, fla (compiled while the tests run, timed alone), kvjax bench.
# Usage on the device machine (repo root, .whl carried): bash benchmarks/gdn_run.sh [jax_timeout_s]
export PYTHONUNBUFFERED=1
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/fla*.whl .whl/flash*.whl
rm -f /tmp/gdn_go
(export PYTHONPATH=$PWD:/tmp/site HOME=/tmp TRITON_CACHE_DIR=/tmp/triton FLA_CACHE_RESULTS=0
 exec timeout 280 python benchmarks/gdn.py --fla --go-file /tmp/gdn_go --out $OUT/gdn_fla.json > $OUT/fla.log 2>&1) &
FLA=$!
PYTHONPATH=$PWD timeout ${PYTEST_TIMEOUT:-90} python -m pytest -q tests/test_gdn_kernels.py -m gpu -p no:cacheprovider ${PYTEST_K:+-k "$PYTEST_K"} > $OUT/pytest.log 2>&1
tail -${PYTEST_TAIL:-12} $OUT/pytest.log
while ! grep -q "waiting for" $OUT/fla.log && kill -0 $FLA 2>/dev/null && [ $(( $(date +%s) - T0 )) -lt ${FLA_WAIT:-120} ]; do sleep 1; done
if grep -q "waiting for" $OUT/fla.log; then touch /tmp/gdn_go; wait $FLA; echo "fla rc $?"; else kill $FLA; echo "fla not ready: killed"; tail -3 $OUT/fla.log; fi
PYTHONPATH=$PWD timeout ${1:-150} python benchmarks/gdn.py --out $OUT/gdn.json > $OUT/jax.log 2>&1; echo "jax rc $?"
grep -v "^decode {\|^prefill [0-9]" $OUT/jax.log | tail -${JAX_TAIL:-12}
PYTHONPATH=$PWD python benchmarks/gdn.py --table $OUT/gdn.json --fla-json $OUT/gdn_fla.json
