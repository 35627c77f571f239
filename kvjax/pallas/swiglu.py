"""The SwiGLU up-projection ``silu(x @ w_gate) * (x @ w_up)`` for skinny ``x`` (Pallas, Triton lowering).

One program per tile of :data:`BLOCK_N` output columns: it walks ``H`` in blocks of :data:`BLOCK_K`, loads the
``[T, BLOCK_K]`` slice of ``x`` and both weights' ``[BLOCK_K, BLOCK_N]`` tiles, accumulates the two products in
float32 and writes ``silu(gate) * up`` in x's dtype. Each weight byte is read once and no float32 partial
leaves the kernel (XLA's GEMM for T <= 64 splits K and reduces the partials in the next fusion). The tile
sizes and the 4 pipeline stages are the fastest measured, alone and in the gpu-preset engine, at T=16 and 64
(RESULTS.md, "SwiGLU up-projection").
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

BLOCK_N = 32  # output columns per program
BLOCK_K = 128  # hidden columns per pipeline step
NUM_STAGES = 4  # software-pipeline depth of the K walk
NUM_WARPS = 4
MAX_ROWS = 64  # larger T does not fit shared memory at 4 stages (and XLA's GEMM is no longer skinny)


def _kernel(x_ref, wg_ref, wu_ref, o_ref):  # x [T, H], w_gate / w_up [H, I], o [T, I]
    j = pl.program_id(0)
    rows, hidden = x_ref.shape
    cols = pl.ds(pl.multiple_of(j * BLOCK_N, BLOCK_N), BLOCK_N)
    dims = (((1,), (0,)), ((), ()))

    def body(i, acc):
        gate, up = acc
        ks = pl.ds(pl.multiple_of(i * BLOCK_K, BLOCK_K), BLOCK_K)
        xk = x_ref[:, ks]
        gate = gate + lax.dot_general(xk, wg_ref[ks, cols], dims, preferred_element_type=jnp.float32)
        up = up + lax.dot_general(xk, wu_ref[ks, cols], dims, preferred_element_type=jnp.float32)
        return gate, up

    zero = jnp.zeros((rows, BLOCK_N), jnp.float32)
    gate, up = lax.fori_loop(0, hidden // BLOCK_K, body, (zero, zero))
    o_ref[:, cols] = (gate * (1.0 / (1.0 + jnp.exp(-gate))) * up).astype(o_ref.dtype)


def unsupported(
    x,  # [T, H]
    w_gate,  # [H, I]
    w_up,  # [H, I]
) -> str | None:
    """Why the kernel cannot take the call, or ``None``: 16-bit floats, ``T`` a power of two in ``16..64``,
    ``H`` a multiple of :data:`BLOCK_K`, ``I`` of :data:`BLOCK_N`."""
    del w_up
    rows, hidden = x.shape
    if x.dtype not in (jnp.bfloat16, jnp.float16):
        return f"the kernel takes bfloat16 / float16 (float32 keeps XLA's full-precision products), got {x.dtype}"
    if not 16 <= rows <= MAX_ROWS or rows & (rows - 1):
        return f"the kernel takes T a power of two in 16..{MAX_ROWS} (skinny decode rows), got T={rows}"
    if hidden % BLOCK_K or w_gate.shape[1] % BLOCK_N:
        return f"the kernel needs H % {BLOCK_K} == 0 and I % {BLOCK_N} == 0, got H={hidden}, I={w_gate.shape[1]}"
    return None


@functools.partial(jax.jit, static_argnames=("interpret",))
def swiglu_pallas(
    x: jax.Array,  # [T, H]
    w_gate: jax.Array,  # [H, I]
    w_up: jax.Array,  # [H, I]
    *,
    interpret: bool = False,
) -> jax.Array:  # [T, I] in x's dtype
    """Backend ``"pallas"`` of ``kvjax.ops.mlp.swiglu`` (the calls :func:`unsupported` accepts)."""
    reason = unsupported(x, w_gate, w_up)
    if reason:
        raise ValueError(f"pallas swiglu: {reason}")
    rows, inter = x.shape[0], w_gate.shape[1]
    return pl.pallas_call(
        _kernel,
        out_shape=jax.ShapeDtypeStruct((rows, inter), x.dtype),
        grid=(inter // BLOCK_N,),
        compiler_params=plt.CompilerParams(num_warps=NUM_WARPS, num_stages=NUM_STAGES),
        interpret=interpret,
        name="kvjax_swiglu",
    )(x, w_gate, w_up)
