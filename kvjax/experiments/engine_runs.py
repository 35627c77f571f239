"""Recycle policies on a real model: the toy Qwen3.5 through :class:`kvjax.engine.engine.Engine`.

Same question as the simulator sweeps, answered with a model in the loop: at fixed page memory, generated
tokens per second and per step, running requests and pages in use over time for ``recycle="none"`` and
``"timely"`` (and both pool policies). Every engine run compiles its own step once (the engine owns it; the
compiling step is left out of the rates), and :func:`engine_run` checks that the engine is idle (all slots and
pages free) afterwards.

Runs pad every step to one bucket each of tokens (``max_num_batched_tokens``), rows (``max_seqs``) and blocks
(``max_blocks_per_seq``) (the engine's ``token_buckets`` / ``row_buckets`` / ``block_buckets``), so an engine
compiles its step once and every step costs about the same: tokens per second then follows tokens per step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np

from kvjax.config import AttentionConfig, CacheConfig, GDNConfig
from kvjax.experiments.sweeps import workload_bound
from kvjax.sched.workload import RequestSpec

if TYPE_CHECKING:
    from kvjax.engine.engine import Engine
    from kvjax.models.qwen3_5 import Qwen3_5ForCausalLM
    from kvjax.sched.recycle import RecyclePolicy


def toy_qwen(*, vocab: int = 128, hidden: int = 32, kv_heads: int = 4, head_dim: int = 16,
             swa_fraction: float = 1.0, window: int = 32, sinks: int = 4,
             layer_types: Sequence[str] = ("linear_attention", "full_attention"),
             seed: int = 0) -> Qwen3_5ForCausalLM:
    """A randomly initialised toy Qwen3.5 whose first ``round(swa_fraction * kv_heads)`` KV heads (in every
    attention layer) are SWA heads with ``window`` / ``sinks``."""
    from kvjax.models.qwen3_5 import Qwen3_5Config, init_random

    att = AttentionConfig.with_swa_fraction(2 * kv_heads, kv_heads, head_dim, swa_fraction=swa_fraction,
                                            window=window, sinks=sinks if swa_fraction > 0 else 0)
    cfg = Qwen3_5Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                        layer_types=tuple(layer_types), attention=att, gdn=GDNConfig(1, 2, 8, 8, 4),
                        rope_theta=10_000.0, partial_rotary_factor=0.5)
    return init_random(cfg, seed=seed)


def long_prompt_workload(num_requests: int, *, prompt: tuple[int, int], output: tuple[int, int], vocab: int,
                         seed: int = 0) -> list[RequestSpec]:
    """Requests with prompt and output lengths uniform in the inclusive ranges ``prompt`` / ``output``."""
    if num_requests < 1 or not 1 <= prompt[0] <= prompt[1] or not 1 <= output[0] <= output[1]:
        raise ValueError(f"need num_requests >= 1 and 1 <= lo <= hi ranges, got {num_requests}, {prompt}, {output}")
    rng = np.random.default_rng(seed)
    return [RequestSpec(rng.integers(1, vocab, int(rng.integers(prompt[0], prompt[1] + 1)), dtype=np.int32),
                        int(rng.integers(output[0], output[1] + 1))) for _ in range(num_requests)]


def single_bucket_engine(model: Qwen3_5ForCausalLM, cache: CacheConfig, *, recycle: str | RecyclePolicy,
                         pool: str = "shared", max_num_batched_tokens: int) -> Engine:
    """An :class:`~kvjax.engine.engine.Engine` whose steps all have one shape (``T = max_num_batched_tokens``,
    ``B = max_seqs``, all blocks) and no separate decode path: one compilation per engine."""
    from kvjax.engine.engine import Engine

    return Engine(model, cache, recycle=recycle, pool=pool, max_num_batched_tokens=max_num_batched_tokens,
                  use_decode_path=False, token_buckets=(max_num_batched_tokens,), row_buckets=(cache.max_seqs,),
                  block_buckets=(cache.max_blocks_per_seq,))


def engine_run(model: Qwen3_5ForCausalLM, cache: CacheConfig, workload: list[RequestSpec], *,
               recycle: str | RecyclePolicy, pool: str = "shared",
               max_num_batched_tokens: int = 16) -> dict:
    """Generate ``workload`` greedily through one :class:`Engine`; returns ``outputs`` (token lists), ``summary``
    (:meth:`EngineMetrics.summary`), ``trace`` (per-step ``pages_used``, ``running``, ``generated``, ``t_step``
    as arrays), ``num_pages`` and ``bound`` (the simulator's upper bound on tokens per step for this
    workload, layout and memory). Raises ``AssertionError`` if the engine is not idle afterwards."""
    eng = single_bucket_engine(model, cache, recycle=recycle, pool=pool, max_num_batched_tokens=max_num_batched_tokens)
    outputs = eng.generate([w.prompt for w in workload], [w.max_new_tokens for w in workload], progress=False)
    if not eng.is_idle():
        raise AssertionError("engine not idle after generate(): slots or pages leaked")
    m = eng.metrics
    trace = {name: m.column(name) for name in ("pages_used", "running", "generated", "t_step", "compiled")}
    name = recycle if isinstance(recycle, str) else getattr(recycle, "name", type(recycle).__name__)
    bound = workload_bound(workload, cache, model.attention_layout(), max_num_batched_tokens=max_num_batched_tokens,
                           pool=pool, recycle=name)
    return {"recycle": name, "pool": pool, "outputs": outputs, "summary": m.summary(num_pages=cache.num_pages),
            "trace": trace, "num_pages": cache.num_pages, "bound": bound}


def compare_policies(model: Qwen3_5ForCausalLM, cache: CacheConfig, workload: list[RequestSpec], *,
                     pools: Sequence[str] = ("shared",),
                     max_num_batched_tokens: int = 16) -> list[dict]:
    """``engine_run`` for ``none`` and ``timely`` under each pool; every run must produce the same tokens
    (recycling honours the window), else ``AssertionError``. ``gain`` = tokens/s relative to ``none`` (same
    pool), ``step_gain`` the same for tokens/step."""
    runs = []
    for pool in pools:
        base = None
        for recycle in ("none", "timely"):
            r = engine_run(model, cache, workload, recycle=recycle, pool=pool,
                           max_num_batched_tokens=max_num_batched_tokens)
            if runs and r["outputs"] != runs[0]["outputs"]:
                raise AssertionError(f"recycle={recycle}, pool={pool} generated different tokens than the first run")
            base = base or r
            s, b = r["summary"], base["summary"]
            r["gain"] = s["generated_tokens_per_s"] / b["generated_tokens_per_s"]
            r["step_gain"] = s["generated_tokens_per_step"] / b["generated_tokens_per_step"]
            r["bound_gain"] = r["bound"] / base["bound"]
            runs.append(r)
    return runs
