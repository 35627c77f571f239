"""The gated delta rule on the slot-addressed SSM state array ``f32[L, S+1, Hv, K, V]`` (the GDN pool's ``ssm``).

Slot ids follow :mod:`kvjax.base.slots`: slot 0 is the PAD sentinel, never written; an id outside ``1..S`` is a
padding row (:func:`~kvjax.base.slots.slot_index` maps it out of range, read as zeros, writes dropped);
:func:`~kvjax.base.slots.check_slot_ids` checks host values.

A call is one :class:`~kvjax.ops.gdn.DeltaRuleCall` with the pool addressing set (``slot_ids``, ``layer``,
``has_initial_state``), beside the array ``ssm``. Batch row ``n`` owns the tokens ``cu_seqlens[n]:cu_seqlens[n+1]``
(``cu_seqlens=None``: token ``n``) and the slot ``slot_ids[n]``. Padding rows read and write nothing and their
tokens' outputs are zero. A live row starts from ``ssm[layer, slot]`` when ``has_initial_state[n]`` (``None``:
every live row does; else from zeros) and its final state is written back there.

- :func:`gdn_prefill_pool`: the chunked gated delta rule (:data:`PREFILL_TABLE`).
- :func:`gdn_decode_pool`: the stepwise one (:data:`DECODE_TABLE`).
- :func:`gated_delta_decode_pool`: Qwen3.5's decode step, one :class:`GatedDecodeCall` (the packed conv
  output ``q | k | v``, the hidden state, the gate parameters, the slot ids) and the array
  (:data:`GATED_DECODE_TABLE`): the slot kernel reads the columns and projects and computes the gates
  (:func:`qwen_gates`) itself, so no XLA op runs between the conv and the kernel. Qwen3.5's helpers
  (:func:`split_packed`, :func:`gate_projections`, :func:`qwen_gates`) are part of this op's definition (its
  inputs are the raw projections, so its reference computes the gates as the kernel does); the model's prefill
  path imports them from here rather than keeping a second copy.

Each returns ``(o: [T, Hv, V], new ssm)`` and its normalised call is ``(call, ssm)`` (kernels also
``interpret=``), checked once by :func:`check_pool_call` (the gated decode's by :func:`validate_gated_call`).
The oracle of each is the composition ``gather -> reference op of`` :mod:`kvjax.ops.gdn` ``-> scatter``.
Backends (Pallas, Triton lowering, any CUDA GPU, any K and V): ``"pallas"`` runs the rows/flags
kernels of :mod:`kvjax.pallas.gdn` on the flattened ``[L * (S+1)]`` slots and takes every call; decode also has
``"slots"``, :func:`kvjax.pallas.gdn.recurrent.recurrent_gated_delta_rule_slots`, which indexes the array by
slot id inside the kernel with no XLA op around it: ``auto`` takes it for one token per row, every live row
continuing and a static int ``layer`` (RESULTS.md, GDN decode); prefill also has ``"mosaic"`` on Hopper, the
``"pallas"`` kernels with the Mosaic GPU preparation kernel (:mod:`kvjax.pallas.gdn.prep_mgpu`; bf16, K and V of
64 or 128; RESULTS.md, GDN chunked prefill) and ``"mosaic-fused"`` (FlashQLA's layout: the same calls by name,
``auto`` where it was measured ahead of ``"mosaic"``, as for the unpooled op). The array is
updated in place (aliased) under jit when donated: :mod:`kvjax.state.gdn_pool` applies these ops to a
:class:`~kvjax.state.gdn_pool.GDNStatePool`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.base.checks import check_array, check_float, check_int32
from kvjax.base.ragged import count_le
from kvjax.base.slots import check_slot_ids, live_slots, slot_index, static_layer
from kvjax.ops import gdn
from kvjax.ops.gdn import DeltaRuleCall
from kvjax.ops.backends import Backend, BackendTable, on_hopper
from kvjax.pallas.gdn import chunk as chunk_kernels
from kvjax.pallas.gdn import recurrent as recurrent_kernels

PREFILL_OP = "gdn_prefill_pool"
DECODE_OP = "gdn_decode_pool"
GATED_DECODE_OP = "gated_delta_decode_pool"


# ---------------------------------------------------------------------------------------------- references
def _pool_reference(op_reference, name: str):
    """The oracle of a pool op named ``name``: gather the initial states, run ``op_reference`` (a reference of
    :mod:`kvjax.ops.gdn`), scatter the final states."""

    def reference(
        call: DeltaRuleCall,  # with slot_ids, layer (has_initial_state, cu_seqlens may be None)
        ssm: jax.Array,  # f32[L, S+1, Hv, K, V]
    ) -> tuple[jax.Array, jax.Array]:  # (o [T, Hv, V], new ssm f32[L, S+1, Hv, K, V])
        num_slots, slot_ids = ssm.shape[1], call.slot_ids
        cu_seqlens = call.cu_seqlens
        if cu_seqlens is None:
            cu_seqlens = jnp.arange(call.q.shape[0] + 1, dtype=jnp.int32)
        live = live_slots(slot_ids, num_slots)
        idx = slot_index(slot_ids, num_slots)  # out of range: read as zeros, writes dropped
        read = live if call.has_initial_state is None else live & call.has_initial_state
        init = jnp.where(read[:, None, None, None], ssm.at[call.layer, idx].get(mode="fill", fill_value=0.0), 0.0)
        o, final = op_reference(DeltaRuleCall(call.q, call.k, call.v, call.g, call.beta, cu_seqlens, call.scale,
                                              use_qk_l2norm=call.use_qk_l2norm), init)
        t = jnp.arange(call.q.shape[0], dtype=jnp.int32)
        row = count_le(cu_seqlens, t) - 1
        in_batch = (row >= 0) & (row < slot_ids.shape[0])
        row_live = in_batch & live[jnp.clip(row, 0, slot_ids.shape[0] - 1)]
        o = jnp.where(row_live[:, None, None], o, jnp.zeros_like(o))
        return o, ssm.at[call.layer, idx].set(final, mode="drop")

    reference.__name__ = reference.__qualname__ = name
    reference.__doc__ = (f"Oracle: gather the initial states, run ``{op_reference.__name__}``, scatter the final "
                         "ones.")
    return reference


gdn_prefill_pool_reference = _pool_reference(gdn.chunk_gated_delta_rule_reference, "gdn_prefill_pool_reference")
gdn_decode_pool_reference = _pool_reference(gdn.recurrent_gated_delta_rule_reference, "gdn_decode_pool_reference")


# ---------------------------------------------------------------------------------------------- public ops
def check_pool_call(call: DeltaRuleCall, ssm: jax.Array, impl: str) -> DeltaRuleCall:
    """Host-side (trace-time) check of a pool op's call; returns it with ``scale`` a Python float, ``layer`` a
    Python int where it is static and ``use_qk_l2norm`` a bool.

    :func:`kvjax.ops.gdn.check_tokens` (``cu_seqlens=None``: one token per row, ``T == N``), the array's shape
    and dtype (``f32[L, S+1, Hv, K, V]``), ``layer`` (a Python int in range, or an i32 scalar), ``slot_ids``
    i32[N] (host values also by :func:`check_slot_ids`), ``has_initial_state`` bool[N] or ``None``.
    ``ValueError`` (``InvalidPlanError`` for slot ids) names the argument.
    """
    if not isinstance(call, DeltaRuleCall):
        raise ValueError(f"call must be a DeltaRuleCall, got {type(call).__name__}")
    q, v, slot_ids, layer, cu_seqlens = call.q, call.v, call.slot_ids, call.layer, call.cu_seqlens
    if slot_ids is None or layer is None:
        raise ValueError("a pool op's call needs slot_ids and layer")
    if cu_seqlens is None:
        if q.shape[0] != slot_ids.shape[0]:
            raise ValueError(f"without cu_seqlens decode takes one token per row: q has {q.shape[0]} tokens, "
                             f"slot_ids {slot_ids.shape[0]} rows")
        cu_seqlens = np.arange(slot_ids.shape[0] + 1, dtype=np.int32)
    scale = gdn.check_tokens(call, cu_seqlens, impl)
    hv, kd, vd = v.shape[1], q.shape[2], v.shape[2]
    check_array("pool.ssm", ssm, rank=5, dtypes=[jnp.float32], shape=(None, None, hv, kd, vd))
    num_seqs = cu_seqlens.shape[0] - 1
    check_int32("slot_ids", slot_ids, shape=(num_seqs,))
    if call.has_initial_state is not None:
        check_array("has_initial_state", call.has_initial_state, shape=(num_seqs,), dtypes=[jnp.bool_])
    num_layers, num_slots = ssm.shape[:2]
    fixed = static_layer(layer)
    if fixed is not None:
        if not 0 <= fixed < num_layers:
            raise ValueError(f"layer={layer} out of range for a GDN pool of {num_layers} layers")
    else:
        check_int32("layer", layer, rank=0)
    if isinstance(slot_ids, np.ndarray):  # host values: free to check (device code cannot raise)
        check_slot_ids(slot_ids, num_slots - 1)
    return dataclasses.replace(call, scale=scale, layer=layer if fixed is None else fixed,
                               use_qk_l2norm=bool(call.use_qk_l2norm))


def gdn_prefill_pool(
    call: DeltaRuleCall,  # q / k / v / g / beta [T, ...], cu_seqlens i32[N+1], slot_ids i32[N], layer, ...
    ssm: jax.Array,  # f32[L, S+1, Hv, K, V]
    impl: str = "auto",
) -> tuple[jax.Array, jax.Array]:  # (o [T, Hv, V] in v's dtype, new ssm f32[L, S+1, Hv, K, V])
    """Chunked gated delta rule (prefill / extend) on the SSM array; returns ``(o, ssm)`` with every live row's
    final state written at ``ssm[call.layer, call.slot_ids[n]]`` (slot 0 never). Errors: see
    :func:`check_pool_call`; ``UnknownImplError`` for an ``impl`` that cannot run here or take this call."""
    call = check_pool_call(call, ssm, impl)
    return PREFILL_TABLE.choose(impl, (call, ssm), {})[1](call, ssm)


def gdn_decode_pool(
    call: DeltaRuleCall,  # q / k / v / g / beta [T, ...] (T = N without cu_seqlens), slot_ids i32[N], layer, ...
    ssm: jax.Array,  # f32[L, S+1, Hv, K, V]
    impl: str = "auto",
) -> tuple[jax.Array, jax.Array]:  # (o [T, Hv, V] in v's dtype, new ssm f32[L, S+1, Hv, K, V])
    """Stepwise gated delta rule (decode, verification) on the SSM array; same contract as
    :func:`gdn_prefill_pool`. Padding rows cost no state traffic."""
    call = check_pool_call(call, ssm, impl)
    return DECODE_TABLE.choose(impl, (call, ssm), {})[1](call, ssm)


def qwen_gates(
    a: jax.Array,  # [T, Hv]  raw decay projection
    b: jax.Array,  # [T, Hv]  raw beta projection
    a_log: jax.Array,  # [Hv]
    dt_bias: jax.Array,  # [Hv]
    beta_dtype,
) -> tuple[jax.Array, jax.Array]:  # (g f32[T, Hv], beta [T, Hv] in beta_dtype)
    """Qwen3.5's GDN gates: ``g = -exp(A_log) * softplus(a + dt_bias)`` (f32), ``beta = sigmoid(b)``."""
    g = -jnp.exp(a_log.astype(jnp.float32)) * jax.nn.softplus(a.astype(jnp.float32) + dt_bias.astype(jnp.float32))
    return g, jax.nn.sigmoid(b).astype(beta_dtype)


