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
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.engine import sampling
from kvjax.engine.drafting import Drafting, StepTokens, draft
from kvjax.engine.inputs import PackLayout
from kvjax.models.interface import ModelCaches
from kvjax.sched.plan import StepPlan
from kvjax.state import gdn_checkpoints, gdn_spec


def verify_step(model_step: Callable, params, caches: ModelCaches, unpacked: tuple, prev_tokens: jax.Array,
                layout: PackLayout, greedy_only: bool, drafting: Drafting | None = None
                ) -> tuple[jax.Array | StepTokens, ModelCaches]:
    """One verification step (traceable; see the module docstring). ``model_step(params, caches, inputs) ->
    (logits, caches)``; ``unpacked``: ``(StepInputs, SampleInputs with draft_len, CheckpointCopies | None)``;
    ``prev_tokens``: i32[R], the previous step's sampled tokens (fed where ``prev_index >= 0``); ``layout.spec``:
    K (static); ``drafting``: step 5. Returns ``(i32[B * (K + 2)], caches)``."""
    inputs, rows, copies = unpacked
    K = layout.spec
    J = K + 1
    T = inputs.token_ids.shape[0]
    fed = prev_tokens[jnp.clip(rows.prev_index, 0, prev_tokens.shape[0] - 1)]
    inputs = dataclasses.replace(inputs, token_ids=jnp.where(rows.prev_index >= 0, fed, inputs.token_ids))
    draft_len = rows.draft_len  # i32[B]
    last = inputs.logits_indices  # i32[B]: each row's last token
    first = last - draft_len  # i32[B]: its first verification position
    j = jnp.arange(J, dtype=jnp.int32)
    grid = jnp.minimum(first[:, None] + j, last[:, None])  # i32[B, J]
    count = jnp.where(draft_len > 0, draft_len + 1, 0)  # i32[B]: verification positions
    gdn = caches.gdn is not None
    if copies is not None and gdn:
        caches = _copy(caches, copies.restore, gdn_checkpoints.restore, copies.restore, inputs.gdn_slots)
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
        caches = dataclasses.replace(caches, gdn=gdn_spec.commit(caches.gdn, inputs.gdn_slots, accepted))
    if copies is not None and gdn:
        caches = _copy(caches, copies.save, gdn_checkpoints.save, inputs.gdn_slots, copies.save)
    out = jnp.concatenate([tokens, accepted[:, None]], axis=1).reshape(-1)
    if drafting is None:
        return out, caches
    bonus = jnp.take_along_axis(tokens, accepted[:, None], axis=1)[:, 0]  # i32[B]: the token after the accepted
    drafts, caches = draft(drafting, params, caches, hidden, inputs, first + accepted, bonus, rows.next_ids)
    return StepTokens(out, drafts), caches


def _copy(caches: ModelCaches, which: jax.Array, fn: Callable, *args: jax.Array) -> ModelCaches:
    """``caches`` with ``fn(caches.gdn, *args)`` applied where ``which`` (i32[B]) names any checkpoint (the pool
    carries no verification states then: restores run before :func:`~kvjax.state.gdn_spec.attach`, saves after
    :func:`~kvjax.state.gdn_spec.commit`)."""
    gdn = jax.lax.cond((which >= 0).any(), lambda g: fn(g, *args), lambda g: g, caches.gdn)
    return dataclasses.replace(caches, gdn=gdn)


def verify_stats(plan: StepPlan, result: np.ndarray) -> dict[str, int | tuple[int, ...]]:
    """The metrics of a resolved verification step (``result``: its ``i32[B * (K + 2)]``; see the module
    docstring): ``verify_rows``, ``drafts_proposed``, ``drafts_accepted`` and, per draft position ``j < K``,
    ``drafts_proposed_at`` / ``drafts_accepted_at``."""
    B, n = plan.seq_lens.shape[0], plan.num_seqs
    grid = np.asarray(result).reshape(B, -1)
    K = grid.shape[1] - 2
    k = plan.draft_len[:n].astype(np.int64)
    a = np.clip(grid[:n, -1], 0, k)
    j = np.arange(K)
    return dict(verify_rows=int((k > 0).sum()), drafts_proposed=int(k.sum()), drafts_accepted=int(a.sum()),
                drafts_proposed_at=tuple((j[None, :] < k[:, None]).sum(0).tolist()),
                drafts_accepted_at=tuple((j[None, :] < a[:, None]).sum(0).tolist()))
