"""Speculative decoding on the device: one verification step, the drafts of every row checked in one model pass.

A verification plan (:mod:`kvjax.sched.spec`) is an ordinary ragged plan whose decoding rows carry their last
token and ``k <= K`` draft tokens (``draft_len[b] = k``): paged attention treats the row as a prefill chunk, the
GDN layers run it through the chunked kernel. :func:`verify_step`, inside the jitted step:

1. takes the logits after each of a row's ``K + 1`` last positions (``logits_indices`` becomes ``i32[B, K + 1]``,
   clipped to the row's last token: an ordinary row's position 0 is its usual sampling position);
2. puts :class:`~kvjax.state.gdn_spec.VerifyStates` on the GDN pool, where each GDN layer records the state after
   every verification position;
3. accepts drafts (:func:`kvjax.engine.sampling.verify_tokens`: the longest prefix equal to the argmax for greedy
   rows, rejection sampling for sampling rows) and writes each verification row's state after its last accepted
   position into its slot (:func:`kvjax.state.gdn_spec.commit`): the state after exactly the accepted tokens;
4. returns ``i32[B * (K + 2)]``: row ``b``'s tokens ``t_0 .. t_K`` then its accepted count ``a``
   (:func:`kvjax.sched.spec.resolve` reads it). The K/V of rejected drafts stay in their pages, past the row's
   computed tokens: never attended, overwritten by later steps;
5. with the MTP drafter (``drafting``, :mod:`kvjax.engine.drafting`): the model step gives its hidden states too,
   and the MTP layer drafts the next ``K`` tokens after each row's last accepted position ``first + a`` and its
   token ``t_a``; the step returns ``StepTokens(i32[B * (K + 2)], drafts i32[B, K])``.

GDN checkpoint copies (prefix caching) run as in :func:`kvjax.engine.runner.device_step`.

Verification bursts (:func:`verify_burst`, ``layout.burst = S > 1`` with ``layout.spec = K``; the MTP drafter or
the n-gram lookup on the device, see "Verification bursts" in :mod:`kvjax.sched.spec`): ``S`` sub-steps of steps 1-3
and 5 (or the lookup over each row's history grown by its accepted tokens, :mod:`kvjax.engine.ngram`) in one
dispatch. Each
row carries its position ``p`` (its last token's), its ``K + 1`` tokens (last token, drafts) and its draft count
``k``; sub-step ``j`` packs the live rows' ``1 + k`` tokens ragged on the plan's token axis (``K + 1`` per row
within the budget; a new slot mapping from the block tables, which cover the row's ``spec_span`` positions),
verifies them, and moves the row to ``p + a + 1`` with the bonus token and the ``K`` new drafts, the next ``k``
being ``min(spec_cap, last allocated position - p)`` (trimmed to the token axis from the last row). A row past
its allocation is padding from then on (no tokens, slot 0, nothing written). Returns ``StepTokens(i32[S * B * (K +
2)], drafts i32[B, K])``: per sub-step and row ``t_0 .. t_k``, ``-1`` past them, then ``a`` (``-1``: the row did not
run), and the drafts of each row's last sub-step (with the n-gram lookup the tokens alone). Sampling keys are those
of single verification steps (each position's token count).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.base.ragged import token_rows
from kvjax.engine import ngram as ngram_lib
from kvjax.engine import sampling
from kvjax.engine.burst import slot_mapping
from kvjax.engine.drafting import Drafting, StepTokens, draft
from kvjax.engine.inputs import PackLayout
from kvjax.inputs import StepInputs
from kvjax.models.interface import ModelCaches
from kvjax.sched import spec
from kvjax.sched.plan import StepPlan
from kvjax.state import gdn_checkpoints, gdn_spec


def verify_step(model_step: Callable, params, caches: ModelCaches, unpacked: tuple, prev_tokens: jax.Array,
                layout: PackLayout, greedy_only: bool, drafting: Drafting | None = None,
                localize: Callable[[StepInputs], StepInputs] | None = None
                ) -> tuple[jax.Array | StepTokens, ModelCaches]:
    """One verification step (traceable; see the module docstring). ``model_step(params, caches, inputs) ->
    (logits, caches)``; ``unpacked``: ``(StepInputs, SampleInputs with draft_len, CheckpointCopies | None)``;
    ``prev_tokens``: i32[R], the previous step's sampled tokens (fed where ``prev_index >= 0``); ``layout.spec``:
    K (static); ``drafting``: step 5; ``localize``: this device's view of the inputs on a mesh (as
    :func:`kvjax.engine.runner.device_step`'s). Returns ``(i32[B * (K + 2)], caches)``."""
    inputs, rows, copies = unpacked
    if localize is not None:
        inputs = localize(inputs)
    fed = prev_tokens[jnp.clip(rows.prev_index, 0, prev_tokens.shape[0] - 1)]
    inputs = dataclasses.replace(inputs, token_ids=jnp.where(rows.prev_index >= 0, fed, inputs.token_ids))
    gdn = caches.gdn is not None
    if copies is not None and gdn:
        caches = checkpoint_copy(caches, copies.restore, gdn_checkpoints.restore, copies.restore, inputs.gdn_slots)
    tokens, accepted, drafts, caches = _verify(model_step, params, caches, inputs, rows, rows.draft_len, layout.spec,
                                               greedy_only, drafting)
    if copies is not None and gdn:
        caches = checkpoint_copy(caches, copies.save, gdn_checkpoints.save, inputs.gdn_slots, copies.save)
    out = jnp.concatenate([tokens, accepted[:, None]], axis=1).reshape(-1)
    return (out, caches) if drafting is None else (StepTokens(out, drafts), caches)


