"""Paged attention prefill: the Mosaic GPU kernel's schedule variants against cuDNN, in one process (issue #38).

Usage (Hopper GPU, from the repo root): ``PYTHONPATH=. python benchmarks/prefill_variants.py [--pages 128,64]
[--variants today,persistent,...] [--rounds 7] [--calls 20]``. CPU check of the script and of every variant's
output (no timing): ``python benchmarks/prefill_variants.py --interpret --small``.

Problem: one causal sequence, T=4096, H=32 (one KV head per query head), D=128, bf16 q / K / V, the K/V pages a
random permutation of the pool; pages of 128 and of 64 tokens. Rows, per page size:

- every variant of ``--variants``: ``paged_prefill_mgpu(call, variant=...)``, each compiled under its own kernel
  name (:class:`kvjax.pallas.paged.prefill_mgpu.Variant`). A variant is a name of :data:`KNOBS` or several joined
  by ``+`` (their knobs together); ``today`` is the default schedule, the one RESULTS.md measures;
- ``cudnn``: ``jax.nn.dot_product_attention(implementation="cudnn")`` on the contiguous K/V (GPU only).

Each row is checked first: max ``|out - reference|`` against the float32 reference over the same pages (a variant
that fails to compile or run is reported and left out). Then ``--rounds`` rounds, each timing ``--calls``
back-to-back calls of every row in turn under the profiler (device records, as ``timing.device_ms``); medians of
the rounds. Columns: ``call ms`` (every kernel of the call: cuDNN's memsets, kvjax's launch metadata),
``kernel ms`` (the call's longest kernel alone), ``vs cudnn`` (cuDNN's call ms over the row's), TFLOP/s (causal
FLOPs ``2 T (T + 1) H D`` over call ms) and its share of FlashAttention-3's published 648 TFLOP/s (H100,
non-causal, 16k, D=128). The default run (2 page sizes, 9 variants and cuDNN, 5 rounds) is meant to take under 6
minutes on an H100, compiles included (not measured yet: the script prints each row's first-call seconds).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SHAPE = (4096, 32, 128)  # T, H, D
SMALL = (200, 2, 64)  # --small: two query tiles, the second one ragged
FA3_TFLOPS = 648.0
KNOBS = {  # variant name -> Variant fields; "programs": None is the device's SM count
    "today": {},
    "persistent": {"programs": None},
    "lane": {"semantics": "lane"},
    "regs240": {"registers": (240, 24)},  # FlashAttention-3's split
    "iota_inner": {"mask_iota": "inner"},
    "pv_barrier": {"pv_barrier": True},
    "split": {"split_release": True},
    "overlap": {"overlap": True},
}
DEFAULT_VARIANTS = "today,persistent,overlap,persistent+overlap,split,lane,regs240,iota_inner,pv_barrier"


def variant_of(name: str, programs: int):
    """The :class:`Variant` of ``name`` (``KNOBS`` names joined by ``+``); ``programs``: what ``None`` means."""
    from kvjax.pallas.paged.prefill_mgpu import Variant

    fields = {}
    for part in name.split("+"):
        if part not in KNOBS:
            raise SystemExit(f"unknown variant {part!r} (known: {', '.join(KNOBS)})")
        fields.update(KNOBS[part])
    if "programs" in fields and fields["programs"] is None:
        fields["programs"] = programs
    return Variant(**fields)


def batch(t: int, h: int, d: int, page_size: int):
    """(q, k, v bf16[T, H, D] contiguous, the checked PagedAttentionCall over the same K/V in permuted pages)."""
    import jax
    import jax.numpy as jnp

    from kvjax.ops.attention import PagedAttentionCall, check_call

    keys = jax.random.split(jax.random.key(3), 4)
    q, k, v = (jax.random.normal(kk, (t, h, d), jnp.bfloat16) for kk in keys[:3])
    blocks = -(-t // page_size)
    perm = jax.random.permutation(jax.random.fold_in(keys[3], page_size), h * blocks).astype(jnp.int32)

    def pages(x):  # bf16[H * blocks, page_size, D]: page perm[hh * blocks + j] holds x[j*ps:(j+1)*ps, hh]
        x = jnp.pad(x, ((0, blocks * page_size - t), (0, 0), (0, 0)))  # a zero (finite) tail
        return jnp.zeros((h * blocks, page_size, d), x.dtype).at[perm].set(
            jnp.swapaxes(x, 0, 1).reshape(h * blocks, page_size, d))

    call = check_call(PagedAttentionCall(q, pages(k), pages(v), perm.reshape(1, h, blocks), jnp.array([t], jnp.int32),
                                         jnp.array([0, t], jnp.int32)))
    return (q, k, v), call


def _max_err(out, ref) -> float:
    import numpy as np

    out = np.asarray(out, np.float32)
    return float("nan") if not np.isfinite(out).all() else float(np.abs(out - np.asarray(ref, np.float32)).max())


def _device_round(fn, calls: int) -> tuple[float, float] | None:
    """(call ms, longest kernel's ms) per call over ``calls`` back-to-back calls, from the profiler; None without
    device records."""
    import timing

    def run():
        out = None
        for _ in range(calls):
            out = fn()
        timing.block(out)

    recs = timing.kernel_records(run)
    if not recs["names"]:
        return None
    longest = max(total for _, total in recs["names"].values())
    return recs["kernel_ns"] / calls / 1e6, longest / calls / 1e6


def run_page(page_size: int, names: list[str], *, shape, programs: int, rounds: int, calls: int,
             interpret: bool) -> None:
    import jax

    import timing

    from kvjax.ops.attention import paged_attention_reference
    from kvjax.pallas.paged import prefill_mgpu

    t, h, d = shape
    flops = 4 * (t * (t + 1) // 2) * d * h
    (q, k, v), call = batch(t, h, d, page_size)
    ref = jax.jit(paged_attention_reference)(dataclasses.replace(
        call, q=q.astype("float32"), k_pages=call.k_pages.astype("float32"), v_pages=call.v_pages.astype("float32")))
    runners, errs, compile_s = {}, {}, {}
    for name in names:
        variant = variant_of(name, programs)
        runners[name] = lambda v=variant: prefill_mgpu.paged_prefill_mgpu(call, variant=v, interpret=interpret)
    if not interpret:
        cudnn = jax.jit(lambda a, b, c: jax.nn.dot_product_attention(
            a[None], b[None], c[None], scale=d ** -0.5, is_causal=True, implementation="cudnn")[0])
        runners["cudnn"] = lambda: cudnn(q, k, v)
    for name in list(runners):
        t0 = time.perf_counter()
        try:
            errs[name] = _max_err(runners[name](), ref)
        except Exception as e:  # a variant the compiler rejects is reported; the others still run
            errs[name] = f"FAILED: {type(e).__name__}: {str(e)[:300]}"
            del runners[name]
        compile_s[name] = time.perf_counter() - t0
        print(f"checked {name}: {errs[name]} ({compile_s[name]:.1f} s)", flush=True)  # a hang shows where
    print(f"\n## prefill T={t} H={h} D={d} page={page_size} (causal, {flops / 1e9:.1f} GFLOP; max |ref| "
          f"{float(abs(ref).max()):.2f}; {jax.devices()[0].device_kind}, jax {jax.__version__})")
    if interpret or not timing.has_device_records():
        print("| variant | max err vs f32 ref | first call s |\n|---|---|---:|")
        for name in errs:
            err = errs[name] if isinstance(errs[name], str) else f"{errs[name]:.2e}"
            print(f"| {name} | {err} | {compile_s[name]:.1f} |")
        return
    for fn in runners.values():  # warm-up
        timing.block(fn())
    per = {name: [] for name in runners}
    for _ in range(rounds):
        for name, fn in runners.items():
            per[name].append(_device_round(fn, calls))
    med = {name: (statistics.median(c for c, _ in r), statistics.median(k for _, k in r))
           for name, r in per.items() if r and r[0] is not None}
    base = med.get("cudnn", (None, None))[0]
    print("| variant | call ms | kernel ms | vs cudnn | TFLOP/s | vs FA3 648 | call ms rounds | max err vs f32 ref "
          "| first call s |")
    print("|---|---:|---:|---:|---:|---:|---|---|---:|")
    for name in errs:
        if name not in med:
            print(f"| {name} | - | - | - | - | - | - | {errs[name]} | {compile_s[name]:.1f} |")
            continue
        call_ms, kernel_ms = med[name]
        tflops = flops / call_ms / 1e9
        vs = f"{base / call_ms:.3f}x" if base else "-"
        spread = " ".join(f"{c:.4f}" for c, _ in per[name])
        err = errs[name] if isinstance(errs[name], str) else f"{errs[name]:.2e}"
        print(f"| {name} | {call_ms:.4f} | {kernel_ms:.4f} | {vs} | {tflops:.0f} | {tflops / FA3_TFLOPS:.2f} "
              f"| {spread} | {err} | {compile_s[name]:.1f} |")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pages", default="128,64", help="page sizes, comma-separated (64 and / or 128)")
    p.add_argument("--variants", default=DEFAULT_VARIANTS, help="variants, comma-separated (module doc)")
    p.add_argument("--rounds", type=int, default=5, help="profiled rounds (medians over them)")
    p.add_argument("--calls", type=int, default=20, help="back-to-back calls per round")
    p.add_argument("--programs", type=int, default=0, help="persistent CTAs (0: the device's SM count)")
    p.add_argument("--small", action="store_true", help=f"T, H, D = {SMALL} instead of {SHAPE}")
    p.add_argument("--interpret", action="store_true", help="the Mosaic GPU interpreter on the CPU: errors only")
    args = p.parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)  # rows show up as they come, even if the run is cut short
    if args.interpret:
        os.environ.setdefault("NPROC", "8")  # the interpreter blocks a thread per warpgroup (prefill_mgpu doc)
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
        from helpers.mosaic_interpret import cache_thread_programs

        cache_thread_programs()  # jax < 0.11 compiles each CTA again without it
    import jax

    programs = args.programs or getattr(jax.devices()[0], "core_count", 0) or 2
    names = [n.strip() for n in args.variants.split(",") if n.strip()]
    for n in names:
        variant_of(n, programs)  # unknown names fail before anything runs
    t0 = time.perf_counter()
    for ps in (int(x) for x in args.pages.split(",") if x.strip()):
        run_page(ps, names, shape=SMALL if args.small else SHAPE, programs=programs, rounds=args.rounds,
                 calls=args.calls, interpret=args.interpret)
    print(f"\npersistent programs: {programs}; total {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
