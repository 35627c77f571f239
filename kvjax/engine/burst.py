"""Decode bursts on the device: several decode sub-steps of one plan in one jitted step.

A decode step costs the host a schedule, an input build, a dispatch of ~170 kernels and an update, which on a
GPU takes longer than the step's kernels. A burst plan (``StepPlan.burst_len``, :mod:`kvjax.sched.plan`) lets
one dispatch run ``K`` decode sub-steps: the scheduler reserves ``burst_len[b] <= K`` tokens for row ``b`` and
allocates the pages of their positions; the device feeds each sub-step the tokens the previous one sampled
(:func:`advance`). The host work per generated token falls by about ``K``.

Sub-step ``j`` of row ``b`` computes position ``p_b + j`` and samples the step's token ``j * max_seqs + b``, with the
sampling counter ``seq_len`` of that sub-step: the same tokens as ``K`` single steps. A row whose sub-steps
are spent (``j >= burst_len[b]``: it reached ``max_new_tokens``) stays in the batch writing nothing: no K/V
(slot mapping ``-1``) and no GDN state (slot 0, PAD); what it samples is never read. A row that samples eos
keeps going to the end of the burst, as an overlapped step past eos does; the host drops those tokens.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from kvjax.base.ragged import token_rows
from kvjax.inputs import StepInputs
from kvjax.models.interface import ModelCaches


def advance(inputs: StepInputs, tokens: jax.Array, go: jax.Array, page_size: int) -> StepInputs:
    """The next sub-step's inputs of a decode plan (every row has at most one token; rows need not be contiguous).

    ``tokens``: i32[B], this sub-step's sampled tokens; ``go``: bool[B], the rows that run the next sub-step.
    Their token becomes the sampled one at the next position, ``seq_lens`` grows by one, they have a state to
    read, and their slot mapping points at the new position's page on every head (``-1`` where the block is a
    hole). Other rows write nothing (slot mapping ``-1``, GDN slot 0)."""
    T = inputs.token_ids.shape[0]
    t = jnp.arange(T, dtype=jnp.int32)
    row = token_rows(inputs.cu_seqlens, T)  # i32[T]: token's row (a compare, no loop: the step stays one graph)
    tgo = (t < inputs.cu_seqlens[-1]) & go[row]  # bool[T]
    pos = inputs.positions + tgo.astype(jnp.int32)  # i32[T]
    return dataclasses.replace(
        inputs, token_ids=jnp.where(tgo, tokens[row], inputs.token_ids), positions=pos,
        seq_lens=inputs.seq_lens + go.astype(jnp.int32), has_initial_state=inputs.has_initial_state | go,
        gdn_slots=jnp.where(go, inputs.gdn_slots, 0),
        slot_mapping=slot_mapping(inputs.block_tables, row, pos, tgo, page_size))


def slot_mapping(block_tables: jax.Array, row: jax.Array, pos: jax.Array, write: jax.Array,
                 page_size: int) -> jax.Array:
    """i32[T, Hkv]: where token ``t`` (of row ``row[t]`` at position ``pos[t]``, i32[T] each) writes its K/V on every
    head, from ``block_tables`` (i32[B, Hkv, max_blocks]); ``-1`` where ``write`` (bool[T]) is off or the block is a
    hole (traceable)."""
    blk = jnp.minimum(pos // page_size, block_tables.shape[2] - 1)
    page = block_tables[row[:, None], jnp.arange(block_tables.shape[1])[None, :], blk[:, None]]  # i32[T, Hkv]
    return jnp.where(write[:, None] & (page >= 0), page * page_size + (pos % page_size)[:, None], -1).astype(jnp.int32)


def run_burst(forward: Callable, pick: Callable, params, caches: ModelCaches, inputs: StepInputs,
              burst_len: jax.Array, burst: int, page_size: int, stride: int, *, unroll: bool = True
              ) -> tuple[jax.Array, ModelCaches]:
    """``burst`` sub-steps: ``forward(params, caches, inputs) -> (logits f32[B, V], caches)``, then ``pick(logits,
    counters i32[B]) -> i32[B]`` samples. ``burst_len``: i32[B]. Returns ``(tokens i32[burst * stride], caches)``
    with sub-step ``j``'s token of row ``b`` at ``j * stride + b`` (``stride >= B``; zeros elsewhere).
    ``unroll``: the sub-steps as straight-line code (a GPU runs them as one graph); else a ``lax.scan`` (one
    sub-step compiled once)."""

    def sub_step(caches, inputs, j):
        logits, caches = forward(params, caches, inputs)
        tokens = pick(logits, inputs.seq_lens)
        return caches, advance(inputs, tokens, burst_len > j + 1, page_size), tokens

    if unroll:
        out = []
        for j in range(burst):
            caches, nxt, tokens = sub_step(caches, inputs, j)
            inputs = nxt if j + 1 < burst else inputs
            out.append(tokens)
        toks = jnp.stack(out)  # i32[burst, B]
    else:
        def body(carry, j):
            caches, inputs = carry
            caches, inputs, tokens = sub_step(caches, inputs, j)
            return (caches, inputs), tokens

        (caches, _), toks = jax.lax.scan(body, (caches, inputs), jnp.arange(burst, dtype=jnp.int32))
    return pad_tokens(toks, stride).reshape(-1), caches


def pad_tokens(tokens: jax.Array, width: int) -> jax.Array:
    """``tokens`` (i32[..., B]) padded with zeros to i32[..., width] along the last axis.

    A pad, not ``zeros.at[..., :B].set``: where ``B == width`` that scatter has an empty index vector, and XLA's
    GPU compile of a multi-device ``shard_map`` holding one crashes (the empty index constant becomes a
    zero-sized operand of the manual computation)."""
    pad = [(0, 0)] * (tokens.ndim - 1) + [(0, width - tokens.shape[-1])]
    return jnp.pad(tokens, pad)
