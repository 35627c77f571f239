"""The engine's steps between dispatch and their tokens: :class:`StepPipeline`.

One call of :meth:`StepPipeline.step` schedules every data shard, executes the prefix caches' host-tier copies,
packs the step's inputs and dispatches it (asynchronously: the device runs while the host goes on), then, unless it
overlaps (``overlap=True`` and nothing older is in flight), reads the oldest step's sampled tokens, applies them to
the schedulers (``resolve``) and collects the requests' outputs. Each step's timings and counts become one
:class:`~kvjax.engine.metrics.StepRecord`: the fields known at dispatch are kept with the step in flight
(:class:`Flight`), the rest are added when its tokens are read. The pipeline owns the steps in flight and the
data shards' sampling tables; the schedulers, the caches, the host store and the outputs router are the engine's,
handed to each call (a fault replaces them all: :meth:`StepPipeline.drop` forgets the steps in flight).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Sequence

import jax
import numpy as np
from jax.profiler import TraceAnnotation

from kvjax.config import AttentionConfig, CacheConfig
from kvjax.engine.host_tier import HostStore
from kvjax.engine.inputs import SamplingTable
from kvjax.engine.metrics import EngineMetrics, StepRecord, device_pages_used, verify_burst_counts
from kvjax.engine.outputs import Outputs, StepOutput
from kvjax.engine.drafting import StepTokens
from kvjax.engine.runner import Runner
from kvjax.engine.verify import spec_rows, sum_stats, verification_plans, verify_stats
from kvjax.models.interface import ModelCaches
from kvjax.sched import spec
from kvjax.sched.drafter import Drafter, shard_drafters
from kvjax.sched.plan import StepPlan
from kvjax.sched.scheduler import Scheduler


@dataclasses.dataclass
class Flight:
    """A dispatched step whose sampled tokens have not been read yet."""

    plans: list[StepPlan]  # one per data shard
    tokens: jax.Array  # i32[max_seqs * decode_burst] (i32[D, max_seqs] on a mesh): sampled tokens, on the device
    record: dict  # the StepRecord fields known at dispatch
    drafts: jax.Array | None = None  # i32[B, K] (i32[D, B, K] on a mesh): the MTP drafts the step made; None: none
    verify: bool = False  # a verification step: its tokens in the verification layout (kvjax.engine.verify)


class StepPipeline:
    """Dispatches steps and reads their tokens back, up to one step ahead (see the module docstring).

    Args:
      runner: the engine's device step (packing, dispatch, the inputs' debug view).
      cache_config: the engine's cache geometry (per device on a mesh).
      attention: the head layout the schedulers manage (checked against the inputs when ``debug``).
      metrics: where each step's record goes (the engine's).
      data_shards: schedulers per step (one sampling table each).
      decode_burst: sub-steps a decode burst may run (1: single steps).
      drafter: speculative decoding's drafter, or None.
      overlap: dispatch step N+1 before reading step N's tokens.
      prefix_caching: the plans carry checkpoint copies and the schedulers a prefix cache.
      use_decode_path: decode-only steps take the models' decode path.
      debug: validate every step's device inputs before dispatch.
      vocab_size: the model's vocabulary (checked when ``debug``).
      on_mesh: per-device page counts are recorded.
    """

    def __init__(self, runner: Runner, cache_config: CacheConfig, attention: AttentionConfig, metrics: EngineMetrics,
                 *, data_shards: int, decode_burst: int, drafter: Drafter | None, overlap: bool, prefix_caching: bool,
                 use_decode_path: bool, debug: bool, vocab_size: int, on_mesh: bool) -> None:
        self.runner, self.cache_config, self.attention, self.metrics = runner, cache_config, attention, metrics
        self.data_shards = data_shards
        self.decode_burst, self.drafter, self.overlap = decode_burst, drafter, overlap
        self.prefix_caching, self.use_decode_path, self.debug = prefix_caching, use_decode_path, debug
        self.vocab_size, self.on_mesh = vocab_size, on_mesh
        self.sampling = [SamplingTable(cache_config.max_seqs + 1) for _ in range(data_shards)]
        self.inflight: collections.deque[Flight] = collections.deque()  # dispatched, tokens not read, oldest first

    @property
    def drafter(self) -> Drafter | None:
        """Speculative decoding's drafter (settable); each data shard schedules with its own of
        :attr:`drafters` (:func:`kvjax.sched.drafter.shard_drafters`)."""
        return self._drafter

    @drafter.setter
    def drafter(self, drafter: Drafter | None) -> None:
        self._drafter = drafter
        self.drafters = shard_drafters(drafter, self.data_shards)

    def _burst(self, scheds: Sequence[Scheduler]) -> int:
        """The sub-steps every data shard's plan of this step may run: a burst step is one for every data shard,
        of one kind (:meth:`Scheduler.burst_kind`: all decode bursts or all verification bursts; a shard with
        nothing to run fits any), else single steps."""
        burst = self.decode_burst
        if len(scheds) == 1 or burst == 1:
            return burst
        kinds = {s.burst_kind(burst, d) for s, d in zip(scheds, self.drafters)} - {"idle"}
        return burst if None not in kinds and len(kinds) <= 1 else 1

    def device_idle(self) -> bool:
        """Everything dispatched has finished (non-blocking)."""
        return not self.inflight or self.inflight[-1].tokens.is_ready()

    def step(self, schedulers: Sequence[Scheduler], caches: ModelCaches, host_store: HostStore | None,
             outputs: Outputs) -> tuple[list[StepOutput], ModelCaches]:
        """Dispatch a step if any scheduler has work or nothing is in flight; then, unless this step overlaps the
        one before (or nothing is in flight), read the oldest step's tokens. Returns its outputs (``[]`` for
        none) and the caches after the dispatched step."""
        t0 = time.perf_counter()
        dispatched = False
        if any(s.has_unfinished() for s in schedulers) or not self.inflight:
            caches = self._dispatch(schedulers, caches, host_store, outputs, t0)
            dispatched = True
        if not self.inflight or (dispatched and self.overlap and len(self.inflight) == 1):
            return [], caches
        start = time.perf_counter() if dispatched else t0
        idle = not dispatched and self.device_idle()
        return self._resolve(schedulers, outputs, start, idle), caches

    def drop(self) -> None:
        """Forget the steps in flight (after a fault): their device work is recorded, with no tokens."""
        lost = list(self.inflight)
        self.inflight.clear()
        for f in lost:
            self._record(f, generated=0, t_wait=0.0, t_update=0.0, t_part=0.0, t_exposed=0.0)

    def _dispatch(self, scheds: Sequence[Scheduler], caches: ModelCaches, host_store: HostStore | None,
                  outputs: Outputs, t0: float) -> ModelCaches:
        """Schedule (every data shard), build inputs and dispatch one step (queued in ``inflight``); returns the
        caches it writes."""
        idle_since = t0 if self.device_idle() else None
        preempt0 = sum(s.num_preemptions for s in scheds)
        with TraceAnnotation("kvjax.schedule"):  # the step's phases in a profiler trace (cheap when none runs)
            burst = self._burst(scheds)
            plans = [s.schedule(burst, d) for s, d in zip(scheds, self.drafters)]
            if len(plans) > 1 and burst > 1:  # one layout for every shard: bursts of one kind (or empty plans)
                kinds = {(p.spec_span is not None, p.burst_len is not None) for p in plans if p.num_seqs}
                assert len(kinds) <= 1, f"data shards' plans of step {plans[0].step} mix burst kinds: {kinds}"
        if not any(p.num_seqs for p in plans):
            raise RuntimeError(f"engine stalled at step {plans[0].step}: nothing schedulable; running="
                               f"{[r for s in scheds for r in s.running]}, waiting="
                               f"{sum(len(s.waiting) for s in scheds)}, preempted={sum(len(s.preempted) for s in scheds)}")

        def probe() -> None:  # idle counts from the first probe that sees it
            nonlocal idle_since
            if idle_since is None and self.device_idle():
                idle_since = time.perf_counter()

        probe()  # before the copies and after each group of them: idle time beginning while they are issued counts
        caches, copies = self._host_copies(scheds, caches, host_store, probe)
        copies_compiled = copies.pop("compiled")
        t1 = time.perf_counter()
        if idle_since is None and self.device_idle():
            idle_since = t1
        c = self.cache_config
        page_base = scheds[0].blocks.page_base
        with TraceAnnotation("kvjax.inputs"):
            shaped = verification_plans(self.runner.shape(plans))  # one verifies: all do (one layout on a mesh)
            samplings = [table.rows(p, outputs.tracked) for table, p in zip(self.sampling, shaped)]
            greedy_only = not any(bool((s["temperature"] > 0).any()) for s in samplings)
            nxt = [spec.next_tokens(s, p) for s, p in zip(scheds, shaped)] if self.runner.head is not None else None
            hist = None
            if self.runner.ngram is not None and any(p.spec_span is not None for p in shaped):  # once per burst
                width = spec.history_width(scheds, shaped)
                hist = [spec.histories(s, p, width) for s, p in zip(scheds, shaped)]
            buf, layout = self.runner.pack(shaped, samplings, page_base=page_base, page_size=c.page_size,
                                           use_decode_path=self.use_decode_path, checkpoints=self.prefix_caching,
                                           next_ids=nxt, history=hist)
            if self.debug:
                for inputs, groups in self.runner.device_inputs(shaped, page_base, c.num_pages, c.page_size,
                                                                self.use_decode_path):
                    inputs.validate(num_pages=c.num_pages, page_size=c.page_size, max_slots=c.max_seqs + 1,
                                    vocab_size=self.vocab_size, attention=self.attention,
                                    shared_pages=self.prefix_caching, page_groups=groups)
            prev = self.inflight[-1] if self.inflight else None
            for d, plan in enumerate(plans):
                if (plan.prev_index >= 0).any() and (prev is None or prev.plans[d].step != plan.step - 1):
                    raise AssertionError(f"step {plan.step} feeds tokens of a step that is not the one in flight")
        t2 = time.perf_counter()
        if idle_since is None and self.device_idle():
            idle_since = t2
        traces0 = self.runner.num_traces
        prev_tokens = self.runner.no_tokens if prev is None else prev.tokens
        with TraceAnnotation("kvjax.dispatch"):
            tokens, caches = self.runner.step(caches, buf, prev_tokens, layout, greedy_only)
        drafts = None
        if isinstance(tokens, StepTokens):  # the MTP drafter's drafts beside the tokens
            tokens, drafts = tokens
            drafts.copy_to_host_async()  # read after the tokens: its copy starts when the step ends, not then
        t3 = time.perf_counter()
        with TraceAnnotation("kvjax.advance"):
            for sched, plan in zip(scheds, plans):
                sched.advance(plan)
        used = sum(s.blocks.used_pages() for s in scheds)
        record = dict(
            step=plans[0].step, num_tokens=sum(p.num_tokens for p in plans),
            num_seqs=sum(p.num_seqs for p in plans), bucket_tokens=int(shaped[0].token_ids.shape[0]),
            bucket_rows=int(shaped[0].seq_lens.shape[0]), bucket_blocks=int(shaped[0].block_tables.shape[2]),
            decode_only=layout.decode_only, running=sum(len(s.running) for s in scheds),
            waiting=sum(len(s.waiting) + len(s.preempted) for s in scheds),
            preemptions=sum(s.num_preemptions for s in scheds) - preempt0, pages_used=used,
            prefix_hit_tokens=sum(p.prefix_hit_tokens for p in plans),
            prefill_tokens=sum(p.prefill_tokens for p in plans),
            cached_pages=sum(s.prefix.cached_pages() for s in scheds if s.prefix is not None),
            burst=max(max(p.burst, p.spec_steps) for p in plans),
            computed=sum(p.num_tokens if p.burst_len is None else int(p.burst_len[: p.num_seqs].sum()) for p in plans),
            row_steps=sum(p.num_seqs if p.burst_len is None else int(p.burst_len[: p.num_seqs].sum()) for p in plans),
            pages_free=sum(s.blocks.num_pages for s in scheds) - used,
            compiled=self.runner.num_traces > traces0 or copies_compiled,
            pages_used_devices=device_pages_used(scheds) if self.on_mesh else (),
            t_schedule=t1 - t0 - copies["t_copy"], t_inputs=t2 - t1, t_dispatch=t3 - t2, **copies,
            t_exposed=t3 - idle_since if idle_since is not None else 0.0, t_step=time.perf_counter() - t0)
        self.inflight.append(Flight(plans, tokens, record, drafts, verify=layout.spec > 0))
        return caches

    def _host_copies(self, scheds: Sequence[Scheduler], caches: ModelCaches, host_store: HostStore | None,
                     probe) -> tuple[ModelCaches, dict]:
        """Execute the prefix caches' host-tier copies of the plans just scheduled, before their step is dispatched
        (:mod:`kvjax.engine.host_tier`: in order on the device, their transfers overlapping the step in flight;
        ``probe()`` after each group: the idleness probe); returns the caches and the step record's host-tier
        fields with ``compiled`` (a copy was compiled)."""
        t = time.perf_counter()
        if not self.prefix_caching:
            return caches, dict(t_copy=0.0, compiled=False)
        with TraceAnnotation("kvjax.host_copies"):
            hits = sum(s.prefix.plan_hits()[1] for s in scheds)
            ops = [s.prefix.take_copies() for s in scheds]  # () without a host tier
            store = host_store
            if store is None:
                return caches, dict(t_copy=time.perf_counter() - t, compiled=False)
            out0, in0, traces0 = store.stats.bytes_out, store.stats.bytes_in, store.traces
            caches = store.apply(caches, ops, probe)  # one log per data shard
        return caches, dict(prefix_hit_tokens_host=hits, host_bytes_out=store.stats.bytes_out - out0,
                            host_bytes_in=store.stats.bytes_in - in0, t_copy=time.perf_counter() - t,
                            compiled=store.traces > traces0)

    def _resolve(self, scheds: Sequence[Scheduler], outputs: Outputs, start: float, idle: bool) -> list[StepOutput]:
        """Read the oldest step's tokens (waiting for its device work), apply them, and return their outputs."""
        flight = self.inflight[0]
        t4 = time.perf_counter()
        with TraceAnnotation("kvjax.wait"):
            tokens = np.asarray(flight.tokens)  # the one device -> host copy of a step: i32[max_seqs] or [D, ...]
        t5 = time.perf_counter()
        with TraceAnnotation("kvjax.update"):
            stats, sub_steps = [], []
            D = len(flight.plans)
            drafts = None if flight.drafts is None else np.asarray(flight.drafts).reshape(D, -1, self.runner.spec)
            for d, (sched, plan, row, drafter) in enumerate(zip(scheds, flight.plans, tokens.reshape(D, -1),
                                                                self.drafters)):
                if flight.verify:  # the step's rows cut to this plan's (a shard without drafts: its t_0's)
                    row = spec_rows(row, plan, flight.record["bucket_rows"])
                sched.resolve(plan, row)
                if plan.draft_len is not None:  # speculative decoding's counts, summed over the data shards
                    stats.append(verify_stats(plan, row))
                if plan.spec_steps:  # a verification burst: what every sub-step computed, not sub-step 0's plan
                    computed, row_steps, ran = verify_burst_counts(plan, row)
                    flight.record["computed"] += computed - plan.num_tokens
                    flight.record["row_steps"] += row_steps - plan.num_seqs
                    sub_steps.append(ran)
                if flight.drafts is not None and getattr(drafter, "from_step", False):  # the next plan's drafts
                    n = plan.num_seqs
                    drafter.record(sched.rows, plan.gdn_slots[:n].astype(np.int64),
                                   np.fromiter(plan.request_ids, np.int64, n), drafts[d])
            if stats:
                flight.record.update(sum_stats(stats))
            if sub_steps:  # the sub-steps the burst ran (its loop ends when no row is live; on a mesh the longest
                # data shard's)
                flight.record["sub_steps"] = max(sub_steps)
            self.inflight.popleft()
            outs = [out for sched, plan in zip(scheds, flight.plans) for out in outputs.collect_plan(sched, plan)]
        t6 = time.perf_counter()
        # device idle after the wait when nothing else is in flight (from ``start`` if already idle then)
        exposed = 0.0 if self.inflight else t6 - (start if idle else t5)
        self._record(flight, generated=sum(len(out.tokens) for out in outs), t_wait=t5 - t4, t_update=t6 - t5,
                     t_part=t6 - start, t_exposed=exposed)
        return outs

    def _record(self, flight: Flight, *, generated: int, t_wait: float, t_update: float, t_part: float,
                t_exposed: float) -> None:
        r = flight.record
        self.metrics.append(StepRecord(**{**r, "generated": generated, "t_wait": t_wait, "t_update": t_update,
                                          "t_step": r["t_step"] + t_part, "t_exposed": r["t_exposed"] + t_exposed}))
