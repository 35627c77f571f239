"""Admission: which queued requests a step starts, the pages of their first chunk, and where a prompt's chunks end.

:func:`admit` takes preempted requests first (in their queue's order: the most recently preempted first), then
waiting ones, while the step's token budget, a free slot and the pages of the request's first chunk allow, keeping
``watermark`` of each pool free unless nothing runs. Without prefix caching a request's first chunk starts at its
first token (:func:`first_chunk`); with it, admission matches the prompt against the cache and attaches the matched
blocks (:func:`admit_cached`: the request computes from the match, its plan row restores the matched GDN
checkpoint), and every prompt chunk ends at the cache's next checkpoint stop (:func:`chunk`).

These functions are the :class:`~kvjax.sched.scheduler.Scheduler`'s own (``sched`` is one): they read its queues,
allocators and prefix cache and change them through its transitions (``start``, ``release``).
"""

from __future__ import annotations

import numpy as np

from kvjax.sched.request import Request


def admit(sched: Scheduler, budget: int) -> tuple[np.ndarray, np.ndarray, dict[int, int], int]:
    """Start queued requests within ``budget`` tokens (see the module docstring). Returns ``(i64[a] slots, i64[a]
    tokens, restore, hits)`` of the admitted rows in order; ``restore``: {request id: GDN checkpoint to restore};
    ``hits``: their prompt tokens served from the prefix cache."""
    admitted: list[tuple[int, int]] = []  # (slot, tokens)
    restore: dict[int, int] = {}
    hits = 0
    while budget > 0 and (sched.preempted or sched.waiting) and len(sched.running) < sched.cache.max_seqs:
        queue = sched.preempted if sched.preempted else sched.waiting
        req = queue[0]
        reserve = sched.watermark if sched.running else 0.0
        if sched.prefix is not None:
            n = admit_cached(sched, req, budget, reserve, restore)
            if n is None:
                break
            hits += req.num_computed
        else:
            n = first_chunk(sched, req, budget, reserve)
            if n is None:
                break
            sched.start(req)
            sched.blocks.allocate(req.slot, n)
        queue.popleft()
        admitted.append((req.slot, n))
        budget -= n
    slots, counts = np.array(admitted, np.int64).reshape(-1, 2).T
    return slots, counts, restore, hits


def admissible(sched: Scheduler) -> bool:
    """A queued request would be admitted by an ordinary step now (a free slot and its first chunk's pages, within
    the budget the running rows' decodes leave)."""
    queue = sched.preempted or sched.waiting
    if not queue or len(sched.running) >= sched.cache.max_seqs:
        return False
    return first_chunk(sched, queue[0], sched.max_num_batched_tokens - len(sched.running), sched.watermark) is not None


def first_chunk(sched: Scheduler, req: Request, budget: int, reserve: float) -> int | None:
    """Tokens of ``req``'s first chunk within ``budget`` (no prefix caching), or None if its pages do not fit while
    keeping ``reserve`` of each pool free."""
    n = min(req.num_tokens, budget)
    return n if sched.blocks.can_fit(sched.blocks.blocks_for(n), reserve) else None


def chunk(sched: Scheduler, req: Request, start: int, budget: int) -> int:
    """Tokens of ``req`` to compute this step from ``start``: what is left, within the budget, ending at the prefix
    cache's next checkpoint stop."""
    n = min(req.num_tokens - start, budget)
    stop = sched.prefix.next_stop(req.slot, start) if sched.prefix is not None else None
    return min(n, stop - start) if stop is not None else n


def admit_cached(sched: Scheduler, req: Request, budget: int, reserve: float, restore: dict[int, int]) -> int | None:
    """Start ``req`` (head of its queue) on its cached prefix: attach the matched blocks, allocate its first chunk,
    note the checkpoint to restore in ``restore``. Returns the chunk's tokens, or None (nothing changed) if its
    pages do not fit."""
    status = req.status
    sched.start(req)
    prompt = req.token_ids[: req.prompt_len]
    match = sched.prefix.match(prompt)
    ckpt = sched.prefix.attach(req.slot, match, prompt)
    start = match.num_tokens
    n = chunk(sched, req, start, budget)
    blocks = sched.blocks
    if not blocks.can_fit(blocks.blocks_for(start + n) - int(blocks.num_blocks[req.slot]), reserve):
        sched.running.remove(req)
        sched.release(req)
        req.status = status
        return None
    req.num_computed = start
    blocks.allocate(req.slot, start + n)
    if ckpt >= 0:
        restore[req.request_id] = ckpt
    return n
