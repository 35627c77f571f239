"""A small scheduler for the scheduler and engine tests: 4 query / 2 KV heads of 8, KV head 0 SWA (window 6,
2 sinks)."""

from __future__ import annotations

from kvjax.config import AttentionConfig, CacheConfig
from kvjax.sched import Scheduler

ATT = AttentionConfig(4, 2, 8, window=(6, 0), sinks=(2, 0))


def sched_with(num_pages=64, page_size=4, max_seqs=4, max_blocks=16, budget=16, **kw) -> Scheduler:
    """A :class:`Scheduler` over a cache of ``num_pages`` pages of ``page_size`` tokens (``att=`` overrides
    :data:`ATT`; other keywords go to the scheduler)."""
    cache = CacheConfig(page_size=page_size, num_pages=num_pages, max_seqs=max_seqs, max_blocks_per_seq=max_blocks)
    return Scheduler(cache, kw.pop("att", ATT), max_num_batched_tokens=budget, **kw)
