"""Decode bursts on the host: whether a step can be one, and its plan.

A burst (``schedule(burst=K)``) applies when every running request decodes (no prompt token left to compute), at
least one row may sample two more tokens, and no queued request could be admitted now (:func:`admission.admissible
<kvjax.sched.admission.admissible>`; with prefix caching that check counts no cache hit, so a burst may delay an
admission by up to ``K`` sub-steps). Its plan gives each running row ``min(K, tokens it may still sample)``
sub-steps in one step, with the pages of all of them allocated at once and one reserved token per sub-step (see
"Decode bursts" in :mod:`kvjax.sched.plan`). The recycle policy runs first, as in every step, so admission is judged
on the pages left after it.

With a drafter that verifies in bursts (``bursts``: ``"mtp"``, whose drafts come from the device step, and
``"ngram"``, whose later sub-steps look up on the device) the burst is a verification burst where the rule drafts
(:func:`schedule_verify_burst`; "Verification bursts" in :mod:`kvjax.sched.spec`).

These functions are the :class:`~kvjax.sched.scheduler.Scheduler`'s own (``sched`` is one).
"""

from __future__ import annotations

import numpy as np

from kvjax.sched import spec
from kvjax.sched.admission import admissible
from kvjax.sched.drafter import Drafter
from kvjax.sched.plan import StepPlan, bucket, build_plan, pad_plan


def decoding(sched: Scheduler) -> bool:
    """Some request runs and every running one decodes (no prompt token left to compute): a burst may apply."""
    if not sched.running:
        return False
    t, rows = sched.rows, sched.running_slots()  # i64[R]
    return bool((t.num_tokens[rows] - t.num_computed[rows] == 1).all())


def burst_sizes(sched: Scheduler, burst: int, per_step: int = 1) -> np.ndarray | None:
    """``i64[R]``: the positions each running row may compute in a burst of up to ``burst`` sub-steps of up to
    ``per_step`` positions each (a decode burst: 1, its sub-steps; a verification burst: ``K + 1``), at most the
    tokens it may still sample (pages checked, not allocated; a verification burst whose pages are short takes the
    positions of fewer sub-steps, at least 2), or None where a burst does not apply (recycling done either way)."""
    if burst < 2 or not decoding(sched):
        return None
    t, rows = sched.rows, sched.running_slots()  # i64[R]
    done = t.num_computed[rows]  # i64[R]
    n = np.minimum(burst, t.max_tokens[rows] - t.num_tokens[rows])  # i64[R]: sub-steps that sample a token
    if n.max() < 2:  # every row ends within one sub-step
        return None
    # recycle first, as every step does: admission is judged on the pages left after it (judged before, a page the
    # recycling frees could let a queued request in at the next call, and the answer would change)
    sched.recycle_policy.recycle(sched.blocks, rows, done)
    if admissible(sched):
        return None
    left = t.max_tokens[rows] - t.num_tokens[rows]  # i64[R]: tokens each row may still sample
    for steps in range(burst, 1, -1) if per_step > 1 else (burst,):  # a verification burst shortens to fit
        n = np.minimum(steps * per_step, left)  # i64[R]
        if sched.blocks.rows_fit(rows, done + n):
            return n
    return None


def burst_kind(sched: Scheduler, burst: int, drafter: Drafter | None = None) -> str | None:
    """The burst ``sched.schedule(burst, drafter)`` would return now: ``"idle"`` (nothing to run: an empty plan,
    which fits any burst step of other data shards), ``"verify"`` (a verification burst: a drafter that verifies in
    bursts, the rule drafting, its ``K + 1`` positions per sub-step fitting), ``"decode"`` (a
    decode burst), or ``None`` (a single step). Recycles out-of-window blocks, as every ``schedule`` does first;
    changes nothing else."""
    if not sched.has_unfinished():
        return "idle"
    if burst < 2 or not decoding(sched):
        return None
    k = spec.rule_length(sched, drafter) if getattr(drafter, "bursts", False) else 0
    if burst_sizes(sched, burst, k + 1 if k else 1) is None:
        return None
    return "verify" if k else "decode"


def schedule_burst(sched: Scheduler, burst: int) -> StepPlan | None:
    """The decode-burst plan of ``sched.schedule(burst)`` (its pages allocated; the ledger's latest plan), or None
    (nothing changed but recycling) where a burst does not apply."""
    n = burst_sizes(sched, burst)
    if n is None:
        return None
    t, rows = sched.rows, sched.running_slots()  # i64[R]
    allocated = sched.blocks.allocate_rows(rows, t.num_computed[rows] + n)
    assert allocated, "rows_fit and allocate_rows disagree"
    return build_plan(sched.step, rows, np.ones(len(rows), np.int64), t, sched.blocks, sched.t_buckets,
                      sched.b_buckets, sched.blk_buckets, burst=n, stride=sched.cache.max_seqs)


def schedule_verify_burst(sched: Scheduler, burst: int, drafter: Drafter) -> StepPlan | None:
    """The verification-burst plan of ``sched.schedule(burst, drafter)`` with a drafter that verifies in bursts
    (sub-step 0's drafts: :func:`kvjax.sched.spec.propose`'s; its pages allocated; the ledger's latest plan), a
    decode burst's plan where the rule drafts nothing, or None (nothing changed but recycling) where a burst does
    not apply (see "Verification bursts" in :mod:`kvjax.sched.spec`)."""
    if not decoding(sched):  # no burst of either kind (before the rule's cost, paid every prompt step)
        return None
    k = spec.rule_length(sched, drafter)
    if k == 0:
        return schedule_burst(sched, burst)
    n = burst_sizes(sched, burst, k + 1)
    if n is None:
        return None
    t, rows = sched.rows, sched.running_slots()  # i64[R]
    allocated = sched.blocks.allocate_rows(rows, t.num_computed[rows] + n)
    assert allocated, "rows_fit and allocate_rows disagree"
    extra = spec.fit_drafts(sched, spec.propose(sched, drafter, k), rows, np.ones(len(rows), np.int64))
    plan = build_plan(sched.step, rows, 1 + extra, t, sched.blocks, sched.t_buckets, sched.b_buckets,
                      sched.blk_buckets, drafts=extra, spec_span=n, spec_k=k, spec_steps=burst)
    B = plan.seq_lens.shape[0]  # every sub-step's tokens fit one bucket: K + 1 per row, within the budget
    T = bucket(min(B * (drafter.num_draft_tokens + 1), sched.max_num_batched_tokens), sched.t_buckets)
    return pad_plan(plan, T, B, plan.block_tables.shape[2])
