"""Capacity simulator (behind ``python -m kvjax simulate``, :mod:`kvjax.cli.simulate`). Drives the scheduler with
no model.

Every step the scheduler plans as usual and each row that samples "generates" one (random) token. Everything
else (chunked prefill under the token budget, page allocation, SWA recycling, preemption by recompute) is the
real scheduler. Reported per (SWA fraction, pool, recycle) run: steps, generated tokens per step, peak
concurrency (running requests), preemptions, page utilisation (mean and peak fraction of pages in use).

Theoretical bound. Over a run of ``S`` steps that generates ``G = sum_r O_r`` tokens, these give
lower bounds on ``S`` (request ``r``: prompt ``P_r``, output ``O_r``; budget ``Bt`` tokens/step, ``max_seqs``
rows, ``N`` pages):

- tokens: every step computes at most ``Bt`` tokens and the run computes ``sum_r (P_r + O_r - 1)`` of them
  (the last output is sampled, never fed), so ``S >= sum_r (P_r + O_r - 1) / Bt``;
- rows: request ``r`` runs for at least ``ceil(P_r / Bt) + O_r - 1`` steps in one of ``max_seqs`` rows, so
  ``S >= sum_r (ceil(P_r / Bt) + O_r - 1) / max_seqs``;
- longest: the same count for one request alone, ``S >= max_r (ceil(P_r / Bt) + O_r - 1)`` (a finite workload
  cannot finish before its longest request);
- pages: in its decode step at context ``L`` (``L = P_r .. P_r + O_r - 2``) request ``r`` holds at least
  ``live_h(L)`` pages on head ``h`` — ``ceil((L + 1) / ps)`` without recycling, minus its recyclable blocks
  with timely recycling — and a step has ``N`` pages (``N / H_kv`` per head when partitioned), so
  ``S >= sum_{r, L, h} live_h(L) / N`` (shared) or ``max_h sum_{r, L} live_h(L) / (N / H_kv)`` (partitioned).
  Prefill steps also hold pages; leaving them out keeps this a lower bound.

Model shards (``model_shards=M``, the engine on a mesh with ``M`` devices on ``"model"``): the same total page
memory ``N`` split into ``M`` per-device pools of ``N / M`` pages, each serving its shard's ``H_kv / M`` heads
(:class:`~kvjax.sched.blocks.BlockAllocator` with ``shards=M``). ``placement="balanced"`` places the heads as the
engine's sharded model does (:func:`~kvjax.sched.blocks.placed_layout`), ``"contiguous"`` splits them in the
model's order (what a mesh did before placement). A pool that fills first stops admission and preempts while the
others have room; the page term becomes ``max_m sum_{r, L, h on m} live_h(L) / (N / M)``.

``bound = G / max(the four)`` is an upper bound on generated tokens per step. With memory for a few
full-length requests the page term dominates for ``none``, so the bound on the gain ``timely / none`` is the
ratio of time-averaged per-request page footprints, capped where the timely run hits the row or token term.
Preemption (recompute), admission granularity and ramp-up/drain make measured figures fall below the bound.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Callable, Iterator

import numpy as np

from kvjax.config import AttentionConfig, CacheConfig, is_int
from kvjax.sched.blocks import BlockAllocator, placed_layout
from kvjax.sched.prefix_cache import PrefixCache, PrefixCacheConfig
from kvjax.sched.plan import StepPlan
from kvjax.sched.recycle import live_blocks, make_recycle_policy
from kvjax.sched.scheduler import Scheduler
from kvjax.sched.slots import SlotAllocator
from kvjax.sched.workload import RequestSpec


@dataclasses.dataclass(frozen=True)
class SimResult:
    """Aggregates of one simulated run (all plain Python scalars)."""

    swa_fraction: float  # SWA KV heads / all KV heads
    pool: str  # "shared" | "partitioned"
    recycle: str  # policy name
    steps: int  # scheduler steps to finish the workload
    generated: int  # tokens sampled (appended) in all
    tokens_per_step: float  # generated / steps
    bound_tokens_per_step: float  # generated / the largest step lower bound (upper bound on tokens_per_step)
    bound_by: str  # which term gives the bound: "tokens" | "rows" | "longest" | "pages"
    peak_concurrency: int  # most running requests in one step
    preemptions: int  # preemptions (recompute) in all
    page_util_mean: float  # mean over steps of used / num_pages after scheduling
    page_util_peak: float  # max over steps of the same
    model_shards: int = 1  # per-device page pools (the "model" axis of a mesh); 1 = one pool
    placement: str = "balanced"  # "balanced" | "contiguous": how heads were split over the model shards


PLACEMENTS = ("balanced", "contiguous")


def shard_setup(cache: CacheConfig, attention: AttentionConfig, model_shards: int,
                placement: str = "balanced") -> tuple[CacheConfig, AttentionConfig]:
    """The per-device cache and the layout a scheduler with ``page_shards=model_shards`` gets for the same total
    page memory: ``cache.num_pages / model_shards`` pages per shard and ``attention`` placed
    (:func:`~kvjax.sched.blocks.placed_layout`) or, for ``"contiguous"``, as given. ``ValueError`` names a shard
    count that does not divide the pages or the KV heads, or an unknown placement."""
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
    if not is_int(model_shards) or model_shards < 1 or cache.num_pages % model_shards \
            or attention.num_kv_heads % model_shards:
        raise ValueError(f"model_shards must be an int >= 1 dividing num_pages={cache.num_pages} and num_kv_heads="
                         f"{attention.num_kv_heads}, got {model_shards!r}")
    if model_shards == 1:
        return cache, attention
    if placement == "balanced":
        attention, _ = placed_layout(attention, model_shards)
    return dataclasses.replace(cache, num_pages=cache.num_pages // model_shards), attention


def check_servable_sharded(workload: list[RequestSpec], cache: CacheConfig, attention: AttentionConfig, *,
                           max_num_batched_tokens: int, pool: str, recycle: str, model_shards: int,
                           placement: str) -> None:
    """:func:`kvjax.sched.workload.check_servable` for :func:`simulate` with ``model_shards`` / ``placement``: raise
    ``ValueError`` naming the first request that a shard's pool can never serve (even alone)."""
    shard_cache, att = shard_setup(cache, attention, model_shards, placement)
    sched = Scheduler(shard_cache, att, max_num_batched_tokens=max_num_batched_tokens, pool=pool, recycle=recycle,
                      page_shards=model_shards)
    for i, w in enumerate(workload):
        try:
            sched.add_request(w.prompt, w.max_new_tokens)
        except ValueError as err:
            raise type(err)(f"request {i} (prompt {w.prompt.size}, output {w.max_new_tokens}) cannot be served "
                            f"with recycle={recycle}, pool={pool}, {model_shards} model shards ({placement}): "
                            f"{err}") from None


