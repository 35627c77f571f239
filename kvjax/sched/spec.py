"""Speculative decoding, host side: drafts into a plan, and a verification step's accepted tokens into the requests.

Verification. Before planning, every running request that decodes (prompt computed, one token to compute, none
reserved) may get up to ``K`` draft tokens from the engine's :class:`~kvjax.sched.drafter.Drafter`
(:func:`propose`), at most ``max_tokens - num_tokens - 1`` so that the accepted drafts and the token sampled after
them never pass ``max_new_tokens``. The drafts are written into the request's row of the scheduler's
:class:`~kvjax.sched.request.RowTable` *past* ``num_tokens`` (scratch space: nothing counts them, so a preemption,
an abort or a fault never sees them) and the row is planned as ``1 + k`` tokens (its last token and the drafts),
an ordinary ragged row: pages are allocated for all of them and its K/V written. :func:`fit_drafts` drops drafts
that would not fit the step's token budget or pages (speculation never preempts a request).

A verification plan (``StepPlan.draft_len``, :mod:`kvjax.sched.plan`) is applied in the ledger's two halves:
:func:`advance` counts the tokens that are certain (prompt chunks, each verification row's first token) as
computed and reserves nothing; :func:`resolve` takes the step's ``i32[B, K + 2]`` result (row ``b``: the target's
token after each of its ``1 + k`` positions, then the number ``a`` of drafts accepted), counts ``a`` more tokens
as computed, and gives the request the ``a + 1`` tokens ``t_0 .. t_a`` (the accepted drafts and the target's
token after them) through the row table's ``append`` (what its burst path ``reserve_burst`` / ``resolve_burst``
does, for tokens known at once: stop ids end the request at the first one, later tokens dropped;
``max_new_tokens`` finishes it). The rejected drafts' K/V stay in
pages past ``num_computed``: never attended (``seq_lens`` stops before them) and overwritten by the next step.
Recycling and the prefix cache see ``num_computed`` only, so they never see a rejected token.

When it pays (:func:`draft_length`, with a :class:`~kvjax.sched.drafter.PacedDrafter`, the engine's default). The
step-cost model: a step computing ``T`` tokens costs ``max(T, F)`` (``F`` = ``flat_tokens``: below it the step is
bound by reading the weights and pages, which a token more does not change; above it, by compute, per token). With
``R`` rows that decode, ``g(k) = 1 + p_0 + .. + p_{k-1}`` the expected tokens a verification row with ``k`` drafts
gains (``p_j``: the measured rate at which rows with a draft at position ``j`` accepted it and every draft before
it; 1 before any such row was measured), decoding costs ``c = min_k max(R (k + 1), F) / (R g(k))`` per token at the
best draft length (``k = 0``: plain decoding). In a step where the running rows compute ``T0`` tokens without drafts
(prompt chunks, one per decoding row), ``k`` drafts a row add ``max(T0 + R k, F) - max(T0, F)`` to its cost and gain
``R (g(k) - 1)`` tokens worth ``c`` each; each step drafts the ``k`` in ``0..K`` with the largest saving (the
longest among equals). Decoding alone (``T0 = R``) that is the ``k`` with the fewest cost units per token; beside a
prompt chunk drafts are priced against decoding's cost; once ``R >= F`` (decoding compute-bound, ``c = 1``) a draft
costs a token and saves ``p_j < 1``, so only drafts every row has accepted are kept. Decoding alone the first draft
pays while ``2 R <= (1 + p_0) F``: speculation turns off above ``R = (1 + p_0) F / 2`` rows. The model prices
tokens only; where a verification costs more than its tokens (a small model, whose verification sub-step runs several
times the kernels of a decode sub-step), ``disable_by_batch_size`` (vLLM's option) turns drafts off above a row count.

Speculation needs the accepted tokens before the next plan (its drafts continue them), so the engine applies a
verification step before planning the next (``overlap`` off). A drafter without ``bursts`` (a custom host drafter)
runs no decode bursts.

Verification bursts (a drafter with ``bursts``: ``"mtp"``, ``"ngram"``, with ``schedule(burst=S)``;
:func:`kvjax.sched.burst.schedule_verify_burst`). Where a decode burst applies (every running row decodes, no
queued request could be admitted) and the rule drafts with every running row decoding (:func:`rule_length` ``k >
0``; ``k = 0`` gives a plain decode burst), the plan verifies each row's drafts in sub-step 0 (``"mtp"``: recorded
from the device step; ``"ngram"``: the host lookup's) and lets the device run ``S`` sub-steps, each verifying up to
``k`` drafts made on the device after the previous sub-step (:func:`kvjax.engine.verify.verify_burst`: the MTP
layer's, or the n-gram lookup over each row's history, which the host sends once per burst: :func:`histories`).
Each row's pages cover ``min(S (K + 1), tokens it may still sample)``
positions (``StepPlan.spec_span``; those of fewer sub-steps, at least 2, where the pages are short), allocated at
once; a row that reaches them or ``max_new_tokens`` stops writing. :func:`advance` counts each row's first token;
:func:`resolve` takes the burst's ``i32[S * B * (K + 2)]`` (per sub-step and row: tokens ``t_0 .. t_k``, ``-1``
past them, then ``a``; ``-1`` where the row did not run) and applies the sub-steps in order, each as a
verification step whose first token (the previous sub-step's last) became computed; a row that ended takes no
later sub-step's tokens. :class:`SpecStats` counts every sub-step.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from kvjax.sched.drafter import Drafter, PacedDrafter, propose_rows
from kvjax.sched.plan import StepPlan
from kvjax.sched.request import Status


@dataclasses.dataclass
class SpecStats:
    """Counts over every verification step applied (:func:`resolve`)."""

    steps: int = 0  # verification steps (plans with at least one draft)
    rows: int = 0  # verification rows (rows with drafts)
    proposed: int = 0  # draft tokens verified
    accepted: int = 0  # of those, accepted
    proposed_at: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int64))  # i64[K]: by position
    accepted_at: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int64))  # i64[K]


def draft_length(rows: int, base_tokens: int, stats: SpecStats, num_draft_tokens: int, flat_tokens: int) -> int:
    """The drafts per row in ``0..num_draft_tokens`` (K) that save the most step cost (the longest among equals; see
    the module docstring): ``rows`` that decode, ``base_tokens`` the running rows compute without drafts, ``stats``
    the acceptance so far, ``flat_tokens`` the cost model's flat region."""
    K = int(num_draft_tokens)
    if rows <= 0 or K <= 0:
        return 0
    # scalar float arithmetic in the order of the vectorised formula (K <= 16 values: numpy's per-call cost would
    # be most of the scheduler's step; tests/test_spec_rule.py checks it against that formula)
    m = min(K, stats.proposed_at.size)
    prop, acc = stats.proposed_at[:m].tolist(), stats.accepted_at[:m].tolist()
    gain, run = [1.0], 0.0  # g(k) for k = 0..K
    for j in range(K):
        run += acc[j] / max(prop[j], 1) if j < m and prop[j] > 0 else 1.0  # rate of accepting drafts 0..j
        gain.append(1.0 + run)
    per_token = min(max(rows * (k + 1), flat_tokens) / (rows * gain[k]) for k in range(K + 1))  # decoding's best
    floor = max(base_tokens, flat_tokens)
    saving = [rows * (gain[k] - 1.0) * per_token - (max(base_tokens + rows * k, flat_tokens) - floor)
              for k in range(K + 1)]
    best = max(saving) - 1e-9 * max(rows, flat_tokens)
    return max(k for k in range(K + 1) if saving[k] >= best)


