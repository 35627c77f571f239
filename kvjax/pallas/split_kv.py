"""Split-KV decoding, written once for every split-KV kernel: split choice, head padding, the host wrapper
around a stage-1 kernel, and stage 2 (the f32 log-sum-exp merge).

Stage 1 (a kernel) cuts each row's key walk into splits and writes, per split, an f32 partial output normalised
over that split and its natural-log log-sum-exp (``-inf`` for a split that saw no key). Stage 2 weighs the parts
by ``exp(lse_s - lse)``: an empty split weighs 0, and a row where every split is empty gets 0, never NaN. With
one split, stage 1 writes the final output directly (in the dtype it is given) and stage 2 is skipped.

:func:`split_kv_inputs` and :func:`split_kv_output` are the host side shared by the MLA decode kernels
(``kvjax.pallas.mla``: the Triton-lowered dense / DSA-sparse kernel, the fp8 DSA kernel, the Mosaic GPU kernel)
and the jax-triton one (``kvjax.triton.mla_decode``): cast and pad the query heads of the op's call
(``kvjax.ops.mla.MLADecodeCall``) to whole head groups, choose the split factor from static shapes; the kernel
runs its stage 1; merge, drop the padded heads. :class:`Tiles`, :func:`default_tiles` and :func:`tile_reason` are
the tiles of the Triton-lowered ones.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from kvjax.base.device import is_pow2, num_sms

MAX_SPLITS = 64  # bounds the f32 split buffers
LOG2E = 1.4426950408889634  # the kernels' online softmax runs in base 2 (exp2 is one instruction)
LN2 = 0.6931471805599453  # back to the natural-log lse stage 2 expects
MASK_INIT = -1e30  # finite running-max start: a fully masked step keeps exp(...) at 0, never NaN


# the static (trace-time) arguments of the Triton-lowered split-KV MLA kernel entries besides the call's own
STATIC_ARGNAMES = ("tiles", "interpret")


def merge_splits(
    o_parts: jax.Array,  # f32[..., S, ..., R]: split outputs, split axis ``axis``
    lse_parts: jax.Array,  # f32[..., S, ...]: o_parts without its last dimension
    axis: int,
) -> jax.Array:  # f32[..., ..., R]: o_parts with the split axis summed out
    """``o = Σ_s exp(lse_s - lse) o_s / Σ_s exp(lse_s - lse)`` over the split axis ``axis`` of ``lse_parts``."""
    m = jnp.max(lse_parts, axis=axis, keepdims=True)
    w = jnp.exp(lse_parts - jnp.where(jnp.isfinite(m), m, 0.0))  # -inf -> weight 0
    den = jnp.sum(w, axis=axis)
    o = jnp.sum(w[..., None] * o_parts, axis=axis)
    return o / jnp.where(den > 0, den, 1.0)[..., None]


def choose_num_kv_splits(batch: int, head_groups: int, max_steps: int, num_sms: int, *,
                         one_cta_per_sm: bool = False) -> int:
    """Static split factor from shapes only (no host sync), at least 4 key steps per split and at most
    ``MAX_SPLITS``.

    Programs that share an SM (the Triton-lowered kernels): about one program per SM and at least two splits
    (the best measured at B=128; RESULTS.md, "MLA decode"). ``one_cta_per_sm`` (the Mosaic GPU kernel, whose
    shared memory holds one CTA per SM): as many splits as keep the CTAs within one wave, and one split once they
    fill the SMs: a second split then only adds the f32 partial outputs and their merge, and is slower.
    """
    programs = batch * head_groups
    if one_cta_per_sm:
        want = num_sms // programs
    else:
        want = max(2, math.ceil(num_sms / programs))
    return max(1, min(want, max_steps // 4, MAX_SPLITS))


@dataclasses.dataclass(frozen=True)
class Tiles:
    """Tiles of the Triton-lowered MLA decode kernels (Pallas and jax-triton), a static kernel argument; a field
    left ``None`` takes :func:`default_tiles`' value for the call's shapes."""

    block_h: int | None = None  # query heads per program
    block_n: int | None = None  # latent rows per key step (a divisor of the page size reads contiguous rows)
    num_warps: int | None = None
    num_stages: int | None = None  # software pipeline stages


def default_tiles(num_heads: int, page_size: int, sparse: bool = False, chosen: Tiles = Tiles()) -> Tiles:
    """``chosen`` with every ``None`` field set to the tile picked by measurement (RESULTS.md, "MLA decode" and
    "DSA sparse decode").

    Few heads (memory-bound): 16 heads x half a page per step, 4 warps, 3 stages. Many heads (the QK/PV
    products dominate): 64 heads x one page, 8 warps, 2 stages (3 stages exceed shared memory). DSA-sparse
    walks: 64 listed positions per step.
    """
    if num_heads <= 16:
        tiles = dict(block_h=16, block_n=32 if page_size % 32 == 0 else page_size, num_warps=4, num_stages=3)
    else:
        tiles = dict(block_h=64 if num_heads >= 64 else 32, block_n=page_size, num_warps=8, num_stages=2)
    if sparse:
        tiles["block_n"] = 64
    return Tiles(**{name: getattr(chosen, name) or value for name, value in tiles.items()})


def tile_reason(
    call,  # kvjax.ops.mla.MLADecodeCall: q_latent [B, H, R], q_rope [B, H, r]; topk_indices (sparse) or None
    latent_pages: jax.Array,  # [P, page_size, R + r]
) -> str | None:
    """Why the Triton-lowered MLA decode kernels (Pallas and jax-triton) cannot take this call with their
    :func:`default_tiles`, or ``None``: their tiles are Triton blocks, so ``R``, ``r`` and the rows of a step
    (32 or a whole page; 64 gathered rows for a sparse call) must be powers of two >= 16."""
    for what, n in (("kv_lora_rank R", call.q_latent.shape[-1]), ("rope_dim r", call.q_rope.shape[-1])):
        if n < 16 or not is_pow2(n):
            return f"needs a power-of-two {what} >= 16 (a Triton tile), got {n}"
    page_size = latent_pages.shape[1]
    block_n = default_tiles(call.q_latent.shape[1], page_size, sparse=call.topk_indices is not None).block_n
    if block_n < 16 or not is_pow2(block_n):
        return (f"needs a power-of-two page_size >= 16 when a step reads {block_n} rows of one page (a Triton "
                f"tile), got page_size {page_size}")
    return None


def pad_heads(x: jax.Array, block_h: int) -> jax.Array:
    """``[B, H, D] -> [B, Hp, D]``, ``Hp`` the next multiple of ``block_h`` (zero heads appended)."""
    pad = -x.shape[1] % block_h
    return jnp.pad(x, ((0, 0), (0, pad), (0, 0))) if pad else x


def pad_positions(positions: jax.Array, block_n: int) -> jax.Array:
    """``i32[B, K] -> i32[B, Kp]``: listed positions padded with ``-1`` (none) to whole steps of ``block_n``."""
    pad = -positions.shape[1] % block_n
    return jnp.pad(positions, ((0, 0), (0, pad)), constant_values=-1) if pad else positions


def split_kv_inputs(
    call,  # kvjax.ops.mla.MLADecodeCall: q_latent [B, H, R], q_rope [B, H, r], static num_kv_splits
    *,
    dtype,  # operand dtype of stage 1: the queries are cast to it
    block_h: int,
    max_steps: int,  # key steps of the longest possible row (the split choice's bound)
    out_dtype=None,  # what stage 1 writes with one split (default ``dtype``); f32 with several
    one_cta_per_sm: bool = False,
) -> tuple[jax.Array, jax.Array, int, object]:  # (q [B, Hp, R], q_rope [B, Hp, r], splits, stage-1 out dtype)
    """Host side of a split-KV decode before stage 1: queries cast to ``dtype`` and padded to whole groups of
    ``block_h`` heads, ``call.num_kv_splits`` (or :func:`choose_num_kv_splits`) and the dtype stage 1 writes.
    The kernel then runs its stage 1 and hands ``(o, lse)`` to :func:`split_kv_output`."""
    b = call.q_latent.shape[0]
    q, qr = pad_heads(call.q_latent.astype(dtype), block_h), pad_heads(call.q_rope.astype(dtype), block_h)
    groups = q.shape[1] // block_h
    splits = call.num_kv_splits or choose_num_kv_splits(b, groups, max_steps, num_sms(),
                                                        one_cta_per_sm=one_cta_per_sm)
    return q, qr, splits, (out_dtype or dtype) if splits == 1 else jnp.float32


def split_kv_output(
    o: jax.Array,  # [B, S, Hp, R]  stage 1's partial outputs
    lse: jax.Array,  # f32[B, S, Hp]
    call,  # kvjax.ops.mla.MLADecodeCall: q_latent [B, H, R] gives the head count and the dtype
) -> jax.Array:  # [B, H, R] in q_latent's dtype
    """Host side after stage 1: :func:`merge_splits` over the splits (skipped with one), padded heads dropped."""
    out = o[:, 0] if o.shape[1] == 1 else merge_splits(o, lse, axis=1)
    return out[:, :call.q_latent.shape[1]].astype(call.q_latent.dtype)
