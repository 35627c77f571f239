"""The scheduler's checks: its invariants (:func:`check_scheduler`, what ``Scheduler.check_integrity`` runs) and
the sampled tokens a step hands back (:func:`check_sampled`). Host only, numpy."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvjax.config import INT32_MAX
from kvjax.sched.plan import StepPlan
from kvjax.sched.request import Status

def check_sampled(plan: StepPlan, sampled: np.ndarray) -> np.ndarray:
    """The plan's sampled tokens as ``i64[burst, num_seqs]`` (sub-step ``j`` of row ``b`` at ``sampled[j * S +
    b]``, ``S = plan.token_stride``) after the checks of ``Scheduler.resolve`` (``ValueError`` naming the bad shape, dtype or id)."""
    sampled = np.asarray(sampled)
    if sampled.ndim != 1 or sampled.dtype.kind not in "iu":
        raise ValueError(f"sampled must be a 1-d integer array (a token id per plan row), got "
                         f"{sampled.dtype}{list(sampled.shape)}")
    n, B, k = plan.num_seqs, plan.token_stride, plan.burst
    need = (k - 1) * B + n
    if sampled.shape[0] < need:
        what = f"the plan has {n} rows" if k == 1 else f"a burst of {k} sub-steps of {B} rows needs {need}"
        raise ValueError(f"sampled has {sampled.shape[0]} entries, {what}")
    if sampled.shape[0] >= k * B:  # sub-step j's rows at [j * B, j * B + n)
        tokens = sampled[: k * B].reshape(k, B)[:, :n].astype(np.int64)
    else:
        tokens = np.stack([sampled[j * B: j * B + n] for j in range(k)]).astype(np.int64)
    mask = plan.sample_mask[:n] if plan.burst_len is None else \
        plan.sample_mask[:n] & (plan.burst_len[:n][None, :] > np.arange(k)[:, None])
    if (mask & ((tokens < 0) | (tokens > INT32_MAX))).any():
        kept = tokens[np.broadcast_to(mask, tokens.shape)]
        raise ValueError(f"sampled token ids must lie in [0, {INT32_MAX}], got min {kept.min()}, max {kept.max()}")
    return tokens


def check_scheduler(sched: Any) -> None:
    """Raise ``AssertionError`` unless the allocators of ``sched`` (a :class:`~kvjax.sched.scheduler.Scheduler`)
    are consistent and its slots, rows and block tables match its queues (running requests each with a unique
    slot and something to compute, queued ones holding nothing, the planned-but-unapplied step's rows
    non-empty)."""
    sched.blocks.check_integrity()
    sched.slots.check_integrity()
    if sched.prefix is not None:
        sched.prefix.check_integrity()
    sched.rows.check_integrity(sched.running)
    slots = [r.slot for r in sched.running]
    version, cached = sched._run_slots
    if version == sched.running.version and cached.tolist() != slots:
        raise AssertionError(f"cached running slots {cached.tolist()} != {slots}")
    if any(r.status is not Status.RUNNING for r in sched.running) or 0 in slots or len(set(slots)) != len(slots):
        raise AssertionError(f"running requests without a unique slot: {sched.running}")
    if any(not 0 <= r.num_computed < r.num_tokens for r in sched.running):
        raise AssertionError(f"a running request has nothing to compute (its next plan row would be empty): "
                             f"{[r for r in sched.running if not 0 <= r.num_computed < r.num_tokens]}")
    if any(sched.blocks.num_blocks[r.slot] < sched.blocks.blocks_for(r.num_computed) for r in sched.running):
        raise AssertionError(f"a running request's computed tokens lie past its blocks: {sched.running}")
    plan = sched.ledger.planned  # scheduled, not yet applied
    if plan is not None:
        q, li, T = plan.query_lens[: plan.num_seqs], plan.logits_indices, plan.token_ids.shape[0]
        if (q < 1).any() or (li < 0).any() or (li >= T).any():
            raise AssertionError(f"step {plan.step}'s plan has a row without tokens or a logits index outside "
                                 f"[0, {T}): query_lens {q.tolist()}, logits_indices {li.tolist()}")
    if set(slots) != sched.slots.allocated:
        raise AssertionError(f"allocated slots {sorted(sched.slots.allocated)} != running slots {sorted(slots)}")
    idle = np.setdiff1d(np.arange(1, sched.cache.max_seqs + 1), slots)
    if (sched.blocks.tables[idle] != -1).any() or np.asarray(sched.blocks.num_blocks)[idle].any():
        raise AssertionError("a free slot's block-table row still holds pages")
    for q in (sched.waiting, sched.preempted):
        if any(r.slot != 0 or r.num_computed != 0 for r in q):
            raise AssertionError(f"a queued request holds a slot or progress: {list(q)}")