def split_packed(qkv: jax.Array, num_v_heads: int, kd: int, vd: int):  # [T, 2*Hk*K + Hv*V] -> q, k, v
    """The head-major column blocks ``q | k | v`` of the packed conv output as ``[T, Hk, K]`` x2, ``[T, Hv, V]``."""
    t, width = qkv.shape
    hk, rem = divmod(width - num_v_heads * vd, 2 * kd)
    if rem or hk < 1 or num_v_heads % hk:
        raise ValueError(f"qkv has {width} columns: not 2*Hk*{kd} + {num_v_heads}*{vd} for an Hk dividing "
                         f"Hv={num_v_heads}")
    kdim = hk * kd
    return (qkv[:, :kdim].reshape(t, hk, kd), qkv[:, kdim:2 * kdim].reshape(t, hk, kd),
            qkv[:, 2 * kdim:].reshape(t, num_v_heads, vd))


def gate_projections(x: jax.Array, w_a: jax.Array, w_b: jax.Array):  # [T, D], [Hv, D] x2 -> a, b [T, Hv]
    """The raw gate projections ``a = x @ w_a.T``, ``b = x @ w_b.T`` (torch-layout weights; full-precision
    products, x's dtype out)."""
    hi = jax.lax.Precision.HIGHEST
    return jnp.matmul(x, w_a.T, precision=hi), jnp.matmul(x, w_b.T, precision=hi)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GatedDecodeCall:
    """One Qwen3.5 GDN decode step's arguments, built once by the model layer and handed unchanged to
    :func:`gated_delta_decode_pool`, its backend table's check and the chosen kernel (one token per row, every
    live row continuing its state). A pytree: the arrays are leaves, ``layer``, ``scale`` and
    ``use_qk_l2norm`` are static (checked here; the arrays are checked by :func:`validate_gated_call`)."""

    qkv: jax.Array  # [B, 2*Hk*K + Hv*V]  the conv output: q | k | v head-major columns
    x: jax.Array  # [B, D]  the hidden state the gates are projected from
    w_a: jax.Array  # [Hv, D]  in_proj_a weight (torch layout)
    w_b: jax.Array  # [Hv, D]  in_proj_b weight
    a_log: jax.Array  # [Hv]
    dt_bias: jax.Array  # [Hv]
    slot_ids: jax.Array  # i32[B]  outside 1..S = padding row
    layer: int = dataclasses.field(metadata=dict(static=True))  # GDN layer index into the pool
    scale: float = dataclasses.field(metadata=dict(static=True))  # query scale (K**-0.5 in Qwen3.5)
    use_qk_l2norm: bool = dataclasses.field(default=True, metadata=dict(static=True))

    def __post_init__(self):
        if static_layer(self.layer) is None or self.layer < 0:
            raise ValueError(f"layer must be a Python int >= 0, got {self.layer!r}")
        if isinstance(self.scale, bool) or not isinstance(self.scale, (int, float)) or not self.scale > 0:
            raise ValueError(f"scale must be a positive Python float, got {self.scale!r}")
        if not isinstance(self.use_qk_l2norm, bool):
            raise ValueError(f"use_qk_l2norm must be a bool, got {self.use_qk_l2norm!r}")