def paced_length(sched: Any, drafter: Drafter, decoding: int, base_tokens: int) -> int:
    """The drafts per row a step of ``sched`` may verify under ``drafter``: ``K``, but under a
    :class:`~kvjax.sched.drafter.PacedDrafter` none while more than its ``disable_by_batch_size`` requests run, and
    :func:`draft_length` for ``decoding`` rows beside ``base_tokens`` tokens where it has a flat region."""
    K = int(drafter.num_draft_tokens)
    if not isinstance(drafter, PacedDrafter):
        return K
    if drafter.disable_by_batch_size is not None and len(sched.running) > drafter.disable_by_batch_size:
        return 0
    if drafter.flat_tokens is None:
        return K
    return draft_length(decoding, base_tokens, sched.spec_stats, K, drafter.flat_tokens)


def rule_length(sched: Any, drafter: Drafter) -> int:
    """The drafts per row a step of ``sched`` verifies where its running rows all decode (a verification burst's
    cap; an engine that drafts on the device drafts in a step only where this is ``> 0``): :func:`paced_length`
    with every running row decoding."""
    rows = len(sched.running)
    return paced_length(sched, drafter, rows, min(rows, sched.max_num_batched_tokens))


def propose(sched: Any, drafter: Drafter, k: int | None = None) -> dict[int, np.ndarray]:
    """Drafts for ``sched``'s running requests that decode: {slot: i32[k]} (``k >= 1``; at most
    :func:`paced_length`'s, or ``k`` where given; see the module docstring)."""
    t = sched.rows
    slots = sched.running_slots()  # i64[R]
    if not slots.size:
        return {}
    nt, done = t.num_tokens[slots], t.num_computed[slots]
    room = t.max_tokens[slots] - nt - 1  # i64[R]
    ok = (done >= t.prompt_len[slots]) & (t.num_pending[slots] == 0) & (nt - done == 1) & (room > 0)
    if k is None:
        K = paced_length(sched, drafter, int(ok.sum()), min(int((nt - done).sum()), sched.max_num_batched_tokens))
    else:
        K = int(k)
    room = np.minimum(room, K)
    ok &= room > 0
    out = {}
    rows = np.flatnonzero(ok)
    if not rows.size:
        return out
    if getattr(drafter, "from_step", False):  # drafts the device step made (kvjax.sched.drafter.StepDrafter)
        at = slots[rows]
        drafts = drafter.drafts_rows(at, t.request_id[at], nt[rows], room[rows])
    else:  # every row's lookup at once for the n-gram drafter
        drafts = propose_rows(drafter, t.tokens[slots[rows], : int(nt[rows].max())], nt[rows], room[rows])
    for i, d in zip(rows.tolist(), drafts):
        if d.size:
            out[int(slots[i])] = np.asarray(d, np.int64)
    return out


