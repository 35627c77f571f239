"""Speculative decoding with the MTP drafter (``speculative="mtp"``, issue 36): the model's MTP layer drafts inside
every jitted step and the next verification step checks its drafts.

Exactness: greedy tokens identical to uncached greedy decoding (``greedy_oracle``) for K in {1, 2, 4} with timely
recycling on a pool small enough to preempt, prefix caching (the MTP pools share the main pools' pages and block
tables), aborts between steps and a fault inside a step; with a random MTP layer (drafts almost never accepted) and
with one trained by :func:`kvjax.experiments.mtp_train.train_mtp` (drafts mostly accepted): acceptance changes the
speed only. The trained layer's acceptance, read from the engine's metrics, is many times chance.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kvjax.engine.engine import Engine
from kvjax.models.qwen3_5 import mtp as mtp_lib
from kvjax.models.sharding import shard_model
from kvjax.sched import spec
from kvjax.sched.drafter import SpeculativeConfig, StepDrafter, make_drafter
from helpers.engine import (BUDGET, SMALL, assert_idle, fault_midway, greedy_oracle, prefix_sharing_prompts,
                            stream_aborting)
from helpers.spec import Successors
from helpers.models import VOCAB, qwen_swa_model, random_model, tiny_config, tiny_deepseek_config

NEW = 12
# one token, row and block bucket and no decode path: two traces per engine (an ordinary and a verification step)
ONE_BUCKET = dict(token_buckets=(BUDGET,), row_buckets=(SMALL.max_seqs,), block_buckets=(SMALL.max_blocks_per_seq,),
                  use_decode_path=False)


@pytest.fixture(scope="module")
def qwen():
    """The tiny f32 Qwen3.5 with an SWA head (window 6, 2 sinks) and random MTP layers attached."""
    model = qwen_swa_model()
    return mtp_lib.attach(model, mtp_lib.init(model.config, seed=11))


@pytest.fixture(scope="module")
def shared(qwen):
    """Prompts sharing long prefixes (prefix-cache hits), chunked by the budget, and their greedy continuations."""
    rng = np.random.default_rng(8)
    prompts = prefix_sharing_prompts(rng)
    return prompts, greedy_oracle(qwen, prompts, NEW)


def mtp_engine(model, K: int, **kw) -> Engine:
    return Engine(model, SMALL, recycle="timely", max_num_batched_tokens=BUDGET,
                  speculative=SpeculativeConfig(method="mtp", num_draft_tokens=K, flat_tokens=None), **ONE_BUCKET, **kw)


@pytest.mark.parametrize("K", [1, 2, 4])
def test_greedy_equals_oracle_with_recycling_preemption_and_prefix_caching(qwen, shared, K):
    prompts, expect = shared
    eng = mtp_engine(qwen, K, prefix_caching=True, debug=K == 2)
    assert not eng.overlap and eng.decode_burst > 1  # verification bursts where every row decodes
    assert eng.generate(prompts, NEW) == expect
    s = eng.metrics.summary()
    assert s["drafts_proposed"] > 0 and s["preemptions"] > 0 and s["prefix_hit_tokens"] > 0
    assert len(s["acceptance_rate_per_position"]) == K
    assert eng.num_traces <= 4  # ordinary, verification, verification burst (and the prefix cache's copies' variant)
    mtp_pages = {n for n in eng.caches.pages if n.endswith(f"_{qwen.config.num_layers}")}
    assert mtp_pages == {f"key_caches_{qwen.config.num_layers}", f"value_caches_{qwen.config.num_layers}"}
    eng.clear_prefix_cache()
    assert_idle(eng)


def test_aborts_between_steps_and_a_fault_inside_one(qwen, shared, monkeypatch):
    prompts, expect = shared
    eng = mtp_engine(qwen, 2)
    stream_aborting(eng, prompts, NEW, expect)
    assert eng.metrics.summary()["drafts_proposed"] > 0
    assert_idle(eng)

    # the same engine: a fault after the step's caches were donated; recovery recomputes (fresh MTP pools too)
    steps0 = eng.scheduler.spec_stats.steps
    fault_midway(monkeypatch, eng, prompts[:3], NEW, expect[:3], lambda: eng.scheduler.spec_stats.steps >= steps0 + 2)
    assert_idle(eng)


# ------------------------------------------------------------------------------------ a trained MTP layer


def test_trained_mtp_layer_is_accepted_far_above_chance_and_exact():
    """A model trained on :class:`Successors` and an MTP layer trained by ``train_mtp`` with it frozen: the engine's
    acceptance rate (its metrics) is many times chance, and the tokens are the oracle's."""
    pytest.importorskip("optax")
    from kvjax.experiments.mtp_train import train_mtp
    from kvjax.experiments.tasks import train

    rng = np.random.default_rng(3)
    task = Successors(rng, 16)
    # attention only (an SWA head): the GDN layers' gradients cost most of a CPU training step
    model = random_model(tiny_config(window=(6, 0), sinks=(2, 0), layer_types=("full_attention",)), seed=2)
    model, h = train(model, task, steps=50, lr=2e-2, warmup=10, seed=5)
    head, hist = train_mtp(model, task, steps=50, lr=2e-2, warmup=10, on="all", seed=4)
    mtp_lib.attach(model, head)
    prompts = [list(map(int, p)) for p in task.chains(rng.integers(1, VOCAB, 4), 5)]
    expect = greedy_oracle(model, prompts, NEW)
    eng = mtp_engine(model, 2)
    assert eng.generate(prompts, NEW) == expect
    s = eng.metrics.summary()
    assert s["drafts_proposed"] > 10
    assert s["acceptance_rate"] > 30 / VOCAB, (s, h["accuracy"][-10:].mean(), hist["accuracy"][-10:].mean())
    assert s["tokens_per_verify_row"] > 1.5
    assert_idle(eng)


