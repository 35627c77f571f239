"""The engine: continuous batching over the jitted model step, planning step N+1 while step N runs.

One step (``overlap=True``, the default)::

    plan = scheduler.schedule(burst)         # host: recycle, admit / preempt, pages; padded arrays of step N+1
    buf, layout = runner.pack([plan], ...)   # every input in one i32 host buffer
    tokens, caches = runner.step(caches, buf, tokens_of_step_N, layout, greedy_only)  # async dispatch
    scheduler.advance(plan)                  # requests move on; sampled tokens reserved, values unknown
    scheduler.resolve(plan_N, device_get(tokens_of_step_N))   # waits for step N only; step N's outputs

A decode row's input is the token step N samples, named by row (``StepPlan.prev_index``) and read on the device:
the host never waits for it before planning, so eos, aborts and preemption act one step late (a token computed
after eos is dropped); the tokens equal ``overlap=False``'s. Decode bursts (``decode_burst``,
:mod:`kvjax.engine.burst`) run up to ``K`` decode sub-steps per dispatch.

The engine holds the requests' outputs (:mod:`kvjax.engine.outputs`), the device caches (donated to every step),
one :class:`~kvjax.engine.runner.Runner` (the step, on one device or a mesh) and one
:class:`~kvjax.engine.pipeline.StepPipeline` (the steps dispatched and not yet read, and how one is); slots, pages
and block tables belong to :class:`kvjax.sched.Scheduler` (one per data shard); the model is seen only through
:class:`kvjax.models.interface.CausalLM`. Options: :class:`~kvjax.engine.options.EngineOptions`, checked and
resolved by :mod:`kvjax.engine.setup`; call arguments :mod:`kvjax.engine.calls`; cache sizing
:mod:`kvjax.engine.sizing`; prefix caching's host tier :mod:`kvjax.engine.host_tier`; metrics
:mod:`kvjax.engine.metrics`. The contracts (overlap, bursts, sampling, outputs, faults, prefix caching, meshes,
profiling phases) are in docs/contracts.md, "Models and engine"; where the engine sits in docs/architecture.md.

Use::

    engine = Engine(model)                                   # cache sized from the free device memory
    outs = engine.generate(prompts, max_new_tokens=64)       # list[list[int]], greedy
    for ev in engine.stream(prompts, SamplingParams(temperature=0.7, max_tokens=64)):  # a TokenEvent per token
        if ev.index == 3 and ev.position > 10: engine.abort(ev.request_id)
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator, Sequence

import jax
import numpy as np

from kvjax.config import CacheConfig, is_int
from kvjax.engine.args import check_index, check_prompt, set_buckets, stop_ids
from kvjax.engine.calls import Call, check_call, is_text, progress_bar
from kvjax.engine.outputs import Outputs, StepOutput, TokenEvent, Tracked
from kvjax.engine.host_tier import HostStore
from kvjax.engine.options import EngineOptions
from kvjax.engine.sampling import SamplingParams, call_params
from kvjax.engine.runner import Runner
from kvjax.engine.metrics import EngineMetrics
from kvjax.engine.pipeline import StepPipeline
from kvjax.engine.setup import settle
from kvjax.models.interface import CausalLM
from kvjax.errors import RequestTooLongError
from kvjax.sched.drafter import ngram_sizes
from kvjax.sched.scheduler import Scheduler

logger = logging.getLogger(__name__)


class Engine:
    """Continuous-batching generation for one model over fixed page memory.

    Args:
      model: a :class:`kvjax.models.interface.CausalLM` (a Qwen3.5 or DeepSeek-V3.2 kvjax model).
      cache_config: pages, page size, ``max_seqs`` (GDN slots and batch rows), block-table width. ``None``:
        sized from the model and ``memory_fraction`` of the free device memory (a fixed budget on CPU; see
        :mod:`kvjax.engine.sizing`; per device on a mesh); logged, and kept in ``cache_sizing`` / :meth:`describe`.
      mesh: a ``jax.sharding.Mesh(devices, ("data", "model"))``: the model is split with
        :func:`kvjax.models.sharding.shard_model` and each data shard gets its own scheduler, ``max_seqs`` slots
        and ``num_pages`` pages *per device* (see :mod:`kvjax.engine.runner`). ``model`` may also be a
        :class:`~kvjax.models.sharding.ShardedModel` (e.g. ``load_pretrained(path, mesh=...)``), whose mesh is
        used. Every option works on a mesh.
      tokenizer: encodes text prompts of :meth:`generate` / :meth:`stream` and decodes :meth:`generate`'s outputs
        of text prompts (``None``: token ids only; ids are always accepted).
      options: an :class:`~kvjax.engine.options.EngineOptions` (scheduling, recycling, bursts, overlap, prefix
        caching, cache dtype and sizing share, buckets, debugging); ``**settings``: its fields by name, over
        ``options`` where both are given (``Engine(model, cache, recycle="timely", decode_burst=1)``). Kept as
        ``options``.
    """

    def __init__(self, model: CausalLM, cache_config: CacheConfig | None = None, *,
                 mesh: jax.sharding.Mesh | None = None, tokenizer: Any = None, options: EngineOptions | None = None,
                 **settings: Any) -> None:
        setup = settle(model, cache_config, mesh, tokenizer, options, settings)
        o = self.options = setup.options
        # "mtp" and "ngram" verify in verification bursts; another drafter object's verification steps are single steps
        bursts = getattr(setup.drafter, "from_step", False) or ngram_sizes(setup.drafter) is not None
        self.decode_burst = o.burst if o.speculative is None or bursts else 1
        self.drafter = setup.drafter  # kvjax.sched.drafter
        self.model, self.sharded = model, setup.sharded
        sharded = setup.sharded
        self.mesh = None if sharded is None else sharded.mesh
        self.data_shards = 1 if sharded is None else sharded.data_size
        self.cache_config = cache_config = setup.cache_config
        self.cache_sizing = setup.cache_sizing  # how the cache was sized (None: given)
        if self.cache_sizing is not None:
            logger.info("kvjax engine: %s", self.cache_sizing.describe())
        self.overlap = o.overlap and o.speculative is None  # a step's drafts need the previous step's tokens
        self.tokenizer = tokenizer  # text prompts in, text out of generate (load_tokenizer); None: ids only
        self.eos_token_ids = setup.eos_token_ids  # tuple[int, ...]: end every request
        self.eos_token_id = self.eos_token_ids[0] if self.eos_token_ids else None  # the first (None: none)
        self.attention = (model if sharded is None else sharded).attention_layout()  # on a mesh: the placed heads
        prefix = setup.prefix
        self.schedulers = [Scheduler(cache_config, self.attention, max_num_batched_tokens=setup.max_num_batched_tokens,
                                     pool=o.pool, recycle=o.recycle, watermark=o.watermark, prefix_cache=prefix,
                                     page_shards=setup.page_shards) for _ in range(self.data_shards)]
        self.scheduler = self.schedulers[0]  # the scheduler (of data shard 0 on a mesh); a new object after a fault
        self.prefix_caching = prefix is not None
        set_buckets(self.schedulers, cache_config, setup.max_num_batched_tokens, o.token_buckets, o.row_buckets,
                    o.block_buckets)
        if sharded is not None and setup.page_shards > 1:  # the allocator's pools are the devices' pools
            owners = [sharded.head_owner(h) for h in range(self.attention.num_kv_heads)]
            assert (self.scheduler.blocks.page_base == np.asarray(owners) * cache_config.num_pages).all()
        self._next_id = 0  # request ids over all data shards
        self.recycle = o.recycle if isinstance(o.recycle, str) else type(o.recycle).__name__
        self.pool = o.pool
        self.debug = o.debug
        self.use_decode_path = o.use_decode_path
        self._cache_args = setup.cache_args
        self.runner = Runner(model, sharded, max_seqs=cache_config.max_seqs, burst=self.decode_burst,
                             max_traces=o.max_traces,
                             spec=0 if o.speculative is None else o.speculative.num_draft_tokens,
                             head=setup.draft_head, ngram=ngram_sizes(setup.drafter))
        self.host_store = self._host_store() if prefix is not None and prefix.host_bytes else None  # the tier's data
        if self.host_store is not None:  # every step argument committed alike (see _init_caches)
            self.runner.no_tokens = self.host_store.on_device(self.runner.no_tokens)
        self.caches = self._init_caches()
        self.outputs = Outputs()  # what each request was given; the consumers' queues
        self.num_recoveries = 0  # faults recovered from (see step)
        self.metrics = EngineMetrics()
        self.pipeline = StepPipeline(self.runner, cache_config, self.attention, self.metrics,
                                     data_shards=self.data_shards, decode_burst=self.decode_burst,
                                     drafter=self.drafter, overlap=self.overlap, prefix_caching=self.prefix_caching,
                                     use_decode_path=self.use_decode_path, debug=self.debug,
                                     vocab_size=self.vocab_size, on_mesh=self.mesh is not None)

    def _host_store(self) -> HostStore:  # the host tier's data and copies, on this engine's device(s)
        return HostStore(sharded=self.sharded)

    def _init_caches(self):  # on a mesh: num_pages per device, leading data / model axes
        caches = self.runner.init_caches(self.model, **self._cache_args)
        if self.host_store is not None:  # committed to the device as the copies' outputs are: one step trace key
            caches = self.host_store.on_device(caches)
        return caches

    @property
    def total_pages(self) -> int:
        """Pages of every pool together (``num_pages`` on one device; ``num_pages`` x devices holding distinct
        pages on a mesh)."""
        return sum(s.blocks.num_pages for s in self.schedulers)

    def describe(self) -> str:
        """One line: mode, cache geometry (and how it was sized), scheduler policies."""
        c = self.cache_config
        cache = (self.cache_sizing.describe() if self.cache_sizing is not None else
                 f"cache {c.num_pages} pages of {c.page_size} tokens, {c.max_seqs} sequences of up to "
                 f"{c.max_blocks_per_seq} blocks")
        mesh = "" if self.mesh is None else f", mesh {self.data_shards}x{self.sharded.model_size} (data x model)"
        return (f"Engine({type(self.model).__name__}{mesh}, overlap={'on' if self.overlap else 'off'}, "
                f"recycle={self.recycle}, pool={self.pool}, {self.scheduler.max_num_batched_tokens} tokens/step"
                f"{self._describe_prefix()}): "
                f"{cache}")

    def _describe_prefix(self) -> str:
        pc = self.scheduler.prefix
        each = " per data shard" if self.data_shards > 1 else ""
        host = f" and a host tier of {pc.config.host_bytes / 2**30:.2f} GiB{each}" if pc is not None and pc.host else ""
        return "" if pc is None else (f", prefix caching {pc.config.recycle} with {pc.config.num_checkpoints} "
                                      f"checkpoints{host}")

    def clear_prefix_cache(self) -> int:
        """Drop every cached prompt block and GDN checkpoint (blocks that running requests hold stay theirs);
        returns the pages freed. No-op without prefix caching."""
        freed = sum(s.clear_prefix_cache() for s in self.schedulers)
        if self.host_store is not None:  # the host tier's copies are dropped now, not at the next step
            self.caches = self.host_store.apply(self.caches, [s.prefix.take_copies() for s in self.schedulers])
        return freed

    # ---- requests --------------------------------------------------------------------------------------------
    @property
    def num_traces(self) -> int:
        """How many times this engine's device step has been traced (= compiled) so far."""
        return self.runner.num_traces

    @property
    def vocab_size(self) -> int:
        return int(self.model.vocab_size)

    def add_request(self, prompt: Sequence[int] | np.ndarray, params: SamplingParams | int | None = None, *,
                    max_new_tokens: int | None = None, temperature: float | None = None, seed: int | None = None,
                    index: int = 0) -> int:
        """Queue one request; returns its request id. Its tokens come back from :meth:`step` (:class:`StepOutput`
        s).

        ``params``: a :class:`SamplingParams` (temperature, top-k / top-p, seed, ``max_tokens``, stop ids), or
        the short form: ``max_new_tokens`` as an int (here or as ``max_new_tokens=``) with ``temperature=``
        (default 0, greedy) and ``seed=`` (default 0), which then must not be given with a ``SamplingParams``.
        ``index`` names the request in outputs and selects its sampling stream (with the seed). The request ends
        at ``max_tokens`` or at the first sampled token among the engine's ``eos_token_ids`` and its
        ``stop_token_ids``.

        Raises :class:`RequestTooLongError` if the cache can never hold it, and ``ValueError`` naming the value
        for a prompt that is not a non-empty 1-d sequence of ints in ``[0, vocab_size)``, a bad ``SamplingParams``
        field or short-form argument (``max_new_tokens`` not an int >= 1, a temperature that is not a finite
        number >= 0, a seed outside int32), a stop id outside the vocabulary, more than 8 stop ids with the
        engine's eos ids, or an index outside ``[0, 2**31)``; on error nothing is queued.
        """
        (params,) = call_params(1, params, max_new_tokens, temperature, seed)
        index = check_index(index)
        prompt = check_prompt(prompt, self.vocab_size)
        return self._queue(prompt, params, stop_ids(self.eos_token_ids, params, self.vocab_size), index)

    def _queue(self, prompt: np.ndarray, params: SamplingParams, stops: tuple[int, ...], index: int) -> int:
        """Queue a checked request; ``stops``: its stop ids (the engine's eos ids, then its own: ``stop_ids``)."""
        if self.data_shards == 1:
            req = self.scheduler.add_request(prompt, params.max_tokens, eos_token_id=stops)
        else:  # the data shard with the fewest unfinished requests (lowest index on ties); ids over all shards
            load = [len(s.running) + len(s.waiting) + len(s.preempted) for s in self.schedulers]
            sched = self.schedulers[load.index(min(load))]
            req = sched.add_request(prompt, params.max_tokens, eos_token_id=stops, request_id=self._next_id)
            self._next_id += 1
        self.outputs.track(req.request_id, Tracked(index, params, req))
        return req.request_id

    def num_waiting(self) -> int:
        """Requests queued and not running: waiting for their first admission or preempted (every data shard)."""
        return sum(len(s.waiting) + len(s.preempted) for s in self.schedulers)

    def has_unfinished(self) -> bool:
        """A request is queued, running, or waiting for tokens of a step in flight."""
        return any(s.has_unfinished() for s in self.schedulers) or bool(self.outputs.tracked)

    def abort(self, request_id: int) -> list[int]:
        """Abort a queued or running request (its slot and pages go back at once); returns the tokens that were
        delivered (by :meth:`step`, or yielded by its stream). Its tokens not yet delivered (a stream's queue,
        outputs held for the next ``step()``, a burst's later tokens) are dropped, and so is any token a step in
        flight samples for it (a request that finished in the scheduler with tokens still undelivered is aborted
        too). ``ValueError`` for a request id that is not an int, unknown, or whose tokens were all delivered."""
        if not is_int(request_id):
            raise ValueError(f"request_id must be an int, got {request_id!r}")
        owner = [s for s in self.schedulers if request_id in s.requests]
        if not owner and not self.outputs.known(request_id):
            raise ValueError(f"unknown request id {request_id} (never added, aborted, or all its tokens delivered)")
        if owner:
            owner[0].abort(request_id)
        return self.outputs.drop(request_id)

    def stream(self, prompts: Sequence[Sequence[int]],
               params: SamplingParams | Sequence[SamplingParams] | int | Sequence[int] | None = None, *,
               max_new_tokens: int | Sequence[int] | None = None, temperature: float | None = None,
               seed: int | None = None, progress: bool | None = None) -> Iterator[TokenEvent]:
        """Generate for every prompt, yielding each token as it is sampled (:class:`TokenEvent`).

        ``params``: one :class:`SamplingParams` for every prompt or one per prompt; or the short form,
        ``max_new_tokens`` (an int or one per prompt, here or as ``max_new_tokens=``) with ``temperature=`` and
        ``seed=`` for every prompt (see :meth:`add_request`). A prompt's index in ``prompts`` selects its sampling
        stream.

        Arguments are checked when ``stream`` is called (``ValueError`` naming the value, as
        :meth:`add_request`); the requests are queued at the first ``next()``. A prompt that can never fit raises
        :class:`RequestTooLongError` naming its index before any step runs, and none of this call's requests
        stays queued. The caller may :meth:`abort` any request (by ``event.request_id``) between events;
        closing the generator early (or an error inside it) aborts what is left.

        Several consumers may run at once (two streams consumed alternately, ``generate`` inside a ``stream``
        loop): whichever consumer runs a step, every event goes to the stream whose request produced it, so
        each consumer gets all of its tokens, in order. ``progress``: tqdm bar over generated tokens (``None``:
        on when the run generates >= 4096 tokens).
        """
        return self._stream(self._check_call(prompts, params, max_new_tokens, temperature, seed), progress)

    def _check_call(self, prompts, params, max_new_tokens, temperature, seed) -> list[Call]:
        return check_call(prompts, params, max_new_tokens, temperature, seed, tokenizer=self.tokenizer,
                          vocab_size=self.vocab_size, eos_token_ids=self.eos_token_ids)

    def _stream(self, calls: list[Call], progress: bool | None, chunks: bool = False
                ) -> Iterator[TokenEvent] | Iterator[StepOutput]:
        """Queue ``calls`` and run steps until every one is delivered, yielding its tokens as :class:`TokenEvent` s
        (``chunks``: as the :class:`StepOutput` s the steps delivered); closed early, it aborts what is left."""
        ids = []
        try:
            for i, (p, params, stops) in enumerate(calls):
                try:
                    ids.append(self._queue(p, params, stops, i))
                except RequestTooLongError as err:
                    raise RequestTooLongError(f"prompt {i} (length {len(p)}) rejected: {err}") from None
        except BaseException:
            for rid in ids:
                self.abort(rid)
            raise
        box = self.outputs.open_stream(ids, chunks)
        bar = progress_bar(int(sum(params.max_tokens for _, params, _ in calls)), progress)
        try:
            while box or any(rid in self.outputs.tracked for rid in ids):
                if not box:
                    self._stream_step()
                    continue
                ev = box.popleft()
                self.outputs.consumed(ev)
                if bar is not None:
                    bar.update(len(ev.tokens) if chunks else 1)
                yield ev
        finally:
            if bar is not None:
                bar.close()
            for rid in self.outputs.close_stream(ids):  # generator closed early: abort what is left
                self.abort(rid)

    def generate(self, prompts: Sequence[Sequence[int]] | Sequence[str],
                 params: SamplingParams | Sequence[SamplingParams] | int | Sequence[int] | None = None, *,
                 max_new_tokens: int | Sequence[int] | None = None, temperature: float | None = None,
                 seed: int | None = None, progress: bool | None = None) -> list[list[int]] | list[str]:
        """Generate for every prompt; returns the generated token ids per prompt (prompt order), or, for text
        prompts (an engine with a ``tokenizer``), the generated text per prompt.

        ``params``: one :class:`SamplingParams` for every prompt or one per prompt, e.g.
        ``generate(prompts, SamplingParams(temperature=0.7, top_p=0.9, seed=1, max_tokens=64))``; or the short
        form ``generate(prompts, 64, temperature=0.7, seed=1)`` (``max_new_tokens`` an int or one per prompt,
        ``temperature`` 0 = greedy by default). Sampling keys derive from ``(seed, prompt index, tokens so far)``,
        so the result does not depend on batching, preemption or the recycle policy. Raises ``ValueError``
        (nothing queued) for a bad argument (see :meth:`add_request`) and :class:`RequestTooLongError` (nothing
        queued) if a prompt can never fit in the cache. May run inside another consumer's :meth:`stream` loop.
        """
        calls = self._check_call(prompts, params, max_new_tokens, temperature, seed)
        out: list[list[int]] = [[] for _ in range(len(calls))]
        for chunk in self._stream(calls, progress, chunks=True):  # whole StepOutputs: no object per token
            out[chunk.index].extend(chunk.tokens)
        return [self.tokenizer.decode(ids) for ids in out] if is_text(prompts, self.tokenizer) else out

    # ---- one step --------------------------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """Run one engine step; returns the tokens it delivered as one :class:`StepOutput` per request that got
        any (every request's, including those a :meth:`stream` consumer also receives; a decode burst gives a
        request up to ``decode_burst`` tokens in one output), preceded by the outputs of :meth:`add_request`
        requests that steps run by a :meth:`stream` / :meth:`generate` consumer (or a step that failed) generated
        since, one per such step (only those, without running a step, when nothing is left to run; an idle engine
        returns ``[]``).
        ``[t for out in engine.step() for t in out.tokens]`` are the step's tokens; ``out.events()`` gives
        per-token :class:`TokenEvent` s.

        ``overlap=True``: one call schedules and dispatches step N+1, then waits for step N's tokens and returns
        them (the first call returns none; a call with nothing left to schedule only collects the step in
        flight). ``overlap=False``: dispatches a step and returns its tokens.

        A step is a transaction: a fault anywhere in it (a bad argument deep down, a kernel or out-of-memory
        error, a ``KeyboardInterrupt``) is re-raised after :meth:`_recover` has brought the engine back to a state
        derived from the requests' resolved tokens, and the next calls give the outputs of an uninterrupted run.
        """
        with self._transaction():
            outs = self._step() if self.has_unfinished() or (self.pipeline.inflight and not self.outputs.held) else []
            return self.outputs.take_held() + outs

    def _stream_step(self) -> None:
        """One step run by a stream consumer (a transaction, as :meth:`step`): its outputs go to their streams,
        those of requests no stream owns are held for the next :meth:`step`."""
        with self._transaction():
            self.outputs.hold(self._step())

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        """The block is one step: the outputs router records what it delivers, and a fault anywhere inside is
        re-raised after :meth:`_recover`."""
        self.outputs.begin()
        try:
            yield
        except BaseException:
            self._recover()
            raise

    def _step(self) -> list[StepOutput]:
        """:meth:`StepPipeline.step` on the engine's schedulers, caches (rebuilt first if a fault lost them), host
        store and outputs."""
        if self.caches is None:
            self.caches = self._init_caches()
        outs, self.caches = self.pipeline.step(self.schedulers, self.caches, self.host_store, self.outputs)
        return outs

    def _recover(self) -> None:
        """After a fault at any point of a step: re-derive the engine's state from one source of truth, the
        requests' resolved tokens. The outputs the step had begun to deliver are taken back
        (:meth:`Outputs.rollback`); the steps in flight are dropped (recorded with 0 tokens); every scheduler is
        rebuilt from its requests (:meth:`Scheduler.rebuilt`: the unfinished ones recomputed, as after a
        preemption; the prefix cache empty); the caches, possibly donated or half-written, are rebuilt at the next
        dispatch; tokens resolved but not yet delivered go out with the next call. Sampling keys depend only on
        (seed, prompt index, tokens so far), so the recomputed tokens are the ones an uninterrupted run gives."""
        self.num_recoveries += 1
        self.outputs.rollback()
        self.pipeline.drop()
        self.caches = None
        if self.host_store is not None:  # its spilled blocks belong to the prefix cache that starts over
            self.host_store = self._host_store()
        self.schedulers = [s.rebuilt() for s in self.schedulers]
        self.scheduler = self.schedulers[0]
        self.outputs.rebind({rid: req for s in self.schedulers for rid, req in s.requests.items()})
        self.outputs.hold(self.outputs.collect(list(self.outputs.tracked)))

    # ---- invariants ------------------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """The schedulers' allocator and queue invariants (``AssertionError`` if broken)."""
        for sched in self.schedulers:
            sched.check_integrity()

    def is_idle(self) -> bool:
        """No request queued, running or waiting for tokens, every slot and page free (a step whose requests all
        finished or were aborted may still be in flight: it holds nothing)."""
        return not self.outputs.tracked and all(not s.has_unfinished() and s.slots.num_used == 0
                                         and s.blocks.used_pages() == 0 for s in self.schedulers)