def next_tokens(sched: Any, plan: StepPlan) -> np.ndarray:
    """``i32[B]``: for each row of ``plan`` (scheduled, not yet advanced), the known token that follows its last
    token in the step: the prompt's next token where the row is a chunk that does not end its prompt (or its
    known tokens), ``-1`` where the step samples it (the MTP drafter's catch-up pairs the row's last hidden state
    with this token, or with the sampled one at ``-1``; :mod:`kvjax.engine.drafting`)."""
    B, n = plan.seq_lens.shape[0], plan.num_seqs
    out = np.full(B, -1, np.int32)
    if not n:
        return out
    t = sched.rows
    slots = plan.gdn_slots[:n].astype(np.int64)  # i64[n]
    end = t.num_computed[slots] + plan.query_lens[:n]  # i64[n]: tokens known after the step's (drafts past them)
    known = end < t.num_tokens[slots]
    out[:n][known] = t.tokens[slots[known], end[known]]
    return out


def histories(sched: Any, plan: StepPlan, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Each row of ``plan`` (a verification burst's, scheduled, not yet advanced) as the device's n-gram lookup
    starts from it: ``(i32[B, width] its known tokens, zeros past them and on padding rows; i32[B] their count)``
    (the drafts written past ``num_tokens`` left out). ``width``: at least :func:`history_width`'s."""
    B, n = plan.seq_lens.shape[0], plan.num_seqs
    hist, length = np.zeros((B, width), np.int32), np.zeros(B, np.int32)
    if not n:
        return hist, length
    t = sched.rows
    slots = plan.gdn_slots[:n].astype(np.int64)  # i64[n]
    w = min(width, t.tokens.shape[1])
    length[:n] = t.num_tokens[slots]
    hist[:n, :w] = np.where(np.arange(w) < length[:n, None], t.tokens[slots, :w], 0)
    return hist, length


def history_width(scheds: Any, plans: Any, minimum: int = 128) -> int:
    """The history width of a verification burst step over the data shards' ``plans`` (of ``scheds``): the power
    of two (at least ``minimum``) that holds every row's known tokens and the ``spec_span`` positions its burst may
    append (one trace per width)."""
    need = minimum
    for sched, plan in zip(scheds, plans):
        n = plan.num_seqs
        if n and plan.spec_span is not None:
            slots = plan.gdn_slots[:n].astype(np.int64)
            need = max(need, int((sched.rows.num_tokens[slots] + plan.spec_span[:n]).max()) + 1)
    return 1 << (need - 1).bit_length()


def fit_drafts(sched: Any, drafts: dict[int, np.ndarray], rows: np.ndarray, cap: np.ndarray) -> np.ndarray:
    """``i64[R]``: the drafts each running row (``rows``: i64[R] slots, ``cap``: i64[R] tokens each would compute
    without drafts) takes this step, written into the row table past ``num_tokens``: all of ``drafts`` where every
    row's tokens fit the token budget and the pages the rows need fit at once; the budget trims them from the
    last row; where the pages do not fit, none."""
    extra = np.array([drafts[s].size if s in drafts else 0 for s in rows.tolist()], np.int64)
    if not extra.any():
        return extra
    left = sched.max_num_batched_tokens - int(cap.sum())
    extra = np.minimum(extra, np.maximum(left - (np.cumsum(extra) - extra), 0))
    t = sched.rows
    if not extra.any() or not sched.blocks.rows_fit(rows, t.num_computed[rows] + cap + extra):
        return np.zeros_like(extra)
    for i in np.flatnonzero(extra).tolist():
        s, k = int(rows[i]), int(extra[i])
        t.tokens[s, t.num_tokens[s]: t.num_tokens[s] + k] = drafts[s][:k]
    return extra


def advance(sched: Any, plan: StepPlan) -> list:
    """The host-known half of a verification plan (the latest schedule()'s): the certain tokens count as computed,
    nothing is reserved. Returns ``[]`` (no request finishes before its tokens are known)."""
    t, n = sched.rows, plan.num_seqs
    slots, live = sched.ledger.take(plan)  # i64[n], bool[n]
    certain = (plan.query_lens[:n] - plan.draft_len[:n]).astype(np.int64)  # i64[n]
    t.num_computed[slots[live]] += certain[live]
    return []


def resolve(sched: Any, plan: StepPlan, result: np.ndarray) -> list:
    """Apply a verification step's result (``result``: its flat ``i32[B * (K + 2)]``, or a verification burst's
    ``i32[S * B * (K + 2)]``, see the module docstring) to the oldest advanced plan; returns the requests that
    finished. ``ValueError`` (nothing changed) unless ``plan`` is that plan and ``result`` has the shape and token
    ids in ``[0, 2**31)`` where rows sample."""
    ledger = sched.ledger
    if not ledger.unresolved or plan is not ledger.unresolved[0][0]:
        raise ValueError(f"resolve() takes the oldest advanced plan, got the plan of step "
                         f"{getattr(plan, 'step', plan)!r}")
    _, slots, rids = ledger.unresolved[0]
    B, n = plan.seq_lens.shape[0], plan.num_seqs
    S = max(plan.spec_steps, 1)
    result = np.asarray(result)
    if (result.ndim != 1 or result.size % (S * B) or result.size // (S * B) < 2
            or not np.issubdtype(result.dtype, np.integer)):
        raise ValueError(f"a verification result must be int[{S} * B * (K + 2)] with B={B}, got {result.shape} "
                         f"{result.dtype}")
    toks, k, a, ran = verified(plan, result)
    J = toks.shape[2]
    sample = plan.sample_mask[:n]
    if plan.spec_steps:
        if (ran & ((a > k) | (k < 0))).any() or (ran[1:] & ~ran[:-1]).any():
            raise ValueError(f"step {plan.step}: a verification burst's accepted counts exceed its drafts or a row "
                             "runs after a sub-step it did not run")
    elif (k > J - 1).any():
        raise ValueError(f"step {plan.step}: drafts {k.max()} exceed the result's K={J - 1}")
    bad = (sample & ran)[..., None] & (np.arange(J) <= a[..., None]) & ((toks < 0) | (toks > np.iinfo(np.int32).max))
    if bad.any():
        raise ValueError(f"step {plan.step}: sampled token ids outside [0, 2**31): {toks[bad][:4]}")
    # every sub-step at once (a single step is one): each row's tokens of all its sub-steps in order
    _record(sched, plan, k[ran], a[ran], steps=int((ran & (k > 0)).any(axis=1).sum()))
    finished = _take(sched, plan, slots, rids, toks, a, ran & sample)
    ledger.unresolved.popleft()
    return [r for r in finished if r.status is Status.FINISHED]


def verified(plan: StepPlan, result: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A verification step's or burst's result (of ``plan``, ``S = max(plan.spec_steps, 1)`` sub-steps; shape
    unchecked) per sub-step and real row: ``(tokens i64[S, n, K + 1], drafts verified k i64[S, n], accepted a
    i64[S, n], ran bool[S, n])``. A burst marks a sub-step's unverified positions ``-1`` (its drafts: the tokens
    ``>= 0`` but one; ``a = -1`` and ``k = 0`` where the row did not run); a single step's drafts are its plan's
    ``draft_len`` and ``a`` is clipped to ``0..k``."""
    B, n, S = plan.seq_lens.shape[0], plan.num_seqs, max(plan.spec_steps, 1)
    grid = np.asarray(result).reshape(S, B, -1)[:, :n].astype(np.int64)  # i64[S, n, K + 2]
    J = grid.shape[2] - 1
    toks = grid[:, :, :J]
    if plan.spec_steps:
        ran = grid[:, :, J] >= 0  # bool[S, n]
        return toks, np.where(ran, (toks >= 0).sum(2) - 1, 0), np.where(ran, grid[:, :, J], -1), ran
    k = plan.draft_len[:n].astype(np.int64)[None]  # i64[1, n]
    a = np.clip(grid[:, :, J], 0, k)
    return toks, k, a, np.ones_like(a, bool)


def _take(sched: Any, plan: StepPlan, slots: np.ndarray, rids: np.ndarray, toks: np.ndarray, a: np.ndarray,
          ran: np.ndarray) -> list:
    """A verification step's result, or a burst's ``S`` sub-steps' at once, applied to the plan's rows still running
    (``slots`` / ``rids``: i64[n]): row ``b`` accepted ``a[s, b]`` drafts in sub-step ``s`` (``a``: i64[S, n]) and
    takes, in sub-step order, ``toks[s, b, :a[s, b] + 1]`` (i64[S, n, K + 1]) of every sub-step it ran (``ran``:
    bool[S, n], a prefix of the sub-steps) as one run of tokens: what applying the sub-steps one after another does
    (a stop id or ``max_new_tokens`` ends the row there, its later tokens dropped). Returns the requests that ended,
    in the order the sub-steps one after another would end them (by sub-step, then row)."""
    t = sched.rows
    S, _, J = toks.shape
    live = t.request_id[slots] == rids  # bool[n]
    rows = np.flatnonzero(live & ran[0])  # i64[m]
    if not rows.size:
        return []
    rs = slots[rows]
    c = np.where(ran[:, rows], a[:, rows] + 1, 0).T  # i64[m, S]: tokens each row takes per sub-step
    valid = (np.arange(J) < c[:, :, None]).reshape(rows.size, S * J)  # bool[m, S * J]
    flat = toks[:, rows].transpose(1, 0, 2).reshape(rows.size, S * J)
    order = np.argsort(~valid, axis=1, kind="stable")  # each row's taken tokens first, in sub-step order
    total = c.sum(1)  # i64[m]
    W = int(total.max())
    got = np.where(np.arange(W) < total[:, None], np.take_along_axis(flat, order[:, :W], axis=1), -1)  # i64[m, W]
    first = t.append(rs, got)  # nothing is reserved for a verification's rows (advance reserves nothing)
    done = (first < W) | (t.num_tokens[rs] >= t.max_tokens[rs])  # bool[m]: eos or max_new_tokens
    end = np.minimum(first, total - 1)  # i64[m]: the index of each row's last token taken
    cum = np.cumsum(c, axis=1)  # i64[m, S]
    sub = (cum <= end[:, None]).sum(1)  # i64[m]: the sub-step it came from, where the row ends
    # computed: every token taken up to that sub-step's, but its last (sub-step 0's first was computed before)
    t.num_computed[rs] += np.take_along_axis(cum, sub[:, None], axis=1)[:, 0] - 1
    by_end = np.lexsort((rows, sub))  # the order the sub-steps one after another end them
    finished = [t.requests[int(rs[i])] for i in by_end[done[by_end]].tolist()]
    sched.finish_many(finished)
    return finished


def _record(sched: Any, plan: StepPlan, k: np.ndarray, a: np.ndarray, steps: int = 1) -> None:
    """Count the plan's drafts (``k``: i64[n]) and accepted drafts (``a``: i64[n]) in ``sched.spec_stats``, as
    ``steps`` verification steps (a burst's sub-steps with drafts)."""
    s = sched.spec_stats
    if not k.any():
        return
    K = int(k.max())
    if s.proposed_at.size < K:
        s.proposed_at = np.concatenate([s.proposed_at, np.zeros(K - s.proposed_at.size, np.int64)])
        s.accepted_at = np.concatenate([s.accepted_at, np.zeros(K - s.accepted_at.size, np.int64)])
    j = np.arange(K)
    s.steps += steps
    s.rows += int((k > 0).sum())
    s.proposed += int(k.sum())
    s.accepted += int(a.sum())
    s.proposed_at[:K] += (j[None, :] < k[:, None]).sum(0)
    s.accepted_at[:K] += (j[None, :] < a[:, None]).sum(0)
