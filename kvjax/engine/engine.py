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

The engine holds the requests' outputs (:mod:`kvjax.engine.outputs`), the device caches (donated to every step)
and one :class:`~kvjax.engine.runner.Runner` (the step, on one device or a mesh); slots, pages and block tables
belong to :class:`kvjax.sched.Scheduler` (one per data shard); the model is seen only through
:class:`kvjax.models.interface.CausalLM`. Options: :class:`~kvjax.engine.options.EngineOptions`; cache sizing
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

import collections
import contextlib
import dataclasses
import logging
import time
import warnings
from typing import Any, Iterator, Sequence

import jax
import numpy as np
from flax import nnx
from jax.profiler import TraceAnnotation

from kvjax.config import CacheConfig, is_int
from kvjax.engine.args import (cache_options, check_cache_dtype, check_eos, check_index, check_prompt, check_prompts,
                               prefix_config, set_buckets, stop_ids)
from kvjax.engine.outputs import Outputs, StepOutput, TokenEvent, Tracked
from kvjax.engine.host_tier import HostStore, host_tier_config
from kvjax.engine.inputs import SamplingTable
from kvjax.engine.options import EngineOptions
from kvjax.engine.sampling import SamplingParams, call_params
from kvjax.engine.runner import Runner, engine_model
from kvjax.engine.metrics import EngineMetrics, StepRecord, device_pages_used
from kvjax.engine.verify import verify_stats
from kvjax.engine.sizing import CacheSizing, check_cache_fits, default_max_seqs, size_cache
from kvjax.models.interface import CausalLM
from kvjax.models.sharding import ShardedModel
from kvjax.sched.plan import StepPlan
from kvjax.errors import RequestTooLongError
from kvjax.sched.drafter import make_drafter
from kvjax.sched.scheduler import Scheduler

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _Flight:
    """A dispatched step whose sampled tokens have not been read yet."""

    plans: list[StepPlan]  # one per data shard
    tokens: jax.Array  # i32[max_seqs * decode_burst] (i32[D, max_seqs] on a mesh): sampled tokens, on the device
    record: dict  # the StepRecord fields known at dispatch


