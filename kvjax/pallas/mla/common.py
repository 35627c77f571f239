"""What the two Triton-lowered stage-1 kernels share (:mod:`.decode`, dense and DSA-sparse over a latent cache;
:mod:`.dsa_sparse`, over the fp8 DSA key roles): the key steps of a program's split, the row gather through the
block table, the base-2 online-softmax step, and the ``pallas_call`` layout of the query tiles and the split
outputs. Pure functions traced inside the kernels (or their builders): they add no launch and no memory traffic.

Grid ``(head groups, KV splits, sequences)``: head groups vary fastest, so the programs of one sequence and split
share each page through L2.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kvjax.pallas.split_kv import LOG2E


def split_steps(
    n_steps: jax.Array,  # i32[]  key steps of the row
    split: jax.Array,  # i32[]  this program's split
    num_splits: int,
) -> tuple[jax.Array, jax.Array]:  # (first step, end step) of the split, i32[] each
    """The contiguous range of key steps split ``split`` of ``num_splits`` walks (empty past the row's end)."""
    per_split = pl.cdiv(n_steps, num_splits)
    start = split * per_split
    end = jnp.minimum(start + per_split, n_steps)
    return start, end


def gather_rows(
    tables_ref,  # i32[B, max_blocks] (whole array)
    b: jax.Array,  # i32[]  the row
    pos: jax.Array,  # i32[block_n]  positions of the step's keys; < 0 = none
    seq_len: jax.Array,  # i32[]
    page_size: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:  # (page i32[block_n, 1], offset i32[block_n, 1], valid bool[block_n])
    """Where the step's keys live: page and row (column vectors, to index a ref), and whether a key is attended
    (``0 <= pos < seq_len`` and its page is not a hole). Invalid keys point at row 0 of page 0: masked loads never
    read them."""
    max_blocks = tables_ref.shape[1]
    pos_ok = (pos >= 0) & (pos < seq_len)
    pos = jnp.where(pos_ok, pos, 0)
    page = tables_ref[b, jnp.minimum(pos // page_size, max_blocks - 1)]
    valid = pos_ok & (page >= 0)  # bool[block_n]
    return jnp.maximum(page, 0)[:, None], (pos % page_size)[:, None], valid


def softmax_step(
    s: jax.Array,  # f32[block_h, block_n]  logits (unscaled)
    valid: jax.Array,  # bool[block_n]
    m: jax.Array,  # f32[block_h]  running max (base 2)
    l: jax.Array,  # f32[block_h]  running sum
    scale: float,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:  # (p, alpha, m_new, l_new)
    """One base-2 online-softmax step: logits pre-scaled by ``log2(e)`` so exp2 (one instruction) does the work;
    ``p f32[block_h, block_n]`` the step's weights, ``alpha f32[block_h]`` the accumulator's rescale factor."""
    s = jnp.where(valid[None, :], s * (scale * LOG2E), -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    alpha = jnp.exp2(m - m_new)
    p = jnp.exp2(s - m_new[:, None])
    l = l * alpha + jnp.sum(p, axis=1)
    return p, alpha, m_new, l


def stage1_layout(b: int, hp: int, rank: int, rope: int, *, block_h: int, num_splits: int, out_dtype):
    """The ``pallas_call`` layout of a stage 1 over ``q [B, Hp, R]``, ``q_rope [B, Hp, r]``:
    ``(grid, query_specs, out_specs, out_shape)``, the grid ``(Hp // block_h, num_splits, B)``, the block specs of
    the query tiles ``[block_h, R]``, ``[block_h, r]`` (placed among the kernel's inputs by the caller), and the
    outputs: split outputs ``[B, S, Hp, R]`` in ``out_dtype`` and f32 lse ``[B, S, Hp]``."""
    grid = (hp // block_h, num_splits, b)
    query_specs = [
        pl.BlockSpec((None, block_h, rank), lambda g, s, i: (i, g, 0)),
        pl.BlockSpec((None, block_h, rope), lambda g, s, i: (i, g, 0)),
    ]
    out_specs = [
        pl.BlockSpec((None, None, block_h, rank), lambda g, s, i: (i, s, g, 0)),
        pl.BlockSpec((None, None, block_h), lambda g, s, i: (i, s, g)),
    ]
    out_shape = [
        jax.ShapeDtypeStruct((b, num_splits, hp, rank), out_dtype),
        jax.ShapeDtypeStruct((b, num_splits, hp), jnp.float32),
    ]
    return grid, query_specs, out_specs, out_shape