def _verify(model_step: Callable, params, caches: ModelCaches, inputs: StepInputs, rows, draft_len: jax.Array,
            K: int, greedy_only: bool, drafting: Drafting | None, keep: bool = False
            ) -> tuple[jax.Array, jax.Array, jax.Array | None, ModelCaches]:
    """Steps 1-3 and 5 of the module docstring on fed ``inputs`` whose rows end with ``draft_len`` (i32[B]) drafts:
    ``(tokens i32[B, K + 1], accepted i32[B], drafts i32[B, K] or None without drafting, caches)``. ``keep``
    (static): the GDN pool keeps its per-position state buffers for the next sub-step (a burst's)."""
    J = K + 1
    T = inputs.token_ids.shape[0]
    last = inputs.logits_indices  # i32[B]: each row's last token
    first = last - draft_len  # i32[B]: its first verification position
    j = jnp.arange(J, dtype=jnp.int32)
    grid = jnp.minimum(first[:, None] + j, last[:, None])  # i32[B, J]
    count = jnp.where(draft_len > 0, draft_len + 1, 0)  # i32[B]: verification positions
    gdn = caches.gdn is not None
    if gdn:
        caches = dataclasses.replace(caches, gdn=gdn_spec.attach(caches.gdn, first, count, J))
    at_grid = dataclasses.replace(inputs, logits_indices=grid)
    if drafting is None:
        logits, caches = model_step(params, caches, at_grid)  # f32[B, J, V]
    else:
        logits, hidden, caches = drafting.hidden_step(params, caches, at_grid)
    drafts = inputs.token_ids[jnp.clip(first[:, None] + 1 + j[:K], 0, T - 1)]  # i32[B, K]
    counters = inputs.positions[grid] + 1  # i32[B, J]: each position's token count (an ordinary step's counter)
    B = draft_len.shape[0]
    keys = sampling.row_keys(jnp.repeat(rows.seeds, J), jnp.repeat(rows.streams, J), counters.reshape(-1))
    tokens, accepted = sampling.verify_tokens(logits, drafts, draft_len, keys.reshape(B, J), rows.temperature,
                                              rows.top_k, rows.top_p, greedy_only)
    if gdn:
        caches = dataclasses.replace(caches, gdn=gdn_spec.commit(caches.gdn, inputs.gdn_slots, accepted, keep=keep))
    if drafting is None:
        return tokens, accepted, None, caches
    bonus = jnp.take_along_axis(tokens, accepted[:, None], axis=1)[:, 0]  # i32[B]: the token after the accepted
    drafts, caches = draft(drafting, params, caches, hidden, inputs, first + accepted, bonus, rows.next_ids)
    return tokens, accepted, drafts, caches


