"""The engine: continuous batching over the jitted model step.

One step::

    plan = scheduler.schedule()                 # host: recycle, admit/preempt, allocate pages, padded arrays
    inputs = plan_to_inputs(plan)               # host -> device StepInputs (one batched device_put)
    tokens, caches = device_step(params, caches, inputs, sampling rows)   # jitted: model step + sampling
    scheduler.update(plan, tokens)              # host: advance requests, append tokens, finish

The engine owns nothing the scheduler owns: GDN slots, pages and block tables come only from
:class:`kvjax.sched.Scheduler`. It talks to the model only through :class:`kvjax.models.interface.CausalLM`
(``attention_layout()`` for the scheduler, ``init_caches``, ``forward_step``, ``vocab_size``). The device caches
are created once (``model.init_caches``) and donated to every step. Each engine builds its own device step once
(:func:`kvjax.engine.step.make_step` with ``sample=True``): one ``jax.jit`` of ``model.forward_step(caches,
inputs)`` followed by :func:`kvjax.engine.sampling.sample`, so a step is one dispatch and only ``i32[B]`` tokens
come back to the host. It compiles once per ``(T, B, max_blocks, decode_only)`` bucket of the plan (and per
greedy / sampling mode); :attr:`Engine.num_traces` counts this engine's compilations.

Use from a script or notebook::

    engine = Engine(model, CacheConfig(page_size=16, num_pages=512, max_seqs=8, max_blocks_per_seq=64),
                    recycle="timely")
    outs = engine.generate(prompts, max_new_tokens=64)          # list[list[int]]
    for ev in engine.stream(prompts, max_new_tokens=64):        # TokenEvent per generated token
        if ev.index == 3 and ev.position > 10: engine.abort(ev.request_id)
    engine.metrics.summary()                                    # per-step records -> aggregates

Models in the package: Qwen3.5 (:mod:`kvjax.models.qwen3_5`: GDN slots + head-wise K/V pages; SWA heads
recycle) and DeepSeek-V3.2 (:mod:`kvjax.models.deepseek`: MLA latent + DSA indexer caches, one latent head).
"""

from __future__ import annotations

import collections
import dataclasses
import time
import warnings
from typing import Any, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvjax.config import CacheConfig
from kvjax.engine.args import (check_call, check_index, check_max_new_tokens, check_prompt, check_seed,
                               check_temperature, check_token_id)
from kvjax.engine.inputs import StepInputs
from kvjax.engine.metrics import EngineMetrics, StepRecord
from kvjax.engine.step import make_step
from kvjax.errors import RequestTooLongError
from kvjax.models.interface import CausalLM
from kvjax.sched.plan import DEVICE_FIELDS, StepPlan
from kvjax.sched.request import Request, Status
from kvjax.sched.scheduler import Scheduler


@dataclasses.dataclass(frozen=True)
class TokenEvent:
    """One generated token, as :meth:`Engine.stream` yields it."""

    index: int  # position of the request's prompt in the ``prompts`` list of the call
    request_id: int  # scheduler request id (for :meth:`Engine.abort`)
    token: int  # the sampled token id
    position: int  # 0-based index of this token among the request's generated tokens
    finished: bool  # the request is done (max_new_tokens or eos)


@dataclasses.dataclass
class _Tracked:
    index: int  # prompt index in its call (events, sampling stream)
    temperature: float  # 0 = greedy
    seed: int  # sampling seed
    request: Request  # the scheduler's request: its token buffer is the record of what was generated
    tokens: list  # list[int]: generated tokens already turned into events


def _is_done(req: Request) -> bool:
    """The request took its last token (``max_new_tokens`` reached or eos sampled)."""
    return req.num_output >= req.max_new_tokens or (
        req.eos_token_id is not None and req.num_output > 0 and int(req.token_ids[req.num_tokens - 1])
        == req.eos_token_id)


