"""Per-position GDN and conv states of verification rows (speculative decoding): the states a rollback picks from.

A verification row runs its last token and ``k`` draft tokens through the model in one ragged step; if the target
accepts ``a <= k`` drafts, the row's state must become the state after its first ``a + 1`` tokens, not after all
``k + 1``. These ops give every such state at once (the SGLang way: intermediate states of the step, the accepted
one scattered back by :func:`kvjax.state.gdn_spec.commit`):

- :func:`verify_ssm_states`: the gated delta rule state after each verification token, one recurrent step per
  position from the row's initial state (the recurrence of :mod:`kvjax.ops.gdn`, float32, ``Precision.HIGHEST``);
- :func:`verify_conv_states`: the conv state (its last ``W - 1`` inputs, oldest first) after each verification
  token: the initial state followed by the row's conv inputs, a window per position.

Both take the verification tokens of row ``b`` as ``index[b, j]`` (token indices into the step's ``T`` tokens,
``j < J``) with ``valid[b, j]``; an invalid position's state is unspecified (never picked). Reference
implementations only (jnp, any device): a GPU kernel is future work, and the verification rows are few tokens each.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from kvjax.ops.gdn import l2norm

_HI = lax.Precision.HIGHEST


def verify_ssm_states(
    k: jax.Array,  # [T, Hk, K]
    v: jax.Array,  # [T, Hv, V]
    g: jax.Array,  # f32[T, Hv] log-decay
    beta: jax.Array,  # [T, Hv]
    initial: jax.Array,  # f32[B, Hv, K, V]: each row's state before its first verification token
    index: jax.Array,  # i32[B, J]: token of row b's j-th verification position (any in-range value where invalid)
    valid: jax.Array,  # bool[B, J]
    *,
    use_qk_l2norm: bool,
) -> jax.Array:  # f32[B, J, Hv, K, V]: the state after position j
    """The recurrent state after each verification position (see the module docstring; the state does not
    depend on the queries)."""
    hv = v.shape[1]
    idx = jnp.clip(index, 0, k.shape[0] - 1)
    kf = l2norm(k) if use_qk_l2norm else k.astype(jnp.float32)
    kf = jnp.repeat(kf, hv // k.shape[1], axis=1)  # f32[T, Hv, K]
    xs = (kf[idx], v.astype(jnp.float32)[idx], g.astype(jnp.float32)[idx], beta.astype(jnp.float32)[idx], valid)
    xs = jax.tree.map(lambda a: jnp.moveaxis(a, 1, 0), xs)  # [J, B, ...]

    def step(s, x):  # s: f32[B, Hv, K, V]
        k_t, v_t, g_t, b_t, ok = x
        n = s * jnp.exp(g_t)[..., None, None]
        delta = (v_t - jnp.einsum("bhk,bhkv->bhv", k_t, n, precision=_HI)) * b_t[..., None]  # f32[B, Hv, V]
        n = n + k_t[..., :, None] * delta[..., None, :]
        n = jnp.where(ok[:, None, None, None], n, s)
        return n, n

    _, states = lax.scan(step, initial.astype(jnp.float32), xs)  # f32[J, B, Hv, K, V]
    return jnp.moveaxis(states, 0, 1)


def verify_conv_states(
    x: jax.Array,  # [T, D]: the conv inputs of the step's tokens
    initial: jax.Array,  # [B, D, W-1]: each row's conv state before its first verification token
    index: jax.Array,  # i32[B, J]
) -> jax.Array:  # [B, J, D, W-1] (initial's dtype): the conv state after position j
    """The conv state after each verification position (see the module docstring); a position past the row's
    verification tokens reads some token (its state is never picked)."""
    T = x.shape[0]
    width = initial.shape[-1]  # W - 1
    J = index.shape[1]
    xs = x[jnp.clip(index, 0, T - 1)].astype(initial.dtype)  # [B, J, D]
    ext = jnp.concatenate([initial, jnp.swapaxes(xs, 1, 2)], axis=-1)  # [B, D, W-1+J]
    return jnp.stack([ext[:, :, j + 1: j + 1 + width] for j in range(J)], axis=1)
