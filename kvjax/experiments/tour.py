"""Small random inputs for every public op, run through each implementation (the kernels tour notebook).

:func:`op_cases` builds one small case per op (random inputs, a head-wise SWA layout with holes for paged
attention); :func:`compare_impls` runs a case under every implementation usable here (``reference`` and, for
ops with a Pallas kernel, ``interpret`` on CPU or ``pallas`` on a GPU) and reports the max abs difference to
the reference and the wall time of the first (compiling) and a second call.
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib
import time
from typing import Callable

import numpy as np


@dataclasses.dataclass(frozen=True)
class OpCase:
    op: str  # op name of a backend table (kvjax.ops.tables())
    shapes: str  # human-readable input shapes
    run: Callable  # run(impl: str) -> array (or tuple, compared elementwise)


def _f32(rng, *shape, scale=1.0):
    import jax.numpy as jnp

    return jnp.asarray(scale * rng.standard_normal(shape), jnp.float32)


def paged_swa_batch(rng: np.random.Generator, *, seq_lens=(37, 22), window=(0, 0, 8, 8), sinks=(0, 0, 2, 2),
                    page_size: int = 4, num_pages: int = 64):
    """Head-wise block tables of a batch as the scheduler leaves them under ``timely`` recycling: every head of
    every sequence gets its own pages from one shared, shuffled free list, then each SWA head's blocks that are
    out of the window of the last token (and hold no sink) are holes. Returns ``(tables i32[B, H, max_blocks],
    seq_lens i32[B])``."""
    from kvjax.sched.recycle import first_recyclable_block, recycle_stop

    h = len(window)
    nb = -(-max(seq_lens) // page_size)
    need = h * sum(-(-n // page_size) for n in seq_lens)
    if need > num_pages:
        raise ValueError(f"the batch needs {need} pages, num_pages={num_pages}")
    free = list(rng.permutation(num_pages))
    tables = np.full((len(seq_lens), h, nb), -1, np.int32)
    for b, n in enumerate(seq_lens):
        for hh in range(h):
            for blk in range(-(-n // page_size)):
                tables[b, hh, blk] = free.pop()
        stop = recycle_stop(np.int64(n - 1), np.asarray(window), page_size)
        first = first_recyclable_block(np.asarray(sinks), page_size)
        for hh in range(h):
            if window[hh] > 0:
                tables[b, hh, first[hh]:max(first[hh], stop[hh])] = -1
    return tables, np.asarray(seq_lens, np.int32)


def op_cases(rng: np.random.Generator) -> list[OpCase]:
    """One small random case per op: paged attention (head-wise SWA, decode + chunked prefill rows), the
    chunked and recurrent gated delta rule (two ragged sequences, initial states), causal conv1d, MLA decode
    and its DSA top-k sparse form, the GDN pool ops (decode step, conv update and prefill by slot id) and the
    DSA indexer scores over fp8 keys."""
    import jax.numpy as jnp

    import kvjax.ops as ops
    from kvjax.ops.dsa import sparse_mla_decode
    from kvjax.ops.mla import mla_decode

    cases = []
    window, sinks, ps = (0, 0, 8, 8), (0, 0, 2, 2), 4
    tables, seq_lens = paged_swa_batch(rng, window=window, sinks=sinks, page_size=ps)
    cu = jnp.asarray([0, 5, 6], jnp.int32)  # row 0: a 5-token prefill chunk; row 1: one decode token
    kp, vp = _f32(rng, 64, ps, 16), _f32(rng, 64, ps, 16)
    q = _f32(rng, 6, 8, 16)
    cases.append(OpCase("paged_attention", "q[6, 8, 16], pages[64, 4, 16], tables[2, 4, 10] (2 SWA heads)",
                        lambda impl: ops.paged_attention(q, kp, vp, jnp.asarray(tables), jnp.asarray(seq_lens),
                                                         cu_seqlens=cu, window=jnp.asarray(window, jnp.int32),
                                                         sinks=jnp.asarray(sinks, jnp.int32), impl=impl)))

    t, hk, hv, kd, vd = 24, 2, 4, 16, 16
    gq, gk, gv = _f32(rng, t, hk, kd), _f32(rng, t, hk, kd), _f32(rng, t, hv, vd)
    g = -jnp.abs(_f32(rng, t, hv, scale=0.3))
    beta = jnp.asarray(rng.uniform(0.1, 0.9, (t, hv)), jnp.float32)
    gcu = jnp.asarray([0, 17, 24], jnp.int32)
    h0 = _f32(rng, 2, hv, kd, vd, scale=0.1)
    for op, fn in (("chunk_gated_delta_rule", ops.chunk_gated_delta_rule),
                   ("recurrent_gated_delta_rule", ops.recurrent_gated_delta_rule)):
        cases.append(OpCase(op, "q,k[24, 2, 16], v[24, 4, 16], 2 sequences (17 + 7), initial state",
                            lambda impl, fn=fn: fn(gq, gk, gv, g, beta, cu_seqlens=gcu, initial_state=h0,
                                                   use_qk_l2norm=True, impl=impl)))

    x, w = _f32(rng, 24, 32), _f32(rng, 32, 4, scale=0.5)
    cases.append(OpCase("causal_conv1d", "x[24, 32], weight[32, 4], 2 sequences",
                        lambda impl: ops.causal_conv1d(x, w, cu_seqlens=gcu, impl=impl)))

    b, h, r, rr, mps = 2, 4, 64, 16, 4
    ql, qr = _f32(rng, b, h, r), _f32(rng, b, h, rr)
    lat = _f32(rng, 32, mps, r + rr)
    mtab = jnp.asarray(rng.permutation(32)[: b * 6].reshape(b, 1, 6), jnp.int32)
    mlens = jnp.asarray([21, 9], jnp.int32)
    cases.append(OpCase("mla_decode", "q_latent[2, 4, 64], q_rope[2, 4, 16], latent pages[32, 4, 80]",
                        lambda impl: mla_decode(ql, qr, lat, mtab, mlens, scale=0.1, impl=impl)))
    topk = jnp.asarray([[0, 3, 7, 20, 11, -1], [1, 8, 2, -1, -1, -1]], jnp.int32)
    cases.append(OpCase("sparse_mla_decode", "as mla_decode, top-6 positions per row (-1 = none)",
                        lambda impl: sparse_mla_decode(ql, qr, lat, mtab, mlens, topk, scale=0.1, impl=impl)))
    cases += _pool_cases(rng) + [_indexer_case(rng)]
    return cases


def _pool_cases(rng: np.random.Generator) -> list[OpCase]:
    """The GDN ops on the slot-addressed pool (decode step, conv update, conv prefill): a fresh pool per call
    (the ops donate it); outputs compared together with the whole returned pool, so a write to a slot outside
    the batch (or to PAD slot 0) would show up as a difference."""
    import jax.numpy as jnp

    from kvjax.state import gdn_pool
    from kvjax.state.gdn_pool import GDNStatePool

    b, hk, hv, kd, vd, dim, width = 3, 1, 2, 16, 16, 24, 4
    ssm0 = _f32(rng, 2, 6, hv, kd, vd, scale=0.1).at[:, 0].set(0.0)
    conv0 = _f32(rng, 2, 6, dim, width - 1).at[:, 0].set(0.0)
    slots = jnp.asarray([4, 0, 2], jnp.int32)  # row 1 is padding

    def pool():
        return GDNStatePool(conv=jnp.array(conv0, copy=True), ssm=jnp.array(ssm0, copy=True))

    q, k, v = _f32(rng, b, hk, kd), _f32(rng, b, hk, kd), _f32(rng, b, hv, vd)
    g, beta = -jnp.abs(_f32(rng, b, hv, scale=0.3)), jnp.asarray(rng.uniform(0.1, 0.9, (b, hv)), jnp.float32)
    x1, w, xs = _f32(rng, b, dim), _f32(rng, dim, width, scale=0.5), _f32(rng, 9, dim)
    cu = jnp.asarray([0, 5, 5, 9], jnp.int32)
    init = jnp.asarray([True, False, False])
    return [
        OpCase("gdn_decode_pool", "q,k[3, 1, 16], v[3, 2, 16], pool ssm[2, 6, 2, 16, 16], slots [4, PAD, 2]",
               lambda impl: gdn_pool.gdn_decode(q, k, v, g, beta, pool(), layer=1, slot_ids=slots,
                                                 use_qk_l2norm=True, impl=impl)),
        OpCase("conv_decode_pool", "x[3, 24], weight[24, 4], pool conv[2, 6, 24, 3], slots [4, PAD, 2]",
               lambda impl: gdn_pool.conv_decode(x1, w, None, pool(), layer=1, slot_ids=slots, impl=impl)),
        OpCase("conv_prefill_pool", "x[9, 24], 3 rows (5, 0, 4 tokens), initial state for row 0 only",
               lambda impl: gdn_pool.conv_prefill(xs, w, None, pool(), layer=0, slot_ids=slots,
                                                   has_initial_state=init, cu_seqlens=cu, impl=impl)),
    ]


def _indexer_case(rng: np.random.Generator) -> OpCase:
    """DSA indexer scores over fp8 keys with one f32 scale per 128 values (pages of 16, a hole, a padding
    token); the kernel rounds q to bf16 (the reference is f32): small queries keep that rounding (about 2^-9 of
    each score) under the tour's 1e-4 absolute tolerance."""
    import jax.numpy as jnp

    from kvjax.ops.dsa import indexer_scores
    from kvjax.base.fp8 import quantize_fp8_blockwise

    keys, scales = quantize_fp8_blockwise(_f32(rng, 8, 16, 128))
    tables = jnp.asarray([[[3, 0, -1, 5]], [[1, 6, 2, 7]]], jnp.int32)
    q, w = _f32(rng, 4, 16, 128, scale=0.005), _f32(rng, 4, 16, scale=0.25)
    cu, lens = jnp.asarray([0, 1, 3], jnp.int32), jnp.asarray([50, 40], jnp.int32)
    return OpCase("indexer_scores", "q[4, 16, 128], fp8 keys[8, 16, 128] + scales, tables[2, 1, 4] (a hole)",
                  lambda impl: indexer_scores(q, w, keys, scales, tables, lens, cu_seqlens=cu, scale=128 ** -0.5,
                                              impl=impl))


