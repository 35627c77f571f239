"""Gated DeltaNet (gated delta rule) ops: chunked (prefill) and recurrent (decode / verification) forms.

Semantics are those of Hugging Face transformers' ``qwen3_5`` ``torch_chunk_gated_delta_rule`` and
``torch_recurrent_gated_delta_rule``, over a ragged (varlen) token-major batch. For every sequence ``n``
(tokens ``cu_seqlens[n] : cu_seqlens[n+1]``) and value head ``j`` (q/k head ``h = j // (Hv // Hk)``), with
the state ``S: f32[K, V]`` starting from ``initial_state[n, j]`` (zeros if ``None``)::

    q_t, k_t = l2norm(q_t), l2norm(k_t)            # only if use_qk_l2norm; l2norm(x) = x * rsqrt(|x|^2 + 1e-6)
    S   = exp(g_t) * S                             # g: log-decay, <= 0
    S   = S + k_t (beta_t * (v_t - S^T k_t))^T     # delta rule
    o_t = scale * S^T q_t                          # scale defaults to K ** -0.5

Tokens outside every sequence (``t < cu_seqlens[0]`` or ``t >= cu_seqlens[N]``, the padding of a static
token bucket) get ``o_t = 0``. An empty sequence writes no outputs and returns its initial state (or zeros).

Kernel contract
---------------
A call of the family is one :class:`DeltaRuleCall` (the arrays q / k / v / g / beta, ``cu_seqlens``, ``scale``,
``use_qk_l2norm`` and, for the slot-pool ops of :mod:`kvjax.ops.gdn_on_pool`, the pool addressing), built once
and handed down unchanged beside its state. The public ops build it from their arguments, check it on the host (at
trace time, :func:`check_call`: ``scale`` resolved to a Python float) and call the implementation their backend
table (:data:`CHUNK_TABLE`, :data:`RECURRENT_TABLE`) chooses for ``impl`` with exactly::

    fn(call, initial_state)   # kernels also get interpret=

    call.q, call.k:      [T, Hk, K]  float (same dtype as v)
    call.v:              [T, Hv, V]  float, Hv % Hk == 0
    call.g:              f32[T, Hv]  log-decay
    call.beta:           [T, Hv]     float
    call.cu_seqlens:     i32[N+1]    may be traced; non-decreasing, within [0, T] (not checked on device)
    call.scale:          Python float
    call.use_qk_l2norm:  Python bool (static)
    initial_state:       f32[N, Hv, K, V] or None (None = zeros)
    returns (o: [T, Hv, V] in v's dtype, final_state: f32[N, Hv, K, V])

Backends: ``"pallas"`` (:mod:`kvjax.pallas.gdn.chunk` / :mod:`kvjax.pallas.gdn.recurrent`: any CUDA GPU,
any K and V, padded to power-of-two blocks inside the kernels); ``impl="auto"`` takes it on a GPU, else the
reference; the chunked op's ``"mosaic"`` (Hopper: the same kernels with the Mosaic GPU preparation kernel,
:mod:`kvjax.pallas.gdn.prep_mgpu`, for bf16 q / k / v with K and V of 64 or 128) ahead of it where it applies;
``"mosaic-fused"`` (FlashQLA's layout: the preparation without ``w`` / ``u``, its value heads' inverses in
lockstep, and the fused Mosaic GPU pass, ``seq="fused"`` of :mod:`kvjax.pallas.gdn.chunk`) takes the same calls by
name, and ``auto`` takes it ahead of both where it was measured fastest: one sequence of >= 16 value heads or
<= 2048 tokens, several sequences of >= 512 tokens on average (not the engine's chunked-prefill buckets)
(its ``prefer`` rule, :func:`kvjax.pallas.gdn.chunk.mosaic_fused_preferred`; RESULTS.md, GDN chunked prefill).
The references (``*_reference`` below) follow the same contract, compute in float32 with ``Precision.HIGHEST``
matmuls (no TF32 on GPU), and are jitted with ``use_qk_l2norm`` static (``scale`` is traced, so a new scale does
not recompile; ``scale=None`` is ``K ** -0.5``).
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kvjax.base.checks import check_array, check_cu_seqlens, check_float
from kvjax.ops.backends import Backend, BackendTable, on_hopper
from kvjax.pallas.gdn import chunk as chunk_kernels
from kvjax.pallas.gdn import recurrent as recurrent_kernels

CHUNK_OP = "chunk_gated_delta_rule"
RECURRENT_OP = "recurrent_gated_delta_rule"
CHUNK_SIZE = 64
L2NORM_EPS = 1e-6  # Hugging Face / fla l2norm epsilon (added to the squared norm)

_HI = lax.Precision.HIGHEST


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DeltaRuleCall:
    """One gated-delta-rule call: built once where the values are (a public op, the slot pool's functions, a
    model layer) and handed unchanged to the op's check, its backend table and the chosen kernel; the state goes
    beside it (``initial_state`` for the ops of this module, the pool's ``ssm`` for :mod:`kvjax.ops.gdn_on_pool`).
    A pytree: ``use_qk_l2norm`` is static, every other field a leaf (``None`` where unused). Checked by
    :func:`check_call` / :func:`kvjax.ops.gdn_on_pool.check_pool_call`, which resolve ``scale``."""

    q: jax.Array  # [T, Hk, K]
    k: jax.Array  # [T, Hk, K]
    v: jax.Array  # [T, Hv, V]
    g: jax.Array  # f32[T, Hv] log-decay (<= 0)
    beta: jax.Array  # [T, Hv]
    cu_seqlens: jax.Array | None = None  # i32[N+1]; None = one token per row (slot-pool ops)
    scale: float | None = None  # query scale; None = K ** -0.5
    slot_ids: jax.Array | None = None  # i32[N] slot-pool ops: each row's slot, outside 1..S = padding row
    has_initial_state: jax.Array | None = None  # bool[N] slot-pool ops; None = every live row reads its slot
    layer: int | jax.Array | None = None  # slot-pool ops: the GDN layer (a Python int, or i32[])
    use_qk_l2norm: bool = dataclasses.field(default=False, metadata=dict(static=True))


def _einsum(spec: str, *xs):
    return jnp.einsum(spec, *xs, precision=_HI)


def l2norm(x: jax.Array, eps: float = L2NORM_EPS) -> jax.Array:
    """``x * rsqrt(sum(x**2, -1) + eps)`` in float32 (Hugging Face's ``l2norm``)."""
    x = x.astype(jnp.float32)
    return x * lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def _prepare_qk(q, k, num_v_heads: int, scale: float, use_qk_l2norm: bool):
    """Float32, optional l2norm, q scaled, q/k heads expanded to value heads (``repeat_interleave``)."""
    q, k = q.astype(jnp.float32), k.astype(jnp.float32)
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    group = num_v_heads // k.shape[1]
    return jnp.repeat(q * scale, group, axis=1), jnp.repeat(k, group, axis=1)


def _token_sequences(cu_seqlens, num_tokens: int):
    """Per token: its sequence id (clipped into range), position in it, and whether it belongs to one."""
    num_seqs = cu_seqlens.shape[0] - 1
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.searchsorted(cu_seqlens, t, side="right", method="compare_all").astype(jnp.int32) - 1  # i32[T]
    valid = (seq >= 0) & (seq < num_seqs)
    seq = jnp.clip(seq, 0, num_seqs - 1)
    return seq, t - cu_seqlens[seq], valid


def _initial_or_zeros(initial_state, num_seqs: int, hv: int, kd: int, vd: int):
    if initial_state is None:
        return jnp.zeros((num_seqs, hv, kd, vd), jnp.float32)
    return jnp.asarray(initial_state, jnp.float32)


# ----------------------------------------------------------------------------------------------------------
# Recurrent reference: one scan step per token.
# ----------------------------------------------------------------------------------------------------------


def _reference(scan: Callable, name: str) -> Callable:
    """A float32 reference of the ops' call form ``(call, initial_state)`` (module docstring) around ``scan(q, k,
    v, g, beta, cu_seqlens, init) -> (o f32[T, Hv, V], final f32[N, Hv, K, V])``, which gets q / k prepared
    (:func:`_prepare_qk`: f32, optional l2norm, q scaled, expanded to the value heads), v / g / beta in f32 and
    the initial states (zeros for ``None``). Jitted (``call.use_qk_l2norm`` is static); the docstring is
    ``scan``'s."""

    def reference(
        call: DeltaRuleCall,
        initial_state: jax.Array | None = None,  # f32[N, Hv, K, V]; None = zeros
    ) -> tuple[jax.Array, jax.Array]:  # (o [T, Hv, V] in v's dtype, final state f32[N, Hv, K, V])
        v = call.v
        hv, vd, kd = v.shape[1], v.shape[2], call.k.shape[-1]
        cu_seqlens = jnp.asarray(call.cu_seqlens)
        init = _initial_or_zeros(initial_state, cu_seqlens.shape[0] - 1, hv, kd, vd)
        scale = kd ** -0.5 if call.scale is None else call.scale
        q, k = _prepare_qk(call.q, call.k, hv, scale, call.use_qk_l2norm)  # f32[T, Hv, K]
        f32 = (x.astype(jnp.float32) for x in (v, call.g, call.beta))
        o, final = scan(q, k, *f32, cu_seqlens, init)
        return o.astype(v.dtype), final

    reference.__name__ = reference.__qualname__ = name
    reference.__doc__ = scan.__doc__
    return jax.jit(reference)


def _recurrent_scan(q, k, v, g, beta, cu_seqlens, init):
    """Stepwise gated delta rule over a ragged batch (see the module docstring for the contract)."""
    num_seqs = init.shape[0]
    seq, pos, valid = _token_sequences(cu_seqlens, v.shape[0])
    is_last = valid & (pos == cu_seqlens[seq + 1] - cu_seqlens[seq] - 1)

    def step(carry, xs):
        state, final = carry  # f32[Hv, K, V], f32[N, Hv, K, V]
        q_t, k_t, v_t, g_t, b_t, n, p, ok, last = xs
        s = jnp.where(p == 0, init[n], state)
        s = s * jnp.exp(g_t)[:, None, None]
        delta = (v_t - _einsum("hk,hkv->hv", k_t, s)) * b_t[:, None]  # f32[Hv, V]
        s = s + k_t[:, :, None] * delta[:, None, :]
        o_t = jnp.where(ok, _einsum("hk,hkv->hv", q_t, s), 0.0)
        final = final.at[jnp.where(last, n, num_seqs)].set(s, mode="drop")
        return (jnp.where(ok, s, state), final), o_t

    xs = (q, k, v, g, beta, seq, pos, valid, is_last)
    (_, final), o = lax.scan(step, (jnp.zeros(init.shape[1:], jnp.float32), init), xs)
    return o, final


recurrent_gated_delta_rule_reference = _reference(_recurrent_scan, "recurrent_gated_delta_rule_reference")


# ----------------------------------------------------------------------------------------------------------
# Chunked reference: WY/UT form over 64-token chunks, sequences packed chunk-aligned.
# ----------------------------------------------------------------------------------------------------------


def _chunk_layout(cu_seqlens, num_tokens: int, chunk: int):
    """Pack each sequence into whole chunks, back to back, so no chunk mixes two sequences.

    Returns ``dest: i32[T]`` (row of each token in the packed ``[C * chunk]`` buffer; ``C * chunk`` for tokens
    outside every sequence, which drops them), and per chunk ``seq: i32[C]``, ``first, last: bool[C]``.
    ``C = (T + (chunk - 1) * N) // chunk`` bounds ``sum_n ceil(len_n / chunk)`` statically.
    """
    num_seqs = cu_seqlens.shape[0] - 1
    num_chunks = max(1, (num_tokens + (chunk - 1) * num_seqs) // chunk)
    lens = cu_seqlens[1:] - cu_seqlens[:-1]  # i32[N]
    chunk_end = jnp.cumsum((lens + chunk - 1) // chunk).astype(jnp.int32)  # i32[N]
    chunk_begin = chunk_end - (lens + chunk - 1) // chunk
    seq, pos, valid = _token_sequences(cu_seqlens, num_tokens)
    dest = jnp.where(valid, chunk_begin[seq] * chunk + pos, num_chunks * chunk)

    c = jnp.arange(num_chunks, dtype=jnp.int32)
    c_seq = jnp.searchsorted(chunk_end, c, side="right", method="compare_all").astype(jnp.int32)  # N: unused
    used = c_seq < num_seqs
    c_seq = jnp.minimum(c_seq, num_seqs - 1)
    first = used & (c == chunk_begin[c_seq])
    last = used & (c == chunk_end[c_seq] - 1)
    return dest, num_chunks, c_seq, first, last


def _to_chunks(x, dest, num_chunks: int, chunk: int):
    """``[T, ...]`` -> zero-padded ``[C, chunk, ...]`` by the packed layout."""
    packed = jnp.zeros((num_chunks * chunk,) + x.shape[1:], x.dtype).at[dest].set(x, mode="drop")
    return packed.reshape((num_chunks, chunk) + x.shape[1:])


def _solve_unit_lower(lower, rhs):
    """``(I + lower)^-1 rhs`` by forward substitution; ``lower: [..., c, c]`` strictly lower, ``rhs: [..., c, n]``."""

    def row(i, x):
        return x.at[..., i, :].set(rhs[..., i, :] - _einsum("...j,...jn->...n", lower[..., i, :], x))

    return lax.fori_loop(0, rhs.shape[-2], row, jnp.zeros_like(rhs))


def _chunk_scan(q, k, v, g, beta, cu_seqlens, init):
    """Chunked (WY/UT-form) gated delta rule over a ragged batch (see the module docstring for the contract).

    Phase 1, all chunks at once: within a chunk (positions ``i, j``; ``G = cumsum(g)``), with
    ``D[i, j] = exp(G_i - G_j)`` for ``j <= i`` (else 0), solve the unit-lower-triangular system
    ``A = I + strict_lower(beta_i k_i.k_j D[i, j])`` for ``U = A^-1 (beta v)`` and ``W = A^-1 (beta exp(G) k)``.
    Phase 2, a scan over chunks carrying the state ``S``::

        V' = U - W S;   O = exp(G) q S + (q k^T * D) V';   S = exp(G_last) S + (exp(G_last - G) k)^T V'
    """
    num_tokens, hv, vd = v.shape
    num_seqs = init.shape[0]
    c = CHUNK_SIZE
    dest, num_chunks, c_seq, first, last = _chunk_layout(cu_seqlens, num_tokens, c)

    # [C, Hv, c, ...]; padding rows are zero (k = v = beta = g = 0), so they neither read nor change S.
    qc, kc, vc = (_to_chunks(x, dest, num_chunks, c).transpose(0, 2, 1, 3) for x in (q, k, v))
    gc, bc = (_to_chunks(x, dest, num_chunks, c).transpose(0, 2, 1) for x in (g, beta))

    g_cum = jnp.cumsum(gc, axis=-1)  # f32[C, Hv, c]
    causal = jnp.tril(jnp.ones((c, c), bool))
    decay = jnp.exp(jnp.where(causal, g_cum[..., :, None] - g_cum[..., None, :], -jnp.inf))  # f32[C, Hv, c, c]
    k_beta = kc * bc[..., None]
    lower = jnp.tril(_einsum("...ik,...jk->...ij", k_beta, kc) * decay, -1)
    rhs = jnp.concatenate([vc * bc[..., None], k_beta * jnp.exp(g_cum)[..., None]], axis=-1)
    solved = _solve_unit_lower(lower, rhs)
    u, w = solved[..., :vd], solved[..., vd:]  # f32[C, Hv, c, V], f32[C, Hv, c, K]
    attn = _einsum("...ik,...jk->...ij", qc, kc) * decay  # f32[C, Hv, c, c]
    q_dec = qc * jnp.exp(g_cum)[..., None]
    k_dec = kc * jnp.exp(g_cum[..., -1:] - g_cum)[..., None]
    chunk_decay = jnp.exp(g_cum[..., -1])[..., None, None]  # f32[C, Hv, 1, 1]

    def step(carry, xs):
        state, final = carry  # f32[Hv, K, V], f32[N, Hv, K, V]
        u_c, w_c, attn_c, q_c, k_c, decay_c, n, is_first, is_last = xs
        s = jnp.where(is_first, init[n], state)
        v_new = u_c - _einsum("hik,hkv->hiv", w_c, s)
        o_c = _einsum("hik,hkv->hiv", q_c, s) + _einsum("hij,hjv->hiv", attn_c, v_new)
        s = s * decay_c + _einsum("hik,hiv->hkv", k_c, v_new)
        final = final.at[jnp.where(is_last, n, num_seqs)].set(s, mode="drop")
        return (s, final), o_c

    xs = (u, w, attn, q_dec, k_dec, chunk_decay, c_seq, first, last)
    (_, final), oc = lax.scan(step, (jnp.zeros(init.shape[1:], jnp.float32), init), xs)
    o_packed = oc.transpose(0, 2, 1, 3).reshape(num_chunks * c, hv, vd)
    return o_packed.at[dest].get(mode="fill", fill_value=0.0), final


chunk_gated_delta_rule_reference = _reference(_chunk_scan, "chunk_gated_delta_rule_reference")


# ----------------------------------------------------------------------------------------------------------
# Host validation of the ops' arguments.
# ----------------------------------------------------------------------------------------------------------


def check_tokens(call: DeltaRuleCall, cu_seqlens: jax.Array, impl: str) -> float:
    """Host-side (trace-time) check of a call's token side against the kernel contract (module docstring) with
    ``cu_seqlens`` (i32[N+1]; values when they are a host ``np.ndarray``): ranks, dtypes, shapes and head counts,
    ``use_qk_l2norm`` a bool, ``impl`` a string. Returns the resolved ``scale`` (``None``: ``K ** -0.5``).
    ``ValueError`` names the argument. Shared by the slot-pool ops (:mod:`kvjax.ops.gdn_on_pool`)."""
    if not isinstance(call, DeltaRuleCall):
        raise ValueError(f"call must be a DeltaRuleCall, got {type(call).__name__}")
    q, k, v = call.q, call.k, call.v
    check_float("q", q, rank=3)
    check_array("k", k, shape=tuple(q.shape), dtypes=[q.dtype])
    check_float("v", v, rank=3)
    check_array("v", v, dtypes=[q.dtype])
    num_tokens, hk, kd = q.shape
    hv = v.shape[1]
    if v.shape[0] != num_tokens:
        raise ValueError(f"v has {v.shape[0]} tokens but q has {num_tokens} (v shape {tuple(v.shape)})")
    if hv % hk:
        raise ValueError(f"v has Hv={hv} value heads, not a multiple of q/k's Hk={hk} heads")
    check_array("g", call.g, shape=(num_tokens, hv), dtypes=[jnp.float32])
    check_float("beta", call.beta, shape=(num_tokens, hv))
    check_cu_seqlens(cu_seqlens, num_tokens)
    if not isinstance(call.use_qk_l2norm, (bool, np.bool_)):
        raise ValueError(f"use_qk_l2norm must be a Python bool, got {call.use_qk_l2norm!r}")
    if not isinstance(impl, str):
        raise ValueError(f"impl must be a string, got {impl!r}")
    scale = call.scale
    if scale is None:
        return float(kd) ** -0.5
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not np.isfinite(scale):
        raise ValueError(f"scale must be a finite Python number or None, got {scale!r}")
    return float(scale)


def check_call(call: DeltaRuleCall, initial_state: jax.Array | None, impl: str) -> DeltaRuleCall:
    """Host-side (trace-time) check of a public op's call (:func:`check_tokens` with ``call.cu_seqlens``, then
    ``initial_state`` ``f32[N, Hv, K, V]`` or ``None``); returns the call with ``scale`` a Python float and
    ``use_qk_l2norm`` a bool. ``ValueError`` names the argument."""
    scale = check_tokens(call, call.cu_seqlens, impl)
    if initial_state is not None:
        hv, kd, vd = call.v.shape[1], call.q.shape[2], call.v.shape[2]
        check_array("initial_state", initial_state, shape=(call.cu_seqlens.shape[0] - 1, hv, kd, vd),
                    dtypes=[jnp.float32])
    return dataclasses.replace(call, scale=scale, use_qk_l2norm=bool(call.use_qk_l2norm))


# ----------------------------------------------------------------------------------------------------------
# Backend tables.
# ----------------------------------------------------------------------------------------------------------


def example_call(num_tokens: int, num_seqs: int, heads: int, kd: int = 128, vd: int = 128):
    """A representative call ``((call, initial_state), {})``: bf16 q/k/v/beta, f32 g and state, l2norm in the
    kernel."""
    sds, bf16 = jax.ShapeDtypeStruct, jnp.bfloat16
    call = DeltaRuleCall(sds((num_tokens, heads, kd), bf16), sds((num_tokens, heads, kd), bf16),
                         sds((num_tokens, heads, vd), bf16), sds((num_tokens, heads), jnp.float32),
                         sds((num_tokens, heads), bf16), cu_seqlens=sds((num_seqs + 1,), jnp.int32),
                         scale=kd ** -0.5, use_qk_l2norm=True)
    return (call, sds((num_seqs, heads, kd, vd), jnp.float32)), {}


# The notes of the Mosaic GPU backends, shared with the pool op's table (kvjax.ops.gdn_on_pool): the same kernels.
MOSAIC_NOTE = ("the Mosaic GPU (wgmma) preparation kernel: 1.29-1.44x the Triton one on an H200 "
               "(benchmarks/RESULTS.md, GDN chunked prefill)")
MOSAIC_FUSED_NOTE = (
    "FlashQLA's layout: the Mosaic GPU preparation without w / u (Tb = T diag(beta); the value heads' inverses in "
    "lockstep) and the fused Mosaic GPU pass (v_new = Tb (v - kr k S)); auto for one sequence of >= 16 value heads "
    "or <= 2048 tokens and for several sequences of >= 512 tokens on average, where it was measured ahead of "
    "'mosaic' on an H200: 1.01-1.85x at 28 of 29 shapes (1 to 16 equal sequences of 512 to 32768 tokens, 8 to 32 "
    "heads), 0.81x at one sequence of 8 heads and 8192 tokens (chunk parallelism wins there); the engine's "
    "chunked-prefill buckets (2048 tokens in 16 or 64 rows) split either way and keep 'mosaic' "
    "(benchmarks/RESULTS.md, GDN chunked prefill, HISTORY runs 248-249)")


CHUNK_TABLE = BackendTable(
    CHUNK_OP,
    chunk_gated_delta_rule_reference,
    (
        Backend("mosaic", chunk_kernels.chunk_gated_delta_rule_mosaic_prep, priority=20, device=on_hopper,
                unsupported=chunk_kernels.mosaic_prep_unsupported,
                note=MOSAIC_NOTE),
        Backend("mosaic-fused", chunk_kernels.chunk_gated_delta_rule_mosaic_fused, priority=30, device=on_hopper,
                unsupported=chunk_kernels.mosaic_prep_unsupported, prefer=chunk_kernels.mosaic_fused_preferred,
                note=MOSAIC_FUSED_NOTE),
        Backend("pallas", chunk_kernels.chunk_gated_delta_rule_pallas, priority=10,
                note="Pallas prep + fused sequential kernel, chunk-parallel segments for few long sequences "
                     "(benchmarks/RESULTS.md, GDN chunked prefill)"),
    ),
    examples={
        "prefill N=1 T=8192 H=16 K=V=128": lambda: example_call(8192, 1, 16),
        "prefill N=1 T=32768 H=16 K=V=128": lambda: example_call(32768, 1, 16),
        "prefill N=1 T=8192 H=32 K=V=128": lambda: example_call(8192, 1, 32),
        "prefill N=4 T=16384 H=32 K=V=128": lambda: example_call(16384, 4, 32),
        "prefill N=16 T=8192 H=16 K=V=128": lambda: example_call(8192, 16, 16),
        "prefill N=1 T=8192 H=8 K=V=128": lambda: example_call(8192, 1, 8),
        "prefill N=64 T=2048 H=32 K=V=128 (an engine step's bucket)": lambda: example_call(2048, 64, 32),
        "prefill N=2 T=512 H=8 K=96 V=128": lambda: example_call(512, 2, 8, kd=96),
    },
)

RECURRENT_TABLE = BackendTable(
    RECURRENT_OP,
    recurrent_gated_delta_rule_reference,
    (
        Backend("pallas", recurrent_kernels.recurrent_gated_delta_rule_pallas, priority=10,
                note="one program per (row, head, value block)"),
    ),
    examples={
        "verify N=32 x 4 tokens H=32 K=V=128": lambda: example_call(128, 32, 32),
        "decode N=8 H=8 K=V=96": lambda: example_call(8, 8, 8, kd=96, vd=96),
    },
)


# ----------------------------------------------------------------------------------------------------------
# Public ops: host validation, then the backend table.
# ----------------------------------------------------------------------------------------------------------


def _op(table: BackendTable, doc: str) -> Callable:
    """The public op of ``table``: its arguments made one :class:`DeltaRuleCall`, :func:`check_call`, then the
    backend ``impl`` names."""

    def op(
        q: jax.Array,  # [T, Hk, K]
        k: jax.Array,  # [T, Hk, K]
        v: jax.Array,  # [T, Hv, V]
        g: jax.Array,  # f32[T, Hv] log-decay (<= 0)
        beta: jax.Array,  # [T, Hv]
        *,
        cu_seqlens: jax.Array,  # i32[N+1]
        initial_state: jax.Array | None = None,  # f32[N, Hv, K, V]
        scale: float | None = None,
        use_qk_l2norm: bool = False,
        impl: str = "auto",
    ) -> tuple[jax.Array, jax.Array]:
        call = check_call(DeltaRuleCall(q, k, v, g, beta, cu_seqlens, scale, use_qk_l2norm=use_qk_l2norm),
                          initial_state, impl)
        return table.choose(impl, (call, initial_state), {})[1](call, initial_state)

    op.__name__ = op.__qualname__ = table.op
    op.__doc__ = doc
    return op


chunk_gated_delta_rule = _op(CHUNK_TABLE, """Gated delta rule over a ragged batch, chunked form (prefill).

    Returns ``(o: [T, Hv, V] in v's dtype, final_state: f32[N, Hv, K, V])``; see the module docstring for the
    semantics and the kernel contract. ``scale`` defaults to ``K ** -0.5``. Raises ``ValueError`` naming the
    offending argument (ranks, dtypes, head counts, ``cu_seqlens`` int32) and ``UnknownImplError`` for an
    ``impl`` that is not available here.
    """)

recurrent_gated_delta_rule = _op(RECURRENT_TABLE, """Gated delta rule over a ragged batch, stepwise form (decode,
    verification).

    Same arguments, results and errors as :func:`chunk_gated_delta_rule`.
    """)
