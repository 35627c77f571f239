"""SwiGLU up-projection cases (``kvjax.ops.mlp.swiglu``): the Pallas kernel beside XLA's fused GEMM.

Usage: ``python benchmarks/runner.py mlp`` (GPU). The anchor is XLA (``impl="reference"``: the two products and
the SiLU product, which XLA merges into one split-K GEMM and a reducing fusion), timed beside the Pallas kernel
(``impl="pallas"``) at the decode-step rows of the gpu preset's MLP (H = 1024, I = 3072, bf16). Each call uses
the next of 8 weight pairs (200 MB), so the weights come from HBM, as in an engine step, not from L2. Bytes: both
weights, x and the output.
"""

from __future__ import annotations

import functools

from case import Case, Setup

ROTATE = 8
SHAPES = [(16, 1024, 3072), (64, 1024, 3072)]  # (T, H, I): the engine's decode rows at 16 and 64


def _setup(t: int, h: int, i: int) -> Setup:
    import jax
    import jax.numpy as jnp

    from kvjax.ops.mlp import swiglu

    x = jax.random.normal(jax.random.key(0), (t, h), jnp.bfloat16)  # bf16[T, H]
    ws = [tuple(jax.random.normal(jax.random.key(10 * r + j), (h, i), jnp.bfloat16) * h ** -0.5 for j in (1, 2))
          for r in range(ROTATE)]  # ROTATE x (bf16[H, I], bf16[H, I])

    def run(impl: str):
        fn = jax.jit(functools.partial(swiglu, impl=impl))
        state = {"i": 0}

        def call():
            wg, wu = ws[state["i"] % ROTATE]
            state["i"] += 1
            return fn(x, wg, wu)

        return call

    def reference():
        return jax.jit(functools.partial(swiglu, impl="reference"))(x, *ws[0])

    return Setup(run=run, reference=reference)


def cases(small: bool = False) -> list[Case]:
    """The decode-row shapes, Pallas against XLA; ``small``: one tiny shape (CPU smoke run)."""
    shapes = [(16, 128, 64)] if small else SHAPES
    return [Case(f"swiglu T={t} H={h} I={i}", "kvjax.ops.mlp.swiglu", dict(T=t, H=h, I=i), ("pallas", "reference"),
                 functools.partial(_setup, t, h, i), anchor="reference", bytes=2 * (2 * h * i + t * h + t * i),
                 tol=1e-2) for t, h, i in shapes]