def _max_abs_diff(a, b) -> float:
    import jax

    def diff(x, y):  # equal entries (matching infinities included) differ by 0; a mismatched inf by inf
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        with np.errstate(invalid="ignore"):
            d = np.where(x == y, 0.0, np.abs(x - y))
        return float(np.max(np.where(np.isnan(d), np.inf, d))) if d.size else 0.0

    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    return max(diff(x, y) for x, y in zip(la, lb))


def compare_impls(case: OpCase, *, platform: str | None = None) -> list[dict]:
    """Run ``case`` under every implementation of its op's backend table usable on ``platform`` (default: the
    current backend; on CPU every kernel with an interpret mode runs as ``"NAME:interpret"``, except the Hopper-only
    Mosaic GPU kernels, whose interpreter is slow; compiled kernels are skipped). A kernel that declines the case's
    shapes is left out. Rows: ``op``, ``impl``, ``max_abs_diff`` (vs the reference), ``first_s`` (incl. compile),
    ``second_s``, ``error`` (non-empty, and the numbers NaN, where an optional kernel backend is not installed)."""
    import jax

    from kvjax import ops
    from kvjax.base.device import NAMED, current_device
    from kvjax.errors import UnknownImplError
    from kvjax.ops.backends import on_hopper

    platform = platform or jax.default_backend()
    table = next(t for t in ops.tables() if t.op == case.op)
    device = current_device() if platform == jax.default_backend() else NAMED.get(platform, NAMED["cpu"])
    impls = table.available(device)
    if platform == "cpu":
        impls = ["reference"] + [f"{b.name}:interpret" for b in table.backends
                                 if b.interpretable and b.device is not on_hopper]
    rows, ref = [], None
    for impl in impls:
        t0 = time.perf_counter()
        try:
            out = jax.block_until_ready(case.run(impl))
        except UnknownImplError:  # the kernel declines this call's shapes
            continue
        except ImportError as err:  # an optional backend (e.g. jax-triton) that is not installed
            if impl == "reference":
                raise
            rows.append({"op": case.op, "impl": impl, "max_abs_diff": float("nan"), "first_s": float("nan"),
                         "second_s": float("nan"), "error": f"{type(err).__name__}: {err}"})
            continue
        t1 = time.perf_counter()
        jax.block_until_ready(case.run(impl))
        t2 = time.perf_counter()
        ref = out if ref is None else ref
        rows.append({"op": case.op, "impl": impl, "max_abs_diff": _max_abs_diff(out, ref),
                     "first_s": t1 - t0, "second_s": t2 - t1, "error": ""})
    return rows


def benchmark_scripts(root: str | pathlib.Path) -> list[dict]:
    """``benchmarks/*.py`` under ``root``: file name, first docstring line, and its ``Usage:`` line if any."""
    out = []
    for path in sorted(pathlib.Path(root, "benchmarks").glob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        usage = next((ln.strip() for ln in doc.splitlines() if ln.strip().lower().startswith("usage")), "")
        out.append({"script": f"benchmarks/{path.name}", "what": doc.splitlines()[0] if doc else "", "usage": usage})
    return out
