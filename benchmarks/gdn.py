"""GDN benchmark cases: decode and chunked prefill on the slot pool (``kvjax.state.gdn_pool``) vs fla.

Usage: ``python benchmarks/runner.py gdn [--anchors-json OUT/anchors.json]`` (the torch half,
``python benchmarks/runner.py --anchors-only gdn``, times fla's kernels: ``torch_anchors`` below). Issue 38 on
FlashQLA's recipe: ``python benchmarks/gdn.py jax|auto|fla [OUT.json] [shape indices]`` (kvjax / fla, one process
a side); ``python benchmarks/gdn.py prep-mgpu [OUT.json] [shape indices]``: the Triton and the Mosaic GPU
preparation kernels, alone and inside the whole pool kernel, in one process (:func:`flashqla_prep_mgpu`);
``python benchmarks/gdn.py fused-mgpu [OUT.json] [shape indices] [line prefixes]``: FlashQLA's layout
(``"mosaic-fused"``: inverse-only preparation with its value heads' inverses in lockstep, fused Mosaic GPU pass)
against ``auto``, whole and by part (:func:`flashqla_fused_mgpu`; ``fused-mgpu OUT.json 0,1,2,3,4 whole,prep``:
the two whole-forward and two preparation lines); ``python benchmarks/gdn.py rule [OUT.json] [grid indices]``:
``"mosaic"`` against ``"mosaic-fused"`` over :data:`RULE_GRID`, beside ``auto``'s choice (:func:`flashqla_rule`).
The non-fused Mosaic GPU sequential pass (``seq-mgpu``, backend
``"mosaic-seq"``) is deleted; its figures are in HISTORY.md.

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

    from kvjax.state import gdn_pool

    num_slots = b + 8
    slots = np.random.default_rng(0).permutation(np.arange(1, num_slots + 1))[:b].astype(np.int32)
    if padding:  # every other row is padding (slot 0): its state traffic must vanish
        slots[1::2] = 0
    ssm0 = jax.random.normal(jax.random.key(1), (1, num_slots + 1, h, kd, kd), jnp.float32).at[:, 0].set(0)
    return _pool_setup(gdn_pool.gdn_decode, _inputs(b, h, kd, b + h), ssm0, layer=0, slot_ids=jnp.asarray(slots),
                       use_qk_l2norm=True)


def _prefill_setup(b: int, t: int, h: int, kd: int) -> Setup:
    import jax
    import jax.numpy as jnp

    from kvjax.state import gdn_pool

    ssm0 = jax.random.normal(jax.random.key(2), (1, b + 2, h, kd, kd), jnp.float32).at[:, 0].set(0)
    return _pool_setup(gdn_pool.gdn_prefill, _inputs(b * t, h, kd, t + h), ssm0, layer=0,
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
                f"gdn decode B={b} H={h}" + (" half padding" if padding else ""), "kvjax.state.gdn_pool.gdn_decode",
                dict(B=b, H=h, K=kd, V=kd, padding_rows=b - live), ("pallas", "auto"),
                functools.partial(_decode_setup, b, h, kd, padding), anchor=None if padding else "torch:fla",
                bytes=2 * live * h * kd * kd * 4, tol=(2e-2, 1e-4)))
    for b, t, h in prefill:
        io = 4 * b * t * h * kd * 2 + 2 * b * h * kd * kd * 4
        out.append(Case(
            f"gdn prefill B={b} T={t} H={h}", "kvjax.state.gdn_pool.gdn_prefill", dict(B=b, T=t, H=h, K=kd, V=kd),
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


# ---------------------------------------------------------------------------------------------------------
# Issue 38: FlashQLA's forward recipe (benchmark/bench_gated_delta_rule.py of QwenLM/FlashQLA), one process a side.
# ---------------------------------------------------------------------------------------------------------

FLASHQLA_SHAPES = [([8192], 16, 16), ([8192], 16, 32), ([32768], 16, 32), ([8192] * 4, 16, 32), ([4096] * 8, 16, 32),
                   ([2048], 4, 8)]  # the last: one chunked-prefill step of the engine's gpu preset (no anchor)
FLASHQLA_H200_MS = {0: 0.178, 1: 0.280, 2: 0.877, 3: 0.611, 4: 0.619}  # published (CUDA-graph timer), H200


def flashqla_inputs(seqlens: list[int], hk: int, hv: int, d: int = 128, seed: int = 0):
    """FlashQLA's recipe as numpy: q, k l2-normalised (bf16), v bf16, ``g = logsigmoid(x) / 16`` with a quarter
    of the value heads ungated (g = 0), f32 ``beta = sigmoid(x)``, f32 initial state, int32 cu_seqlens."""
    import numpy as np

    rng = np.random.default_rng(seed)
    t, n = sum(seqlens), len(seqlens)

    def unit(x):
        return x / np.linalg.norm(x, axis=-1, keepdims=True)

    q = unit(rng.standard_normal((t, hk, d), np.float32))  # f32[T, Hk, K]
    k = unit(rng.standard_normal((t, hk, d), np.float32))  # f32[T, Hk, K]
    v = rng.standard_normal((t, hv, d), np.float32)  # f32[T, Hv, V]
    g = -np.logaddexp(0.0, -rng.standard_normal((t, hv), np.float32)) / 16  # f32[T, Hv]
    g[:, rng.permutation(hv)[: hv - -(-3 * hv // 4)]] = 0.0
    beta = 1.0 / (1.0 + np.exp(-rng.standard_normal((t, hv), np.float32)))  # f32[T, Hv]
    h0 = rng.standard_normal((n, hv, d, d), np.float32)  # f32[N, Hv, K, V]
    cu = np.concatenate([[0], np.cumsum(seqlens)]).astype(np.int32)  # i32[N+1]
    return q, k, v, g.astype(np.float32), beta.astype(np.float32), h0, cu


def flashqla_case(seqlens: list[int], hk: int, hv: int, reference: bool = True):
    """:func:`flashqla_inputs` on the device (q / k / v bf16), the scale and the f32 chunked reference's
    ``(o, final state)`` (``(None, None)`` without ``reference``)."""
    import jax.numpy as jnp

    from kvjax.ops import gdn

    q, k, v, g, beta, h0, cu = flashqla_inputs(seqlens, hk, hv)
    q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
    g, beta, h0, cu = jnp.asarray(g), jnp.asarray(beta), jnp.asarray(h0), jnp.asarray(cu)
    scale = 128 ** -0.5
    if not reference:
        return q, k, v, g, beta, h0, cu, scale, (None, None)
    return q, k, v, g, beta, h0, cu, scale, gdn.chunk_gated_delta_rule_reference(
        gdn.DeltaRuleCall(q, k, v, g, beta, cu, scale), h0)


def _shape_name(seqlens, hk, hv) -> str:
    n = len(seqlens)
    return f"{seqlens[0]} x {n}, {hk}, {hv}" if n > 1 else f"1 x {seqlens[0]}, {hk}, {hv}"


SWEEP_ONE = {  # variants timed beside the public op at one sequence (pool kernel keyword arguments); the
    # settings that lost (wider blocks, 2 or 8 warps, 3 stages) are in benchmarks/HISTORY.md (issue 38)
    "seq": dict(segment_chunks=0),
}
SWEEP_MANY: dict = {}  # ... and at several sequences (the public op runs the fused pass with two warpgroups a CTA
# there since HISTORY run 213; its one-warpgroup form and the Mosaic prep + Triton pass: runs 212-213)


def flashqla_jax(variants: bool = True, shapes: list[int] | None = None) -> list[dict]:
    """kvjax on FlashQLA's recipe: the public op (``impl="auto"``, jitted) and, with ``variants``, the pool
    kernel with chunk parallelism off / at several segment lengths; errors against the chunked reference."""
    import jax

    from kvjax.ops import gdn
    from kvjax.pallas.gdn.chunk import chunk_gated_delta_rule_pool
    from kvjax.pallas.gdn.common import state_as_pool

    import timing

    rows = []
    for i, (seqlens, hk, hv) in enumerate(FLASHQLA_SHAPES):
        if shapes is not None and i not in shapes:
            continue
        q, k, v, g, beta, h0, cu, scale, (ro, rf) = flashqla_case(seqlens, hk, hv)
        runners = {"auto": jax.jit(lambda q, k, v, g, b, h: gdn.chunk_gated_delta_rule(
            q, k, v, g, b, cu_seqlens=cu, initial_state=h, scale=scale, impl="auto"))}
        if variants:
            configs = dict(SWEEP_ONE if len(seqlens) == 1 else SWEEP_MANY)
            for name, kw in configs.items():
                def fn(q, k, v, g, b, h, kw=kw):
                    pool, prow, flags = state_as_pool(h, len(seqlens), hv, 128, 128)
                    return chunk_gated_delta_rule_pool(q, k, v, g, b, pool, cu_seqlens=cu, rows=prow, flags=flags,
                                                       scale=scale, **kw)
                runners[name] = jax.jit(fn)
        args = (q, k, v, g, beta, h0)
        calls = {}
        for name, fn in runners.items():
            o, f = fn(*args)
            err = (timing.rel_err(o, ro), timing.rel_err(f, rf))
            calls[name] = (lambda fn=fn: fn(*args))
            rows.append({"shape": _shape_name(seqlens, hk, hv), "index": i, "impl": name, "err_o": err[0],
                         "err_state": err[1]})
            print("checked", rows[-1], flush=True)
        times = timing.interleaved(calls, rounds=5, n=20)
        for r in rows:
            if r["index"] == i and r["impl"] in times:
                r.update(wall_ms=times[r["impl"]]["wall_ms"], device_ms=times[r["impl"]]["device_ms"],
                         kernels={n: c for n, c in times[r["impl"]]["kernels"].items()} if r["impl"] == "auto" else None)
                recs = timing.kernel_records(lambda fn=calls[r["impl"]]: timing.block([fn() for _ in range(10)]))
                r["kernel_ms"] = {k: t / 10 / 1e6 for k, (c, t) in recs["names"].items() if t / 10 / 1e6 > 0.002}
                print(f"{r['shape']:>20} {r['impl']:>8} wall {r['wall_ms']:.4f} device {r['device_ms'] or 0:.4f} ms "
                      f"err {r['err_o']:.1e}/{r['err_state']:.1e} " + " ".join(
                          f"{k.replace('gdn_chunk', 'K')}={t:.3f}" for k, t in r["kernel_ms"].items()), flush=True)
    return rows


def flashqla_fla(shapes: list[int] | None = None) -> list[dict]:
    """fla's ``chunk_gated_delta_rule`` on the same recipe (q, k pre-normalised, no in-kernel l2norm),
    Triton's CUDA-graph timer and the torch timers."""
    import torch
    import triton
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    import timing

    rows = []
    for i, (seqlens, hk, hv) in enumerate(FLASHQLA_SHAPES):
        if shapes is not None and i not in shapes:
            continue
        q, k, v, g, beta, h0, cu = flashqla_inputs(seqlens, hk, hv)
        dev = "cuda"
        q, k, v = (torch.from_numpy(x).to(dev, torch.bfloat16)[None] for x in (q, k, v))
        g, beta = (torch.from_numpy(x).to(dev)[None] for x in (g, beta))
        h0, cu = torch.from_numpy(h0).to(dev), torch.from_numpy(cu).to(dev, torch.long)

        def call():
            return chunk_gated_delta_rule(q, k, v, g=g, beta=beta, scale=128 ** -0.5, initial_state=h0,
                                          output_final_state=True, cu_seqlens=cu)

        t = timing.torch_time(call)
        t["graph_ms"] = triton.testing.do_bench_cudagraph(call, rep=200, return_mode="median")
        rows.append({"shape": _shape_name(seqlens, hk, hv), "index": i, "impl": "fla", **t})
        print(rows[-1], flush=True)
    return rows