# ---------------------------------------------------------------------------------------------- engine


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
        if cache_config is not None and not isinstance(cache_config, CacheConfig):
            raise ValueError(f"cache_config must be a CacheConfig or None, got {type(cache_config).__name__}")
        if not isinstance(model, ShardedModel) and (not isinstance(model, CausalLM)
                                                    or not isinstance(model, nnx.Module)):
            raise ValueError(f"model must be an nnx.Module implementing kvjax.models.interface.CausalLM, got "
                             f"{type(model).__name__}")
        if options is not None and not isinstance(options, EngineOptions):
            raise ValueError(f"options must be an EngineOptions or None, got {type(options).__name__}")
        unknown = sorted(set(settings) - {f.name for f in dataclasses.fields(EngineOptions)})
        if unknown:
            raise TypeError(f"Engine got unknown settings {unknown}; settings are EngineOptions fields: "
                            f"{[f.name for f in dataclasses.fields(EngineOptions)]}")
        o = dataclasses.replace(options or EngineOptions(), **settings)
        self.options = o
        self.decode_burst = 1 if o.speculative is not None else o.burst  # verification steps are single steps
        self.drafter = None if o.speculative is None else make_drafter(o.speculative)  # kvjax.sched.drafter
        sharded = engine_model(model, mesh)
        if o.speculative is not None and sharded is not None:
            raise ValueError("speculative decoding on a mesh is not supported yet: give speculative=None or no mesh")
        self.model, self.sharded = model, sharded
        self.mesh = None if sharded is None else sharded.mesh
        self.data_shards = 1 if sharded is None else sharded.data_size
        params = nnx.state(model) if sharded is None else sharded.params
        cache_dtype = check_cache_dtype(o.cache_dtype, params)
        local = model if sharded is None else sharded.local  # what one device holds
        cache_opts = cache_options(local, o.cache_options, o.kv_cache_dtype)  # init_caches' extra keywords
        self.cache_sizing: CacheSizing | None = None
        device = None if sharded is None else sharded.mesh.devices.flat[0]
        prefix = prefix_config(model, o.prefix_caching, o.prefix_checkpoints, o.prefix_recycle,
                                cache_config.max_seqs if cache_config is not None else default_max_seqs(device))
        num_ckpts = prefix.num_checkpoints if prefix is not None else 0
        if cache_config is None:
            self.cache_sizing = size_cache(local, dtype=cache_dtype, memory_fraction=o.memory_fraction,
                                           cache_options=cache_opts, num_checkpoints=num_ckpts, device=device)
            cache_config = self.cache_sizing.cache_config
            logger.info("kvjax engine: %s", self.cache_sizing.describe())
        else:
            if o.memory_fraction is not None:
                raise ValueError(f"memory_fraction={o.memory_fraction!r} sizes the cache only without a cache_config; "
                                 "got both")
            check_cache_fits(local, cache_config, num_ckpts, cache_dtype, cache_opts, device)
        self.cache_config = cache_config
        prefix = host_tier_config(prefix, o.host_cache_bytes, local, page_size=cache_config.page_size,
                                  dtype=cache_dtype, cache_options=cache_opts, mesh=self.mesh)
        self.overlap = o.overlap and o.speculative is None  # a step's drafts need the previous step's tokens
        eos_token_id = o.eos_token_id
        if isinstance(eos_token_id, str) and eos_token_id == "auto":
            generation = getattr(model, "generation_config", None)
            eos_token_id = None if generation is None else generation.eos_token_ids
        if tokenizer is not None and not (callable(getattr(tokenizer, "encode", None))
                                          and callable(getattr(tokenizer, "decode", None))):
            raise ValueError(f"tokenizer must have encode(text) -> ids and decode(ids) -> text (a transformers "
                             f"tokenizer, e.g. kvjax.models.load_tokenizer), got {type(tokenizer).__name__}")
        self.tokenizer = tokenizer  # text prompts in, text out of generate (load_tokenizer); None: ids only
        self.eos_token_ids = check_eos(eos_token_id, int(model.vocab_size))  # tuple[int, ...]: end every request
        self.eos_token_id = self.eos_token_ids[0] if self.eos_token_ids else None  # the first (None: none)
        self.attention = (model if sharded is None else sharded).attention_layout()  # on a mesh: the placed heads
        max_num_batched_tokens = o.max_num_batched_tokens
        if max_num_batched_tokens is None:
            max_num_batched_tokens = max(256, cache_config.max_seqs)
        page_shards = sharded.model_size if sharded is not None and sharded.plan.pages_over_model else 1
        self.schedulers = [Scheduler(cache_config, self.attention, max_num_batched_tokens=max_num_batched_tokens,
                                     pool=o.pool, recycle=o.recycle, watermark=o.watermark, prefix_cache=prefix,
                                     page_shards=page_shards) for _ in range(self.data_shards)]
        self.scheduler = self.schedulers[0]  # the scheduler (of data shard 0 on a mesh); a new object after a fault
        self.prefix_caching = prefix is not None
        set_buckets(self.schedulers, cache_config, max_num_batched_tokens, o.token_buckets, o.row_buckets,
                    o.block_buckets)
        if sharded is not None and page_shards > 1:  # the allocator's pools are the devices' pools
            owners = [sharded.head_owner(h) for h in range(self.attention.num_kv_heads)]
            assert (self.scheduler.blocks.page_base == np.asarray(owners) * cache_config.num_pages).all()
        self._next_id = 0  # request ids over all data shards
        self.recycle = o.recycle if isinstance(o.recycle, str) else type(o.recycle).__name__
        self.pool = o.pool
        self.debug = o.debug
        self.use_decode_path = o.use_decode_path
        self._cache_args = dict(num_pages=cache_config.num_pages, page_size=cache_config.page_size,
                                max_seqs=cache_config.max_seqs + num_ckpts, dtype=cache_dtype, **cache_opts)
        self.runner = Runner(model, sharded, max_seqs=cache_config.max_seqs, burst=self.decode_burst,
                             max_traces=o.max_traces,
                             spec=0 if o.speculative is None else o.speculative.num_draft_tokens)
        self.host_store = HostStore() if prefix is not None and prefix.host_bytes else None  # the host tier's data
        if self.host_store is not None:  # every step argument committed alike (see _init_caches)
            self.runner.no_tokens = self.host_store.on_device(self.runner.no_tokens)
        self.caches = self._init_caches()
        self._sampling = [SamplingTable(cache_config.max_seqs + 1) for _ in self.schedulers]
        self._inflight: collections.deque[_Flight] = collections.deque()  # dispatched, tokens not read
        self.outputs = Outputs()  # what each request was given; the consumers' queues
        self.num_recoveries = 0  # faults recovered from (see step)
        self.metrics = EngineMetrics()

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
        host = f" and a host tier of {pc.config.host_bytes / 2**30:.2f} GiB" if pc is not None and pc.host else ""
        return "" if pc is None else (f", prefix caching {pc.config.recycle} with {pc.config.num_checkpoints} "
                                      f"checkpoints{host}")

    def clear_prefix_cache(self) -> int:
        """Drop every cached prompt block and GDN checkpoint (blocks that running requests hold stay theirs);
        returns the pages freed. No-op without prefix caching."""
        freed = sum(s.clear_prefix_cache() for s in self.schedulers)
        if self.host_store is not None:  # the host tier's copies are dropped now, not at the next step
            self.caches = self.host_store.apply(self.caches, self.scheduler.prefix.take_copies())
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

    def _check_call(self, prompts, params, max_new_tokens, temperature, seed) -> list:
        """``[(prompt i32[L], SamplingParams, stop ids)]`` of a ``generate`` / ``stream`` call, every argument
        checked (text prompts encoded by the engine's tokenizer first)."""
        if self._is_text(prompts):
            prompts = [list(self.tokenizer.encode(text)) for text in prompts]
        checked = check_prompts(prompts, self.vocab_size)
        plist = call_params(len(checked), params, max_new_tokens, temperature, seed)
        return [(prompt, p, stop_ids(self.eos_token_ids, p, self.vocab_size, f"stop_token_ids of prompt {i}"))
                for i, (prompt, p) in enumerate(zip(checked, plist))]

    def _stream(self, calls: list, progress: bool | None) -> Iterator[TokenEvent]:
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
        box = self.outputs.open_stream(ids)
        bar = self._progress_bar(int(sum(params.max_tokens for _, params, _ in calls)), progress)
        try:
            while box or any(rid in self.outputs.tracked for rid in ids):
                if not box:
                    self._stream_step()
                    continue
                ev = box.popleft()
                self.outputs.consumed(ev)
                if bar is not None:
                    bar.update(1)
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
        for ev in self._stream(calls, progress):
            out[ev.index].append(ev.token)
        return [self.tokenizer.decode(ids) for ids in out] if self._is_text(prompts) else out

    def _is_text(self, prompts: Any) -> bool:
        """``prompts`` are strings (``ValueError`` without a tokenizer, or when strings and token ids mix)."""
        if isinstance(prompts, str) or not isinstance(prompts, Sequence):
            return False
        text = [isinstance(p, str) for p in prompts]
        if not any(text):
            return False
        if not all(text):
            raise ValueError("prompts must be all strings (with a tokenizer) or all token-id sequences, not a mix")
        if self.tokenizer is None:
            raise ValueError("text prompts need Engine(..., tokenizer=...) (e.g. kvjax.models.load_tokenizer(path)); "
                             "or pass token ids")
        return True

    @staticmethod
    def _progress_bar(total: int, progress: bool | None):
        if progress is False or (progress is None and total < 4096):
            return None
        try:
            from tqdm.auto import tqdm
        except ImportError:
            warnings.warn("progress bar requested but tqdm is not installed", stacklevel=3)
            return None
        return tqdm(total=total, unit="tok", desc="generate")

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
            outs = self._step() if self.has_unfinished() or (self._inflight and not self.outputs.held) else []
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

    def _device_idle(self) -> bool:
        """Everything dispatched has finished (non-blocking)."""
        return not self._inflight or self._inflight[-1].tokens.is_ready()

    def _step(self) -> list[StepOutput]:
        t0 = time.perf_counter()
        dispatched = None
        if any(s.has_unfinished() for s in self.schedulers) or not self._inflight:
            dispatched = self._dispatch(t0)
        if not self._inflight or (dispatched is not None and self.overlap and len(self._inflight) == 1):
            return []
        start = t0 if dispatched is None else time.perf_counter()
        idle = dispatched is None and self._device_idle()
        return self._resolve(self._inflight[0], start, idle)

    def _dispatch(self, t0: float) -> _Flight:
        """Schedule (every data shard), build inputs and dispatch one step; returns it (also queued in
        ``_inflight``)."""
        scheds = self.schedulers
        idle_since = t0 if self._device_idle() else None
        preempt0 = sum(s.num_preemptions for s in scheds)
        if self.caches is None:  # lost to a fault in an earlier step
            self.caches = self._init_caches()
        with TraceAnnotation("kvjax.schedule"):  # the step's phases in a profiler trace (cheap when none runs)
            burst = self.decode_burst
            if len(scheds) > 1 and burst > 1 and not all(s.burst_ready(burst) for s in scheds):
                burst = 1  # a burst step is one for every data shard (a shard with nothing to run fits any)
            plans = [s.schedule(burst, self.drafter) for s in scheds]
        if not any(p.num_seqs for p in plans):
            raise RuntimeError(f"engine stalled at step {plans[0].step}: nothing schedulable; running="
                               f"{[r for s in scheds for r in s.running]}, waiting="
                               f"{sum(len(s.waiting) for s in scheds)}, preempted={sum(len(s.preempted) for s in scheds)}")
        copies = self._host_copies(scheds)
        copies_compiled = copies.pop("compiled")
        t1 = time.perf_counter()
        if idle_since is None and self._device_idle():
            idle_since = t1
        c = self.cache_config
        page_base = self.scheduler.blocks.page_base
        with TraceAnnotation("kvjax.inputs"):
            shaped = self.runner.shape(plans)
            samplings = [table.rows(p, self.outputs.tracked) for table, p in zip(self._sampling, shaped)]
            greedy_only = not any(bool((s["temperature"] > 0).any()) for s in samplings)
            buf, layout = self.runner.pack(shaped, samplings, page_base=page_base, page_size=c.page_size,
                                           use_decode_path=self.use_decode_path, checkpoints=self.prefix_caching)
            if self.debug:
                for inputs, groups in self.runner.device_inputs(shaped, page_base, c.num_pages, c.page_size,
                                                                self.use_decode_path):
                    inputs.validate(num_pages=c.num_pages, page_size=c.page_size, max_slots=c.max_seqs + 1,
                                    vocab_size=self.vocab_size, attention=self.attention,
                                    shared_pages=self.prefix_caching, page_groups=groups)
            prev = self._inflight[-1] if self._inflight else None
            for d, plan in enumerate(plans):
                if (plan.prev_index >= 0).any() and (prev is None or prev.plans[d].step != plan.step - 1):
                    raise AssertionError(f"step {plan.step} feeds tokens of a step that is not the one in flight")
        t2 = time.perf_counter()
        if idle_since is None and self._device_idle():
            idle_since = t2
        traces0 = self.num_traces
        prev_tokens = self.runner.no_tokens if prev is None else prev.tokens
        with TraceAnnotation("kvjax.dispatch"):
            tokens, self.caches = self.runner.step(self.caches, buf, prev_tokens, layout, greedy_only)
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
            burst=max(p.burst for p in plans),
            computed=sum(p.num_tokens if p.burst_len is None else int(p.burst_len[: p.num_seqs].sum()) for p in plans),
            pages_free=self.total_pages - used, compiled=self.num_traces > traces0 or copies_compiled,
            pages_used_devices=() if self.mesh is None else device_pages_used(scheds),
            t_schedule=t1 - t0 - copies["t_copy"], t_inputs=t2 - t1, t_dispatch=t3 - t2, **copies,
            t_exposed=t3 - idle_since if idle_since is not None else 0.0, t_step=time.perf_counter() - t0)
        flight = _Flight(plans, tokens, record)
        self._inflight.append(flight)
        return flight

    def _host_copies(self, scheds: list[Scheduler]) -> dict:
        """Execute the prefix caches' host-tier copies of the plans just scheduled, before their step is dispatched
        (:mod:`kvjax.engine.host_tier`: in order on the device, their transfers overlapping the step in flight);
        returns the step record's host-tier fields and ``compiled`` (a copy was compiled)."""
        t = time.perf_counter()
        if not self.prefix_caching:
            return dict(t_copy=0.0, compiled=False)
        with TraceAnnotation("kvjax.host_copies"):
            hits = sum(s.prefix.plan_hits()[1] for s in scheds)
            ops = [s.prefix.take_copies() for s in scheds]  # () without a host tier
            store = self.host_store
            if store is None:
                return dict(t_copy=time.perf_counter() - t, compiled=False)
            out0, in0, traces0 = store.stats.bytes_out, store.stats.bytes_in, store.traces
            self.caches = store.apply(self.caches, ops[0])  # one device: one scheduler
        return dict(prefix_hit_tokens_host=hits, host_bytes_out=store.stats.bytes_out - out0,
                    host_bytes_in=store.stats.bytes_in - in0, t_copy=time.perf_counter() - t,
                    compiled=store.traces > traces0)

    def _resolve(self, flight: _Flight, start: float, idle: bool) -> list[StepOutput]:
        """Read ``flight``'s tokens (waiting for its device work), apply them, and return their outputs."""
        t4 = time.perf_counter()
        with TraceAnnotation("kvjax.wait"):
            tokens = np.asarray(flight.tokens)  # the one device -> host copy of a step: i32[max_seqs] or [D, ...]
        t5 = time.perf_counter()
        with TraceAnnotation("kvjax.update"):
            for sched, plan, row in zip(self.schedulers, flight.plans, tokens.reshape(len(flight.plans), -1)):
                sched.resolve(plan, row)
                if plan.draft_len is not None:  # speculative decoding's counts (one data shard)
                    flight.record.update(verify_stats(plan, row))
            self._inflight.popleft()
            outs = [out for sched, plan in zip(self.schedulers, flight.plans)
                    for out in self.outputs.collect_plan(sched, plan)]
        t6 = time.perf_counter()
        # device idle after the wait when nothing else is in flight (from ``start`` if already idle then)
        exposed = 0.0 if self._inflight else t6 - (start if idle else t5)
        self._record(flight, generated=sum(len(out.tokens) for out in outs), t_wait=t5 - t4, t_update=t6 - t5,
                     t_part=t6 - start, t_exposed=exposed)
        return outs

    def _record(self, flight: _Flight, *, generated: int, t_wait: float, t_update: float, t_part: float,
                t_exposed: float) -> None:
        r = flight.record
        self.metrics.append(StepRecord(**{**r, "generated": generated, "t_wait": t_wait, "t_update": t_update,
                                          "t_step": r["t_step"] + t_part, "t_exposed": r["t_exposed"] + t_exposed}))

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
        lost, self._inflight = list(self._inflight), collections.deque()
        self.caches = None
        if self.host_store is not None:  # its spilled blocks belong to the prefix cache that starts over
            self.host_store = HostStore()
        self.schedulers = [s.rebuilt() for s in self.schedulers]
        self.scheduler = self.schedulers[0]
        self.outputs.rebind({rid: req for s in self.schedulers for rid, req in s.requests.items()})
        self.outputs.hold(self.outputs.collect(list(self.outputs.tracked)))
        for f in lost:  # their device work counts; their tokens are lost
            self._record(f, generated=0, t_wait=0.0, t_update=0.0, t_part=0.0, t_exposed=0.0)

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