def verify_burst(model_step: Callable, params, caches: ModelCaches, unpacked: tuple, layout: PackLayout,
                 greedy_only: bool, drafting: Drafting | None,
                 localize: Callable[[StepInputs], StepInputs] | None = None, ngram: tuple[int, int] | None = None
                 ) -> tuple[StepTokens | jax.Array, ModelCaches]:
    """A verification burst (traceable; see "Verification bursts" in the module docstring): ``layout.burst``
    sub-steps of :func:`_verify`, each row's drafts of sub-step ``j > 0`` the ones made after sub-step ``j - 1``: by
    the MTP drafter (``drafting``), or, with ``ngram = (max_ngram, min_ngram)`` and no ``drafting``, by the n-gram
    lookup (:func:`kvjax.engine.ngram.lookup`) over each row's history (``rows.history`` / ``history_len``: its
    known tokens at sub-step 0, carried through the loop, each sub-step's accepted drafts and bonus token appended),
    a sub-step's ``k`` capped at the drafts found. ``unpacked``: the plan of sub-step 0 (every row its last token
    and ``draft_len`` drafts, the token axis ``T`` holding ``K + 1`` tokens per row within the budget) with
    ``spec_span`` and ``spec_cap``.
    The sub-steps run as a ``lax.while_loop`` (one sub-step compiled once, on every platform: straight-line
    sub-steps were slower on a GPU and compiled 3x longer; benchmarks/RESULTS.md "Speculative decoding") that ends
    when no row is live: a sub-step in which no row would run is not run (its result ``-1`` throughout, as a padded
    sub-step's). Returns
    ``(StepTokens(i32[S * B * (K + 2)], drafts i32[B, K] made by each row's last sub-step), caches)`` (with the
    n-gram lookup the ``i32[S * B * (K + 2)]`` alone: the host drafts the next plan). ``localize``:
    this device's view of the inputs on a mesh (:func:`verify_step`'s); a data shard with nothing to run in another
    shard's burst (an empty plan: no live row) runs no sub-step, its result ``-1`` throughout."""
    inputs, rows, _ = unpacked  # a burst plan is all decodes: no checkpoint copy
    if localize is not None:
        inputs = localize(inputs)
    K, S = layout.spec, layout.burst
    J = K + 1
    T = inputs.token_ids.shape[0]
    cu = inputs.cu_seqlens
    live = cu[1:] > cu[:-1]  # bool[B]
    p = inputs.positions[jnp.clip(cu[:-1], 0, T - 1)]  # i32[B]: each row's last token's position
    limit = p + rows.spec_span - 1  # i32[B]: the last position its pages cover and it may compute
    j = jnp.arange(J, dtype=jnp.int32)
    toks = jnp.where(j < 1 + rows.draft_len[:, None], inputs.token_ids[jnp.clip(cu[:-1, None] + j, 0, T - 1)], 0)
    gdn = caches.gdn is not None
    if gdn:  # the per-position state buffers, allocated once and carried through the sub-steps
        none = jnp.zeros_like(p)
        caches = dataclasses.replace(caches, gdn=gdn_spec.attach(caches.gdn, none, none, J))
    lookup = drafting is None
    hist = (rows.history, rows.history_len) if lookup else ()  # (i32[B, L], i32[B]): carried, grown per sub-step
    carry0 = (caches, p, toks, rows.draft_len, live, hist)

    def sub_step(carry):
        caches, p, toks, k, live, hist = carry
        sub = _layout(inputs, p, toks, k, live, layout.page_size)
        tokens, accepted, drafts, caches = _verify(model_step, params, caches, sub, rows, jnp.where(live, k, 0), K,
                                                   greedy_only, drafting, keep=True)
        ran = live[:, None]
        out = jnp.concatenate([jnp.where(ran & (j <= k[:, None]), tokens, -1),
                               jnp.where(ran, accepted[:, None], -1)], axis=1)  # i32[B, J + 1]
        bonus = jnp.take_along_axis(tokens, accepted[:, None], axis=1)  # i32[B, 1]
        if lookup:  # the accepted drafts and the bonus token join the history; the drafts continue it
            hist = ngram_lib.append(*hist, tokens, jnp.where(live, accepted + 1, 0))
            drafts = ngram_lib.lookup(*hist, K, *ngram)
        toks = jnp.where(ran, jnp.concatenate([bonus, drafts], axis=1), toks)  # a row's drafts: from its last run
        p = jnp.where(live, p + accepted + 1, p)
        live = live & (p <= limit)
        k = jnp.clip(jnp.minimum(rows.spec_cap, limit - p), 0, K)
        if lookup:  # a lookup may find fewer than K drafts (-1 after them)
            k = jnp.minimum(k, ngram_lib.leading(toks[:, 1:]))
        k = _trim(k, live, T)
        return (caches, p, toks, k, live, hist), out

    def body(state):
        j, carry, outs = state
        carry, out = sub_step(carry)
        return j + 1, carry, jax.lax.dynamic_update_index_in_dim(outs, out, j, 0)

    outs0 = jnp.full((S, *toks.shape[:1], J + 1), -1, jnp.int32)  # i32[S, B, J + 1]: a sub-step not run: -1
    _, carry, outs = jax.lax.while_loop(lambda s: (s[0] < S) & s[1][4].any(), body, (jnp.int32(0), carry0, outs0))
    drafts = jnp.where(carry0[4][:, None], carry[2][:, 1:], -1)  # i32[B, K]
    caches = carry[0]
    if gdn:
        caches = dataclasses.replace(caches, gdn=gdn_spec.detach(caches.gdn))
    return (outs.reshape(-1) if lookup else StepTokens(outs.reshape(-1), drafts)), caches


