"""Prefix reuse at fixed memory: no recycling, timely recycling, prefix caching and both, on three workloads.

Workloads (:mod:`kvjax.sched.workload`): a shared system prompt with many users, multi-turn conversations (turn
``t + 1``'s prompt = turn ``t``'s prompt + its answer + a new message, arriving when turn ``t`` finishes), and
few-shot prompts (a few fixed prefixes, each request's own question).

Policies (:data:`POLICIES`): ``none`` and ``timely`` recycling without caching; ``prefix`` (caching, no
recycling); ``timely+keep_tail`` and ``timely+eager`` (both; what the cache does with a recycled SWA page it
holds, see :mod:`kvjax.sched.prefix_cache`).

Host tier (:data:`HOST_POLICY`, ``timely+keep_tail+host``): ``timely+keep_tail`` with the prefix cache's host
tier of ``PrefixSetup.host_bytes`` (what the device evicts spills to host memory and comes back on a hit); not
in :data:`POLICIES`, so the default sweeps are unchanged: name it in ``policies=``.

Fixed memory. Every policy gets the same cache bytes: ``memory_pages`` pages plus the ``max_seqs + 1`` sequence
slots of GDN state; a policy with caching pays its ``num_checkpoints`` GDN checkpoint slots out of the pages
(:func:`kvjax.sched.simulate.split_memory`), so checkpoints and pages share one budget.

Two drivers, one row format (:func:`scheduler_run`, :func:`engine_runs`):

- the capacity simulation: the real :class:`~kvjax.sched.scheduler.Scheduler` (recycling, prefix cache,
  preemption by recompute) with no model, every sampling row taking the workload's fixed answer token;
- the toy Qwen3.5 (SWA heads, GDN layers) through :class:`~kvjax.engine.engine.Engine`, greedy in f32: a turn's
  prompt is built from the answer the model actually generated, and every policy must generate the same tokens.

Prompt token accounting per run: ``prompt_tokens`` (prompts as submitted) = ``served`` (prompt tokens taken from
the cache at admission) + ``computed`` (prompt positions computed) - ``recomputed`` (prompt positions computed
or served again after a preemption; 0 without preemption); ``hit_rate = served / (served + computed)`` (the
engine's ``prefix_hit_rate``). ``memory_bytes``: pages, checkpoint slots and sequence slots of the run.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import TYPE_CHECKING, Callable

import numpy as np

from kvjax.config import AttentionConfig, CacheConfig
from kvjax.experiments.size import Size
from kvjax.sched.prefix_cache import PrefixCacheConfig
from kvjax.sched.scheduler import Scheduler
from kvjax.sched.simulate import split_memory
from kvjax.sched.workload import RequestSpec, few_shot_workload, multi_turn_workload, system_prompt_workload

if TYPE_CHECKING:
    from kvjax.engine.engine import Engine
    from kvjax.models.qwen3_5 import Qwen3_5ForCausalLM

POLICIES = {  # name -> (recycle, prefix cache recycle mode or None: no caching)
    "none": ("none", None),
    "timely": ("timely", None),
    "prefix": ("none", "keep_tail"),
    "timely+keep_tail": ("timely", "keep_tail"),
    "timely+eager": ("timely", "eager"),
}
HOST_POLICY = "timely+keep_tail+host"  # timely+keep_tail plus the host tier (PrefixSetup.host_bytes)
WORKLOADS = ("system-prompt", "multi-turn", "few-shot")


def policy_modes(policy: str) -> tuple[str, str | None, bool]:
    """``(recycle, prefix cache recycle mode or None, host tier)`` of a policy name (:data:`POLICIES` or
    :data:`HOST_POLICY`); ``ValueError`` for another name."""
    if policy == HOST_POLICY:
        return "timely", "keep_tail", True
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; known: {[*POLICIES, HOST_POLICY]}")
    return (*POLICIES[policy], False)


@dataclasses.dataclass(frozen=True)
class PrefixSetup:
    """One fixed-memory comparison: workloads and the cache geometry every policy shares."""

    workloads: dict  # name -> list[RequestSpec]
    page_size: int  # tokens per page
    memory_pages: int  # pages the budget holds without checkpoint slots
    max_seqs: int  # running requests (GDN slots, batch rows)
    max_tokens: int  # token budget per step
    num_checkpoints: int  # GDN checkpoint slots of the policies with caching
    page_bytes: int  # one page over all layers
    slot_bytes: int  # one GDN state slot over all layers
    host_bytes: int = 0  # the host tier of HOST_POLICY (host memory, beside the device budget)

    def __post_init__(self) -> None:
        if set(self.workloads) - set(WORKLOADS) or not self.workloads:
            raise ValueError(f"workloads must be named among {WORKLOADS}, got {sorted(self.workloads)}")
        for name in ("page_size", "memory_pages", "max_seqs", "max_tokens", "num_checkpoints", "page_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"PrefixSetup.{name} must be >= 1, got {getattr(self, name)}")

    @property
    def max_blocks(self) -> int:
        longest = max(w.total_len for ws in self.workloads.values() for w in ws)
        return -(-longest // self.page_size)

    @property
    def budget_bytes(self) -> int:
        """Cache bytes of every policy: pages (and checkpoints) plus the sequence slots."""
        return self.memory_pages * self.page_bytes + (self.max_seqs + 1) * self.slot_bytes

    def cache(self, policy: str) -> CacheConfig:
        """The policy's :class:`CacheConfig`: all pages, or what the checkpoint slots leave of them."""
        pages = self.memory_pages
        if policy_modes(policy)[1] is not None:
            pages = split_memory(self.memory_pages * self.page_bytes, page_bytes=self.page_bytes,
                                 slot_bytes=self.slot_bytes, num_checkpoints=self.num_checkpoints)
        return CacheConfig(page_size=self.page_size, num_pages=pages, max_seqs=self.max_seqs,
                           max_blocks_per_seq=self.max_blocks)

    def checkpoints(self, policy: str) -> int:
        return self.num_checkpoints if policy_modes(policy)[1] is not None else 0

    def prefix_config(self, policy: str) -> PrefixCacheConfig | None:
        """The scheduler's prefix cache of ``policy`` (None: no caching)."""
        _, mode, host = policy_modes(policy)
        if mode is None:
            return None
        return PrefixCacheConfig(self.num_checkpoints, True, mode, host_bytes=self.host_bytes if host else 0,
                                 page_bytes=self.page_bytes, ckpt_bytes=self.slot_bytes)