PREP_VARIANTS = {  # name: PrepConfig keyword arguments (value_heads=1 only where a key head has several)
    "triton": dict(), "mosaic": dict(kernel="mosaic"), "mosaic vh1": dict(kernel="mosaic", value_heads=1)}


def _ms(times: dict, name: str) -> float:
    """A line's device ms where the profiler has records, else its wall ms."""
    return times[name]["device_ms"] or times[name]["wall_ms"]


def _compile_and_time(runners: dict, args_for, shape: str, width: int) -> tuple[dict, dict, dict]:
    """Run each jitted runner once on ``args_for(name)`` (its outputs), print ``FAILED`` for a line that does not
    compile and time the others interleaved in one process. Returns ``(outputs, calls, times)``."""
    import timing

    outs, calls = {}, {}
    for name, fn in runners.items():
        a = args_for(name)
        try:
            outs[name] = fn(*a)
            calls[name] = (lambda fn=fn, a=a: fn(*a))
        except Exception as e:  # a line that does not compile or fit: say so, time the others
            print(f"{shape:>20} {name:>{width}} FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
    return outs, calls, timing.interleaved(calls, rounds=3, n=10, device_rounds=1)


def flashqla_prep_mgpu(shapes: list[int] | None = None) -> list[dict]:
    """The preparation kernel alone (``kvjax.pallas.gdn.prep.prepare``) and the whole pool kernel
    (``chunk_gated_delta_rule_pool``, chunk parallelism as the public op picks it) with each preparation kernel
    (:data:`PREP_VARIANTS`: Triton, Mosaic GPU with a key head's value heads per CTA, and one per CTA), one process,
    interleaved timing, on FlashQLA's recipe at its five shapes. Checks: each Mosaic prep's outputs against the
    Triton prep's (the largest relative error of w, u, A, qf, kf, gl), each whole kernel's output / final state
    against the chunked reference. Prints one line per shape and variant: device ms (wall ms where the profiler
    has no device records) of the prep and the whole kernel, and Triton's time over it."""
    import jax

    from kvjax.pallas.gdn.chunk import CHUNK, chunk_gated_delta_rule_pool
    from kvjax.pallas.gdn.common import state_as_pool
    from kvjax.pallas.gdn.prep import PrepConfig, prepare

    import timing

    rows = []
    print(f"{'shape':>20} {'prep':>11} {'ms':>8} {'x':>5} {'whole ms':>9} {'x':>5}  errors: prep vs triton prep; "
          "whole o / state vs reference", flush=True)
    for i, (seqlens, hk, hv) in enumerate(FLASHQLA_SHAPES[:5]):
        if shapes is not None and i not in shapes:
            continue
        q, k, v, g, beta, h0, cu, scale, (ro, rf) = flashqla_case(seqlens, hk, hv)
        variants = {n: PrepConfig(**kw) for n, kw in PREP_VARIANTS.items() if kw.get("value_heads", 0) < hv // hk}
        runners = {}
        for name, cfg in variants.items():
            runners[f"prep {name}"] = jax.jit(lambda q, k, v, g, b, h, cfg=cfg: prepare(
                q, k, v, g, b, cu, scale=scale, use_qk_l2norm=False, chunk=CHUNK, config=cfg)[2:])

            def whole(q, k, v, g, b, h, cfg=cfg):
                pool, prow, flags = state_as_pool(h, len(seqlens), hv, 128, 128)
                return chunk_gated_delta_rule_pool(q, k, v, g, b, pool, cu_seqlens=cu, rows=prow, flags=flags,
                                                   scale=scale, prep=cfg)
            runners[f"whole {name}"] = jax.jit(whole)
        args = (q, k, v, g, beta, h0)
        outs = {name: fn(*args) for name, fn in runners.items()}
        times = timing.interleaved({n: (lambda fn=fn: fn(*args)) for n, fn in runners.items()}, rounds=5, n=20)

        for name in variants:
            o, f = outs[f"whole {name}"]
            row = {"shape": _shape_name(seqlens, hk, hv), "index": i, "prep": name,
                   "err_prep": max(timing.rel_err(a, b) for a, b in zip(outs[f"prep {name}"], outs["prep triton"])),
                   "err_o": timing.rel_err(o, ro), "err_state": timing.rel_err(f, rf)}
            for part in ("prep", "whole"):
                row[f"{part}_wall_ms"] = times[f"{part} {name}"]["wall_ms"]
                row[f"{part}_device_ms"] = times[f"{part} {name}"]["device_ms"]
            rows.append(row)
            prep_ms, whole_ms = _ms(times, "prep " + name), _ms(times, "whole " + name)
            print(f"{row['shape']:>20} {name:>11} {prep_ms:>8.4f} {_ms(times, 'prep triton') / prep_ms:>5.2f} "
                  f"{whole_ms:>9.4f} {_ms(times, 'whole triton') / whole_ms:>5.2f}  {row['err_prep']:.1e}; "
                  f"{row['err_o']:.1e} / {row['err_state']:.1e}   (wall {row['prep_wall_ms']:.4f} / "
                  f"{row['whole_wall_ms']:.4f})", flush=True)
    return rows


def flashqla_fused_mgpu(shapes: list[int] | None = None, lines: str = "") -> list[dict]:
    """FlashQLA's layout (issue 38, GDN half) against ``auto``, one process, interleaved timing, FlashQLA's recipe
    at its five shapes. Whole forward: the public op with ``impl="auto"`` (which takes ``"mosaic-fused"`` for one
    sequence of >= 32 value heads on Hopper) and ``"mosaic-fused"`` (inverse-only preparation + fused pass). Parts:
    the Mosaic preparation with the default outputs (``w``, ``u``, ...: backend ``"mosaic"``'s) against
    ``outputs="inverse"`` (its value heads' inverses in lockstep, its only form), and the fused pass on the latter's
    operands (computed once). Errors: outputs / final states against the f32 chunked reference; the inverse-only
    prep's ``A`` and row factors against the default outputs' (the largest relative error). Prints device ms (every
    kernel of the call; wall where the profiler has none) and the first line of its group over it. One jit per
    line. ``lines``: only the lines whose name starts with one of its comma-separated prefixes (``"prep"``: the two
    preparation lines, no f32 reference computed; ``"whole,prep"``: the two whole-forward and two preparation
    lines)."""
    import jax
    import jax.numpy as jnp

    from kvjax.base.ragged import count_le
    from kvjax.ops import gdn
    from kvjax.pallas.gdn.common import state_as_pool
    from kvjax.pallas.gdn.prep_mgpu import prep_mgpu_call
    from kvjax.pallas.gdn.seq_mgpu import seq_mgpu_fused_call

    import timing

    rows = []
    print(f"{'shape':>20} {'line':>21} {'ms':>8} {'x':>5}  errors: o / state vs reference (prep: vs today's)",
          flush=True)
    for i, (seqlens, hk, hv) in enumerate(FLASHQLA_SHAPES[:5]):
        if shapes is not None and i not in shapes:
            continue
        q, k, v, g, beta, h0, cu, scale, (ro, rf) = flashqla_case(seqlens, hk, hv,
                                                                  reference=not lines.startswith("prep"))
        n, t = len(seqlens), q.shape[0]  # t: a multiple of 64 at every shape (no padding)
        seg = (count_le(cu, jnp.arange(t, dtype=jnp.int32)) - 1).astype(jnp.int32)  # i32[T]
        prep_kw = dict(chunk=64, scale=scale, use_qk_l2norm=False)
        runners = {
            "whole auto": jax.jit(lambda q, k, v, g, b, h: gdn.chunk_gated_delta_rule(
                q, k, v, g, b, cu_seqlens=cu, initial_state=h, scale=scale, impl="auto")),
            "whole mosaic-fused": jax.jit(lambda q, k, v, g, b, h: gdn.chunk_gated_delta_rule(
                q, k, v, g, b, cu_seqlens=cu, initial_state=h, scale=scale, impl="mosaic-fused")),
        }
        runners["prep mosaic"] = jax.jit(lambda q, k, v, g, b: prep_mgpu_call(seg, q, k, v, g, b, **prep_kw))
        runners["prep inverse"] = jax.jit(lambda q, k, v, g, b: prep_mgpu_call(seg, q, k, v, g, b,
                                                                               outputs="inverse", **prep_kw))
        prep_args = (q, k, v, g, beta)
        _, _, a, qf, kf, gl = runners["prep mosaic"](*prep_args)
        tb, a2, rowf = runners["prep inverse"](*prep_args)

        def seq_fused(h, *ops):
            pool, prow, flags = state_as_pool(h, n, hv, 128, 128)
            return seq_mgpu_fused_call(q, k, v, *ops, pool, cu, prow, flags, out_dtype=jnp.bfloat16)
        runners["seq fused"] = jax.jit(seq_fused)
        runners = {name: fn for name, fn in runners.items() if name.startswith(tuple(lines.split(",")))}
        args = {"whole": (q, k, v, g, beta, h0), "prep": prep_args, "seq fused": (h0, tb, a2, rowf)}
        shape = _shape_name(seqlens, hk, hv)
        outs, calls, times = _compile_and_time(
            runners, lambda name: args[name] if name in args else args[name.split()[0]], shape, 21)

        first = {"whole": "whole auto", "prep": "prep mosaic", "seq": "seq fused"}
        for name in calls:
            row = {"shape": _shape_name(seqlens, hk, hv), "index": i, "line": name,
                   "wall_ms": times[name]["wall_ms"], "device_ms": times[name]["device_ms"],
                   "flashqla_h200_ms": FLASHQLA_H200_MS.get(i)}
            if name.startswith("prep"):
                got = outs[name][1:5] if name.startswith("prep inverse") else outs[name][2:6]
                row["err_vs_today"] = max(timing.rel_err(x, y) for x, y in zip(got, (a, qf, kf, gl)))
                errs = f"{row['err_vs_today']:.1e}"
            else:
                o, f = outs[name]
                row.update(err_o=timing.rel_err(o[:t], ro), err_state=timing.rel_err(f, rf))
                errs = f"{row['err_o']:.1e} / {row['err_state']:.1e}"
            base = first[name.split()[0]]
            x = _ms(times, base) / _ms(times, name) if base in times else float("nan")
            rows.append(row)
            print(f"{row['shape']:>20} {name:>21} {_ms(times, name):>8.4f} {x:>5.2f}  {errs}   "
                  f"(wall {row['wall_ms']:.4f})", flush=True)
    return rows


RULE_GRID = (  # (sequence lengths, Hk, Hv): where auto's choice between the Mosaic backends is drawn; the last four
    # are the engine's chunked-prefill calls (benchmarks/RESULTS.md, "GDN prefill in the engine's steps")
    [([t], 16, 32) for t in (1024, 2048, 4096)] + [([t] * 2, 16, 32) for t in (1024, 2048, 4096, 8192)]
    + [([t] * n, 16, 32) for n in (4, 8) for t in (512, 1024, 2048)] + [([t] * 16, 16, 32) for t in (512, 1024)]
    + [([t], 16, 16) for t in (2048, 4096, 16384, 32768)] + [([t] * 2, 16, 16) for t in (2048, 4096, 8192)]
    + [([t] * 4, 16, 16) for t in (2048, 8192)] + [([t] * 8, 16, 16) for t in (1024, 4096)]
    + [([2048], 4, 8), ([8192], 4, 8), ([2048] * 4, 4, 8)]
    + [([2045, 1, 1, 1] + [0] * 12, 4, 8), ([128] * 16, 4, 8), ([2045, 1, 1, 1] + [0] * 60, 16, 32),
       ([32] * 64, 16, 32)])


def flashqla_rule(grid=RULE_GRID) -> list[dict]:
    """Where ``auto`` should take ``"mosaic-fused"`` over ``"mosaic"`` (chunk-parallel Mosaic preparation + Triton
    pass): both by name on FlashQLA's recipe at each ``(sequence lengths, Hk, Hv)`` of ``grid``, device ms
    interleaved in one process, and ``auto``'s choice (the backend table's, on these arrays)."""
    import jax

    from kvjax.ops import gdn

    rows = []
    for seqlens, hk, hv in grid:
        q, k, v, g, beta, h0, cu, scale, _ = flashqla_case(seqlens, hk, hv, reference=False)
        chosen, _ = gdn.CHUNK_TABLE.choose("auto", (gdn.DeltaRuleCall(q, k, v, g, beta, cu, scale), h0), {})
        runners = {impl: jax.jit(lambda q, k, v, g, b, h, impl=impl: gdn.chunk_gated_delta_rule(
            q, k, v, g, b, cu_seqlens=cu, initial_state=h, scale=scale, impl=impl))
            for impl in ("mosaic", "mosaic-fused")}
        even = len(set(seqlens)) == 1
        shape = (_shape_name(seqlens, hk, hv) if even else
                 f"{'+'.join(str(x) for x in seqlens if x)} in {len(seqlens)} rows, {hk}, {hv}")
        _, calls, times = _compile_and_time(runners, lambda name: (q, k, v, g, beta, h0), shape, 12)
        row = {"shape": shape, "sequences": len(seqlens), "tokens": sum(seqlens), "hk": hk, "hv": hv,
               "auto": chosen, **{impl: _ms(times, impl) for impl in calls}}
        best = min(calls, key=lambda impl: row[impl]) if calls else None
        row.update(best=best, auto_is_best=chosen == best)
        rows.append(row)
        print(row, flush=True)
    return rows


if __name__ == "__main__":
    import json
    import os
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    side = sys.argv[1] if len(sys.argv) > 1 else "jax"
    only = [int(x) for x in sys.argv[3].split(",")] if len(sys.argv) > 3 else None
    if side == "fla":
        out = flashqla_fla(only)
    elif side == "prep-mgpu":
        out = flashqla_prep_mgpu(only)
    elif side == "fused-mgpu":
        out = flashqla_fused_mgpu(only, sys.argv[4] if len(sys.argv) > 4 else "")
    elif side == "rule":
        out = flashqla_rule(RULE_GRID if only is None else [RULE_GRID[i] for i in only])
    else:
        out = flashqla_jax(variants=side != "auto", shapes=only)
    if len(sys.argv) > 2:
        with open(sys.argv[2], "w") as fh:
            json.dump(out, fh, indent=1)