def _trim(k: jax.Array, live: jax.Array, T: int) -> jax.Array:
    """``k`` (i32[B] drafts of the live rows) trimmed from the last row so that every live row's ``1 + k`` tokens
    fit ``T`` (as :func:`kvjax.sched.spec.fit_drafts` trims to the budget)."""
    k = jnp.where(live, k, 0)
    left = T - live.sum()
    return jnp.minimum(k, jnp.maximum(left - (jnp.cumsum(k) - k), 0)).astype(jnp.int32)


def _layout(inputs: StepInputs, p: jax.Array, toks: jax.Array, k: jax.Array, live: jax.Array,
            page_size: int) -> StepInputs:
    """A verification sub-step's inputs: each ``live`` row (bool[B]) its ``1 + k`` tokens ``toks[b, :1 + k]``
    (i32[B, K + 1]) at positions ``p[b]..`` (i32[B]), packed ragged on ``inputs``' token axis (its block tables and
    GDN slots; ``inputs``: sub-step 0's); other rows are padding (no tokens, GDN slot 0, no pages written). Every
    live row continues its state with at most ``K + 1`` tokens: ``max_query_len`` says so (the models' few-token
    paths)."""
    T = inputs.token_ids.shape[0]
    n = jnp.where(live, 1 + k, 0)  # i32[B]
    cu = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(n).astype(jnp.int32)])  # i32[B + 1]
    t = jnp.arange(T, dtype=jnp.int32)
    row = token_rows(cu, T)  # i32[T]
    off = jnp.clip(t - cu[row], 0, toks.shape[1] - 1)
    valid = t < cu[-1]  # bool[T]
    pos = jnp.where(valid, p[row] + off, 0)  # i32[T]
    return dataclasses.replace(
        inputs, token_ids=jnp.where(valid, toks[row, off], 0), positions=pos, cu_seqlens=cu,
        seq_lens=jnp.where(live, p + n, 0), gdn_slots=jnp.where(live, inputs.gdn_slots, 0), has_initial_state=live,
        slot_mapping=slot_mapping(inputs.block_tables, row, pos, valid, page_size),
        logits_indices=jnp.where(live, cu[1:] - 1, 0), max_query_len=toks.shape[1])


