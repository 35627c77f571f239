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
``j < J``) with ``valid[b, j]``; an invalid position's state is unspecified (never picked). Both are jnp (any
device): the general path of a verification step, whose rows may be mixed with prefill chunks.

A step whose rows all continue their state with at most ``J`` tokens each (a verification burst's sub-step,
``StepInputs.max_query_len``) takes :func:`gdn_verify_pool` instead: the op gives each token's output, each row's
final state in the pool and its per-position states in one call (:data:`VERIFY_TABLE`: the kernel of
:mod:`kvjax.pallas.gdn.verify` on a GPU, :func:`gdn_verify_pool_reference` elsewhere), where the general path runs the
chunked kernel and then :func:`verify_ssm_states`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from kvjax.base.checks import check_array
from kvjax.base.slots import live_slots, slot_index
from kvjax.ops.backends import Backend, BackendTable
from kvjax.ops.gdn import DeltaRuleCall, example_call, l2norm
from kvjax.ops.gdn_on_pool import check_pool_call
from kvjax.pallas.gdn import verify as verify_kernels

VERIFY_OP = "gdn_verify_pool"

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


# ---------------------------------------------------------------------------------------- few-token verification
def check_verify_call(call: DeltaRuleCall, ssm: jax.Array, states: jax.Array, impl: str) -> DeltaRuleCall:
    """Host-side (trace-time) check of a :func:`gdn_verify_pool` call; returns it normalised as
    :func:`kvjax.ops.gdn_on_pool.check_pool_call` does (whose checks it runs). ``ValueError`` naming the argument for
    a call without ``cu_seqlens`` or with ``has_initial_state`` (every live row continues its state) and for
    ``states`` other than ``f32[L, B, J, Hv, K, V]`` with ``ssm``'s ``L, Hv, K, V`` and the call's ``B`` rows."""
    if isinstance(call, DeltaRuleCall) and call.cu_seqlens is None:
        raise ValueError("gdn_verify_pool needs cu_seqlens (i32[B+1]: each row's 1 + k verification tokens)")
    if isinstance(call, DeltaRuleCall) and call.has_initial_state is not None:
        raise ValueError("gdn_verify_pool continues every live row's state: has_initial_state must be None")
    call = check_pool_call(call, ssm, impl)
    L, _, hv, kd, vd = ssm.shape
    check_array("states", states, rank=6, dtypes=[jnp.float32],
                shape=(L, call.slot_ids.shape[0], None, hv, kd, vd))
    if states.shape[2] < 1:
        raise ValueError(f"states needs at least one position (J >= 1), got shape {tuple(states.shape)}")
    return call


