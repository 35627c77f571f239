"""Continuous-batching scheduler with chunked prefill, SWA recycling and preemption by recompute.

One step: ``plan = sched.schedule()`` → run the model on ``plan`` → ``sched.update(plan, sampled)`` (or, to plan
the next step before this one's tokens are known, ``sched.advance(plan)`` now and ``sched.resolve(plan, sampled)``
later).

``schedule``
1. calls the recycle policy on every running request (out-of-window SWA blocks go back to the pool);
2. serves running requests in order under the token budget: a decode takes 1 token, a prefill (or a resumed
   request's re-prefill) takes ``min(left to compute, budget left)`` tokens. When the pages for a request's
   tokens are short, the most recently admitted running request is preempted (slot and pages freed, progress
   dropped, requeued at the front) until they fit — possibly the request itself;
3. if nothing was preempted, admits preempted then waiting requests while the budget, a free slot and the
   pages for their first chunk (keeping ``watermark`` of each pool free unless nothing runs) allow;
4. returns a :class:`~kvjax.sched.plan.StepPlan`.

``schedule(burst=K)`` first tries a decode burst (every running request decoding, no queued request that step 3
would admit now; with prefix caching the admission check counts no cache hit, so a burst may delay an admission
by up to ``K`` sub-steps): one plan of up to ``K`` sub-steps per row, pages allocated for all of them,
one reserved token per sub-step (see "Decode bursts" in :mod:`kvjax.sched.plan`); else the steps above.

Applying a step has two halves (the scheduler's :class:`~kvjax.sched.ledger.Ledger`), so that the next step can be planned while this one
runs (the engine's overlap mode): ``advance(plan)`` applies what the host knows without the sampled tokens — every
scheduled request advances by its tokens, and where the plan samples it *reserves* the next token (its value comes
later; the next plan feeds it through ``StepPlan.prev_index``); a request that reaches ``max_new_tokens`` finishes
at once (its slot and pages go back; it stays in ``requests`` until its last token is resolved). ``resolve(plan,
sampled)`` (plans in the order they were advanced) checks the sampled tokens first (a bad array changes nothing,
and the plan can still be resolved), then gives each reserved token its value; a request that sampled eos finishes
there and any token reserved after it (a step it ran one step too long) is dropped. ``update(plan, sampled)`` is
both at once (the synchronous engine, simulations). ``rollback()`` forgets every reserved, unresolved token after
a fault (their requests are preempted: recomputed later). Every way into RUNNING (admission, resume,
``add_request(..., running=True)``) goes through ``_start`` which takes a slot; every way out (finish, abort,
preemption) goes through ``_release`` which frees the slot and all pages.

Host cost. The running requests' hot state (tokens, counters, reserved tokens) lives in ``self.rows``, a
:class:`~kvjax.sched.request.RowTable` indexed by GDN slot; ``_start`` binds a request to its slot's row and
``_release`` unbinds it (its :class:`Request` attributes read and write the row meanwhile). A steady decode step
(recycling, budget, page allocation, plan, ``advance``, ``resolve``) is a fixed number of numpy operations on
the running rows' slots; Python loops run only over rows that change state (admission, preemption, finishing,
eos, prefill chunks with prefix caching).

Prefix caching (``prefix_cache=PrefixCacheConfig(...)``; :mod:`kvjax.sched.prefix_cache`). Admission matches the
request's prompt against the cache and attaches the matched blocks to its row (``num_computed`` starts at the
match; the plan's ``ckpt_restore`` names the GDN checkpoint the step copies into its slot first); prefill chunks
end at the cache's checkpoint stops; at the end of ``schedule`` every scheduled prompt publishes the blocks this
step completes (the plan's ``ckpt_save`` names the checkpoint slot its state is copied into after the step).
Entries published by a plan are matched only by later plans, whose device steps run after it. ``_release`` lets
the cache forget the row first; ``rollback`` clears the cache (a lost step's pages and checkpoints were never
written). ``recycle="timely"`` becomes the cache's :class:`~kvjax.sched.prefix_cache.CachedRecycle`.
"""