# --------------------------------------------------------------------------------- host side and refusals


def test_step_drafts_continue_only_the_tokens_they_were_made_for(qwen, shared):
    """The host keeps a step's drafts per slot for the request and token count they continue: a request that moved
    on, left its slot or was replaced gets none; the rule still caps them."""
    drafter = make_drafter(SpeculativeConfig(method="mtp", num_draft_tokens=3))
    assert drafter.from_step and isinstance(drafter.drafter, StepDrafter)
    assert drafter.propose(np.arange(5), 3).size == 0  # no host drafting

    class Rows:
        request_id = np.array([-1, 7, 8, 9])
        num_tokens = np.array([0, 10, 12, 5])

    fresh = drafter.drafts_rows(*np.array([[1, 7, 10, 3]], np.int64).T)  # nothing recorded yet
    assert [d.tolist() for d in fresh] == [[]]
    # the step's drafts may be wider than K (its width: the engine's largest K): the first K are kept
    drafter.record(Rows, np.array([1, 2, 3]), np.array([7, 8, 4]),
                   np.array([[4, 5, 6, 9], [1, -1, -1, 9], [3, 3, 3, 9]]))
    # (slot, request, tokens, cap) -> drafts, asked for all rows at once
    cases = [((1, 7, 10, 3), [4, 5, 6]), ((1, 7, 10, 2), [4, 5]),
             ((2, 8, 12, 3), [1]),  # -1: no draft there
             ((1, 7, 11, 3), []),  # the request moved on
             ((1, 6, 10, 3), []),  # another request in the slot
             ((3, 9, 5, 3), []),  # recorded for request 4, which left before the record
             ((9, 7, 10, 3), []),  # a slot never recorded
             ((1, 7, 10, 0), [])]  # no room
    got = drafter.drafts_rows(*np.array([c for c, _ in cases], np.int64).T)
    assert [d.tolist() for d in got] == [want for _, want in cases]
    assert all(d.dtype == np.int32 for d in got)


def test_next_tokens_are_the_prompts_next_token_or_sampled(qwen):
    eng = mtp_engine(qwen, 2)
    eng.add_request(list(range(1, 31)), 4)  # 30 tokens: chunks of 16 and 14
    sched = eng.scheduler
    plan = sched.schedule(1, eng.drafter)
    assert plan.query_lens[0] == BUDGET
    assert spec.next_tokens(sched, plan)[:2].tolist() == [BUDGET + 1, -1]


def test_mtp_is_refused_without_mtp_layers():
    from kvjax.models.deepseek import DeepseekV32

    with pytest.raises(ValueError, match="MTP layers.*none"):
        Engine(qwen_swa_model(), SMALL, speculative="mtp")
    deepseek = nnx.eval_shape(lambda: DeepseekV32(tiny_deepseek_config(), rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match="DeepseekV32 has none"):
        Engine(deepseek, SMALL, speculative="mtp")
    model = mtp_lib.attach(qwen_swa_model(), mtp_lib.init(qwen_swa_model().config, seed=1))
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    with pytest.raises(ValueError, match="ShardedModel has none"):  # its parameters leave the MTP layers out
        Engine(shard_model(model, mesh), SMALL, speculative="mtp")


def test_sizing_pays_for_the_mtp_pools(qwen):
    """A page of an MTP engine's cache holds the MTP layer's K and V too (``Engine`` sizes and checks the cache
    with them); slots and fixed bytes are the model's."""
    from kvjax.engine.sizing import cache_bytes_model

    a = qwen.config.attention
    for dtype, fp8, item in ((jnp.float32, {}, 4), (jnp.float32, {"kv_cache_dtype": "fp8"}, 1)):
        plain = cache_bytes_model(qwen, page_size=4, dtype=dtype, cache_options=fp8)
        both = cache_bytes_model(qwen, page_size=4, dtype=dtype, cache_options=fp8, head=qwen.mtp_head())
        scales = 2 * 4 if fp8 else 0  # f32 key / value scale per page
        assert both[0] - plain[0] == 2 * 4 * a.head_dim * item + scales
        assert both[1:] == plain[1:]


def test_fp8_pages_give_the_plain_engines_tokens(qwen, shared):
    """fp8 K/V pages (the MTP pools too, with their per-page scales): the MTP engine's tokens are the plain fp8
    engine's (not the f32 oracle's)."""
    prompts, _ = shared
    plain = Engine(qwen, SMALL, recycle="timely", max_num_batched_tokens=BUDGET, kv_cache_dtype="fp8", **ONE_BUCKET)
    expect = plain.generate(prompts, NEW)
    eng = mtp_engine(qwen, 2, kv_cache_dtype="fp8")
    assert eng.caches.pages[f"key_caches_{qwen.config.num_layers}"].dtype == jnp.float8_e4m3fn
    assert f"key_scale_caches_{qwen.config.num_layers}" in eng.caches.pages
    assert eng.generate(prompts, NEW) == expect
    assert eng.metrics.summary()["drafts_proposed"] > 0
    assert_idle(eng)
