"""All-reduce over the ``"model"`` axis (issue 34): XLA's ``psum`` vs the one-shot Mosaic GPU kernel
(:mod:`kvjax.pallas.allreduce_mgpu`), device time per call, and the ``tp`` preset's decode with each.

Usage (repo root)::

    python benchmarks/allreduce.py --out OUT/allreduce.json                 # G = 2 and 4 (those JAX has)
    python benchmarks/allreduce.py --engine --gpus 4 --out OUT/ar_engine.json   # + the tp preset's 1xG decode
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/allreduce.py --smoke   # CPU: psum only

Kernels: for each G and size (``bf16[64, H]``, 64 KB .. 4 MB; 512 KB is the tp preset's ``[64, 4096]``) one jit
runs a ``lax.scan`` of ``--calls`` (34, the all-reduces of one tp decode sub-step) all-reduces, each call's input
the previous call's sum, on a ``1xG`` mesh. Per implementation: ``psum`` (XLA's all-reduce as compiled by
default), ``psum-oneshot`` (the same with XLA's own one-shot all-reduce kernel,
``xla_gpu_unsupported_use_all_reduce_one_shot_kernel``, passed as a compile option; ``error`` if this jaxlib
rejects it) and ``mosaic`` (the kernel). Figures: ``us_per_call`` = device time of every kernel and copy on all G
GPUs / G / calls (the profiler's records, ``timing.device_ms``; the Mosaic runtime's cross-GPU barrier kernel
before each launch included), ``span_us_per_call`` (first start to last end / calls) and ``wall_us_per_call``;
``max_abs_err`` of each against ``psum`` of the same partials in float32 (``mosaic``: one bf16 rounding).
Without device records (CPU) the ``us`` figures are wall clock and ``mosaic`` is skipped.

``--engine``: the ``tp`` preset (``benchmarks/scale.py``'s model, rows, prompts) in steady decode on ``1xG`` with
``all_reduce="auto"`` (XLA's psum) then ``"mosaic"`` (:meth:`kvjax.models.sharding.ShardedModel.set_all_reduce`),
same process: ms per decode sub-step, tok/s, the ratio and whether the tokens are identical (bf16: they may not be).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path[:0] = [HERE, REPO]

SIZES_KB = (64, 128, 256, 512, 1024, 2048, 4096)
ROWS = 64
IMPLS = ("psum", "psum-oneshot", "mosaic")
ONE_SHOT = {"xla_gpu_unsupported_use_all_reduce_one_shot_kernel": True}


def _mesh(m: int):
    import jax
    import numpy as np

    return jax.sharding.Mesh(np.array(jax.devices()[:m]).reshape(1, m), ("data", "model"))


def scan_fn(impl: str, mesh, calls: int):
    """``parts [1, G, R, H] -> sums [1, G, R, H]``: ``calls`` all-reduces over ``"model"`` in a ``lax.scan``."""
    import jax
    from jax.sharding import PartitionSpec as P

    from kvjax.models.sharding import shard_map
    from kvjax.ops.allreduce import all_reduce

    def one(x):
        return all_reduce(x, "model", impl="mosaic") if impl == "mosaic" else jax.lax.psum(x, "model")

    def local(x):
        out, _ = jax.lax.scan(lambda c, _: (one(c), None), x[0, 0], None, length=calls)
        return out[None, None]

    return shard_map(local, mesh, P("data", "model"), P("data", "model"))


def kernel_rows(gs: list[int], sizes_kb: tuple[int, ...], calls: int, dtype_name: str) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from timing import block, device_ms, has_device_records, wall_ms

    dtype = jnp.dtype(dtype_name)
    on_gpu = has_device_records()
    out = []
    for g in gs:
        mesh = _mesh(g)
        for kb in sizes_kb:
            h = kb * 1024 // (ROWS * dtype.itemsize)
            rng = np.random.default_rng(kb)
            parts = jax.device_put(jnp.asarray(rng.standard_normal((1, g, ROWS, h)) / g, dtype),
                                   jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data", "model")))
            one = jax.jit(scan_fn("psum", mesh, 1)).lower(parts.astype(jnp.float32)).compile()
            ref = np.asarray(one(parts.astype(jnp.float32)))  # one call, f32: the error reference
            for impl in IMPLS:
                if impl == "mosaic" and not on_gpu:
                    continue
                row = dict(gpus=g, kb=kb, shape=[ROWS, h], dtype=dtype.name, impl=impl, calls=calls)
                try:
                    opts = ONE_SHOT if impl == "psum-oneshot" else None
                    fn = jax.jit(scan_fn(impl, mesh, calls)).lower(parts).compile(compiler_options=opts)
                    first = jax.jit(scan_fn(impl, mesh, 1)).lower(parts).compile(compiler_options=opts)
                    err = float(np.abs(np.asarray(first(parts).astype(jnp.float32)) - ref).max())
                    block(fn(parts))
                    dev = device_ms(lambda: fn(parts), n=10)
                    wall = wall_ms(lambda: fn(parts), n=10, rounds=3)
                    row.update(max_abs_err=err, wall_us_per_call=1e3 * wall / calls)
                    if dev is not None:
                        row.update(us_per_call=1e3 * dev["kernel_ms"] / g / calls,
                                   span_us_per_call=1e3 * dev["span_ms"] / calls,
                                   kernels={k: v for k, v in dev["kernels"].items()})
                    else:
                        row.update(us_per_call=row["wall_us_per_call"], timer="wall")
                except Exception as e:  # noqa: BLE001 (a row per failure: the others still run)
                    row.update(error=f"{type(e).__name__}: {str(e)[:300]}")
                _print(row)
                out.append(row)
    return out


def engine_rows(g: int, rows: int, steps: int, smoke: bool) -> list[dict]:
    """The tp preset on ``1xG`` with each all-reduce: steady decode (``scale.steady_decode``)."""
    import scale
    from kvjax.cli.run import build_model
    from kvjax.config import CacheConfig
    from kvjax.engine.engine import Engine
    from kvjax.engine.options import AUTO_BURST

    import numpy as np

    p = scale.tp_preset(smoke)
    prompt = 16 if smoke else scale.TP_PROMPT
    budget = 64 if smoke else 2048
    new_tokens = (steps + 60) * AUTO_BURST + (rows * prompt) // budget
    blocks = -(-(prompt + new_tokens) // p.page_size)
    mesh = scale._mesh(1, g)
    model = build_model(p, seed=0, mesh=mesh)
    out, first = [], None
    for impl in ("auto", "mosaic"):  # auto: XLA's psum (on a GPU the "xla" backend, on a CPU the reference)
        model.set_all_reduce(impl)
        cache = CacheConfig(page_size=p.page_size, num_pages=rows * p.kv_heads * blocks // g, max_seqs=rows,
                            max_blocks_per_seq=blocks)
        row = dict(run=f"1x{g}", all_reduce=impl, rows=rows)
        try:
            eng = Engine(model, cache, mesh=mesh, recycle="timely", max_num_batched_tokens=budget,
                         token_buckets=tuple(sorted({rows, budget})), row_buckets=(rows,), block_buckets=(blocks,))
            rng = np.random.default_rng(0)
            for i in range(rows):
                eng.add_request(rng.integers(0, p.vocab, prompt), new_tokens, index=i)
            tokens: dict = {}
            row.update(scale.steady_decode(eng, rows, steps, tokens))
            firsts = [tokens[i] for i in sorted(tokens)]
            if first is None:
                first, base = firsts, row["tokens_per_s"]
            k = min(len(t) for t in firsts + first)
            row.update(ratio=row["tokens_per_s"] / base, compared_tokens=k,
                       identical_tokens=all(a[:k] == b[:k] for a, b in zip(firsts, first)))
            del eng
        except Exception as e:  # noqa: BLE001
            row.update(error=f"{type(e).__name__}: {str(e)[:300]}")
        _print(row)
        out.append(row)
    return out


def _print(row: dict) -> None:
    print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items() if k != "kernels"}),
          flush=True)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", default="2,4", help="comma-separated G values (those above the device count are "
                                                  "dropped)")
    ap.add_argument("--sizes-kb", default=",".join(map(str, SIZES_KB)))
    ap.add_argument("--calls", type=int, default=34, help="all-reduces per scan (a tp decode sub-step has 34)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--engine", action="store_true", help="also the tp preset's 1xG decode with each all-reduce")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--smoke", action="store_true", help="CPU: small sizes, psum only (8 host devices)")
    ap.add_argument("--out", help="write the JSON here")
    args = ap.parse_args(argv)

    import jax

    n = jax.device_count()
    gs = [g for g in map(int, args.gpus.split(",")) if 2 <= g <= n]
    sizes = (64, 512) if args.smoke else tuple(map(int, args.sizes_kb.split(",")))
    calls = 4 if args.smoke else args.calls
    doc = {"meta": {"jax": jax.__version__, "device": jax.devices()[0].device_kind, "devices": n,
                    "date": time.strftime("%Y-%m-%d %H:%M:%S")},
           "kernels": kernel_rows(gs, sizes, calls, args.dtype)}
    if args.engine:
        doc["engine"] = [r for g in gs for r in engine_rows(g, 8 if args.smoke else args.rows,
                                                          3 if args.smoke else args.steps, args.smoke)]
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
