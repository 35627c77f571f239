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
   pages for their first chunk (keeping ``watermark`` of each pool free unless nothing runs) allow
   (:mod:`kvjax.sched.admission`);
4. returns a :class:`~kvjax.sched.plan.StepPlan`.

``schedule(burst=K)`` first tries a decode burst (:mod:`kvjax.sched.burst`: every running request decoding, no
queued request that step 3 would admit now): one plan of up to ``K`` sub-steps per row, pages allocated for all of
them, one reserved token per sub-step; else the steps above. ``rebuilt()`` (after a fault) is
:mod:`kvjax.sched.rebuild`.

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
``add_request(..., running=True)``) goes through ``start`` which takes a slot; every way out (finish, abort,
preemption) goes through ``release`` which frees the slot and all pages.

Host cost. The running requests' hot state (tokens, counters, reserved tokens) lives in ``self.rows``, a
:class:`~kvjax.sched.request.RowTable` indexed by GDN slot; ``start`` binds a request to its slot's row and
``release`` unbinds it (its :class:`Request` attributes read and write the row meanwhile). A steady decode step
(recycling, budget, page allocation, plan, ``advance``, ``resolve``) is a fixed number of numpy operations on
the running rows' slots; Python loops run only over rows that change state (admission, preemption, finishing,
eos, prefill chunks with prefix caching).

