"""The split-KV decode kernel's ``fp8_convert="bits"`` path (issue #35): e4m3 page bytes turned into q's dtype by
bit placement and one power-of-two multiply instead of conversion instructions, V converted in its load layout.

:func:`kvjax.pallas.paged.decode.e4m3_bits` is checked on every e4m3 byte against XLA's own cast; the kernel in
interpret mode (the same jnp bit placement) against the float32 reference over the same fp8 pages within the fp8
bound of ``test_paged_attention_kernels`` (:func:`_fp8_bound`). On CPU XLA flushes the subnormal intermediates, so
an e4m3 subnormal (``|x| <= 7 * 2**-9``) reads as 0: a value error of at most ``0.0137 s_v <= 0.0137 max|v| / 224
= 6.1e-5 max|v|`` per key, inside the bound's ``2**-12 max|v|`` (2.4e-4) term; a key element flushed the same way
moves its logit by at most ``0.0137 s_k |q_d| scale``, inside the ``2**-8`` probability term at these shapes. The
compiled PTX path runs on the GPU (``gpu`` mark), exact there.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_paged_attention_kernels import _GPU_CTX, _build, _call, _check_fp8, _fp8, _fp8_batch, _ref_fp8

from kvjax.base.fp8 import FP8_DTYPE
from kvjax.pallas.paged import decode

_SUBNORMAL_MAX = 7 * 2.0 ** -9  # largest e4m3 subnormal


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_e4m3_bits_every_byte(dtype):
    # all 256 bytes but NaN: normals exact, subnormals exact or flushed to 0 (XLA on CPU), signs kept
    raw = jnp.arange(256, dtype=jnp.uint8)
    x = jax.lax.bitcast_convert_type(raw, FP8_DTYPE)
    want = np.asarray(x.astype(jnp.float32))
    got = np.asarray(jax.jit(decode.e4m3_bits, static_argnums=1)(x, dtype).astype(jnp.float32))
    finite = np.isfinite(want)
    assert finite.sum() == 254  # 0x7f and 0xff
    sub = finite & (np.abs(want) <= _SUBNORMAL_MAX) & (want != 0)
    assert sub.sum() == 14
    normal = finite & ~sub
    np.testing.assert_array_equal(got[normal], want[normal])
    assert ((got[sub] == want[sub]) | (got[sub] == 0)).all()
    assert (np.signbit(got[finite]) == np.signbit(want[finite])).all()


@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_decode_interpret_fp8_bits(rng, page_size, dtype):
    # the batch of test_decode_interpret_fp8_pages (SWA pages below the window recycled or NaN, scales too, GQA 2,
    # a 1-token row, padding tokens), read through fp8_convert="bits": within the fp8 bound of the f32 reference
    args, scales, kw, (ref, abs_v, v_max) = _fp8_batch(rng, page_size=page_size, ctx=[300, 70, 1, 140],
                                                        new=[1, 1, 1, 1], dtype=dtype)
    for splits, block_k in ((1, 64), (5, page_size)):
        out = decode.paged_decode(_call(args, kw, scales), interpret=True, num_splits=splits, block_k=block_k,
                                  fp8_convert="bits")
        assert out.dtype == dtype
        _check_fp8(out, ref, abs_v, v_max, jnp.bfloat16)  # f16 rounds less than bf16: the bf16 bound holds
    assert float(jnp.abs(out[-2:].astype(jnp.float32)).max()) == 0.0


def test_decode_fp8_convert_rejects(rng):
    args, scales, kw, _ = _fp8_batch(rng, page_size=16, ctx=[40], new=[1], dtype=jnp.float32)
    with pytest.raises(ValueError, match="fp8_convert must be one of"):
        decode.paged_decode(_call(args, kw, scales), interpret=True, fp8_convert="prmt")
    with pytest.raises(ValueError, match="needs a bfloat16 or float16 q, got float32"):
        decode.paged_decode(_call(args, kw, scales), interpret=True, fp8_convert="bits")


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_gpu_decode_fp8_bits_grid(rng, group, page_size):
    # the compiled PTX conversion: the batch of test_gpu_decode_fp8_grid (lengths 1..8k, a SWA head with sinks
    # whose dead pages are holes or NaN), against the f32 reference over the same fp8 pages within _fp8_bound
    hkv = 2
    args, kw = _build(rng, hq=group * hkv, hkv=hkv, d=128, page_size=page_size, ctx=_GPU_CTX,
                      new=[1] * len(_GPU_CTX), window=[0, 100 if page_size == 16 else 65], sinks=[0, 4],
                      dtype=jnp.bfloat16)
    args, scales = _fp8(args)
    ref, abs_v, v_max = _ref_fp8(args, scales, kw)
    for splits, block_k in ((None, None), (1, 128), (7, 64)):
        out = decode.paged_decode(_call(args, kw, scales), num_splits=splits, block_k=block_k, fp8_convert="bits")
        _check_fp8(out, ref, abs_v, v_max, jnp.bfloat16)
    assert float(jnp.abs(out[-2:].astype(jnp.float32)).max()) == 0.0
