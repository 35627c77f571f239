"""Token sampling: greedy and temperature sampling with explicit PRNG keys.

Each row draws from its own key, derived from integers only (``seed``, the request's index in its batch of
prompts, and how many tokens the request knows so far): the token a request samples at a given length does
not depend on which other requests share the step, on preemption, or on the recycle policy. Greedy rows
(``temperature == 0``) take the argmax (lowest id on ties, as ``torch.argmax``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def row_keys(seeds: jax.Array, streams: jax.Array, counters: jax.Array) -> jax.Array:
    """One typed PRNG key per row: ``fold_in(fold_in(key(seed), stream), counter)``.

    ``seeds``, ``streams``, ``counters``: i32[B] -> key[B].
    """
    def one(s, i, n):
        return jax.random.fold_in(jax.random.fold_in(jax.random.key(s), i), n)

    return jax.vmap(one)(seeds, streams, counters)


def sample(logits: jax.Array, keys: jax.Array, temperature: jax.Array) -> jax.Array:
    """Sample one token per row.

    Args:
      logits: f32[B, vocab].
      keys: key[B] (typed PRNG keys, e.g. from :func:`row_keys`).
      temperature: f32[B]; ``0`` = greedy for that row, ``> 0`` = softmax(logits / temperature) sampling.
    Returns:
      i32[B] token ids.
    """
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    safe_t = jnp.where(temperature > 0, temperature, 1.0).astype(jnp.float32)
    drawn = jax.vmap(jax.random.categorical)(keys, logits.astype(jnp.float32) / safe_t[:, None])
    return jnp.where(temperature > 0, drawn.astype(jnp.int32), greedy)