def gated_delta_decode_pool_reference(
    call: GatedDecodeCall,
    ssm: jax.Array,  # f32[L, S+1, Hv, K, V]
) -> tuple[jax.Array, jax.Array]:  # (o [B, Hv, V], new ssm)
    """Oracle: :func:`split_packed`, :func:`gate_projections`, :func:`qwen_gates`, then
    :func:`gdn_decode_pool_reference`."""
    hv, kd, vd = ssm.shape[2:]
    q, k, v = split_packed(call.qkv, hv, kd, vd)
    g, beta = qwen_gates(*gate_projections(call.x, call.w_a, call.w_b), call.a_log, call.dt_bias, call.qkv.dtype)
    return gdn_decode_pool_reference(DeltaRuleCall(q, k, v, g, beta, scale=call.scale, slot_ids=call.slot_ids,
                                                   layer=call.layer, use_qk_l2norm=call.use_qk_l2norm), ssm)


def validate_gated_call(call: GatedDecodeCall, ssm: jax.Array, impl: str) -> None:
    """Host-side check of a :func:`gated_delta_decode_pool` call (the packed widths against the pool's heads,
    the gate inputs, then :func:`check_pool_call` on the split call). ``ValueError`` names the argument."""
    if not isinstance(call, GatedDecodeCall):
        raise ValueError(f"call must be a GatedDecodeCall, got {type(call).__name__}")
    check_array("pool.ssm", ssm, rank=5, dtypes=[jnp.float32])
    hv, kd, vd = ssm.shape[2:]
    qkv, x = call.qkv, call.x
    check_float("qkv", qkv, rank=2)
    q, k, v = jax.eval_shape(lambda t: split_packed(t, hv, kd, vd), jax.ShapeDtypeStruct(qkv.shape, qkv.dtype))
    check_array("x", x, rank=2, dtypes=[qkv.dtype], shape=(qkv.shape[0], None))
    check_array("w_a", call.w_a, shape=(hv, x.shape[1]), dtypes=[qkv.dtype])
    check_array("w_b", call.w_b, shape=(hv, x.shape[1]), dtypes=[qkv.dtype])
    check_float("A_log", call.a_log, shape=(hv,))
    check_float("dt_bias", call.dt_bias, shape=(hv,))
    g = jax.ShapeDtypeStruct((qkv.shape[0], hv), jnp.float32)
    beta = jax.ShapeDtypeStruct((qkv.shape[0], hv), qkv.dtype)
    check_pool_call(DeltaRuleCall(q, k, v, g, beta, scale=call.scale, slot_ids=call.slot_ids, layer=call.layer,
                                  use_qk_l2norm=call.use_qk_l2norm), ssm, impl)