def checkpoint_copy(caches: ModelCaches, which: jax.Array, fn: Callable, *args: jax.Array) -> ModelCaches:
    """``caches`` with ``fn(caches.gdn, *args)`` applied where ``which`` (i32[B]) names any checkpoint, skipped
    under ``lax.cond`` otherwise: a step's GDN checkpoint restores and saves (:mod:`kvjax.state.gdn_checkpoints`;
    in a verification step the pool carries no verification states then: restores run before
    :func:`~kvjax.state.gdn_spec.attach`, saves after :func:`~kvjax.state.gdn_spec.commit`)."""
    gdn = jax.lax.cond((which >= 0).any(), lambda g: fn(g, *args), lambda g: g, caches.gdn)
    return dataclasses.replace(caches, gdn=gdn)


def verify_stats(plan: StepPlan, result: np.ndarray) -> dict[str, int | tuple[int, ...]]:
    """The metrics of a resolved verification step or burst (``result``: its ``i32[B * (K + 2)]``, a burst's
    ``i32[S * B * (K + 2)]``; see the module docstring), summed over a burst's sub-steps: ``verify_rows`` (rows
    with drafts), ``drafts_proposed``, ``drafts_accepted`` and, per draft position ``j < K``,
    ``drafts_proposed_at`` / ``drafts_accepted_at``."""
    toks, k, a, _ = spec.verified(plan, result)
    k = np.maximum(k, 0).reshape(-1)  # i64[S * n]
    a = np.clip(a.reshape(-1), 0, k)
    j = np.arange(toks.shape[2] - 1)
    return dict(verify_rows=int((k > 0).sum()), drafts_proposed=int(k.sum()), drafts_accepted=int(a.sum()),
                drafts_proposed_at=tuple((j[None, :] < k[:, None]).sum(0).tolist()),
                drafts_accepted_at=tuple((j[None, :] < a[:, None]).sum(0).tolist()))


def verification_plans(plans: Sequence[StepPlan]) -> list[StepPlan]:
    """The data shards' shaped plans of one step (what is packed), where one verifies: every plan verifies (a plan
    without drafts gets ``draft_len`` zeros: its rows are ordinary rows of the verification step, its result in the
    verification layout; :func:`spec_rows` reads it back), since a mesh step has one layout for every shard. The
    schedulers keep their own plans."""
    if all(p.draft_len is None for p in plans) or all(p.draft_len is not None for p in plans):
        return list(plans)
    return [p if p.draft_len is not None else dataclasses.replace(p, draft_len=np.zeros(p.seq_lens.shape[0], np.int32))
            for p in plans]


def spec_rows(result: np.ndarray, plan: StepPlan, bucket_rows: int) -> np.ndarray:
    """A data shard's verification result (``i32[S * R * (K + 2)]`` for the step's ``bucket_rows`` = ``R`` rows,
    every shard's plan padded to them) cut to ``plan``'s own ``B`` rows: ``i32[S * B * (K + 2)]``; for a plan that
    verifies nothing (``draft_len`` None: another shard's drafts made the step a verification) each row's token after
    its last position, ``i32[B]``, as an ordinary step returns it."""
    B = plan.seq_lens.shape[0]
    grid = np.asarray(result).reshape(max(plan.spec_steps, 1), bucket_rows, -1)[:, :B]
    return grid.reshape(-1) if plan.draft_len is not None else grid[0, :, 0]


def sum_stats(stats: Sequence[dict]) -> dict[str, int | tuple[int, ...]]:
    """:func:`verify_stats` of the data shards' plans of one step, summed (per draft position for the tuples)."""
    out = dict(stats[0])
    for s in stats[1:]:
        for key, value in s.items():
            out[key] = tuple(int(a + b) for a, b in zip(out[key], value)) if isinstance(value, tuple) else out[key] + value
    return out