def plan_to_inputs(plan: StepPlan, *, use_decode_path: bool = True) -> StepInputs:
    """Device :class:`StepInputs` of a scheduler plan (int fields as int32, ``has_initial_state`` bool), moved
    with one batched ``jax.device_put``. The plan's field names are ``StepInputs``' field names.

    ``use_decode_path``: set the static ``StepInputs.decode_only`` flag when every real row has exactly one
    token (models then use their decode kernels; one more trace per bucket).
    """
    host = {name: np.asarray(getattr(plan, name), np.bool_ if name == "has_initial_state" else np.int32)
            for name in DEVICE_FIELDS}
    q = plan.query_lens[: plan.num_seqs]
    decode_only = bool(use_decode_path and plan.num_seqs > 0 and (q == 1).all())
    return StepInputs(**jax.device_put(host), decode_only=decode_only)


def _check_buckets(name: str, values: Sequence[int], last: int, last_name: str) -> tuple[int, ...]:
    out = tuple(values)
    if (not out or any(isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1 for v in out)
            or list(out) != sorted(set(out)) or out[-1] != last):
        raise ValueError(f"{name} must be ascending ints >= 1 ending at {last_name}={last}, got {out}")
    return tuple(int(v) for v in out)


# ---------------------------------------------------------------------------------------------- engine