def gated_delta_decode_pool(
    call: GatedDecodeCall,
    ssm: jax.Array,  # f32[L, S+1, Hv, K, V]
    impl: str = "auto",
) -> tuple[jax.Array, jax.Array]:  # (o [B, Hv, V] in qkv's dtype, new ssm f32[L, S+1, Hv, K, V])
    """Qwen3.5's GDN decode step on the SSM array: :func:`gdn_decode_pool` (one token per row, every live row
    continuing) of :func:`split_packed` ``(call.qkv)`` with the gates :func:`qwen_gates` of
    :func:`gate_projections` ``(call.x, call.w_a, call.w_b)``; every live row's state at
    ``ssm[call.layer, call.slot_ids[b]]`` advances one token (slot 0 never written). Checks once
    (:func:`validate_gated_call`), then calls the kernel :data:`GATED_DECODE_TABLE` chooses for ``impl``
    directly; ``UnknownImplError`` for an ``impl`` that cannot run here. Kernels donate ``ssm`` under jit."""
    validate_gated_call(call, ssm, impl)
    return GATED_DECODE_TABLE.choose(impl, (call, ssm), {})[1](call, ssm)


# ---------------------------------------------------------------------------------------------- backend tables
def _example(num_tokens: int, rows: int, heads: int, *, ragged: bool, layer_traced: bool = False):
    """A representative call ``((call, ssm), {})``: bf16 q/k/v/beta, K = V = 128, a pool of ``rows + 9`` slots."""
    sds = jax.ShapeDtypeStruct
    (call, _), _ = gdn.example_call(num_tokens, rows, heads)
    call = dataclasses.replace(call, cu_seqlens=call.cu_seqlens if ragged else None,
                               slot_ids=sds((rows,), jnp.int32), has_initial_state=sds((rows,), jnp.bool_) if ragged
                               else None, layer=sds((), jnp.int32) if layer_traced else 0)
    return (call, sds((1, rows + 9, heads, 128, 128), jnp.float32)), {}