def prefix_workloads(size: Size, *, vocab: int, engine: bool, seed: int = 0) -> dict[str, list[RequestSpec]]:
    """The three workloads at ``size`` (``engine``: the smaller ones the toy model runs; else the simulator's),
    token ids in ``[1, vocab)``."""
    k = size.pick(small=1, gpu=8) * (1 if engine else 4)
    n = size.pick(small=8, gpu=32) * (1 if engine else 2)
    return {
        "system-prompt": system_prompt_workload(n, system_len=48 * k, user_len=8 * k, output_len=8 * k,
                                                vocab=vocab, seed=seed),
        "multi-turn": multi_turn_workload(max(2, n // 4), turns=3, first_len=24 * k, message_len=8 * k,
                                          output_len=8 * k, vocab=vocab, seed=seed),
        "few-shot": few_shot_workload(n, tasks=2, shots=3, shot_len=12 * k, question_len=8 * k, output_len=8 * k,
                                      vocab=vocab, seed=seed),
    }


def make_setup(model, workloads: dict[str, list[RequestSpec]], *, page_size: int, memory_requests: float,
               max_seqs: int, max_tokens: int, num_checkpoints: int | None = None,
               host_memory: float = 0.0) -> PrefixSetup:
    """A :class:`PrefixSetup` whose pages hold ``memory_requests`` mean-length requests (over all workloads) on
    every KV head without recycling; page and slot bytes read from ``model``'s caches (f32);
    ``num_checkpoints`` defaults to ``max_seqs``; ``host_memory``: the host tier's bytes as a multiple of the
    device budget."""
    import jax.numpy as jnp

    from kvjax.engine.sizing import cache_bytes_model

    page_bytes, slot_bytes, _ = cache_bytes_model(model, page_size=page_size, dtype=jnp.float32)
    mean = float(np.mean([w.total_len for ws in workloads.values() for w in ws]))
    heads = model.attention_layout().num_kv_heads
    pages = int(np.ceil(memory_requests * -(-mean // page_size))) * heads
    setup = PrefixSetup(workloads, page_size, pages, max_seqs, max_tokens,
                        max_seqs if num_checkpoints is None else num_checkpoints, page_bytes, slot_bytes)
    return dataclasses.replace(setup, host_bytes=int(host_memory * setup.budget_bytes))


def _row(workload: str, policy: str, setup: PrefixSetup, prompts: list, *, steps: int, generated: int,
         served: int, computed: int, preemptions: int, cached_pages_mean: float, page_util_peak: float,
         tokens_per_s: float = float("nan"), served_host: int = 0, bytes_out: int = 0, bytes_in: int = 0) -> dict:
    cache = setup.cache(policy)
    prompt_tokens = int(sum(len(p) for p in prompts))
    ckpts = setup.checkpoints(policy)
    recycle, mode, host = policy_modes(policy)
    return dict(workload=workload, policy=policy, recycle=recycle, cache=mode or "off",
                host_bytes=setup.host_bytes if host else 0, served_host=served_host, bytes_out=bytes_out,
                bytes_in=bytes_in,
                steps=steps, generated=generated, tokens_per_step=generated / max(steps, 1),
                tokens_per_s=tokens_per_s, prompt_tokens=prompt_tokens, served=served, computed=computed,
                recomputed=served + computed - prompt_tokens, hit_rate=served / max(served + computed, 1),
                preemptions=preemptions, num_pages=cache.num_pages, num_checkpoints=ckpts,
                memory_bytes=cache.num_pages * setup.page_bytes + ckpts * setup.slot_bytes
                + (setup.max_seqs + 1) * setup.slot_bytes,
                cached_pages_mean=cached_pages_mean, page_util_peak=page_util_peak)


def _arrivals(workload: list[RequestSpec], add: Callable[[int, np.ndarray], None]):
    """Start the requests that arrive at step 0; returns ``finished(i, answer)``, which starts the requests
    arriving after ``i`` with prompt = ``i``'s prompt + ``answer`` + their own new message."""
    prompts: list = [None] * len(workload)
    children = collections.defaultdict(list)
    for i, w in enumerate(workload):
        if w.after >= 0:
            children[w.after].append(i)

    def start(i: int, prompt: np.ndarray) -> None:
        prompts[i] = prompt
        add(i, prompt)

    def finished(i: int, answer: np.ndarray) -> None:
        for c in children.pop(i, []):
            parent = workload[i]
            message = workload[c].prompt[parent.prompt.size + parent.max_new_tokens:]
            start(c, np.concatenate([prompts[i], np.asarray(answer, np.int32), message]).astype(np.int32))

    for i, w in enumerate(workload):
        if w.after < 0:
            start(i, w.prompt)
    return prompts, finished


def scheduler_run(setup: PrefixSetup, attention: AttentionConfig, workload_name: str, policy: str, *,
                  seed: int = 0, max_steps: int = 200_000) -> dict:
    """Serve one workload with the real scheduler and no model (each sampling row takes the workload's fixed
    answer token, random where it has none); returns the run's row (see the module docstring)."""
    workload = setup.workloads[workload_name]
    recycle = policy_modes(policy)[0]
    cache = setup.cache(policy)
    prefix = setup.prefix_config(policy)
    sched = Scheduler(cache, attention, max_num_batched_tokens=setup.max_tokens, recycle=recycle,
                      prefix_cache=prefix)
    rng = np.random.default_rng(seed)
    answers = [w.output if w.output is not None else rng.integers(1, 32_000, w.max_new_tokens, dtype=np.int32)
               for w in workload]
    index: dict[int, int] = {}  # request id -> workload index

    def add(i: int, prompt: np.ndarray) -> None:
        index[sched.add_request(prompt, workload[i].max_new_tokens).request_id] = i

    prompts, finished = _arrivals(workload, add)
    steps = generated = served = computed = peak = 0
    cached = []
    while sched.has_unfinished():
        if steps >= max_steps:
            raise RuntimeError(f"{workload_name}/{policy}: not finished in {max_steps} steps")
        plan = sched.schedule()
        by_slot = {r.slot: r for r in sched.running}
        sampled = np.zeros(plan.gdn_slots.shape[0], np.int64)
        for b in np.flatnonzero(plan.sample_mask[: plan.num_seqs]):
            r = by_slot[int(plan.gdn_slots[b])]
            sampled[b] = answers[index[r.request_id]][r.num_output]
        served += plan.prefix_hit_tokens
        computed += plan.prefill_tokens
        generated += int(plan.sample_mask[: plan.num_seqs].sum())
        peak = max(peak, sched.blocks.used_pages())
        cached.append(sched.prefix.cached_pages() if sched.prefix is not None else 0)
        if sched.prefix is not None:
            sched.prefix.take_copies()  # the engine would execute them before the step
        for r in sched.update(plan, sampled):
            finished(index[r.request_id], answers[index[r.request_id]])
        steps += 1
    host = sched.prefix.host if sched.prefix is not None else None
    return _row(workload_name, policy, setup, prompts, steps=steps, generated=generated, served=served,
                computed=computed, preemptions=sched.num_preemptions, cached_pages_mean=float(np.mean(cached)),
                page_util_peak=peak / cache.num_pages, served_host=sched.prefix.hit_tokens_host if host else 0,
                bytes_out=host.bytes_out if host else 0, bytes_in=host.bytes_in if host else 0)


def scheduler_sweep(setup: PrefixSetup, attention: AttentionConfig, *, policies=tuple(POLICIES),
                    seed: int = 0) -> list[dict]:
    """:func:`scheduler_run` for every workload and policy."""
    return [scheduler_run(setup, attention, w, p, seed=seed) for w in setup.workloads for p in policies]


def policy_engine(model: Qwen3_5ForCausalLM, setup: PrefixSetup, policy: str,
                  token_buckets: tuple[int, ...] | None = None, decode_burst: int | str = "auto") -> Engine:
    """An :class:`~kvjax.engine.engine.Engine` for ``policy`` at the setup's memory, one bucket per step shape
    (one compilation; ``token_buckets``, ending at ``setup.max_tokens``: more token buckets, e.g. a small one
    for decode steps); ``decode_burst`` as the engine's."""
    from kvjax.engine.engine import Engine

    recycle, mode, host = policy_modes(policy)
    cache = setup.cache(policy)
    extra = dict(prefix_caching=True, prefix_recycle=mode, prefix_checkpoints=setup.num_checkpoints) if mode else {}
    if host:
        extra["host_cache_bytes"] = setup.host_bytes
    return Engine(model, cache, recycle=recycle, max_num_batched_tokens=setup.max_tokens, use_decode_path=False,
                  token_buckets=token_buckets or (setup.max_tokens,), row_buckets=(cache.max_seqs,),
                  block_buckets=(cache.max_blocks_per_seq,), decode_burst=decode_burst, **extra)


def serve(engine: Engine, workload: list[RequestSpec]) -> tuple[list[np.ndarray], list[list[int]]]:
    """Greedy generation of ``workload`` through ``engine`` (``add_request`` / ``step``): a request with
    ``after >= 0`` is queued when that one finishes, its prompt built from the tokens that one generated.
    Returns ``(prompts as served, outputs)``."""
    outputs: list[list[int]] = [[] for _ in workload]

    def add(i: int, prompt: np.ndarray) -> None:
        engine.add_request(prompt, workload[i].max_new_tokens, index=i)

    prompts, finished = _arrivals(workload, add)
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.index] += out.tokens
            if out.finished:
                finished(out.index, np.asarray(outputs[out.index], np.int32))
    return prompts, outputs


def engine_runs(model: Qwen3_5ForCausalLM, setup: PrefixSetup, *, policies=tuple(POLICIES)) -> list[dict]:
    """Every workload under every policy through the toy model, one engine per policy (the prefix cache is
    cleared between workloads, so each starts cold). Each row also has ``outputs`` and ``prompts`` (as served).
    Raises ``AssertionError`` unless every policy generated the same tokens on a workload, or if an engine is not
    idle afterwards."""
    rows = []
    for policy in policies:
        engine = policy_engine(model, setup, policy)
        for name, workload in setup.workloads.items():
            before = len(engine.metrics)
            prompts, outputs = serve(engine, workload)
            engine.check_integrity()
            engine.clear_prefix_cache()
            if not engine.is_idle():
                raise AssertionError(f"{policy}/{name}: slots or pages left allocated after the run")
            s = engine.metrics.summary(skip=before, num_pages=engine.cache_config.num_pages)
            row = _row(name, policy, setup, prompts, steps=s["steps"], generated=s["generated_tokens"],
                       served=s["prefix_hit_tokens"], computed=s["prefill_tokens"], preemptions=s["preemptions"],
                       cached_pages_mean=s["cached_pages_mean"], page_util_peak=s["page_util_peak"],
                       tokens_per_s=s["generated_tokens_per_s"], served_host=s["prefix_hit_tokens_host"],
                       bytes_out=s["host_bytes_out"], bytes_in=s["host_bytes_in"])
            row["outputs"], row["prompts"] = outputs, [p.tolist() for p in prompts]
            rows.append(row)
    for name in setup.workloads:
        same = [r for r in rows if r["workload"] == name]
        bad = [r["policy"] for r in same if r["outputs"] != same[0]["outputs"]]
        if bad:
            raise AssertionError(f"{name}: {bad} generated other tokens than {same[0]['policy']}")
    return rows


COLUMNS = ("workload", "policy", "num_pages", "num_checkpoints", "steps", "tokens_per_step", "tokens_per_s",
           "hit_rate", "prompt_tokens", "served", "computed", "recomputed", "preemptions", "cached_pages_mean")


def format_rows(rows: list[dict], columns=COLUMNS) -> str:
    """Fixed-width table of run rows."""
    def cell(v) -> str:
        return f"{v:.3f}" if isinstance(v, float) else str(v)

    table = [[cell(r[c]) for c in columns] for r in rows]
    width = [max(len(c), *(len(t[i]) for t in table)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, width)), "  ".join("-" * w for w in width)]
    lines += ["  ".join(v.rjust(w) for v, w in zip(t, width)) for t in table]
    return "\n".join(lines)
