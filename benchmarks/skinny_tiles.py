"""The skinny kernels' tile sets (``kvjax.pallas.skinny``) against XLA at the presets' projection shapes, and the
tp preset's decode step with its projections on XLA or on the kernel.

Usage (GPU): ``python benchmarks/skinny_tiles.py`` (the tile sweep: every tile set of :data:`MATMUL` /
:data:`SWIGLU` and XLA interleaved in one process at each shape, device ms from the profiler, % of an XLA copy of
the same bytes, relative error against XLA; weights rotated over >= 200 MB so they come from HBM);
``--engine 1,1x2`` (the tp preset's steady decode at 64 rows on one GPU / a ``1xG`` mesh with the projections
routed by :data:`RULES`: which ``Linear`` shapes take the kernel, the rest XLA; ms per sub-step and the profile's
kernel classes). The engine runs swap the ``linear`` table's kernel function for a routed one: a measurement
device, not a library option. ``--quick``: one tiny shape in interpret mode (CPU smoke run). JSON lines on
stdout.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))

MATMUL = [(32, 128, 4, 4), (16, 128, 4, 4), (16, 256, 4, 4), (64, 128, 3, 4), (32, 256, 3, 4), (32, 128, 6, 4),
          (64, 64, 4, 4), (16, 128, 6, 4), (32, 64, 8, 4)]  # (block_n, block_k, num_stages, num_warps)
SWIGLU = [(32, 128, 4, 4), (16, 128, 4, 4), (32, 64, 6, 4), (16, 256, 3, 4), (32, 128, 3, 8)]
MATMUL_SHAPES = [  # (T, H, N): the tp preset on one GPU, 1x2 and 1x4, its LM head, and T = 16
    (64, 4096, 4096), (64, 4096, 8192), (64, 4096, 1024), (64, 12288, 4096), (64, 4096, 32768),
    (64, 2048, 4096), (64, 4096, 2048), (64, 6144, 4096), (64, 1024, 4096), (64, 3072, 4096),
    (64, 1024, 8192), (64, 3072, 1024), (16, 4096, 4096), (16, 12288, 4096)]
SWIGLU_SHAPES = [(64, 4096, 12288), (64, 4096, 6144), (64, 4096, 3072), (64, 1024, 3072)]  # (T, H, I)
RULES = {  # name -> which (H, N) projections take the kernel
    "xla": lambda h, n: False,
    "table": None,  # the library's own rule (kvjax.pallas.skinny.matmul_unsupported)
    "every": lambda h, n: True,
}


def sweep(kind: str, shapes, variants, interpret: bool) -> list[dict]:
    import jax
    import jax.numpy as jnp
    from timing import interleaved, xla_copy

    from kvjax.ops.linear import linear_reference
    from kvjax.ops.mlp import swiglu_reference
    from kvjax.pallas import skinny

    rows = []
    nw = 1 if kind == "matmul" else 2
    for t, h, n in shapes:
        rot = 1 if interpret else min(16, max(2, int(200e6 // (nw * h * n * 2)) + 1))
        x = jax.random.normal(jax.random.key(0), (t, h), jnp.bfloat16)  # bf16[T, H]
        ws = [tuple(jax.random.normal(jax.random.key(10 * r + j), (h, n), jnp.bfloat16) * h ** -0.5
                    for j in range(nw)) for r in range(rot)]  # rot x nw x bf16[H, N]
        ref_fn = jax.jit(linear_reference if kind == "matmul" else swiglu_reference)
        ref = ref_fn(x, *ws[0]).astype(jnp.float32)
        kfn = skinny.matmul_pallas if kind == "matmul" else skinny.swiglu_pallas
        runners, errs = {}, {}
        for v in variants:
            tiles = skinny.Tiles(*v)
            if skinny.unsupported(x, *ws[0], tiles=tiles):
                continue
            fn = jax.jit(functools.partial(kfn, tiles=tiles, interpret=interpret))
            name = tiles.kernel_name(kind)
            try:
                out = fn(x, *ws[0]).astype(jnp.float32)
            except Exception as e:  # noqa: BLE001 - a tile set that does not compile is reported, not fatal
                print(json.dumps(dict(kind=kind, shape=[t, h, n], variant=name, error=repr(e)[:300])), flush=True)
                continue
            errs[name] = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
            runners[name] = _rotating(fn, x, ws)
        res = interleaved({**runners, "xla": _rotating(ref_fn, x, ws)}, rounds=1 if interpret else 3,
                          n=1 if interpret else 20)
        nbytes = nw * h * n * 2 + t * h * 2 + t * n * 2
        copy = None if interpret else xla_copy(nbytes)["device_ms"]
        for name, r in res.items():
            ms = r.get("device_ms") or r["wall_ms"]
            rows.append(dict(kind=kind, shape=[t, h, n], variant=name, ms=round(ms, 5), bytes=nbytes,
                             of_copy=round(copy / ms, 3) if copy else None, err=errs.get(name)))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def _rotating(fn, x, ws):
    state = {"i": 0}

    def call():
        state["i"] += 1
        return fn(x, *ws[state["i"] % len(ws)])

    return call


def engine(where: str, rule: str) -> dict:
    """The tp preset's steady decode at 64 rows on ``where`` (``"1"`` or ``"DxM"``) with :data:`RULES`[rule]."""
    import scale

    from kvjax.engine.options import AUTO_BURST
    from kvjax.ops.linear import LINEAR_TABLE, linear_reference
    from kvjax.pallas import skinny

    backend = LINEAR_TABLE.backends[0]
    kernel = backend.fn
    take = RULES[rule]
    if take is not None:
        def routed(x, w, interpret=False):
            return kernel(x, w) if take(*w.shape) and not skinny.unsupported(x, w, tiles=skinny.MATMUL_TILES) \
                else linear_reference(x, w)
        object.__setattr__(backend, "fn", routed)
        object.__setattr__(backend, "unsupported", lambda x, w: None)
    try:
        p = scale.tp_preset(False)
        rows, n = 64, 12
        new_tokens = (n + 60) * AUTO_BURST + (rows * scale.TP_PROMPT) // 2048
        mesh = None if where == "1" else scale._mesh(*map(int, where.split("x")))
        eng = scale.tp_engine(p, mesh, rows, scale.TP_PROMPT, new_tokens, 2048)
        tokens = {}
        row = scale.steady_decode(eng, rows, n, tokens)
        prof = scale.profile_engine(eng, 3, tempfile.mkdtemp(), tokens)
        digest = hashlib.md5(json.dumps(sorted(tokens.items())).encode()).hexdigest()[:10]
        del eng
        scale._release()
        return dict(engine=where, rule=rule, digest=digest, **{k: round(v, 4) for k, v in row.items()},
                    kernels_ms=prof["mean"]["ms"], span_ms=prof["mean"]["span_ms"], total_ms=prof["mean"]["total_ms"])
    finally:
        object.__setattr__(backend, "fn", kernel)
        object.__setattr__(backend, "unsupported", skinny.matmul_unsupported)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one tiny shape in interpret mode (CPU smoke run)")
    ap.add_argument("--engine", default="", help="comma list of '1' / 'DxM': the tp step A/B instead of the sweep")
    ap.add_argument("--rules", default="xla,table", help=f"for --engine: comma list of {sorted(RULES)}")
    args = ap.parse_args(argv)
    if args.engine:
        for where in args.engine.split(","):
            for rule in args.rules.split(","):
                print(json.dumps(engine(where, rule)), flush=True)
        return 0
    if args.quick:
        sweep("matmul", [(16, 256, 64)], MATMUL[:2], interpret=True)
        sweep("swiglu", [(16, 256, 64)], SWIGLU[:2], interpret=True)
        return 0
    sweep("matmul", MATMUL_SHAPES, MATMUL, interpret=False)
    sweep("swiglu", SWIGLU_SHAPES, SWIGLU, interpret=False)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