def gdn_verify_pool_reference(
    call: DeltaRuleCall,  # checked: q / k [T, Hk, K], v [T, Hv, V], g f32[T, Hv], beta [T, Hv], cu_seqlens, slot_ids
    ssm: jax.Array,  # f32[L, S+1, Hv, K, V]
    states: jax.Array,  # f32[L, B, J, Hv, K, V]
) -> tuple[jax.Array, jax.Array, jax.Array]:  # (o [T, Hv, V] in v's dtype, ssm, states)
    """Oracle of :func:`gdn_verify_pool`: :func:`verify_ssm_states` from each live row's slot state, the outputs
    ``scale * q_t . S_t`` from the state after each token, the last state scattered into the slot."""
    q, v, cu, layer = call.q, call.v, call.cu_seqlens, call.layer
    T, hv, vd = v.shape
    B, J = call.slot_ids.shape[0], states.shape[2]
    n = cu[1:] - cu[:-1]  # i32[B]
    live = live_slots(call.slot_ids, ssm.shape[1])
    idx = slot_index(call.slot_ids, ssm.shape[1])  # out of range: read as zeros, writes dropped
    s0 = ssm.at[layer, idx].get(mode="fill", fill_value=0.0)  # f32[B, Hv, K, V]
    j = jnp.arange(J, dtype=jnp.int32)
    index = cu[:-1, None] + j  # i32[B, J]
    valid = (j < n[:, None]) & live[:, None]  # bool[B, J]
    per = verify_ssm_states(call.k, v, call.g, call.beta, s0, index, valid,
                            use_qk_l2norm=call.use_qk_l2norm)  # f32[B, J, Hv, K, V]
    qf = l2norm(q) if call.use_qk_l2norm else q.astype(jnp.float32)
    qf = jnp.repeat(qf, hv // q.shape[1], axis=1) * call.scale  # f32[T, Hv, K]
    o_pos = jnp.einsum("bjhk,bjhkv->bjhv", qf[jnp.clip(index, 0, T - 1)], per, precision=_HI)  # f32[B, J, Hv, V]
    dest = jnp.where(valid, index, T).reshape(-1)  # tokens of no live row: zero
    o = jnp.zeros((T, hv, vd), v.dtype).at[dest].set(o_pos.reshape(-1, hv, vd).astype(v.dtype), mode="drop")
    final = jnp.where((n > 0)[:, None, None, None], per[jnp.arange(B), jnp.clip(n - 1, 0, J - 1)], s0)
    kept = jnp.where(valid[..., None, None, None], per, states[layer])
    return o, ssm.at[layer, idx].set(final, mode="drop"), states.at[layer].set(kept)


def gdn_verify_pool(
    call: DeltaRuleCall,  # q / k [T, Hk, K], v [T, Hv, V], g f32[T, Hv], beta [T, Hv], cu_seqlens i32[B+1],
    #                       slot_ids i32[B], layer, scale, use_qk_l2norm; has_initial_state None
    ssm: jax.Array,  # f32[L, S+1, Hv, K, V]  the GDN pool's states (donated by the kernel)
    states: jax.Array,  # f32[L, B, J, Hv, K, V]  per-position states (donated by the kernel)
    impl: str = "auto",
) -> tuple[jax.Array, jax.Array, jax.Array]:  # (o [T, Hv, V] in v's dtype, ssm, states)
    """The gated delta rule of a verification step whose rows all continue their state, each with at most ``J``
    tokens: row ``b`` runs tokens ``cu_seqlens[b]:cu_seqlens[b+1]`` from ``ssm[layer, slot_ids[b]]``; returns
    each token's output (zeros for tokens of padding rows, slot outside ``1..S``, and of no row), ``ssm`` with
    each live row's state after its last token at its slot, and ``states`` with ``states[layer, b, j]`` the state
    after row ``b``'s ``j``-th token (positions past the row's tokens and padding rows unchanged). A row of more
    than ``J`` tokens is a caller bug (the kernel keeps the last states at ``J - 1``).

    Checks the call (:func:`check_verify_call`), then runs what :data:`VERIFY_TABLE` chooses for ``impl``."""
    call = check_verify_call(call, ssm, states, impl)
    return VERIFY_TABLE.choose(impl, (call, ssm, states), {})[1](call, ssm, states)


def _verify_example(rows: int, positions: int, heads: int, *, layer_traced: bool = False):
    """A representative verification call: ``rows`` rows of ``positions`` bf16 tokens, K = V = 128."""
    sds = jax.ShapeDtypeStruct
    (call, _), _ = example_call(rows * positions, rows, heads)
    call = dataclasses.replace(call, slot_ids=sds((rows,), jnp.int32), layer=sds((), jnp.int32) if layer_traced else 0)
    return (call, sds((2, rows + 9, heads, 128, 128), jnp.float32),
            sds((2, rows, positions, heads, 128, 128), jnp.float32)), {}


VERIFY_TABLE = BackendTable(
    VERIFY_OP,
    gdn_verify_pool_reference,
    (
        Backend("pallas", verify_kernels.gdn_verify_slots, priority=10, unsupported=verify_kernels.unsupported,
                note="one read of each row's state, outputs and every position's state in one kernel"),
    ),
    examples={
        "verify B=16 x 5 tokens H=32, int layer": lambda: _verify_example(16, 5, 32),
        "verify B=16 x 5 tokens H=32, traced layer": lambda: _verify_example(16, 5, 32, layer_traced=True),
    },
)