from __future__ import annotations

import collections
from typing import Sequence

import numpy as np

from kvjax.config import INT32_MAX, AttentionConfig, CacheConfig, is_int
from kvjax.sched import spec
from kvjax.sched.blocks import BlockAllocator
from kvjax.sched.drafter import Drafter
from kvjax.sched.integrity import check_scheduler
from kvjax.sched.ledger import Ledger
from kvjax.sched.plan import StepPlan, build_plan, pow2_buckets, seq_buckets, token_buckets
from kvjax.sched.prefix_cache import PrefixCache, PrefixCacheConfig
from kvjax.sched.recycle import RecyclePolicy, check_fits, make_recycle_policy
from kvjax.sched.request import Request, RowTable, RunningList, Status, check_request
from kvjax.sched.slots import SlotAllocator


class Scheduler:
    """Owns the request queues, the GDN slot allocator and the head-wise block allocator of one model.

    Args:
      cache: page size, pages per layer, ``max_seqs`` (slots and batch rows), block-table width.
      attention: KV heads and their per-head ``window`` / ``sinks`` (one table layout for all layers).
      max_num_batched_tokens: token budget of one step (prefill chunks + decodes).
      pool: ``"shared"`` | ``"partitioned"`` (see :mod:`kvjax.sched.blocks`).
      recycle: ``"none"`` | ``"timely"`` or a policy object (see :mod:`kvjax.sched.recycle`).
      watermark: fraction of each pool kept free when admitting a new request while others run.
      prefix_cache: a :class:`PrefixCacheConfig` turns prefix caching on (``None``: off); ``recycle`` must then
        be ``"none"`` or ``"timely"``.
      page_shards: model shards of the page pool (the engine on a mesh; see :mod:`kvjax.sched.blocks`):
        ``cache.num_pages`` pages per shard, each serving its ``H_kv / page_shards`` heads. Default 1.
    """

    def __init__(self, cache: CacheConfig, attention: AttentionConfig, *, max_num_batched_tokens: int,
                 pool: str = "shared", recycle: "str | RecyclePolicy" = "none", watermark: float = 0.01,
                 prefix_cache: PrefixCacheConfig | None = None, page_shards: int = 1) -> None:
        if not isinstance(cache, CacheConfig) or not isinstance(attention, AttentionConfig):
            raise ValueError(f"need a CacheConfig and an AttentionConfig, got {type(cache).__name__}, "
                             f"{type(attention).__name__}")
        if not is_int(max_num_batched_tokens) or not 1 <= max_num_batched_tokens <= INT32_MAX:
            raise ValueError(f"max_num_batched_tokens must be an int in [1, {INT32_MAX}], got "
                             f"{max_num_batched_tokens!r}")
        max_num_batched_tokens = int(max_num_batched_tokens)
        if max_num_batched_tokens < cache.max_seqs:
            raise ValueError(f"max_num_batched_tokens={max_num_batched_tokens} must be >= max_seqs={cache.max_seqs} "
                             "so that every running request can advance in one step")
        if isinstance(watermark, (bool, np.bool_)) or not isinstance(watermark, (int, float, np.integer, np.floating)) \
                or not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be a number in [0, 1), got {watermark!r}")
        self.cache, self.attention = cache, attention
        self._options = dict(max_num_batched_tokens=max_num_batched_tokens, pool=pool, recycle=recycle,
                             watermark=watermark, prefix_cache=prefix_cache, page_shards=page_shards)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.watermark = float(watermark)
        if prefix_cache is not None and not isinstance(prefix_cache, PrefixCacheConfig):
            raise ValueError(f"prefix_cache must be a PrefixCacheConfig or None, got {type(prefix_cache).__name__}")
        if prefix_cache is not None and recycle not in ("none", "timely"):
            raise ValueError(f"with prefix caching recycle must be 'none' or 'timely', got {recycle!r}")
        self.recycle_policy = make_recycle_policy(recycle)
        self.blocks = BlockAllocator(cache, attention, pool, page_shards)
        self.prefix = PrefixCache(self.blocks, prefix_cache) if prefix_cache is not None else None
        if self.prefix is not None and recycle == "timely":
            self.recycle_policy = self.prefix.recycle_policy()
        self.prefix_hit_tokens = 0  # prompt tokens served from the prefix cache, all admissions
        self.slots = SlotAllocator(cache.max_seqs)
        self.t_buckets = token_buckets(max_num_batched_tokens)
        self.b_buckets = seq_buckets(cache.max_seqs)
        self.blk_buckets = pow2_buckets(cache.max_blocks_per_seq, 8)
        self.waiting: collections.deque[Request] = collections.deque()
        self.preempted: collections.deque[Request] = collections.deque()
        self.running = RunningList()  # list[Request], admission order; read it, change it only through the scheduler
        self.rows = RowTable(cache.max_seqs)  # the running requests' hot state, by slot (see request.py)
        self._run_slots = (-1, np.zeros(0, np.int64))  # (running.version, i64[R] slots of running) kept between steps
        self.requests: dict[int, Request] = {}
        self.step = 0
        self._next_id = 0
        self.num_preemptions = 0
        self.spec_stats = spec.SpecStats()  # speculative decoding's counts (drafts proposed, accepted)
        self.ledger = Ledger(self.rows, self.requests, self)  # plans between schedule and their tokens

    # ---- requests ------------------------------------------------------------------------------------------
    def add_request(self, prompt: np.ndarray, max_new_tokens: int, *,
                    eos_token_id: int | Sequence[int] | None = None, request_id: int | None = None,
                    running: bool = False) -> Request:
        """Queue a request (or, with ``running=True``, start it at once: it takes a slot now and computes from
        the next step). It fits a block-table row when ``prompt_len + max_new_tokens - 1 <= max_seq_len``: the
        last sampled token is never fed, so never cached. ``eos_token_id``: the token id, or up to
        :data:`~kvjax.sched.request.MAX_STOP_IDS` ids, that end the request when sampled (``None``: it runs to
        ``max_new_tokens``). Raises :class:`RequestTooLongError` if it could never fit, ``SlotExhaustedError`` if
        ``running`` and no slot is free, ``ValueError`` for a bad prompt, token id or request id; on error
        nothing changes."""
        if request_id is None:
            request_id = self._next_id
        if not is_int(request_id) or request_id < 0:
            raise ValueError(f"request_id must be an int >= 0, got {request_id!r}")
        request_id = int(request_id)
        if request_id in self.requests:
            raise ValueError(f"request id {request_id} is already known")
        prompt = check_request(prompt, max_new_tokens, eos_token_id)
        check_fits(self.blocks, int(prompt.size), int(max_new_tokens), self.max_num_batched_tokens,
                   self.recycle_policy.frees_swa_blocks)  # before Request allocates max_new_tokens
        req = Request(request_id, prompt, max_new_tokens, eos_token_id)
        if running:
            self._start(req)
        else:
            self.waiting.append(req)
        self.requests[req.request_id] = req
        self._next_id = max(self._next_id, request_id + 1)
        return req

    def abort(self, request_id: int) -> None:
        """Drop a request wherever it is (also one finished whose last tokens are not resolved yet: they are
        dropped); a running one gives back its slot and pages."""
        req = self.requests.pop(request_id, None)
        if req is None:
            raise ValueError(f"unknown request id {request_id}")
        if req.status is Status.RUNNING:
            self.running.remove(req)
            self._release(req)
        elif req.status is not Status.FINISHED:
            (self.waiting if req.status is Status.WAITING else self.preempted).remove(req)
        req.status = Status.ABORTED

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.preempted or self.running)

    def has_unresolved(self) -> bool:
        """An advanced plan is waiting for its sampled tokens."""
        return bool(self.ledger.unresolved)

    # ---- applying a step (the ledger) ----------------------------------------------------------------------
    def advance(self, plan: StepPlan) -> list[Request]:
        """:meth:`Ledger.advance`: the host-known half of the latest plan; returns the requests that finished (a
        verification plan: :func:`kvjax.sched.spec.advance`)."""
        if plan.draft_len is not None:
            return spec.advance(self, plan)
        return self.ledger.advance(plan)

    def resolve(self, plan: StepPlan, sampled: np.ndarray) -> list[Request]:
        """:meth:`Ledger.resolve`: the oldest advanced plan's sampled tokens; returns the requests that finished (a
        verification plan: :func:`kvjax.sched.spec.resolve`, ``sampled`` its ``i32[B * (K + 2)]`` result)."""
        if plan.draft_len is not None:
            return spec.resolve(self, plan, sampled)
        return self.ledger.resolve(plan, sampled)

    def update(self, plan: StepPlan, sampled: np.ndarray) -> list[Request]:
        """:meth:`Ledger.update`: ``advance`` and ``resolve`` at once (the synchronous engine, simulations)."""
        if plan.draft_len is not None:
            return self.advance(plan) + self.resolve(plan, sampled)
        return self.ledger.update(plan, sampled)

    def new_tokens(self, plan: StepPlan, sent: np.ndarray) -> tuple[np.ndarray, np.ndarray, list | None]:
        """:meth:`Ledger.new_tokens`: a resolved plan's rows' tokens from output position ``sent``, in one gather."""
        return self.ledger.new_tokens(plan, sent)

    def rollback(self) -> None:
        """:meth:`Ledger.rollback`: forget the plans a fault lost (their requests are recomputed)."""
        self.ledger.rollback()

    def rebuilt(self) -> "Scheduler":
        """A fresh scheduler with this one's configuration, buckets and counters holding this one's requests, for
        when a fault may have left this one's state half-changed (an allocator, the prefix cache or the row table
        interrupted part-way). Only the requests are read: each keeps its prompt and its resolved tokens (the one
        source of truth; reserved tokens and cached progress are dropped, :meth:`Request.resumed`). Those not done
        are queued to be recomputed: running ones first (preempted, in admission order, counted as preemptions),
        then the preempted, then the waiting; a request whose tokens are all resolved and complete is left out.
        The prefix cache starts empty; slots, pages and the step counter's plans in flight are forgotten."""
        fresh = Scheduler(self.cache, self.attention, **self._options)
        fresh.t_buckets, fresh.b_buckets, fresh.blk_buckets = self.t_buckets, self.b_buckets, self.blk_buckets
        fresh.step, fresh._next_id = self.step, self._next_id
        fresh.num_preemptions, fresh.prefix_hit_tokens = self.num_preemptions, self.prefix_hit_tokens
        fresh.spec_stats = self.spec_stats
        running = {id(r) for r in self.running}
        seen: set[int] = set()
        for req in [*self.running, *self.preempted, *self.waiting, *self.requests.values()]:
            if req.request_id in seen or req.request_id not in self.requests or req.status is Status.ABORTED:
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

    def schedule(self, burst: int = 1, drafter: Drafter | None = None) -> StepPlan:
        """Pick this step's work, allocate its pages, and return its plan (see the module docstring).

        ``burst > 1``: when every running request decodes and no queued request could be admitted now (no free
        slot, or not the pages of its first chunk), a decode burst: each row runs
        ``min(burst, tokens it may still sample)`` sub-steps in the one step (pages allocated for all of them);
        otherwise (or if those pages are short) an ordinary plan. ``drafter`` (speculative decoding; not with a
        burst, and only with every earlier plan resolved): the decoding rows verify its drafts, a verification
        plan (``draft_len`` set; :mod:`kvjax.sched.spec`)."""
        if self.prefix is not None:
            self.prefix.begin_plan()
        if burst > 1:
            if drafter is not None:
                raise ValueError("schedule: speculative drafts and decode bursts do not combine")
            plan = self._schedule_burst(burst)
            if plan is not None:
                return plan
        drafts = None
        if drafter is not None:
            if self.ledger.unresolved:
                raise ValueError("schedule: drafting needs every earlier plan resolved (a draft continues the "
                                 "request's known tokens)")
            drafts = spec.propose(self, drafter)
        budget = self.max_num_batched_tokens
        slots = counts = extra = np.zeros(0, np.int64)  # i64[nseq] each: the plan rows' slots, tokens and drafts
        preempted = False
        if self.running:
            slots, counts, extra, preempted = self._schedule_running(drafts)
            budget -= int(counts.sum())
        admitted: list[tuple[int, int]] = []  # (slot, tokens)
        restore: dict[int, int] = {}
        hits = 0
        while not preempted and budget > 0 and (self.preempted or self.waiting) \
                and len(self.running) < self.cache.max_seqs:
            queue = self.preempted if self.preempted else self.waiting
            req = queue[0]
            reserve = self.watermark if self.running else 0.0
            if self.prefix is not None:
                n = self._admit_cached(req, budget, reserve, restore)
                if n is None:
                    break
                hits += req.num_computed
            else:
                n = self._first_chunk(req, budget, reserve)
                if n is None:
                    break
                self._start(req)
                self.blocks.allocate(req.slot, n)
            queue.popleft()
            admitted.append((req.slot, n))
            budget -= n
        if admitted:
            new_slots, new_counts = np.array(admitted, np.int64).T
            slots, counts = np.concatenate([slots, new_slots]), np.concatenate([counts, new_counts])
            extra = np.concatenate([extra, np.zeros(len(admitted), np.int64)])
        save: dict[int, int] = {}
        if self.prefix is not None:  # the blocks this step completes; entries only later plans can match
            t = self.rows
            for i in np.flatnonzero(t.num_computed[slots] < t.prompt_len[slots]).tolist():
                slot = int(slots[i])
                ckpt = self.prefix.publish(slot, int(t.num_computed[slot] + counts[i]))
                if ckpt >= 0:
                    save[int(t.request_id[slot])] = ckpt
        self.prefix_hit_tokens += hits
        plan = build_plan(self.step, slots, counts, self.rows, self.blocks, self.t_buckets, self.b_buckets,
                          self.blk_buckets, restore=restore, save=save, prefix_hit_tokens=hits,
                          drafts=extra if drafter is not None and extra.any() else None)
        self.ledger.planned = plan
        self.step += 1
        return plan

    def burst_ready(self, burst: int) -> bool:
        """Whether :meth:`schedule` ``(burst)`` would return a decode burst now, or this scheduler has nothing to
        run (its plan is empty, which fits a burst step of other data shards). Recycles out-of-window blocks, as
        every ``schedule`` does first; changes nothing else."""
        return not self.has_unfinished() or self._burst_sizes(burst) is not None

    def _burst_sizes(self, burst: int) -> np.ndarray | None:
        """``i64[R]``: the sub-steps of each running row in a decode burst of up to ``burst`` (pages checked, not
        allocated), or None where a burst does not apply (recycling done either way)."""
        if burst < 2 or not self.running:
            return None
        t, rows = self.rows, self._running_slots()  # i64[R]
        done = t.num_computed[rows]  # i64[R]
        if (t.num_tokens[rows] - done != 1).any():  # a row still has prompt tokens to compute
            return None
        n = np.minimum(burst, t.max_tokens[rows] - t.num_tokens[rows])  # i64[R]: sub-steps that sample a token
        if n.max() < 2:  # every row ends within one sub-step
            return None
        # recycle first, as every step does: admission is judged on the pages left after it (judged before, a
        # page the recycling frees could let a queued request in at the next call, and the answer would change)
        self.recycle_policy.recycle(self.blocks, rows, done)
        if self._admissible():
            return None
        return n if self.blocks.rows_fit(rows, done + n) else None

    def _schedule_burst(self, burst: int) -> StepPlan | None:
        """The decode-burst plan of :meth:`schedule`, or None (nothing changed but recycling) where it does not
        apply."""
        n = self._burst_sizes(burst)
        if n is None:
            return None
        t, rows = self.rows, self._running_slots()  # i64[R]
        allocated = self.blocks.allocate_rows(rows, t.num_computed[rows] + n)
        assert allocated, "rows_fit and allocate_rows disagree"
        plan = build_plan(self.step, rows, np.ones(len(rows), np.int64), t, self.blocks, self.t_buckets,
                          self.b_buckets, self.blk_buckets, burst=n, stride=self.cache.max_seqs)
        self.ledger.planned = plan
        self.step += 1
        return plan

    def _admissible(self) -> bool:
        """A queued request would be admitted by an ordinary step now (a free slot and its first chunk's pages,
        within the budget the running rows' decodes leave)."""
        queue = self.preempted or self.waiting
        if not queue or len(self.running) >= self.cache.max_seqs:
            return False
        return self._first_chunk(queue[0], self.max_num_batched_tokens - len(self.running), self.watermark) is not None

    def _first_chunk(self, req: Request, budget: int, reserve: float) -> int | None:
        """Tokens of ``req``'s first chunk within ``budget`` (no prefix caching), or None if its pages do not fit
        while keeping ``reserve`` of each pool free."""
        n = min(req.num_tokens, budget)
        return n if self.blocks.can_fit(self.blocks.blocks_for(n), reserve) else None

    def _running_slots(self) -> np.ndarray:
        """i64[R] (read-only): the slots of ``running``, in order; rebuilt only when ``running`` changed."""
        version, slots = self._run_slots
        if version != self.running.version:
            slots = np.array([r.slot for r in self.running], np.int64)
            slots.setflags(write=False)
            self._run_slots = (self.running.version, slots)
        return slots

    def _schedule_running(self, drafts: dict[int, np.ndarray] | None = None
                          ) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool]:
        """Recycle, then give every running request (in order) its tokens under the budget and the pages they
        need, preempting from the tail when pages are short. Returns (i64[k] slots, i64[k] tokens, i64[k] drafts,
        preempted) of the rows scheduled (``drafts``: {slot: draft tokens}, taken where they fit,
        :func:`kvjax.sched.spec.fit_drafts`; a row's tokens count its drafts). Vectorised over the rows: when the pages of every row that crosses a block boundary
        fit at once, one call allocates them all; otherwise the rows allocate one by one, preempting."""
        blocks, t = self.blocks, self.rows
        rows = self._running_slots()  # i64[R]
        done = t.num_computed[rows]  # i64[R]
        self.recycle_policy.recycle(blocks, rows, done)
        cap = t.num_tokens[rows] - done  # i64[R]: tokens left to compute
        if self.prefix is not None:
            for i in np.flatnonzero(done < t.prompt_len[rows]).tolist():
                cap[i] = self._chunk(self.running[i], int(done[i]), int(cap[i]))
        extra = spec.fit_drafts(self, drafts, rows, cap) if drafts else np.zeros(len(rows), np.int64)  # i64[R]
        cap = cap + extra
        before = np.cumsum(cap) - cap
        n = np.maximum(np.minimum(cap, self.max_num_batched_tokens - before), 0)  # i64[R]
        upto = done + n  # i64[R]: tokens each row covers after this step
        need = -(-upto // self.cache.page_size) - blocks.num_blocks[rows]  # i64[R]: new blocks
        grow = np.flatnonzero((need > 0) & (n > 0))
        preempted = False
        if grow.size and not blocks.allocate_rows(rows[grow], upto[grow]):
            preempted = self._allocate_in_order(list(self.running), grow, need, upto)
        k = min(len(self.running), int(np.count_nonzero(n)))
        return rows[:k], n[:k], extra[:k], preempted

    def _allocate_in_order(self, running: list[Request], grow: np.ndarray, need: np.ndarray,
                           upto: np.ndarray) -> bool:
        """Allocate the rows ``grow`` of ``running`` one by one, preempting from the tail of ``self.running``
        while a row's pages do not fit (possibly the row itself, which ends the step's allocation). Returns
        whether anything was preempted."""
        preempted = False
        for i in grow.tolist():
            req = running[i]
            if req.status is not Status.RUNNING:  # preempted as a victim of an earlier row
                break
            while not self.blocks.can_fit(int(need[i])):
                victim = self.running[-1]
                self.preempt(victim)
                preempted = True
                if victim is req:
                    break
            if req.status is not Status.RUNNING:
                break
            self.blocks.allocate(req.slot, int(upto[i]))
        return preempted

    def _chunk(self, req: Request, start: int, budget: int) -> int:
        """Tokens of ``req`` to compute this step from ``start``: what is left, within the budget, ending at the
        prefix cache's next checkpoint stop."""
        n = min(req.num_tokens - start, budget)
        stop = self.prefix.next_stop(req.slot, start) if self.prefix is not None else None
        return min(n, stop - start) if stop is not None else n

    def _admit_cached(self, req: Request, budget: int, reserve: float, restore: dict[int, int]) -> int | None:
        """Start ``req`` (head of its queue) on its cached prefix: attach the matched blocks, allocate its first
        chunk, note the checkpoint to restore. Returns the chunk's tokens, or None (nothing changed) if its pages
        do not fit."""
        status = req.status
        self._start(req)
        prompt = req.token_ids[: req.prompt_len]
        match = self.prefix.match(prompt)
        ckpt = self.prefix.attach(req.slot, match, prompt)
        start = match.num_tokens
        n = self._chunk(req, start, budget)
        if not self.blocks.can_fit(self.blocks.blocks_for(start + n) - int(self.blocks.num_blocks[req.slot]),
                                   reserve):
            self.running.remove(req)
            self._release(req)
            req.status = status
            return None
        req.num_computed = start
        self.blocks.allocate(req.slot, start + n)
        if ckpt >= 0:
            restore[req.request_id] = ckpt
        return n

    def clear_prefix_cache(self) -> int:
        """Drop every cached block and checkpoint (pages rows still hold go with their rows); returns pages
        freed. No-op without prefix caching."""
        return self.prefix.clear() if self.prefix is not None else 0

    # ---- transitions ---------------------------------------------------------------------------------------
    def _start(self, req: Request) -> None:
        self.rows.bind(req, self.slots.allocate())  # sets req.slot
        req.status = Status.RUNNING
        self.running.append(req)

    def _release(self, req: Request) -> None:
        slot = req.slot
        self.rows.unbind(req)
        if self.prefix is not None:
            self.prefix.release(slot)
        self.blocks.free_row(slot)
        self.slots.free(slot)
        req.slot = 0

    def finish(self, req: Request) -> None:
        """Transition: ``req`` is done (its slot and pages go back); it stays known until its last reserved token
        is resolved."""
        if req.status is Status.RUNNING:
            self.running.remove(req)
            self._release(req)
        elif req.status is Status.PREEMPTED:
            self.preempted.remove(req)
        req.status = Status.FINISHED
        if not req.pending:
            del self.requests[req.request_id]

    def preempt(self, req: Request) -> None:
        """Transition: preempt running ``req`` by recompute (slot and pages freed, progress dropped, requeued
        first)."""
        self.running.remove(req)
        self._release(req)
        self.requeue(req)

    def requeue(self, req: Request) -> None:
        """Transition: ``req`` (out of the running list) starts over, first in the preempted queue."""
        req.num_computed = 0
        req.status = Status.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.preempted.appendleft(req)

    # ---- invariants ----------------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise ``AssertionError`` unless allocators are consistent and slots/rows match the queues
        (:func:`kvjax.sched.integrity.check_scheduler`)."""
        check_scheduler(self)
