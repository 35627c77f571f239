"""Skinny products of decode steps (Pallas, Triton lowering): ``x @ w`` and the SwiGLU up-projection
``silu(x @ w_gate) * (x @ w_up)`` for ``x`` of a few rows.

One kernel body for both: one program per tile of ``block_n`` output columns walks ``H`` in steps of
``block_k``, loads the ``[T, block_k]`` slice of ``x`` and each weight's ``[block_k, block_n]`` tile,
accumulates the products in float32 and writes the epilogue (the product itself, or ``silu(gate) * up``) in
x's dtype. Each weight byte is read once and no float32 partial leaves the kernel (XLA's GEMMs for ``T <= 64``
split ``K`` and reduce the partials in another kernel, or pick tiles that leave the copy rate behind at these
shapes). :class:`Tiles` are static arguments; every tile set compiles under its own kernel name, so a tile
sweep never reuses another set's kernel. The defaults are the fastest measured (RESULTS.md, "SwiGLU
up-projection" and "Skinny projections").
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

MIN_ROWS = 16  # the tensor-core tile's rows: fewer rows are padded by the products anyway
MAX_ROWS = 64  # larger T does not fit shared memory at 4 stages (and XLA's GEMM is no longer skinny)


@dataclasses.dataclass(frozen=True)
class Tiles:
    """A program's tile and pipeline: ``block_n`` output columns, ``block_k`` hidden columns a step,
    ``num_stages`` steps in flight, ``num_warps`` warps. Powers of two; ``block_n, block_k >= 16``."""

    block_n: int = 32
    block_k: int = 128
    num_stages: int = 4
    num_warps: int = 4

    def __post_init__(self):
        for field in ("block_n", "block_k", "num_stages", "num_warps"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Tiles.{field} must be a positive int, got {value!r}")
        for field in ("block_n", "block_k", "num_warps"):
            value = getattr(self, field)
            if value & (value - 1):
                raise ValueError(f"Tiles.{field} must be a power of two, got {value}")
        if self.block_n < 16 or self.block_k < 16:
            raise ValueError(f"Tiles.block_n and block_k must be >= 16 (tensor-core tiles), got {self}")

    def kernel_name(self, op: str) -> str:
        """The compiled kernel's name: the op and every tile field (profiles name the tile set that ran)."""
        return f"kvjax_{op}_n{self.block_n}_k{self.block_k}_s{self.num_stages}_w{self.num_warps}"


MATMUL_TILES = Tiles(block_n=32, block_k=128, num_stages=6, num_warps=4)  # RESULTS.md, "Skinny projections"
WIDE_MATMUL_TILES = Tiles(block_n=64, block_k=128, num_stages=4, num_warps=4)  # N > WIDE_N (matmul_tiles)
WIDE_N = 4096  # above: more than 128 tiles of 32 columns, a second wave of one-CTA-an-SM programs on 132 SMs
MATMUL_PROGRAMS = (64, 256)  # x @ w: the output tiles (programs) where the kernel beat XLA (RESULTS.md)
SWIGLU_TILES = Tiles(block_n=32, block_k=128, num_stages=4, num_warps=4)  # RESULTS.md, "SwiGLU up-projection"