def _gated_example(rows: int, hk: int, hv: int, hidden: int = 1024):
    """A representative gated decode call: bf16 packed conv output, hidden state and weights, K = V = 128."""
    sds, bf16 = jax.ShapeDtypeStruct, jnp.bfloat16
    call = GatedDecodeCall(sds((rows, (2 * hk + hv) * 128), bf16), sds((rows, hidden), bf16),
                           sds((hv, hidden), bf16), sds((hv, hidden), bf16), sds((hv,), bf16), sds((hv,), bf16),
                           sds((rows,), jnp.int32), layer=0, scale=128 ** -0.5)
    return (call, sds((1, rows + 9, hv, 128, 128), jnp.float32)), {}


_PALLAS_NOTE = "rows/flags kernel on the flattened [L * (S+1)] slots: takes every call"

PREFILL_TABLE = BackendTable(
    PREFILL_OP,
    gdn_prefill_pool_reference,
    (
        Backend("mosaic", chunk_kernels.gdn_prefill_pool_mosaic_prep, priority=20, device=on_hopper,
                unsupported=chunk_kernels.mosaic_prep_unsupported,
                note=gdn.MOSAIC_NOTE),
        Backend("mosaic-fused", chunk_kernels.gdn_prefill_pool_mosaic_fused, priority=30, device=on_hopper,
                unsupported=chunk_kernels.mosaic_prep_unsupported, prefer=chunk_kernels.mosaic_fused_preferred,
                note=gdn.MOSAIC_FUSED_NOTE),
        Backend("pallas", chunk_kernels.gdn_prefill_pool_pallas, priority=10,
                note=_PALLAS_NOTE),
    ),
    examples={
        "prefill N=4 T=16384 H=32": lambda: _example(16384, 4, 32, ragged=True),
        "prefill N=16 T=8192 H=16": lambda: _example(8192, 16, 16, ragged=True),
        "prefill N=1 T=8192 H=32": lambda: _example(8192, 1, 32, ragged=True),
        "prefill N=1 T=8192 H=16, traced layer": lambda: _example(8192, 1, 16, ragged=True, layer_traced=True),
        "prefill N=1 T=32768 H=16": lambda: _example(32768, 1, 16, ragged=True),
        "prefill N=1 T=8192 H=8": lambda: _example(8192, 1, 8, ragged=True),
        "prefill N=64 T=2048 H=32 (an engine step's bucket)": lambda: _example(2048, 64, 32, ragged=True),
    },
)