class Engine:
    """Continuous-batching generation for one model over fixed page memory.

    Args:
      model: a :class:`kvjax.models.interface.CausalLM` (a Qwen3.5 or DeepSeek-V3.2 kvjax model).
      cache_config: pages, page size, ``max_seqs`` (GDN slots and batch rows), block-table width.
      recycle: ``"none"`` | ``"timely"`` (or a policy object; see :mod:`kvjax.sched.recycle`).
      pool: ``"shared"`` | ``"partitioned"``.
      max_num_batched_tokens: token budget of one step (default ``max(256, max_seqs)``).
      watermark: fraction of each pool kept free when admitting while others run.
      cache_dtype: dtype of the K/V (or latent) pages and conv state (default: the model's parameter dtype).
      cache_options: extra keyword arguments of ``model.init_caches`` (e.g. ``{"indexer_fp8": False}``).
      eos_token_id: stop a request when it samples this token (``None``: run to ``max_new_tokens``).
      debug: validate every step's inputs on the host before running it (slow).
      max_traces: fail (``AssertionError``) if this engine's device step compiles more than this many times.
      use_decode_path: mark all-decode steps ``decode_only`` (decode kernels; one more trace per bucket).
      token_buckets, row_buckets, block_buckets: replace the scheduler's default bucket sets (powers of two) for
        ``T``, ``B`` and the block-table width; ascending, ending at ``max_num_batched_tokens`` / ``max_seqs`` /
        ``max_blocks_per_seq``. Fewer
        buckets = fewer compilations, more padding (worth it where compiling is slow, e.g. on CPU).
    """

    def __init__(self, model: CausalLM, cache_config: CacheConfig, *, recycle: Any = "none", pool: str = "shared",
                 max_num_batched_tokens: int | None = None, watermark: float = 0.01, cache_dtype: Any = None,
                 cache_options: dict | None = None, eos_token_id: int | None = None, debug: bool = False,
                 max_traces: int | None = None, use_decode_path: bool = True,
                 token_buckets: Sequence[int] | None = None, row_buckets: Sequence[int] | None = None,
                 block_buckets: Sequence[int] | None = None) -> None:
        if not isinstance(cache_config, CacheConfig):
            raise ValueError(f"cache_config must be a CacheConfig, got {type(cache_config).__name__}")
        if not isinstance(model, CausalLM) or not isinstance(model, nnx.Module):
            raise ValueError(f"model must be an nnx.Module implementing kvjax.models.interface.CausalLM, got "
                             f"{type(model).__name__}")
        self.model = model
        self.cache_config = cache_config
        self.eos_token_id = check_token_id(eos_token_id, int(model.vocab_size), "eos_token_id")
        self.attention = model.attention_layout()
        if max_num_batched_tokens is None:
            max_num_batched_tokens = max(256, cache_config.max_seqs)
        self.scheduler = Scheduler(cache_config, self.attention, max_num_batched_tokens=max_num_batched_tokens,
                                   pool=pool, recycle=recycle, watermark=watermark)
        if token_buckets is not None:
            self.scheduler.t_buckets = _check_buckets("token_buckets", token_buckets, max_num_batched_tokens,
                                                      "max_num_batched_tokens")
        if row_buckets is not None:
            self.scheduler.b_buckets = _check_buckets("row_buckets", row_buckets, cache_config.max_seqs, "max_seqs")
        if block_buckets is not None:
            self.scheduler.blk_buckets = _check_buckets("block_buckets", block_buckets,
                                                        cache_config.max_blocks_per_seq, "max_blocks_per_seq")
        self.recycle = recycle if isinstance(recycle, str) else type(recycle).__name__
        self.pool = pool
        self.debug = debug
        self.use_decode_path = use_decode_path
        graphdef, self.params = nnx.split(model)
        if cache_dtype is None:  # the parameters' float dtype
            cache_dtype = next(x.dtype for x in jax.tree_util.tree_leaves(self.params)
                               if jnp.issubdtype(x.dtype, jnp.floating))
        self._cache_args = dict(num_pages=cache_config.num_pages, page_size=cache_config.page_size,
                                max_seqs=cache_config.max_seqs, dtype=cache_dtype, **(cache_options or {}))
        self.caches = model.init_caches(**self._cache_args)
        self._device_step = make_step(graphdef, sample=True, max_traces=max_traces)
        self._tracked: dict[int, _Tracked] = {}
        self._inbox: dict[int, collections.deque] = {}  # request id -> its stream's event queue
        self._held: list[TokenEvent] = []  # events of add_request requests from steps a stream ran
        self.num_recoveries = 0  # faults recovered from (see step)
        self.metrics = EngineMetrics()

    # ---- requests --------------------------------------------------------------------------------------------
    @property
    def num_traces(self) -> int:
        """How many times this engine's device step has been traced (= compiled) so far."""
        return self._device_step.num_traces

    @property
    def vocab_size(self) -> int:
        return int(self.model.vocab_size)

    def add_request(self, prompt: Sequence[int] | np.ndarray, max_new_tokens: int, *, temperature: float = 0.0,
                    seed: int = 0, index: int = 0) -> int:
        """Queue one request; returns its request id. ``index`` names the request in events and selects its
        sampling stream (with ``seed``). Its events come back from :meth:`step`.

        Raises :class:`RequestTooLongError` if the cache can never hold it, and ``ValueError`` naming the value
        for a prompt that is not a non-empty 1-d sequence of ints in ``[0, vocab_size)``, a ``max_new_tokens``
        that is not an int >= 1, a temperature that is not a finite number >= 0, a seed outside int32 or an index
        outside ``[0, 2**31)``; on error nothing is queued.
        """
        temperature, seed, index = check_temperature(temperature), check_seed(seed), check_index(index)
        prompt = check_prompt(prompt, self.vocab_size)
        return self._queue(prompt, check_max_new_tokens(max_new_tokens), temperature, seed, index)

    def _queue(self, prompt: np.ndarray, max_new_tokens: int, temperature: float, seed: int, index: int) -> int:
        req = self.scheduler.add_request(prompt, max_new_tokens, eos_token_id=self.eos_token_id)
        self._tracked[req.request_id] = _Tracked(index, temperature, seed, req, [])
        return req.request_id

    def abort(self, request_id: int) -> list[int]:
        """Abort a queued or running request (its slot and pages go back at once); returns its tokens so far.
        Its events not yet delivered are dropped. ``ValueError`` for an unknown (or finished) request id."""
        self.scheduler.abort(request_id)
        tr = self._tracked.pop(request_id)
        box = self._inbox.pop(request_id, None)
        if box:
            kept = [ev for ev in box if ev.request_id != request_id]
            box.clear()
            box.extend(kept)
        self._held = [ev for ev in self._held if ev.request_id != request_id]
        return tr.request.output_ids.tolist()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- one step --------------------------------------------------------------------------------------------
    def step(self) -> list[TokenEvent]:
        """Run one scheduler step on the device; returns the tokens it generated (every request's, including
        those a :meth:`stream` consumer also receives), preceded by the tokens of :meth:`add_request` requests
        that steps run by a :meth:`stream` / :meth:`generate` consumer (or a step that failed) generated since
        (only those, without running a step, when nothing is left to run).

        A fault anywhere in the step (a bad argument deep down, a kernel or out-of-memory error, a
        ``KeyboardInterrupt``) is re-raised after the engine has recovered: every running request is preempted
        (its progress dropped, recomputed later, as preemption by recompute does), and if the device call had
        started the caches are rebuilt before the next step. Tokens sampled before the fault are kept, so the
        run continues to the same outputs as an uninterrupted one.
        """
        events = self._step() if self.has_unfinished() or not self._held else []
        held, self._held = self._held, []
        return held + events

    def _step(self) -> list[TokenEvent]:
        sched = self.scheduler
        t0 = time.perf_counter()
        preempt0 = sched.num_preemptions
        if self.caches is None:  # lost to a fault in the previous step
            self.caches = self.model.init_caches(**self._cache_args)
        try:
            plan = sched.schedule()
        except BaseException:
            self._recover(None, False)
            raise
        if plan.num_seqs == 0:
            raise RuntimeError(f"engine stalled at step {plan.step}: nothing schedulable; running={sched.running}, "
                               f"waiting={len(sched.waiting)}, preempted={len(sched.preempted)}")
        device_called = False
        try:
            t1 = time.perf_counter()
            inputs = plan_to_inputs(plan, use_decode_path=self.use_decode_path)
            if self.debug:
                inputs.validate(num_pages=self.cache_config.num_pages, page_size=self.cache_config.page_size,
                                max_slots=self.cache_config.max_seqs + 1, vocab_size=self.vocab_size,
                                attention=self.attention)
            B = plan.seq_lens.shape[0]
            seeds, streams, counters = (np.zeros(B, np.int32) for _ in range(3))
            temperature = np.zeros(B, np.float32)
            for b, rid in enumerate(plan.request_ids):
                tr = self._tracked[rid]
                seeds[b], streams[b], counters[b], temperature[b] = (tr.seed, tr.index, tr.request.num_tokens,
                                                                     tr.temperature)
            greedy_only = not bool((temperature > 0).any())
            t2 = time.perf_counter()
            traces0 = self.num_traces
            device_called = True  # from here on the donated caches may be gone
            tokens, self.caches = self._device_step(self.params, self.caches, inputs, seeds, streams, counters,
                                                    temperature, greedy_only)
            tokens = np.asarray(tokens)
            t3 = time.perf_counter()
            sched.update(plan, tokens)
        except BaseException:
            self._recover(plan, device_called)
            raise
        events = self._collect(plan.request_ids)
        t4 = time.perf_counter()
        used = sched.blocks.used_pages()
        self.metrics.append(StepRecord(
            step=plan.step, num_tokens=plan.num_tokens, num_seqs=plan.num_seqs,
            bucket_tokens=int(plan.token_ids.shape[0]), bucket_rows=B, bucket_blocks=int(plan.block_tables.shape[2]),
            decode_only=inputs.decode_only,
            generated=len(events), running=len(sched.running), waiting=len(sched.waiting) + len(sched.preempted),
            preemptions=sched.num_preemptions - preempt0, pages_used=used,
            pages_free=self.cache_config.num_pages - used, compiled=self.num_traces > traces0,
            t_schedule=t1 - t0, t_inputs=t2 - t1, t_device=t3 - t2, t_update=t4 - t3, t_step=t4 - t0))
        return events

    def _collect(self, request_ids: Sequence[int]) -> list[TokenEvent]:
        """Events for the tokens these requests took since their last event (read from the scheduler's
        requests, so a step cut short still delivers what it recorded); queued for their stream consumer too."""
        events = []
        for rid in request_ids:
            tr = self._tracked.get(rid)
            if tr is None:
                continue
            req = tr.request
            new = req.output_ids[len(tr.tokens):].tolist()
            done = req.status is Status.FINISHED or _is_done(req)
            for k, tok in enumerate(new):
                tr.tokens.append(tok)
                events.append(TokenEvent(tr.index, rid, tok, len(tr.tokens) - 1, done and k == len(new) - 1))
            if done:
                del self._tracked[rid]
        for ev in events:
            box = self._inbox.get(ev.request_id)
            if box is not None:
                box.append(ev)
        return events

    def _recover(self, plan: StepPlan | None, device_called: bool) -> None:
        """Bring the engine back to a state the next step can run from after a fault in a step: every running
        request is preempted by recompute (a request that already took its last token is released), and the
        caches, possibly donated, are rebuilt at the next step. Tokens already recorded become events."""
        sched = self.scheduler
        self.num_recoveries += 1
        if plan is not None:
            for rid in plan.request_ids:  # cut short between "took its last token" and "released"
                req = sched.requests.get(rid)
                if req is not None and req.status is Status.RUNNING and req not in sched.running:
                    sched.running.append(req)
        touched = dict.fromkeys([*(plan.request_ids if plan is not None else ()),
                                 *(r.request_id for r in sched.running)])
        for req in reversed(list(sched.running)):
            if _is_done(req):
                sched.abort(req.request_id)  # releases slot and pages; its tokens are complete
            else:
                sched._preempt(req)  # the scheduler's own preemption path (progress dropped, requeued first)
        if device_called:
            self.caches = None
        self._held += [ev for ev in self._collect(list(touched)) if ev.request_id not in self._inbox]

    # ---- whole workloads -------------------------------------------------------------------------------------
    def stream(self, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int], *,
               temperature: float = 0.0, seed: int = 0, progress: bool | None = None) -> Iterator[TokenEvent]:
        """Generate for every prompt, yielding each token as it is sampled (:class:`TokenEvent`).

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
        calls = check_call(prompts, max_new_tokens, self.vocab_size)
        temperature, seed = check_temperature(temperature), check_seed(seed)
        return self._stream(calls, temperature, seed, progress)

    def _stream(self, calls: list, temperature: float, seed: int, progress: bool | None) -> Iterator[TokenEvent]:
        ids = []
        try:
            for i, (p, m) in enumerate(calls):
                try:
                    ids.append(self._queue(p, m, temperature, seed, i))
                except RequestTooLongError as err:
                    raise RequestTooLongError(f"prompt {i} (length {len(p)}) rejected: {err}") from None
        except BaseException:
            for rid in ids:
                self.abort(rid)
            raise
        box: collections.deque[TokenEvent] = collections.deque()
        for rid in ids:
            self._inbox[rid] = box
        bar = self._progress_bar(int(sum(m for _, m in calls)), progress)
        try:
            while box or any(rid in self._tracked for rid in ids):
                if not box:
                    self._held += [ev for ev in self._step() if ev.request_id not in self._inbox]
                    continue
                ev = box.popleft()
                if bar is not None:
                    bar.update(1)
                yield ev
        finally:
            if bar is not None:
                bar.close()
            for rid in ids:  # generator closed early: abort what is left
                self._inbox.pop(rid, None)
                if rid in self._tracked:
                    self.abort(rid)

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int], *,
                 temperature: float = 0.0, seed: int = 0, progress: bool | None = None) -> list[list[int]]:
        """Generate for every prompt; returns the generated token ids per prompt (prompt order).

        ``temperature == 0`` is greedy. Sampling keys derive from ``(seed, prompt index, tokens so far)``, so the
        result does not depend on batching, preemption or the recycle policy. Raises ``ValueError`` (nothing
        queued) for a bad argument (see :meth:`add_request`) and :class:`RequestTooLongError` (nothing queued)
        if a prompt can never fit in the cache. May run inside another consumer's :meth:`stream` loop.
        """
        events = self.stream(prompts, max_new_tokens, temperature=temperature, seed=seed, progress=progress)
        out: list[list[int]] = [[] for _ in range(len(prompts))]
        for ev in events:
            out[ev.index].append(ev.token)
        return out

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

    def check_integrity(self) -> None:
        """The scheduler's allocator and queue invariants (``AssertionError`` if broken)."""
        self.scheduler.check_integrity()

    def is_idle(self) -> bool:
        """No request queued or running, every slot and page free."""
        s = self.scheduler
        return (not s.has_unfinished() and s.slots.num_used == 0
                and s.blocks.used_pages() == 0 and not self._tracked)