def _kernel(x_ref, *refs, tiles: Tiles, epilogue: str):  # x [T, H], weights [H, N] each, o [T, N]
    *w_refs, o_ref = refs
    j = pl.program_id(0)
    rows, hidden = x_ref.shape
    bn, bk = tiles.block_n, tiles.block_k
    cols = pl.ds(pl.multiple_of(j * bn, bn), bn)
    dims = (((1,), (0,)), ((), ()))

    def body(i, acc):
        ks = pl.ds(pl.multiple_of(i * bk, bk), bk)
        xk = x_ref[:, ks]
        return tuple(a + lax.dot_general(xk, w[ks, cols], dims, preferred_element_type=jnp.float32)
                     for a, w in zip(acc, w_refs))

    zero = jnp.zeros((rows, bn), jnp.float32)
    acc = lax.fori_loop(0, hidden // bk, body, (zero,) * len(w_refs))
    if epilogue == "swiglu":
        gate, up = acc
        out = gate * (1.0 / (1.0 + jnp.exp(-gate))) * up
    else:
        (out,) = acc
    o_ref[:, cols] = out.astype(o_ref.dtype)


def unsupported(
    x,  # [T, H]
    *weights,  # [H, N] each
    tiles: Tiles,
) -> str | None:
    """Why the kernel cannot take the call, or ``None``: 16-bit floats (weights of x's dtype), ``T`` a power of two in
    ``MIN_ROWS..MAX_ROWS``, ``H`` a multiple of ``tiles.block_k``, ``N`` of ``tiles.block_n``."""
    rows, hidden = x.shape
    cols = weights[0].shape[1]
    if x.dtype not in (jnp.bfloat16, jnp.float16):
        return f"the kernel takes bfloat16 / float16 (float32 keeps XLA's full-precision products), got {x.dtype}"
    if any(w.dtype != x.dtype for w in weights):
        return f"the kernel takes weights of x's dtype {x.dtype}, got {[str(w.dtype) for w in weights]}"
    if not MIN_ROWS <= rows <= MAX_ROWS or rows & (rows - 1):
        return f"the kernel takes T a power of two in {MIN_ROWS}..{MAX_ROWS} (skinny decode rows), got T={rows}"
    if hidden % tiles.block_k or cols % tiles.block_n:
        return (f"the kernel needs H % {tiles.block_k} == 0 and N % {tiles.block_n} == 0, "
                f"got H={hidden}, N={cols}")
    return None


def _call(x, weights, *, tiles: Tiles, epilogue: str, op: str, interpret: bool):
    reason = unsupported(x, *weights, tiles=tiles)
    if reason:
        raise ValueError(f"pallas {op}: {reason}")
    rows, cols = x.shape[0], weights[0].shape[1]
    return pl.pallas_call(
        functools.partial(_kernel, tiles=tiles, epilogue=epilogue),
        out_shape=jax.ShapeDtypeStruct((rows, cols), x.dtype),
        grid=(cols // tiles.block_n,),
        compiler_params=plt.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
        interpret=interpret,
        name=tiles.kernel_name(op),
    )(x, *weights)


def matmul_tiles(n: int) -> Tiles:
    """The default tiles of ``x @ w`` with ``N = n`` output columns: :data:`WIDE_MATMUL_TILES` (64 columns a
    program) where ``n > WIDE_N`` is a multiple of 64, else :data:`MATMUL_TILES`. At ``N = 8192`` 32 columns a
    program launch 256 programs of one CTA an SM, two waves on 132 SMs: 64 columns measured 1.28x faster on an
    H200 (96.7% of the copy rate against 75.6%; RESULTS.md "Skinny projections")."""
    return WIDE_MATMUL_TILES if n > WIDE_N and n % WIDE_MATMUL_TILES.block_n == 0 else MATMUL_TILES


@functools.partial(jax.jit, static_argnames=("tiles", "interpret"))
def matmul_pallas(
    x: jax.Array,  # [T, H]
    w: jax.Array,  # [H, N]
    *,
    tiles: Tiles | None = None,
    interpret: bool = False,
) -> jax.Array:  # [T, N] in x's dtype
    """Backend ``"pallas"`` of ``kvjax.ops.linear.linear``: ``x @ w`` with float32 accumulation (the calls
    :func:`unsupported` accepts; ``ValueError`` otherwise). ``tiles``: default :func:`matmul_tiles` of ``N``."""
    tiles = matmul_tiles(w.shape[1]) if tiles is None else tiles
    return _call(x, (w,), tiles=tiles, epilogue="none", op="matmul", interpret=interpret)


@functools.partial(jax.jit, static_argnames=("tiles", "interpret"))
def swiglu_pallas(
    x: jax.Array,  # [T, H]
    w_gate: jax.Array,  # [H, I]
    w_up: jax.Array,  # [H, I]
    *,
    tiles: Tiles = SWIGLU_TILES,
    interpret: bool = False,
) -> jax.Array:  # [T, I] in x's dtype
    """Backend ``"pallas"`` of ``kvjax.ops.mlp.swiglu``: ``silu(x @ w_gate) * (x @ w_up)``, both products
    accumulated in float32 over one walk of ``H`` (the calls :func:`unsupported` accepts)."""
    return _call(x, (w_gate, w_up), tiles=tiles, epilogue="swiglu", op="swiglu", interpret=interpret)


def matmul_unsupported(x, w) -> str | None:  # x [T, H], w [H, N]
    """:func:`unsupported` at the default :data:`MATMUL_TILES`, and ``N`` spread over
    :data:`MATMUL_PROGRAMS` output tiles (the backend table's check): with fewer programs than SMs' worth
    (``N <= 1024``) the kernel leaves the GPU idle, with more (the LM head) XLA's GEMM is at the copy rate."""
    reason = unsupported(x, w, tiles=MATMUL_TILES)
    lo, hi = MATMUL_PROGRAMS
    bn = MATMUL_TILES.block_n
    if reason is None and not lo * bn <= w.shape[1] <= hi * bn:
        reason = f"the kernel takes N in {lo * bn}..{hi * bn} ({lo}..{hi} tiles of {bn} columns), got N={w.shape[1]}"
    return reason


def swiglu_unsupported(x, w_gate, w_up) -> str | None:  # x [T, H], w_gate / w_up [H, I]
    """:func:`unsupported` at the default :data:`SWIGLU_TILES` (the backend table's check)."""
    return unsupported(x, w_gate, w_up, tiles=SWIGLU_TILES)
