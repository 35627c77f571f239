"""Rebuilding a scheduler after a fault, from its requests alone.

A fault may leave a scheduler's state half-changed (an allocator, the prefix cache or the row table interrupted
part-way). :func:`rebuild` fills a fresh scheduler of the same configuration from the one source of truth, the
requests: each keeps its prompt and its resolved tokens (reserved tokens and cached progress are dropped,
:meth:`Request.resumed <kvjax.sched.request.Request.resumed>`). Those not done are queued to be recomputed: the
running ones first (preempted, in admission order, counted as preemptions), then the preempted, then the waiting; a
request whose tokens are all resolved and complete is left out. The prefix cache starts empty; slots, pages and the
plans in flight are forgotten; buckets, the step counter and the counters carry over.
"""

from __future__ import annotations

from kvjax.sched.request import Request, Status


def rebuild(old: Scheduler, fresh: Scheduler) -> Scheduler:
    """``fresh`` (new, of ``old``'s configuration, nothing queued) given ``old``'s buckets, counters and requests
    (see the module docstring); returns it. ``old`` is only read."""
    fresh.t_buckets, fresh.b_buckets, fresh.blk_buckets = old.t_buckets, old.b_buckets, old.blk_buckets
    fresh.step = old.step
    fresh.num_preemptions, fresh.prefix_hit_tokens = old.num_preemptions, old.prefix_hit_tokens
    fresh.spec_stats = old.spec_stats
    running = {id(r) for r in old.running}
    seen: set[int] = set()
    for req in [*old.running, *old.preempted, *old.waiting, *old.requests.values()]:
        if req.request_id in seen or req.request_id not in old.requests or req.status is Status.ABORTED:
            continue
        seen.add(req.request_id)
        new = Request.resumed(req)
        if new.complete:
            new.status = Status.FINISHED
            continue
        if id(req) in running or req.status is not Status.WAITING:
            new.status = Status.PREEMPTED
            if id(req) in running or req.status is Status.FINISHED:
                new.num_preemptions += 1
                fresh.num_preemptions += 1
            fresh.preempted.append(new)
        else:
            fresh.waiting.append(new)
        fresh.requests[new.request_id] = new
    return fresh
