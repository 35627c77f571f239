"""Prompt-lookup (n-gram) drafting on the device (``speculative="ngram"`` in verification bursts).

:func:`lookup` is :class:`kvjax.sched.drafter.NgramDrafter`'s rule, traceable: for each row, the longest ``n`` from
``max_ngram`` down to ``min_ngram`` whose last ``n`` tokens occur earlier in the row's history (windows starting
before the last token), the latest such occurrence, and the up to ``K`` tokens that followed it (``-1`` past the
history's end, or for all ``K`` where no ``n`` matches): the host drafter's drafts, token for token.

:func:`append` writes a verification sub-step's accepted tokens after a row's history, so that the rows' histories
stay on the device through a verification burst (:func:`kvjax.engine.verify.verify_burst`): the host sends each
row's history once per burst (:func:`kvjax.sched.spec.histories`) and every later sub-step drafts from the
history the burst has grown. Both cost a few elementwise passes over ``i32[B, L]`` per n-gram size: no model layer.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def lookup(history: jax.Array, length: jax.Array, K: int, max_ngram: int, min_ngram: int) -> jax.Array:
    """``i32[B, K]``: each row's drafts from its history (traceable; static ``K``, ``max_ngram >= min_ngram >= 1``).

    ``history``: i32[B, L], row ``b``'s known tokens (prompt, then outputs) in ``history[b, :length[b]]`` (its last
    token the one not yet computed; entries past ``length`` are ignored); ``length``: i32[B]. A draft is ``-1``
    where the history ends first or nothing matches (the drafts are a prefix of real tokens, then ``-1``)."""
    B, L = history.shape
    s = jnp.arange(L, dtype=jnp.int32)[None, :]  # window starts
    pad = jnp.pad(history, ((0, 0), (0, max_ngram)), constant_values=-1)  # i32[B, L + max_ngram]
    start = jnp.full((B,), -1, jnp.int32)  # i32[B]: where the drafts begin (-1: no match yet)
    for n in range(max_ngram, min_ngram - 1, -1):
        match = s <= (length - n - 1)[:, None]  # bool[B, L]: windows before the last token (none where n >= length)
        for i in range(n):
            suffix = jnp.take_along_axis(history, jnp.clip(length - n + i, 0, L - 1)[:, None], axis=1)  # i32[B, 1]
            match = match & (pad[:, i: i + L] == suffix)
        latest = jnp.max(jnp.where(match, s, -1), axis=1)  # i32[B]
        start = jnp.where((start < 0) & (latest >= 0), latest + n, start)
    at = start[:, None] + jnp.arange(K, dtype=jnp.int32)[None, :]  # i32[B, K]
    ok = (start[:, None] >= 0) & (at < length[:, None])
    return jnp.where(ok, jnp.take_along_axis(history, jnp.clip(at, 0, L - 1), axis=1), -1).astype(jnp.int32)


def append(history: jax.Array, length: jax.Array, tokens: jax.Array, count: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Each row's history with ``tokens[b, :count[b]]`` (i32[B, J], ``count`` i32[B], 0 for a row that takes none)
    written after its ``length[b]`` tokens (positions past ``L`` dropped): ``(i32[B, L], i32[B])`` (traceable)."""
    B, L = history.shape
    j = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None, :]
    at = jnp.where(j < count[:, None], length[:, None] + j, L)  # i32[B, J]: L = dropped
    rows = jnp.broadcast_to(jnp.arange(B, dtype=jnp.int32)[:, None], at.shape)
    return history.at[rows, at].set(tokens.astype(history.dtype), mode="drop"), length + count


def leading(drafts: jax.Array) -> jax.Array:
    """``i32[B]``: the drafts before each row's first ``-1`` (``drafts``: i32[B, K])."""
    return jnp.cumprod(drafts >= 0, axis=1).sum(axis=1).astype(jnp.int32)
