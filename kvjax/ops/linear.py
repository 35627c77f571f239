"""A projection ``x @ w`` (every :class:`kvjax.models.common.layers.Linear` of the models).

Normalised call (the table's functions)::

    linear: fn(x, w)   # x [T, H]; w [H, N]  -> [T, N] in x's dtype

Reference = XLA: ``jnp.matmul`` at full precision in x's dtype (the expression ``Linear`` used before this op,
so CPU results are unchanged). Backend ``"pallas"`` = :func:`kvjax.pallas.skinny.matmul_pallas`, one
Triton-lowered kernel per ``[T, block_n]`` output tile streaming the weight once with float32 accumulation (the
SwiGLU kernel's body with a plain epilogue; 32 columns a tile, 64 where ``N > 4096``:
:func:`kvjax.pallas.skinny.matmul_tiles`); ``auto`` takes it for the skinny products of decode steps where
:func:`kvjax.pallas.skinny.matmul_unsupported` accepts them: bfloat16 / float16, ``16 <= T <= 64`` a power of
two, ``2048 <= N <= 8192`` (64..256 output tiles: the shapes where it beat XLA alone and in the tp preset's step,
RESULTS.md, "Skinny projections"); float32 keeps XLA's full-precision products, prefill chunks, narrow
projections and the LM head XLA's GEMMs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.base.checks import check_float
from kvjax.ops.backends import Backend, BackendTable
from kvjax.pallas import skinny

LINEAR_OP = "linear"


def linear_reference(
    x: jax.Array,  # [T, H]
    w: jax.Array,  # [H, N]
) -> jax.Array:  # [T, N] in the promoted dtype of x and w
    """``x @ w`` with full-precision products (``jnp.matmul``'s dtype promotion where x and w differ)."""
    return jnp.matmul(x, w, precision=jax.lax.Precision.HIGHEST)


def validate_linear_args(x, w, impl) -> None:
    """Host-side check: ``x [T, H]`` float, ``w [H, N]`` float, ``impl`` a string; ``ValueError`` names the
    argument. (Mixed float dtypes are the reference's promotion, as ``Linear`` always allowed; the kernel takes
    one dtype.)"""
    check_float("x", x, rank=2)
    check_float("w", w, rank=2, shape=(x.shape[1], None))
    if not isinstance(impl, str):
        raise ValueError(f"impl must be a string, got {impl!r}")


def linear(
    x: jax.Array,  # [..., H]
    w: jax.Array,  # [H, N]
    *,
    impl: str = "auto",
) -> jax.Array:  # [..., N] in x's dtype (the promoted dtype where w's differs)
    """``x @ w`` over any leading dims (flattened to ``T`` rows for the table's choice).
    Errors: :func:`validate_linear_args`; ``UnknownImplError`` for an ``impl`` that cannot run here."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    validate_linear_args(x2, w, impl)
    _, fn = LINEAR_TABLE.choose(impl, (x2, w), {})
    return fn(x2, w).reshape(*lead, w.shape[1])


def _example(rows: int, d_in: int = 4096, d_out: int = 4096, dtype=jnp.bfloat16):
    sds = jax.ShapeDtypeStruct
    return (sds((rows, d_in), dtype), sds((d_in, d_out), dtype)), {}


LINEAR_TABLE = BackendTable(
    LINEAR_OP,
    linear_reference,
    (
        Backend("pallas", skinny.matmul_pallas, priority=10, unsupported=skinny.matmul_unsupported,
                note="decode-step rows (16..64, 16-bit): ahead of XLA (RESULTS.md, Skinny projections)"),
    ),
    examples={
        "decode T=64 4096->4096 bf16": lambda: _example(64),
        "decode T=16 12288->4096 bf16": lambda: _example(16, 12288),
        "T=256 4096->4096 bf16": lambda: _example(256),
        "decode T=64 4096->1024 bf16": lambda: _example(64, 4096, 1024),
        "decode T=64 LM head 4096->32768 bf16": lambda: _example(64, 4096, 32768),
        "T=64 4096->4096 f32": lambda: _example(64, dtype=jnp.float32),
    },
)
