"""The SwiGLU up-projection of an MLP: ``silu(x @ w_gate) * (x @ w_up)``.

Normalised call (the table's functions)::

    swiglu: fn(x, w_gate, w_up)   # x [T, H]; w_gate, w_up [H, I]  -> [T, I] in x's dtype

Reference = XLA: the two products at full precision in x's dtype, then ``silu(gate) * up`` (the expression
:class:`kvjax.models.common.layers.MLP` used before this op, so CPU results are unchanged). Backend ``"pallas"``
= :func:`kvjax.pallas.skinny.swiglu_pallas`, one Triton-lowered kernel per ``[T, 32]`` output tile streaming both
weights once with float32 accumulation and the SiLU product in its epilogue; ``auto`` takes it for the skinny
products of decode steps: bfloat16 / float16, ``16 <= T <= 64`` a power of two, where it is faster than XLA's
split-K GEMM and the reducing SiLU-product fusion (RESULTS.md, "SwiGLU up-projection"); at T=256 its tiles do
not fit shared memory and XLA keeps it; float32 keeps XLA's full-precision products.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.base.checks import check_array, check_float
from kvjax.ops.backends import Backend, BackendTable
from kvjax.pallas import skinny

SWIGLU_OP = "swiglu"


def swiglu_reference(
    x: jax.Array,  # [T, H]
    w_gate: jax.Array,  # [H, I]
    w_up: jax.Array,  # [H, I]
) -> jax.Array:  # [T, I] in x's dtype
    """``silu(x @ w_gate) * (x @ w_up)`` with full-precision products rounded to x's dtype."""
    hi = jax.lax.Precision.HIGHEST
    return jax.nn.silu(jnp.matmul(x, w_gate, precision=hi)) * jnp.matmul(x, w_up, precision=hi)


def validate_swiglu_args(x, w_gate, w_up, impl) -> None:
    """Host-side check: ``x [T, H]`` float, ``w_gate`` / ``w_up`` ``[H, I]`` of x's dtype, ``impl`` a string;
    ``ValueError`` names the argument."""
    check_float("x", x, rank=2)
    check_array("w_gate", w_gate, rank=2, shape=(x.shape[1], None), dtypes=[x.dtype])
    check_array("w_up", w_up, shape=tuple(w_gate.shape), dtypes=[x.dtype])
    if not isinstance(impl, str):
        raise ValueError(f"impl must be a string, got {impl!r}")


def swiglu(
    x: jax.Array,  # [..., H]
    w_gate: jax.Array,  # [H, I]
    w_up: jax.Array,  # [H, I]
    *,
    impl: str = "auto",
) -> jax.Array:  # [..., I] in x's dtype
    """``silu(x @ w_gate) * (x @ w_up)`` over any leading dims (flattened to ``T`` rows for the table's choice).
    Errors: :func:`validate_swiglu_args`; ``UnknownImplError`` for an ``impl`` that cannot run here."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    validate_swiglu_args(x2, w_gate, w_up, impl)
    _, fn = SWIGLU_TABLE.choose(impl, (x2, w_gate, w_up), {})
    return fn(x2, w_gate, w_up).reshape(*lead, w_gate.shape[1])


def _example(rows: int, hidden: int = 1024, inter: int = 3072, dtype=jnp.bfloat16):
    sds = jax.ShapeDtypeStruct
    return (sds((rows, hidden), dtype), sds((hidden, inter), dtype), sds((hidden, inter), dtype)), {}


SWIGLU_TABLE = BackendTable(
    SWIGLU_OP,
    swiglu_reference,
    (
        Backend("pallas", skinny.swiglu_pallas, priority=10, unsupported=skinny.swiglu_unsupported,
                note="decode-step rows (16..64, 16-bit): ahead of XLA (RESULTS.md, SwiGLU up-projection)"),
    ),
    examples={
        "decode T=64 H=1024 I=3072 bf16": lambda: _example(64),
        "decode T=16 H=1024 I=3072 bf16": lambda: _example(16),
        "T=256 H=1024 I=3072 bf16": lambda: _example(256),
        "T=64 H=1024 I=3072 f32": lambda: _example(64, dtype=jnp.float32),
    },
)
