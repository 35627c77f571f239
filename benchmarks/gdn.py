"""GDN benchmark cases: decode and chunked prefill on the slot pool (``kvjax.state.gdn_ops``) vs fla.

Usage: ``python benchmarks/runner.py gdn [--anchors-json OUT/anchors.json]`` (the torch half,
``python benchmarks/runner.py --anchors-only gdn``, times fla's kernels: ``torch_anchors`` below).

Shapes as in every earlier run: K = V = 128, Hk = Hv = H, bf16 q / k / v / beta, f32 log-decay g and state,
in-kernel q/k l2norm and the initial state on both sides. The pool ``f32[1, S+1, H, K, V]`` is donated and
chained from call to call; slots are a random permutation. Decode bytes: each live row's state read + written
(``2 B H K V 4``); prefill bytes: q, k, v read, o written (bf16) and the state read + written.
"""

from __future__ import annotations

import functools

from case import Case, Setup

KD = VD = 128
CHUNK = 64
DECODE = [(128, 32), (256, 16)]  # (B, H), one token per row
PREFILL = [(1, 8192, 16), (4, 4096, 32)]  # (B, T, H)
SMALL_KD = 32


def _inputs(t: int, h: int, kd: int, seed: int):
    import jax
    import jax.numpy as jnp

    ks = jax.random.split(jax.random.key(seed), 5)
    q = jax.random.normal(ks[0], (t, h, kd), jnp.float32).astype(jnp.bfloat16)  # bf16[T, H, K]
    k = jax.random.normal(ks[1], (t, h, kd), jnp.float32).astype(jnp.bfloat16)  # bf16[T, H, K]
    v = jax.random.normal(ks[2], (t, h, kd), jnp.float32).astype(jnp.bfloat16)  # bf16[T, H, V]
    g = jax.nn.log_sigmoid(jax.random.normal(ks[3], (t, h), jnp.float32)) * 0.1  # f32[T, H]
    beta = jax.random.uniform(ks[4], (t, h), jnp.float32).astype(jnp.bfloat16)  # bf16[T, H]
    return q, k, v, g, beta


def _pool_setup(op, args, ssm0, **kw) -> Setup:
    """A pool op ``op(*args, pool, impl=, **kw) -> (o, pool)`` jitted with the pool donated and chained."""
    import jax
    import jax.numpy as jnp

    def run(impl: str):
        step = jax.jit(lambda ssm: op(*args, ssm, impl=impl, **kw), donate_argnums=0)
        state = {}

        def call():
            if "ssm" not in state:  # fresh state (a copy: ssm0 stays) on the first call only
                state["ssm"] = jnp.array(ssm0, copy=True)
            o, state["ssm"] = step(state["ssm"])
            return o, state["ssm"]

        return call

    return Setup(run=run, reference=lambda: run("reference")())


def _decode_setup(b: int, h: int, kd: int, padding: bool) -> Setup:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from kvjax.state import gdn_ops

    num_slots = b + 8
    slots = np.random.default_rng(0).permutation(np.arange(1, num_slots + 1))[:b].astype(np.int32)
    if padding:  # every other row is padding (slot 0): its state traffic must vanish
        slots[1::2] = 0
    ssm0 = jax.random.normal(jax.random.key(1), (1, num_slots + 1, h, kd, kd), jnp.float32).at[:, 0].set(0)
    return _pool_setup(gdn_ops.gdn_decode, _inputs(b, h, kd, b + h), ssm0, layer=0, slot_ids=jnp.asarray(slots),
                       use_qk_l2norm=True)