def throughput_bound(workload: list[RequestSpec], cache: CacheConfig, attention: AttentionConfig, *,
                     max_num_batched_tokens: int, pool: str, recycle: bool) -> float:
    """Upper bound on generated tokens per step (see the module docstring for the derivation)."""
    steps = step_lower_bounds(workload, cache, attention, max_num_batched_tokens=max_num_batched_tokens, pool=pool,
                              recycle=recycle)
    return sum(w.max_new_tokens for w in workload) / max(steps.values())


def step_lower_bounds(workload: list[RequestSpec], cache: CacheConfig, attention: AttentionConfig, *,
                      max_num_batched_tokens: int, pool: str, recycle: bool, shards: int = 1) -> dict[str, float]:
    """The lower bounds on the number of steps: ``{"tokens", "rows", "longest", "pages"}`` -> steps.
    ``shards``: ``cache.num_pages`` pages per model shard, shard ``m`` serving heads ``[m * H_kv / shards, ..)``."""
    bt, window, sinks = max_num_batched_tokens, np.asarray(attention.window), np.asarray(attention.sinks)
    tokens = rows = longest = 0
    page_steps = np.zeros(attention.num_kv_heads)
    for w in workload:
        p, o = int(w.prompt.size), w.max_new_tokens
        tokens += p + o - 1
        rows += -(-p // bt) + o - 1
        longest = max(longest, -(-p // bt) + o - 1)
        if o > 1:
            L = np.arange(p, p + o - 1)
            page_steps += live_blocks(L, np.ones_like(L), window, sinks, cache.page_size, recycle).sum(axis=0)
    if pool == "partitioned":
        page_lb = page_steps.max() / (cache.num_pages * shards // attention.num_kv_heads)
    else:  # the fullest shard's pool
        page_lb = page_steps.reshape(shards, -1).sum(axis=1).max() / cache.num_pages
    return {"tokens": tokens / bt, "rows": rows / cache.max_seqs, "longest": float(longest), "pages": float(page_lb)}


def simulation_steps(sched: Scheduler, *, seed: int = 0, check_every: int = 0) -> Iterator[StepPlan]:
    """Drive ``sched`` until every request is done, yielding each step's plan after ``schedule()`` and before
    ``update()``; every sampling row gets a random token in ``[1, 32000)`` drawn from ``seed``. Raises
    ``RuntimeError`` if a step schedules nothing; ``check_every > 0`` runs the integrity checks every that many
    steps."""
    rng = np.random.default_rng(seed)
    steps = 0
    while sched.has_unfinished():
        plan = sched.schedule()
        if plan.num_seqs == 0:
            raise RuntimeError(f"simulation stalled at step {steps}: nothing schedulable ({sched.running!r})")
        yield plan
        sched.update(plan, rng.integers(1, 32_000, plan.num_seqs))
        steps += 1
        if check_every and steps % check_every == 0:
            sched.check_integrity()


def sim_result(workload: list[RequestSpec], sched: Scheduler, *, pool: str, recycle: str, generated: int,
               peak: int, util: np.ndarray, placement: str = "balanced") -> SimResult:
    """The :class:`SimResult` of a finished run of ``sched`` over ``workload``: ``generated`` tokens, ``peak``
    running requests, ``util`` = f64[steps] fraction of pages in use after each step's scheduling."""
    att, shards = sched.attention, sched.blocks.shards
    lbs = step_lower_bounds(workload, sched.cache, att, max_num_batched_tokens=sched.max_num_batched_tokens,
                            pool=pool, recycle=sched.recycle_policy.frees_swa_blocks, shards=shards)
    by = max(lbs, key=lbs.get)
    steps = len(util)
    return SimResult(len(att.swa_heads) / att.num_kv_heads, pool, recycle, steps, generated, generated / steps,
                     generated / lbs[by], by, peak, sched.num_preemptions, float(np.mean(util)), float(np.max(util)),
                     shards, placement)


def simulate(workload: list[RequestSpec], cache: CacheConfig, attention: AttentionConfig, *,
             max_num_batched_tokens: int, pool: str, recycle: str, seed: int = 0,
             check_every: int = 0, progress: Callable[[int], object] | None = None, model_shards: int = 1,
             placement: str = "balanced") -> SimResult:
    """Run ``workload`` (all requests arrive at step 0) to completion; ``check_every > 0`` runs the
    integrity checks every that many steps; ``progress`` is called after each step with the number of tokens it
    generated (e.g. a tqdm bar's ``update``). ``model_shards`` / ``placement``: ``cache.num_pages`` (the total)
    split into per-device pools (:func:`shard_setup`; see the module docstring)."""
    cache, attention = shard_setup(cache, attention, model_shards, placement)
    sched = Scheduler(cache, attention, max_num_batched_tokens=max_num_batched_tokens, pool=pool, recycle=recycle,
                      page_shards=model_shards)
    for w in workload:
        sched.add_request(w.prompt, w.max_new_tokens)
    generated = peak = 0
    util = []
    for plan in simulation_steps(sched, seed=seed, check_every=check_every):
        peak = max(peak, len(sched.running))
        util.append(sched.blocks.used_pages() / sched.blocks.num_pages)
        generated += int(plan.sample_mask.sum())
        if progress is not None:
            progress(int(plan.sample_mask.sum()))
    return sim_result(workload, sched, pool=pool, recycle=recycle, generated=generated, peak=peak,
                      util=np.asarray(util), placement=placement)


@dataclasses.dataclass(frozen=True)
class PrefixSimResult:
    """Aggregates of one prefix-cache run (plain Python scalars)."""

    mode: str  # "off" | the cache's recycle option
    steps: int
    generated: int
    tokens_per_step: float  # generated / steps
    prompt_tokens: int  # prompt tokens of every admission (a preempted request's re-admission counts again)
    cached_tokens: int  # of those, served from the cache
    computed_tokens: int  # tokens fed to the model (prompt and output, recomputation included)
    hit_rate: float  # cached_tokens / prompt_tokens
    preemptions: int
    num_pages: int
    num_checkpoints: int
    page_util_peak: float  # max over steps of pages held (running rows + cache) / num_pages
    cached_pages_mean: float  # mean over steps of pages the cache holds
    checkpoints_peak: int  # most checkpoint slots in use
    host_bytes: int = 0  # the host tier's budget (0: none)
    host_hit_tokens: int = 0  # of cached_tokens, those of blocks loaded from the host tier
    bytes_out: int = 0  # bytes spilled device -> host
    bytes_in: int = 0  # bytes loaded host -> device


def split_memory(memory_bytes: int, *, page_bytes: int, slot_bytes: int, num_checkpoints: int) -> int:
    """Pages left for ``memory_bytes`` (one budget, all layers) after ``num_checkpoints`` GDN checkpoint slots of
    ``slot_bytes``; ``ValueError`` if they do not leave a page."""
    pages = (memory_bytes - num_checkpoints * slot_bytes) // page_bytes
    if pages < 1:
        raise ValueError(f"{num_checkpoints} checkpoints of {slot_bytes} bytes leave no page of {page_bytes} bytes "
                         f"in {memory_bytes} bytes")
    return int(pages)


def simulate_prefix(workload: list[RequestSpec], cache: CacheConfig, attention: AttentionConfig, *,
                    max_num_batched_tokens: int, prefix: PrefixCacheConfig | None, seed: int = 0,
                    check_every: int = 0, max_steps: int = 1_000_000,
                    progress: Callable[[int], object] | None = None) -> PrefixSimResult:
    """Run ``workload`` through a small FCFS loop (chunked prefill under the token budget, timely SWA recycling,
    preemption by recompute of the latest admitted request) with the prefix cache ``prefix`` (None: off). The
    loop calls the cache exactly where a scheduler would (see :mod:`kvjax.sched.prefix_cache`). A request with
    ``after >= 0`` arrives when that one finishes. ``progress`` is called after each step with the number of
    new tokens it generated. The host tier (``prefix.host_bytes > 0``): the cache spills what it evicts and loads
    it back on a hit; the run counts the bytes its copy log moves each way (nothing is timed: no device)."""
    rng = np.random.default_rng(seed)
    blocks, slots = BlockAllocator(cache, attention), SlotAllocator(cache.max_seqs)
    pc = PrefixCache(blocks, prefix) if prefix is not None else None
    policy = pc.recycle_policy() if pc else make_recycle_policy("timely")
    tokens = [np.concatenate([w.prompt, w.output if w.output is not None else
                              rng.integers(1, 32_000, w.max_new_tokens, dtype=np.int32)]) for w in workload]
    waiting = collections.deque(i for i, w in enumerate(workload) if w.after < 0)
    children = collections.defaultdict(list)
    for i, w in enumerate(workload):
        if w.after >= 0:
            children[w.after].append(i)
    running: list[list[int]] = []  # [request, row, computed, known]
    stats = collections.Counter()
    peak = ckpt_peak = steps = reported = 0
    cached, best = [], [0] * len(workload)

    def release(r: list[int]) -> None:
        if pc:
            pc.release(r[1])
        blocks.free_row(r[1])
        slots.free(r[1])

    while waiting or running:
        if steps >= max_steps:
            raise RuntimeError(f"prefix simulation did not finish in {max_steps} steps")
        if pc:
            pc.begin_plan()
        if running:
            policy.recycle(blocks, np.array([r[1] for r in running]), np.array([r[2] for r in running]))
        budget, scheduled, preempted = max_num_batched_tokens, [], False
        for r in list(running):
            if budget == 0 or r not in running:
                continue
            n = min(r[3] - r[2], budget)
            stop = pc.next_stop(r[1], r[2]) if pc else None
            n = min(n, stop - r[2]) if stop else n
            while not blocks.can_fit(blocks.blocks_for(r[2] + n) - blocks.num_blocks[r[1]]):
                victim = running.pop()
                release(victim)
                waiting.appendleft(victim[0])
                stats["preemptions"] += 1
                preempted = True
                if victim is r:
                    break
            if r in running:
                blocks.allocate(r[1], r[2] + n)
                scheduled.append((r, n))
                budget -= n
        while budget and waiting and slots.num_free and not preempted:
            i = waiting[0]
            prompt = workload[i].prompt
            m = pc.match(prompt) if pc else None
            start = m.num_tokens if m else 0
            n = min(prompt.size - start, budget)
            if pc:
                stop = next((s for s in m.stops if s > start), None)
                n = min(n, stop - start) if stop else n
            if not blocks.can_fit(blocks.blocks_for(start + n) - start // cache.page_size,
                                  0.01 if running else 0.0):
                break
            r = [i, slots.allocate(), start, int(prompt.size)]
            if pc:
                host_hits = pc.hit_tokens_host
                pc.attach(r[1], m, prompt)
                if not blocks.can_fit(blocks.blocks_for(start + n) - int(blocks.num_blocks[r[1]]),
                                      0.01 if running else 0.0):  # host blocks loaded into pages it counted
                    release(r)
                    break
                stats["host"] += pc.hit_tokens_host - host_hits
            waiting.popleft()
            stats["prompt"] += int(prompt.size)
            stats["cached"] += start
            blocks.allocate(r[1], start + n)
            running.append(r)
            scheduled.append((r, n))
            budget -= n
        if not scheduled:
            raise RuntimeError(f"prefix simulation stalled at step {steps}")
        peak = max(peak, blocks.used_pages())
        cached.append(pc.cached_pages() if pc else 0)
        for r, n in scheduled:
            r[2] += n
            stats["computed"] += n
            if pc and r[2] <= workload[r[0]].prompt.size:
                pc.publish(r[1], r[2])
            if r[2] == r[3]:  # the row samples a token (a recomputed one again, counted once)
                r[3] += 1
                stats["generated"] += r[3] > best[r[0]]
                best[r[0]] = max(best[r[0]], r[3])
                if r[3] == tokens[r[0]].size:
                    running.remove(r)
                    release(r)
                    waiting.extend(children.pop(r[0], []))
        ckpt_peak = max(ckpt_peak, pc.checkpoints_used() if pc else 0)
        if pc:
            pc.take_copies()  # the engine would execute them before the step
        steps += 1
        if progress is not None:
            progress(stats["generated"] - reported)
            reported = stats["generated"]
        if check_every and steps % check_every == 0:
            blocks.check_integrity()
            slots.check_integrity()
            if pc:
                pc.check_integrity()
    return PrefixSimResult(prefix.recycle if prefix else "off", steps, stats["generated"],
                           stats["generated"] / steps, stats["prompt"], stats["cached"], stats["computed"],
                           stats["cached"] / max(stats["prompt"], 1), stats["preemptions"], cache.num_pages,
                           prefix.num_checkpoints if prefix else 0, peak / cache.num_pages,
                           float(np.mean(cached)), ckpt_peak, prefix.host_bytes if prefix else 0, stats["host"],
                           pc.host.bytes_out if pc and pc.host else 0, pc.host.bytes_in if pc and pc.host else 0)


def format_prefix_table(results: list[PrefixSimResult]) -> str:
    """Fixed-width table of prefix-cache runs; ``gain`` is tokens/step relative to the first ``off`` run."""
    base = next((r for r in results if r.mode == "off"), None)
    tier = any(r.host_bytes for r in results)
    head = (f"{'cache':14} {'pages':>6} {'ckpts':>5} {'steps':>6} {'tok/step':>8} {'gain':>6} {'hit rate':>8} "
            f"{'prompt':>8} {'cached':>8} {'computed':>8} {'preempt':>7} {'util peak':>9} {'cached pg':>9}")
    if tier:
        head += f" {'host GB':>7} {'host hits':>9} {'GB out':>7} {'GB in':>7}"
    lines = [head, "-" * len(head)]
    for r in results:
        gain = f"{r.tokens_per_step / base.tokens_per_step:5.2f}x" if base else "     -"
        name = r.mode + ("+host" if r.host_bytes else "")
        line = (f"{name:14} {r.num_pages:6d} {r.num_checkpoints:5d} {r.steps:6d} {r.tokens_per_step:8.2f} "
                f"{gain} {r.hit_rate:8.3f} {r.prompt_tokens:8d} {r.cached_tokens:8d} {r.computed_tokens:8d} "
                f"{r.preemptions:7d} {r.page_util_peak:9.3f} {r.cached_pages_mean:9.1f}")
        if tier:
            line += (f" {r.host_bytes / 1e9:7.2f} {r.host_hit_tokens:9d} {r.bytes_out / 1e9:7.2f} "
                     f"{r.bytes_in / 1e9:7.2f}")
        lines.append(line)
    return "\n".join(lines)


def format_table(results: list[SimResult]) -> str:
    """Fixed-width table; ``gain`` and ``bound gain`` are relative to ``none`` with the same SWA fraction, pool (and
    model shards and placement). With model shards (any result's ``model_shards > 1``) two more leading columns
    name them and the placement."""
    sharded = any(r.model_shards > 1 for r in results)
    base = {(r.swa_fraction, r.pool, r.model_shards, r.placement): r for r in results if r.recycle == "none"}
    head = (f"{'swa':>5} {'pool':11} {'recycle':7} {'steps':>7} {'generated':>9} {'tok/step':>8} {'bound':>8} "
            f"{'by':7} {'gain':>6} {'bound gain':>10} {'peak conc':>9} {'preempt':>7} {'util mean':>9} {'util peak':>9}")
    if sharded:
        head = f"{'M':>2} {'placement':10} " + head
    lines = [head, "-" * len(head)]
    for r in results:
        b = base.get((r.swa_fraction, r.pool, r.model_shards, r.placement))
        gain = f"{r.tokens_per_step / b.tokens_per_step:5.2f}x" if b else "     -"
        bgain = f"{r.bound_tokens_per_step / b.bound_tokens_per_step:9.2f}x" if b else "         -"
        shard = f"{r.model_shards:2d} {r.placement if r.model_shards > 1 else '-':10} " if sharded else ""
        lines.append(f"{shard}{r.swa_fraction:5.2f} {r.pool:11} {r.recycle:7} {r.steps:7d} {r.generated:9d} "
                     f"{r.tokens_per_step:8.2f} {r.bound_tokens_per_step:8.2f} {r.bound_by:7} {gain} {bgain} {r.peak_concurrency:9d} "
                     f"{r.preemptions:7d} {r.page_util_mean:9.3f} {r.page_util_peak:9.3f}")
    return "\n".join(lines)
