"""The split-KV decode kernel's ``page_ids`` knob (issue #35): how a block's page ids reach the address computation of
its K / V copies (``"load"``: read in the block's own step; ``"prefetch"``: block ``c+1``'s read during block ``c`` and
carried in the loop; ``"join"``: one read passed through an identity Triton does not see through).

Every mode must give the same attention: over fp8 pages (the batch of ``test_decode_interpret_fp8_pages``: SWA pages
below the window recycled or NaN, scales too, GQA 2, a 1-token row, padding tokens) against the float32 reference
within the fp8 bound of ``test_paged_attention_kernels`` (:func:`_fp8_bound`), and over float pages (sinks and a
window straddling pages) against the float32 reference to f32 rounding. Interpret mode here; the compiled kernels on
the GPU (``gpu`` mark).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from test_paged_attention_kernels import _GPU_CTX, _build, _call, _check_fp8, _fp8, _fp8_batch, _ref, _ref_fp8, _rel_err

from kvjax.pallas.paged import decode

_MODES = [m for m in decode.PAGE_IDS if m != "load"]


@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("page_ids", _MODES)
def test_decode_interpret_fp8_page_ids(rng, page_size, page_ids):
    args, scales, kw, (ref, abs_v, v_max) = _fp8_batch(rng, page_size=page_size, ctx=[300, 70, 1, 140],
                                                        new=[1, 1, 1, 1], dtype=jnp.bfloat16)
    assert np.isnan(np.asarray(scales["v_scale"])).any()  # poisoned scales exist: a wrong page id would read one
    for splits, block_k in ((1, 64), (5, page_size), (3, 2 * page_size)):
        out = decode.paged_decode(_call(args, kw, scales), interpret=True, num_splits=splits, block_k=block_k,
                                  page_ids=page_ids)
        _check_fp8(out, ref, abs_v, v_max, jnp.bfloat16)
    assert float(jnp.abs(out[-2:].astype(jnp.float32)).max()) == 0.0


@pytest.mark.parametrize("page_ids", _MODES)
def test_decode_interpret_float_page_ids(rng, page_ids):
    args, kw = _build(rng, hq=8, hkv=2, d=32, page_size=16, ctx=[40, 70, 5, 33], new=[1, 1, 1, 1],
                      window=[0, 20], sinks=[0, 4])
    ref = np.asarray(_ref(args, kw))
    for splits, block_k in ((1, 32), (3, 16)):
        out = decode.paged_decode(_call(args, kw), interpret=True, num_splits=splits, block_k=block_k,
                                  page_ids=page_ids)
        np.testing.assert_allclose(np.asarray(out), ref, atol=2e-5, rtol=2e-5)
    assert float(jnp.abs(out[-2:]).max()) == 0.0


def test_decode_page_ids_rejects(rng):
    args, kw = _build(rng, hq=4, hkv=2, d=32, page_size=16, ctx=[40], new=[1], window=[0, 0], sinks=[0, 0])
    with pytest.raises(ValueError, match="page_ids must be one of"):
        decode.paged_decode(_call(args, kw), interpret=True, page_ids="smem")


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("page_ids", _MODES)
def test_gpu_decode_page_ids_grid(rng, page_ids, page_size):
    # the compiled kernels: lengths 1..8k, a SWA head with sinks whose dead pages are holes or NaN, GQA 4, fp8 pages
    # (2 and 3 stages) against the f32 reference over the same pages within _fp8_bound, bf16 pages within 2e-2
    hkv = 2
    args, kw = _build(rng, hq=4 * hkv, hkv=hkv, d=128, page_size=page_size, ctx=_GPU_CTX,
                      new=[1] * len(_GPU_CTX), window=[0, 100 if page_size == 16 else 65], sinks=[0, 4],
                      dtype=jnp.bfloat16)
    ref16 = _ref(args, kw)
    out = decode.paged_decode(_call(args, kw), page_ids=page_ids)
    assert _rel_err(out, ref16) <= 2e-2
    args8, scales = _fp8(args)
    ref, abs_v, v_max = _ref_fp8(args8, scales, kw)
    for splits, block_k, stages in ((None, None, None), (None, None, 3), (1, 128, None), (7, 64, None)):
        out = decode.paged_decode(_call(args8, kw, scales), num_splits=splits, block_k=block_k, num_stages=stages,
                                  page_ids=page_ids)
        _check_fp8(out, ref, abs_v, v_max, jnp.bfloat16)
    assert float(jnp.abs(out[-2:].astype(jnp.float32)).max()) == 0.0