DECODE_TABLE = BackendTable(
    DECODE_OP,
    gdn_decode_pool_reference,
    (
        Backend("slots", recurrent_kernels.gdn_decode_slots_pallas, priority=20,
                unsupported=recurrent_kernels.decode_slots_unsupported,
                note="indexes the pool by slot id in the kernel (RESULTS.md, GDN decode)"),
        Backend("pallas", recurrent_kernels.gdn_decode_pool_pallas, priority=10,
                note=_PALLAS_NOTE),
    ),
    examples={
        "decode B=128 H=32, int layer": lambda: _example(128, 128, 32, ragged=False),
        "decode B=128 H=32, traced layer": lambda: _example(128, 128, 32, ragged=False, layer_traced=True),
        "verify B=32 x 4 tokens H=32": lambda: _example(128, 32, 32, ragged=True),
    },
)

GATED_DECODE_TABLE = BackendTable(
    GATED_DECODE_OP,
    gated_delta_decode_pool_reference,
    (
        Backend("slots", recurrent_kernels.gated_delta_decode_slots, priority=20,
                note="the slot decode kernel reading q/k/v by column and projecting the gates: no XLA op "
                     "between the conv and it"),
    ),
    examples={
        "decode B=64 Hk=4 Hv=8 K=V=128, int layer": lambda: _gated_example(64, 4, 8),
        "decode B=256 Hk=16 Hv=32 K=V=128, int layer": lambda: _gated_example(256, 16, 32),
    },
)