Prefix caching (``prefix_cache=PrefixCacheConfig(...)``; :mod:`kvjax.sched.prefix_cache`). Admission matches the
request's prompt against the cache and attaches the matched blocks to its row (``num_computed`` starts at the
match; the plan's ``ckpt_restore`` names the GDN checkpoint the step copies into its slot first); prefill chunks
end at the cache's checkpoint stops; at the end of ``schedule`` every scheduled prompt publishes the blocks this
step completes (the plan's ``ckpt_save`` names the checkpoint slot its state is copied into after the step).
Entries published by a plan are matched only by later plans, whose device steps run after it. ``release`` lets
the cache forget the row first; ``rollback`` clears the cache (a lost step's pages and checkpoints were never
written). ``recycle="timely"`` becomes the cache's :class:`~kvjax.sched.prefix_cache.CachedRecycle`.
"""

from __future__ import annotations

import collections
from typing import Sequence

import numpy as np

from kvjax.config import INT32_MAX, AttentionConfig, CacheConfig, is_int
from kvjax.sched import spec
from kvjax.sched.admission import admit, chunk
from kvjax.sched.burst import burst_kind, schedule_burst, schedule_verify_burst
from kvjax.sched.blocks import BlockAllocator
from kvjax.sched.drafter import Drafter
from kvjax.sched.integrity import check_scheduler
from kvjax.sched.ledger import Ledger
from kvjax.sched.plan import StepPlan, build_plan, pow2_buckets, seq_buckets, token_buckets
from kvjax.sched.prefix_cache import PrefixCache, PrefixCacheConfig
from kvjax.sched.rebuild import rebuild
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
            self.start(req)
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
            self.release(req)
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
        when a fault may have left this one's state half-changed: :func:`kvjax.sched.rebuild.rebuild` (the requests
        not done are queued to be recomputed, running ones first; the prefix cache starts empty)."""
        fresh = Scheduler(self.cache, self.attention, **self._options)
        fresh._next_id = self._next_id
        return rebuild(self, fresh)

    def schedule(self, burst: int = 1, drafter: Drafter | None = None) -> StepPlan:
        """Pick this step's work, allocate its pages, and return its plan (see the module docstring).

        ``burst > 1``: when every running request decodes and no queued request could be admitted now (no free
        slot, or not the pages of its first chunk), a decode burst (:mod:`kvjax.sched.burst`): each row runs
        ``min(burst, tokens it may still sample)`` sub-steps in the one step (pages allocated for all of them);
        otherwise (or if those pages are short) an ordinary plan. ``drafter`` (speculative decoding, only with every
        earlier plan resolved): the decoding rows verify its drafts, a verification plan (``draft_len`` set;
        :mod:`kvjax.sched.spec`); with ``burst > 1`` (a drafter that verifies in bursts only: ``bursts``) a
        verification burst where a burst applies and the rule drafts (``spec_span`` set), a decode burst where it
        drafts nothing. A drafting plan's ``spec_k`` is the rule's draft length
        (:func:`kvjax.sched.spec.rule_length`)."""
        if self.prefix is not None:
            self.prefix.begin_plan()
        from_step = bool(getattr(drafter, "from_step", False))
        if drafter is not None and self.ledger.unresolved:
            raise ValueError("schedule: drafting needs every earlier plan resolved (a draft continues the "
                             "request's known tokens)")
        if burst > 1:
            if drafter is not None and not getattr(drafter, "bursts", False):
                raise ValueError("schedule: this drafter's drafts and decode bursts do not combine (verification "
                                 "bursts take a drafter that verifies in bursts: \"mtp\" or \"ngram\")")
            plan = schedule_burst(self, burst) if drafter is None else schedule_verify_burst(self, burst, drafter)
            if plan is not None:
                return self._planned(plan)
        drafts = None
        if drafter is not None:
            drafts = spec.propose(self, drafter)
        budget = self.max_num_batched_tokens
        slots = counts = extra = np.zeros(0, np.int64)  # i64[nseq] each: the plan rows' slots, tokens and drafts
        preempted = False
        if self.running:
            slots, counts, extra, preempted = self._schedule_running(drafts)
            budget -= int(counts.sum())
        restore: dict[int, int] = {}  # request id -> GDN checkpoint restored into its slot first
        hits = 0
        if not preempted:
            new_slots, new_counts, restore, hits = admit(self, budget)
            if new_slots.size:
                slots, counts = np.concatenate([slots, new_slots]), np.concatenate([counts, new_counts])
                extra = np.concatenate([extra, np.zeros(new_slots.size, np.int64)])
        save: dict[int, int] = {}
        if self.prefix is not None:  # the blocks this step completes; entries only later plans can match
            t = self.rows
            for i in np.flatnonzero(t.num_computed[slots] < t.prompt_len[slots]).tolist():
                slot = int(slots[i])
                ckpt = self.prefix.publish(slot, int(t.num_computed[slot] + counts[i]))
                if ckpt >= 0:
                    save[int(t.request_id[slot])] = ckpt
        self.prefix_hit_tokens += hits
        return self._planned(build_plan(self.step, slots, counts, self.rows, self.blocks, self.t_buckets,
                                        self.b_buckets, self.blk_buckets, restore=restore, save=save,
                                        prefix_hit_tokens=hits,
                                        drafts=extra if drafter is not None and extra.any() else None,
                                        spec_k=spec.rule_length(self, drafter) if from_step else 0))

    def _planned(self, plan: StepPlan) -> StepPlan:
        """``plan`` becomes the latest (the one ``advance`` / ``update`` take next); the step counter moves on."""
        self.ledger.planned = plan
        self.step += 1
        return plan

    def burst_ready(self, burst: int) -> bool:
        """Whether :meth:`schedule` ``(burst)`` would return a decode burst now, or this scheduler has nothing to
        run (its plan is empty, which fits a burst step of other data shards). Recycles out-of-window blocks, as
        every ``schedule`` does first; changes nothing else."""
        return self.burst_kind(burst) is not None

    def burst_kind(self, burst: int, drafter: Drafter | None = None) -> str | None:
        """What :meth:`schedule` ``(burst, drafter)`` would run now: :func:`kvjax.sched.burst.burst_kind`."""
        return burst_kind(self, burst, drafter)

    def running_slots(self) -> np.ndarray:
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
        rows = self.running_slots()  # i64[R]
        done = t.num_computed[rows]  # i64[R]
        self.recycle_policy.recycle(blocks, rows, done)
        cap = t.num_tokens[rows] - done  # i64[R]: tokens left to compute
        if self.prefix is not None:
            for i in np.flatnonzero(done < t.prompt_len[rows]).tolist():
                cap[i] = chunk(self, self.running[i], int(done[i]), int(cap[i]))
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

    def clear_prefix_cache(self) -> int:
        """Drop every cached block and checkpoint (pages rows still hold go with their rows); returns pages
        freed. No-op without prefix caching."""
        return self.prefix.clear() if self.prefix is not None else 0

    # ---- transitions ---------------------------------------------------------------------------------------
    def start(self, req: Request) -> None:
        """Transition: ``req`` takes a free slot (and its row) and runs; ``SlotExhaustedError`` if none is free."""
        self.rows.bind(req, self.slots.allocate())  # sets req.slot
        req.status = Status.RUNNING
        self.running.append(req)

    def release(self, req: Request) -> None:
        """Transition: running ``req`` (out of the running list) gives back its slot, its row and all its pages."""
        self.release_many([req])

    def release_many(self, reqs: Sequence[Request]) -> None:
        """:meth:`release` of each of running ``reqs`` (distinct, out of the running list): their pages in one pass
        (:meth:`BlockAllocator.free_rows`), their slots returned in their order."""
        slots = [r.slot for r in reqs]
        for req, slot in zip(reqs, slots):
            self.rows.unbind(req)
            if self.prefix is not None:
                self.prefix.release(slot)
        self.blocks.free_rows(slots)
        for req, slot in zip(reqs, slots):
            self.slots.free(slot)
            req.slot = 0

    def finish(self, req: Request) -> None:
        """Transition: ``req`` is done (its slot and pages go back); it stays known until its last reserved token
        is resolved."""
        self.finish_many([req])

    def finish_many(self, reqs: Sequence[Request]) -> None:
        """:meth:`finish` of each of ``reqs`` (distinct), in order; the running ones released at once
        (:meth:`release_many`)."""
        running = [r for r in reqs if r.status is Status.RUNNING]
        if running:
            gone = {id(r) for r in running}
            self.running[:] = [r for r in self.running if id(r) not in gone]
            self.release_many(running)
        for req in reqs:
            if req.status is Status.PREEMPTED:
                self.preempted.remove(req)
            req.status = Status.FINISHED
            if not req.pending:
                del self.requests[req.request_id]

    def preempt(self, req: Request) -> None:
        """Transition: preempt running ``req`` by recompute (slot and pages freed, progress dropped, requeued
        first)."""
        self.running.remove(req)
        self.release(req)
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