def _prefill_setup(b: int, t: int, h: int, kd: int) -> Setup:
    import jax
    import jax.numpy as jnp

    from kvjax.state import gdn_ops

    ssm0 = jax.random.normal(jax.random.key(2), (1, b + 2, h, kd, kd), jnp.float32).at[:, 0].set(0)
    return _pool_setup(gdn_ops.gdn_prefill, _inputs(b * t, h, kd, t + h), ssm0, layer=0,
                       slot_ids=jnp.arange(2, b + 2, dtype=jnp.int32), has_initial_state=jnp.ones((b,), bool),
                       cu_seqlens=jnp.arange(b + 1, dtype=jnp.int32) * t, use_qk_l2norm=True)


def prefill_flops(b: int, t: int, h: int, kd: int = KD, vd: int = VD, c: int = CHUNK) -> int:
    """Matmul FLOPs of the chunked form per (chunk, head): k k^T, q k^T, w, the 10-product inverse, u,
    ``P u``, ``q S``, ``w S`` and ``k^T u`` (about 16.8 MFLOP at c=64, K=V=128)."""
    per = 2 * c * c * kd * 3 + 2 * c * c * vd * 2 + 10 * 2 * c ** 3 + 2 * c * kd * vd * 3
    return per * b * h * -(-t // c)


def cases(small: bool = False) -> list[Case]:
    """Decode (full and half padding) and prefill cases; ``small``: tiny shapes for a CPU smoke run."""
    kd = SMALL_KD if small else KD
    decode = [(4, 2)] if small else DECODE
    prefill = [(2, 80, 2)] if small else PREFILL
    out = []
    for b, h in decode:
        for padding in (False, True):
            live = b - b // 2 if padding else b
            out.append(Case(
                f"gdn decode B={b} H={h}" + (" half padding" if padding else ""), "kvjax.state.gdn_ops.gdn_decode",
                dict(B=b, H=h, K=kd, V=kd, padding_rows=b - live), ("pallas", "auto"),
                functools.partial(_decode_setup, b, h, kd, padding), anchor=None if padding else "torch:fla",
                bytes=2 * live * h * kd * kd * 4, tol=(2e-2, 1e-4)))
    for b, t, h in prefill:
        io = 4 * b * t * h * kd * 2 + 2 * b * h * kd * kd * 4
        out.append(Case(
            f"gdn prefill B={b} T={t} H={h}", "kvjax.state.gdn_ops.gdn_prefill", dict(B=b, T=t, H=h, K=kd, V=kd),
            ("pallas", "auto"), functools.partial(_prefill_setup, b, t, h, kd), anchor="torch:fla", bytes=io,
            flops=prefill_flops(b, t, h, kd, kd), tol=(2e-2, 2e-2)))
    return out


def torch_anchors(small: bool = False) -> dict:
    """fla's ``fused_recurrent_gated_delta_rule`` (decode) and ``chunk_gated_delta_rule`` (prefill) on the
    same shapes, compiled, autotuned and timed alone on the GPU: ``{case name: {"fla": {wall_ms, device_ms}}}``."""
    import torch
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

    import timing

    def inputs(b, t, h, kd):
        bf = dict(device="cuda", dtype=torch.bfloat16)
        q, k, v = (torch.randn(b, t, h, kd, **bf) for _ in range(3))
        g = torch.nn.functional.logsigmoid(torch.randn(b, t, h, device="cuda")) * 0.1
        return q, k, v, g, torch.rand(b, t, h, **bf), torch.randn(b, h, kd, kd, device="cuda")

    kd = SMALL_KD if small else KD
    res = {}
    for case in cases(small):
        s = case.shapes
        if case.anchor != "torch:fla":
            continue
        decode = "T" not in s
        q, k, v, g, beta, s0 = inputs(s["B"], 1 if decode else s["T"], s["H"], kd)
        fn = fused_recurrent_gated_delta_rule if decode else chunk_gated_delta_rule
        call = functools.partial(fn, q, k, v, g=g, beta=beta, initial_state=s0, output_final_state=True,
                                 use_qk_l2norm_in_kernel=True)
        res[case.name] = {"fla": timing.torch_time(call)}
        print("fla", case.name, res[case.name], flush=True)
    return res
