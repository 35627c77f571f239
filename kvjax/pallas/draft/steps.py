"""A small draft layer's chained one-token steps, one Triton-lowered program per row (Pallas).

The op (:mod:`kvjax.ops.draft`, ``DraftStepsCall``) runs ``S`` steps of a Qwen3.5 MTP layer, each a dozen small
products, norms, a rotary embedding, one paged attention and an argmax over the vocabulary: through XLA ~23 kernels
a step at this size, each 1-4 us however small (RESULTS.md, "What an MTP propose costs"). Here one program per row
runs all ``S`` steps: every matrix product is a broadcast multiply and a reduction over a weight tile loaded whole
from global memory (L2 after the first row), so a matrix must fit a program's registers (:func:`unsupported`).

Per step ``k`` at position ``pos = p + k``: the combine, norms and projections in float32; rotary as ``x cos +
x[perm] sin`` where ``x[perm]`` (the rotate-half partner of each dim) comes from the same projection with its
weight columns and norm weights loaded in the permuted order, so no register shuffles are needed; K and V are
computed per *query* head (each head's KV head's weights), written to the row's page at ``pos`` from the first query
head of each group (one store per KV head; masked where the table has a hole or the position is past it), and also
kept in registers: the attention walks the pages only up to ``p`` (keys the catch-up wrote) and adds the row's own
positions ``p + 1 .. pos`` from registers, so the program never reads what it wrote. The page walk is an online
softmax over blocks of ``block_k`` keys with the causal / window / sink masks and ``-1`` holes never read (as
``kvjax.ops.paged_attention``). The argmax takes the first maximum (as ``jnp.argmax``).

Measured (RESULTS.md, "Speculative decoding"; H200, the spec toy's layer at 16 rows): three steps in 53 us against
~130 us and ~70 kernels through XLA; each step is a chain of a dozen dependent reductions in one program
(latency-bound, ~18 us).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kvjax.base.device import is_pow2, next_pow2
from kvjax.base.rotary import rope_cos_sin

_NEG_INF = float("-inf")
MAX_TILE = 16384  # the most values of one weight tile (or K / V block) a program holds: 128 f32 registers a thread
MAX_STEPS = 8


def unsupported(call) -> str | None:  # kvjax.ops.draft.DraftStepsCall
    """Why :func:`draft_steps_pallas` cannot take this call (shapes and dtypes only), or None: float32 weights,
    pages and hidden states; every width (hidden, intermediate, vocabulary, heads, head size, page size) a power of
    two; each weight tile of a step (``H x H`` of ``fc``, ``H x Hq x D`` of the projections, ``H x I``, ``H x V``) and
    each K / V block at most :data:`MAX_TILE` values; at most :data:`MAX_STEPS` steps."""
    lay, sh = call.layer, call.shape
    arrays = dict(lay._asdict(), k_pages=call.k_pages, hidden=call.hidden)
    not_f32 = sorted(n for n, a in arrays.items() if jnp.dtype(a.dtype) != jnp.float32)
    if not_f32:
        return f"needs float32 weights, pages and hidden states; {', '.join(not_f32)} are not"
    v, h = lay.embed.shape
    inter = lay.gate_proj.shape[1]
    widths = dict(hidden=h, intermediate=inter, vocab=v, q_heads=sh.num_q_heads, kv_heads=sh.num_kv_heads,
                  head_dim=sh.head_dim, page_size=call.page_size)
    odd = [f"{n}={w}" for n, w in widths.items() if not is_pow2(w)]
    if odd:
        return f"needs power-of-two widths, got {', '.join(odd)}"
    tiles = dict(fc=h * h, projection=h * sh.num_q_heads * sh.head_dim, mlp=h * inter, lm_head=h * v,
                 kv_block=sh.num_q_heads * block_keys(call.page_size) * sh.head_dim)
    big = [f"{n} {t}" for n, t in tiles.items() if t > MAX_TILE]
    if big:
        return f"a program holds tiles of at most {MAX_TILE} values, this layer's are larger: {', '.join(big)}"
    if call.steps > MAX_STEPS:
        return f"runs at most {MAX_STEPS} steps, got {call.steps}"
    return None


def block_keys(page_size: int) -> int:
    """Keys of one step of the page walk: 64, or a page where pages are larger."""
    return max(64, page_size)


def _rms(x, w, eps):  # x [..., N], w [N] (1 + weight): zero-centred RMSNorm along the last axis
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _kernel(
    embed_ref,  # f32[V*H]
    lm_ref,  # f32[H, V]
    fc_ref,  # f32[2H*H]
    ne_ref, nh_ref, nin_ref,  # f32[H] each: the embedding, hidden and input norms' weights
    wq_ref,  # f32[H*Hq*2D]: each head's query then its gate
    wk_ref, wv_ref,  # f32[H*Hkv*D] each
    qn_ref, kn_ref,  # f32[D] each
    wo_ref,  # f32[Hq*D*H]
    npost_ref,  # f32[H]
    gate_ref, up_ref,  # f32[H, I] each
    down_ref,  # f32[I, H]
    nfin_ref,  # f32[H]
    kp_ref, vp_ref,  # f32[P*page_size, D]: the pages as read (aliased to kout_ref / vout_ref)
    hid_ref,  # f32[B*H]: each row's draft hidden state
    tok_ref, pos_ref, live_ref,  # i32[B] each: first draft, last accepted position, live (0 / 1)
    bt_ref,  # i32[B*Hkv*max_blocks]
    win_ref, sink_ref,  # i32[Hkv] each
    cos_ref, sin_ref,  # f32[B*S*D] each: x cos + x[perm] sin per step (sin signed; 1 / 0 past the rotary dims)
    drafts_ref,  # out i32[B*S]
    kout_ref, vout_ref,  # out f32[P*page_size, D]: the pages as written
    *, steps, hq, hkv, d, rot, page_size, max_blocks, block_k, eps, scale,
):
    b = pl.program_id(0)
    v, h = lm_ref.shape[1], lm_ref.shape[0]
    group = hq // hkv
    s_pad = next_pow2(steps)
    i_h, i_d, i_q = jnp.arange(h), jnp.arange(d), jnp.arange(hq)
    i_s, i_k, i_v = jnp.arange(s_pad), jnp.arange(block_k), jnp.arange(v)
    kvh = i_q // group  # i32[Hq]: each query head's KV head
    half = rot // 2
    perm = jnp.where(i_d < half, i_d + half, jnp.where(i_d < rot, i_d - half, i_d))  # rotate-half partner
    w_q = plgpu.load(win_ref.at[kvh])  # i32[Hq]
    sk_q = plgpu.load(sink_ref.at[kvh])
    p0, tok = pos_ref[b], tok_ref[b]
    live = live_ref[b] != 0
    g = plgpu.load(hid_ref.at[b * h + i_h])  # f32[H]
    tbase = (b * hkv + kvh) * max_blocks  # i32[Hq]
    col_q = i_q[:, None] * (2 * d)  # i32[Hq, 1]
    col_k = kvh[:, None] * d
    rows_h = i_h[:, None, None]

    def proj(ref, width, cols):  # x @ W per query head: W flat [H * width], cols i32[Hq, D] -> f32[H, Hq, D] tile
        return plgpu.load(ref.at[rows_h * width + cols[None]])

    own_k = jnp.zeros((hq, s_pad, d), jnp.float32)
    own_v = jnp.zeros((hq, s_pad, d), jnp.float32)
    own_ok = jnp.zeros((hq, s_pad), jnp.int32)
    drafts = jnp.zeros((s_pad,), jnp.int32)
    for k in range(1, steps + 1):
        pos = p0 + k
        ok = live & (pos >= 0) & (pos < max_blocks * page_size)
        e = plgpu.load(embed_ref.at[tok * h + i_h])
        a = _rms(e, 1.0 + ne_ref[...], eps)
        c = _rms(g, 1.0 + nh_ref[...], eps)
        u = (jnp.sum(a[:, None] * plgpu.load(fc_ref.at[i_h[:, None] * h + i_h[None, :]]), axis=0)
             + jnp.sum(c[:, None] * plgpu.load(fc_ref.at[(i_h[:, None] + h) * h + i_h[None, :]]), axis=0))
        x = _rms(u, 1.0 + nin_ref[...], eps)[:, None, None]  # [H, 1, 1]
        q = jnp.sum(x * proj(wq_ref, hq * 2 * d, col_q + i_d[None, :]), axis=0)  # f32[Hq, D]
        q_p = jnp.sum(x * proj(wq_ref, hq * 2 * d, col_q + perm[None, :]), axis=0)
        gate = jnp.sum(x * proj(wq_ref, hq * 2 * d, col_q + d + i_d[None, :]), axis=0)
        kk = jnp.sum(x * proj(wk_ref, hkv * d, col_k + i_d[None, :]), axis=0)
        kk_p = jnp.sum(x * proj(wk_ref, hkv * d, col_k + perm[None, :]), axis=0)
        vv = jnp.sum(x * proj(wv_ref, hkv * d, col_k + i_d[None, :]), axis=0)
        cs = plgpu.load(cos_ref.at[(b * steps + k - 1) * d + i_d])[None, :]  # f32[1, D]
        sn = plgpu.load(sin_ref.at[(b * steps + k - 1) * d + i_d])[None, :]
        rq = jax.lax.rsqrt(jnp.mean(q * q, axis=1) + eps)[:, None]
        q = ((q * rq * (1.0 + qn_ref[...])[None, :]) * cs
             + (q_p * rq * (1.0 + plgpu.load(qn_ref.at[perm]))[None, :]) * sn)
        rk = jax.lax.rsqrt(jnp.mean(kk * kk, axis=1) + eps)[:, None]
        kk = ((kk * rk * (1.0 + kn_ref[...])[None, :]) * cs
              + (kk_p * rk * (1.0 + plgpu.load(kn_ref.at[perm]))[None, :]) * sn)

        blk = jnp.minimum(pos // page_size, max_blocks - 1)
        page_w = plgpu.load(bt_ref.at[tbase + blk])  # i32[Hq]
        wrote = ok & (page_w >= 0)  # bool[Hq]
        rows_w = jnp.where(wrote, page_w, 0) * page_size + pos % page_size
        for j in range(hkv):  # one store per KV head, from its group's first query head (no duplicate addresses)
            lead = (i_q == j * group)[:, None]
            row_j = jnp.sum(jnp.where(i_q == j * group, rows_w, 0))
            ok_j = jnp.sum(jnp.where(i_q == j * group, wrote.astype(jnp.int32), 0)) != 0
            plgpu.store(kout_ref.at[row_j, i_d], jnp.sum(jnp.where(lead, kk, 0.0), axis=0), mask=ok_j & (i_d >= 0))
            plgpu.store(vout_ref.at[row_j, i_d], jnp.sum(jnp.where(lead, vv, 0.0), axis=0), mask=ok_j & (i_d >= 0))
        at_k = (i_s == k - 1)
        own_k = jnp.where(at_k[None, :, None], kk[:, None, :], own_k)
        own_v = jnp.where(at_k[None, :, None], vv[:, None, :], own_v)
        own_ok = jnp.where(at_k[None, :], wrote.astype(jnp.int32)[:, None], own_ok)

        def visible(kpos):  # i32[Hq or 1, N] key positions -> bool[Hq, N]: window / sink mask of each head
            return (w_q[:, None] == 0) | (pos - kpos < w_q[:, None]) | (kpos < sk_q[:, None])

        def update(carry, sc, vis, vals):  # online softmax step: sc f32[Hq, N], vals f32[Hq, N, D]
            m, l, acc = carry
            sc = jnp.where(vis, sc, _NEG_INF)
            m_new = jnp.maximum(m, jnp.max(sc, axis=1))
            m_safe = jnp.where(m_new == _NEG_INF, 0.0, m_new)
            alpha = jnp.exp(m - m_safe)
            p = jnp.exp(sc - m_safe[:, None])
            return m_new, l * alpha + jnp.sum(p, axis=1), acc * alpha[:, None] + jnp.sum(p[:, :, None] * vals, axis=1)

        def walk(c, carry):  # keys c * block_k .. of the pages (positions <= p0: the catch-up's)
            kpos = c * block_k + i_k  # i32[block_k]
            bl = kpos // page_size
            in_table = (bl < max_blocks)[None, :]
            page = plgpu.load(bt_ref.at[tbase[:, None] + jnp.minimum(bl, max_blocks - 1)[None, :]], mask=in_table,
                              other=-1)  # i32[Hq, block_k]
            vis = in_table & (page >= 0) & (kpos <= p0)[None, :] & visible(kpos[None, :])
            rows = (jnp.where(vis, page, 0) * page_size + (kpos % page_size)[None, :])[:, :, None]
            keys = plgpu.load(kp_ref.at[rows, i_d[None, None, :]], mask=vis[:, :, None], other=0.0)
            vals = plgpu.load(vp_ref.at[rows, i_d[None, None, :]], mask=vis[:, :, None], other=0.0)
            return update(carry, jnp.sum(q[:, None, :] * keys, axis=2) * scale, vis, vals)

        carry = (jnp.full((hq,), _NEG_INF, jnp.float32), jnp.zeros((hq,), jnp.float32), jnp.zeros((hq, d), jnp.float32))
        carry = jax.lax.fori_loop(0, jnp.where(ok, (p0 + block_k) // block_k, 0), walk, carry)
        opos = p0 + 1 + i_s  # i32[S_pad]: the row's own positions
        vis_o = ok & (own_ok != 0) & (i_s <= k - 1)[None, :] & visible(opos[None, :])
        m, l, acc = update(carry, jnp.sum(q[:, None, :] * own_k, axis=2) * scale, vis_o, own_v)
        o = acc / jnp.where(l > 0, l, 1.0)[:, None]  # f32[Hq, D]

        og = o / (1.0 + jnp.exp(-gate))
        wo = plgpu.load(wo_ref.at[(i_q[:, None, None] * d + i_d[None, :, None]) * h + i_h[None, None, :]])
        u = u + jnp.sum(jnp.sum(og[:, :, None] * wo, axis=0), axis=0)
        y = _rms(u, 1.0 + npost_ref[...], eps)[:, None]
        gt = jnp.sum(y * gate_ref[...], axis=0)
        act = gt / (1.0 + jnp.exp(-gt)) * jnp.sum(y * up_ref[...], axis=0)
        u = u + jnp.sum(act[:, None] * down_ref[...], axis=0)
        g = _rms(u, 1.0 + nfin_ref[...], eps)
        lg = jnp.sum(g[:, None] * lm_ref[...], axis=0)  # f32[V]
        tok = jnp.min(jnp.where(lg == jnp.max(lg), i_v, v))
        drafts = jnp.where(at_k, tok, drafts)
    plgpu.store(drafts_ref.at[b * steps + i_s], drafts, mask=i_s < steps)


def draft_steps_pallas(
    call,  # kvjax.ops.draft.DraftStepsCall (checked by the op)
    *,
    num_warps: int = 4,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:  # (drafts i32[B, S], k_pages, v_pages)
    """The op's steps in one program per row (module doc). ``ValueError`` for calls :func:`unsupported` rejects."""
    reason = unsupported(call)
    if reason:
        raise ValueError(f"pallas draft_steps {reason}")
    lay, sh, steps = call.layer, call.shape, call.steps
    b = call.hidden.shape[0]
    num_pages, page_size, d = call.k_pages.shape
    rot = 2 * len(sh.inv_freq)
    pos = call.positions[:, None] + jnp.arange(1, steps + 1, dtype=jnp.int32)  # i32[B, S]
    cos, sin = rope_cos_sin(pos, jnp.asarray(sh.inv_freq, jnp.float32))  # f32[B, S, R/2]
    pad = ((0, 0), (0, 0), (0, d - rot))
    cos_f = jnp.pad(jnp.concatenate([cos, cos], axis=-1), pad, constant_values=1.0)  # f32[B, S, D]
    sin_f = jnp.pad(jnp.concatenate([-sin, sin], axis=-1), pad)
    kernel = functools.partial(
        _kernel, steps=steps, hq=sh.num_q_heads, hkv=sh.num_kv_heads, d=d, rot=rot, page_size=page_size,
        max_blocks=call.block_tables.shape[2], block_k=block_keys(page_size), eps=sh.eps, scale=sh.scale)
    operands = (lay.embed.reshape(-1), lay.lm_head, lay.fc.reshape(-1), lay.norm_embed, lay.norm_hidden,
                lay.input_norm, lay.q_proj.reshape(-1), lay.k_proj.reshape(-1), lay.v_proj.reshape(-1), lay.q_norm,
                lay.k_norm, lay.o_proj.reshape(-1), lay.post_norm, lay.gate_proj, lay.up_proj, lay.down_proj,
                lay.final_norm, call.k_pages.reshape(num_pages * page_size, d),
                call.v_pages.reshape(num_pages * page_size, d), call.hidden.reshape(-1), call.tokens, call.positions,
                call.live.astype(jnp.int32), call.block_tables.reshape(-1), call.window, call.sinks,
                cos_f.reshape(-1), sin_f.reshape(-1))
    drafts, k_out, v_out = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((b * steps,), jnp.int32),
                   jax.ShapeDtypeStruct(operands[17].shape, jnp.float32),
                   jax.ShapeDtypeStruct(operands[18].shape, jnp.float32)),
        grid=(b,),
        input_output_aliases={17: 1, 18: 2},
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name=f"kvjax_draft_steps_s{steps}",
    )(*operands)
    return drafts.reshape(b, steps), k_out.reshape(call.k_pages.shape), v_out.reshape(call.v_pages.shape)
