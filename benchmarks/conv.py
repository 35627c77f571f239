"""Causal conv1d benchmark cases on the GDN conv pool (``kvjax.state.gdn_pool.conv_decode`` / ``conv_prefill``).

Usage: ``python benchmarks/runner.py conv`` (GPU). The anchor is the fused XLA path (``impl="reference"``:
gather by slot, the ``kvjax.ops.conv`` reference, scatter), timed beside the Pallas kernels (``impl="pallas"``).

W = 4, bf16 x / y / state, the pool donated and chained. Decode rotates over 8 layers of the pool and 8 input
buffers, so its working set (about 200 MB) exceeds L2; the first call (layer 0, input 0) is the one checked:
y within 1e-2 and the written layer of the pool bit-exact. Bytes: state read + written, x read, y written (weights,
< 0.2 MB, not counted).
"""

from __future__ import annotations

import functools

from case import Case, Setup

W = 4
ROTATE = 8
DECODE = [(128, 12288), (256, 6144)]  # (B, conv_dim)
PREFILL = [((8192,), 6144), ((4096,) * 4, 12288), ((128,) * 16, 2048)]  # (sequence lengths, conv_dim); the last:
# a chunked-prefill step of the gpu-preset engine (16 rows x 128 tokens, conv_dim 2048)


def _pool(layers: int, slots: int, dim: int):
    import jax
    import jax.numpy as jnp

    from kvjax.state.gdn_pool import GDNStatePool

    conv = jax.random.normal(jax.random.key(1), (layers, slots, dim, W - 1), jnp.bfloat16).at[:, 0].set(0)
    return GDNStatePool(conv=conv, ssm=jnp.zeros((layers, slots, 1, 1, 1), jnp.float32))  # unused ssm


def _fresh(pool0):
    import jax

    return jax.tree.map(lambda a: a.copy(), pool0)


def _decode_setup(b: int, dim: int) -> Setup:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from kvjax.state import gdn_pool

    pool0 = _pool(ROTATE, b + 9, dim)
    w = jax.random.normal(jax.random.key(2), (dim, W), jnp.float32) * 0.5  # f32[D, W]
    xs = [jax.random.normal(jax.random.key(10 + i), (b, dim), jnp.bfloat16) for i in range(ROTATE)]  # bf16[B, D]
    slots = jnp.asarray(np.random.default_rng(b).permutation(np.arange(1, b + 9))[:b].astype(np.int32))
    layers = [jnp.asarray(i, jnp.int32) for i in range(ROTATE)]

    def run(impl: str):
        step = jax.jit(lambda x, pool, layer: gdn_pool.conv_decode(x, w, None, pool, layer=layer, slot_ids=slots,
                                                                 impl=impl), donate_argnums=1)
        state = {"i": 0}

        def call():
            i = state["i"] % ROTATE
            state["i"] += 1
            y, state["pool"] = step(xs[i], state.get("pool") or _fresh(pool0), layers[i])
            return y, state["pool"].conv

        return call

    return Setup(run=run, reference=lambda: run("reference")(), compare=lambda out: (out[0], out[1][0]))


def _prefill_setup(lens: tuple[int, ...], dim: int) -> Setup:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from kvjax.state import gdn_pool

    n, t = len(lens), sum(lens)
    pool0 = _pool(2, n + 9, dim)
    w = jax.random.normal(jax.random.key(2), (dim, W), jnp.float32) * 0.5  # f32[D, W]
    x = jax.random.normal(jax.random.key(3), (t, dim), jnp.bfloat16)  # bf16[T, D]
    kw = dict(layer=1, slot_ids=jnp.asarray(np.random.default_rng(n).permutation(np.arange(1, n + 9))[:n],
                                            jnp.int32),
              has_initial_state=jnp.asarray(np.arange(n) % 2 == 0),
              cu_seqlens=jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32))

    def run(impl: str):
        step = jax.jit(lambda pool: gdn_pool.conv_prefill(x, w, None, pool, impl=impl, **kw), donate_argnums=0)
        state = {}

        def call():
            y, state["pool"] = step(state.get("pool") or _fresh(pool0))
            return y, state["pool"].conv

        return call

    return Setup(run=run, reference=lambda: run("reference")(), compare=lambda out: (out[0], out[1][1]))


def cases(small: bool = False) -> list[Case]:
    """Decode and prefill cases, Pallas against the fused XLA path; ``small``: tiny shapes (CPU smoke run)."""
    decode = [(4, 64)] if small else DECODE
    prefill = [((5, 70), 64)] if small else PREFILL
    impls = ("pallas", "reference")
    out = [Case(f"conv decode B={b} D={d}", "kvjax.state.gdn_pool.conv_decode", dict(B=b, D=d, W=W), impls,
                functools.partial(_decode_setup, b, d), anchor="reference",
                bytes=2 * b * d * (W - 1) * 2 + 2 * b * d * 2, tol=(1e-2, 0.0)) for b, d in decode]
    out += [Case(f"conv prefill N={len(lens)} T={sum(lens)} D={d}", "kvjax.state.gdn_pool.conv_prefill",
                 dict(lens=list(lens), D=d, W=W), impls, functools.partial(_prefill_setup, lens, d),
                 anchor="reference", bytes=2 * sum(lens) * d * 2 + len(lens) * d * (W - 1) * 2 * 2,
                 tol=(1e-2, 0.0)) for lens, d in prefill]
    return out
