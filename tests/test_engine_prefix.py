"""Prefix caching in the engine: outputs equal those without caching (and uncached greedy decoding), token for
token in f32, while prompt tokens are served from the cache.

Oracles: ``greedy_oracle`` (full-sequence ``model.logits``, no cache) and the engine without prefix caching.
Models: tiny f32 Qwen3.5 with an SWA head (GDN checkpoints; recycling none / timely with both cache recycle
policies) and tiny DeepSeek-V3.2 (latent + indexer pages shared by block, no checkpoints). The small pool forces
preemption; the budget below the longest prompt forces chunked prefill; both overlap modes. After every run and
``clear_prefix_cache`` every page and slot is free (``check_integrity``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.engine import sizing
from kvjax.engine.engine import Engine
from kvjax.state import gdn_checkpoints, gdn_pool
from kvjax.config import GDNConfig
from helpers.engine import BUDGET, SMALL, assert_idle, greedy_oracle
from helpers.faults import POINTS, Injected, arm
from helpers.models import VOCAB, qwen_swa_model, tiny_deepseek_config

NEW = 6


@pytest.fixture(scope="module")
def qwen():
    return qwen_swa_model()


def shared_prompts(rng) -> list[list[int]]:
    """Prompts sharing a 14-token system prefix (3.5 pages of 4), one that is an exact prefix of the others'
    prefix, one equal to the prefix, and one unrelated."""
    system = rng.integers(0, VOCAB, 14).tolist()
    return ([system + rng.integers(0, VOCAB, n).tolist() for n in (5, 11, 2, 9)]
            + [system[:9], system, rng.integers(0, VOCAB, 17).tolist(), system + rng.integers(0, VOCAB, 6).tolist()])


@pytest.fixture(scope="module")
def case(qwen):
    prompts = shared_prompts(np.random.default_rng(7))
    return prompts, greedy_oracle(qwen, prompts, NEW)


def finish(engine: Engine) -> None:
    engine.check_integrity()
    engine.clear_prefix_cache()
    assert engine.scheduler.prefix.cached_pages() == 0 and engine.scheduler.prefix.checkpoints_used() == 0
    assert_idle(engine)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
@pytest.mark.parametrize("recycle,policy", [("none", "keep_tail"), ("timely", "keep_tail"), ("timely", "eager")])
def test_qwen_outputs_equal_uncached_and_prompts_hit(qwen, case, overlap, recycle, policy):
    prompts, expect = case
    engine = Engine(qwen, SMALL, overlap=overlap, recycle=recycle, max_num_batched_tokens=BUDGET, debug=True,
                    prefix_caching=True, prefix_recycle=policy, decode_burst=1)  # single steps: preemptions
    assert engine.generate(prompts, NEW) == expect
    first = engine.metrics.summary()
    assert first["preemptions"] > 0 and first["prefix_hit_tokens"] > 0
    assert first["prefill_tokens"] + first["prefix_hit_tokens"] >= sum(map(len, prompts))
    engine.check_integrity()
    traces = engine.num_traces
    assert engine.generate(prompts, NEW) == expect  # the cache outlives the call: the second one hits more
    second = engine.metrics.summary(skip=first["steps"])
    assert second["prefix_hit_tokens"] > first["prefix_hit_tokens"]
    assert second["prefill_tokens"] + second["prefix_hit_tokens"] >= sum(map(len, prompts))  # + recomputes
    assert engine.num_traces == traces  # same buckets, copies of fixed shape: no recompilation
    finish(engine)


def test_conversation_of_generate_calls(qwen):
    """Each turn's prompt = the previous prompt + its answer + a new message; later turns hit the cache."""
    rng = np.random.default_rng(3)
    engine = Engine(qwen, SMALL, recycle="timely", max_num_batched_tokens=BUDGET, prefix_caching=True, debug=True)
    plain = Engine(qwen, SMALL, recycle="timely", max_num_batched_tokens=BUDGET)
    prompts = [rng.integers(0, VOCAB, 10).tolist(), rng.integers(0, VOCAB, 7).tolist()]
    hits = []
    for turn in range(3):
        out = engine.generate(prompts, 4)
        assert out == plain.generate(prompts, 4)
        hits.append(engine.metrics.summary()["prefix_hit_tokens"])
        prompts = [p + o + rng.integers(0, VOCAB, 3).tolist() for p, o in zip(prompts, out)]
    assert hits[0] == 0 < hits[1] < hits[2]
    assert out == greedy_oracle(qwen, [p[: -3 - 4] for p in prompts], 4)
    finish(engine)


def test_aborts_keep_outputs_and_free_everything(qwen, case):
    prompts, expect = case
    for overlap in (True, False):
        engine = Engine(qwen, SMALL, overlap=overlap, recycle="timely", max_num_batched_tokens=BUDGET,
                        prefix_caching=True)
        got = [[] for _ in prompts]
        aborted = {1, 5}
        for ev in engine.stream(prompts, NEW):
            got[ev.index].append(ev.token)
            if ev.index in aborted and ev.position == 1:
                engine.abort(ev.request_id)
        for i, out in enumerate(got):
            assert out == (expect[i][: len(out)] if i in aborted else expect[i])
        assert engine.generate(prompts[:3], NEW) == expect[:3]
        finish(engine)


def test_no_recompilation_after_warmup(qwen):
    """Requests with shared prefixes arriving and leaving for 150 steps: the step traces only on a new
    (T, B, blocks, decode_only) key (the checkpoint copies have fixed shapes)."""
    engine = Engine(qwen, SMALL, recycle="timely", max_num_batched_tokens=BUDGET, prefix_caching=True)
    rng = np.random.default_rng(11)
    systems = [rng.integers(0, VOCAB, n).tolist() for n in (9, 16)]
    added = 0
    while len(engine.metrics) < 150:
        s = engine.scheduler
        while len(s.running) + len(s.waiting) + len(s.preempted) < 6:
            prompt = systems[added % 2] + rng.integers(0, VOCAB, int(rng.integers(1, 20))).tolist()
            engine.add_request(prompt, int(rng.integers(1, 10)), index=added)
            added += 1
        engine.step()
    while engine.has_unfinished():
        engine.step()
    recs = engine.metrics.records
    keys = [(r.bucket_tokens, r.bucket_rows, r.bucket_blocks, r.decode_only, r.burst > 1) for r in recs]
    first = {k: i for i, k in reversed(list(enumerate(keys)))}
    assert all(first[keys[i]] == i for i, r in enumerate(recs) if r.compiled)
    assert engine.metrics.summary()["prefix_hit_tokens"] > 0
    finish(engine)


@pytest.mark.parametrize("point", POINTS)
def test_fault_clears_the_cache_and_recovers(qwen, case, monkeypatch, point):
    prompts, expect = case
    engine = Engine(qwen, SMALL, recycle="timely", max_num_batched_tokens=BUDGET, prefix_caching=True)
    assert engine.generate(prompts[:4], NEW) == expect[:4]
    with monkeypatch.context() as m:
        arm(m, engine, point, Injected)
        with pytest.raises(Injected):
            engine.generate(prompts, NEW)
    assert engine.scheduler.prefix.cached_pages() == 0  # the caches were rebuilt: nothing cached survives
    engine.check_integrity()
    assert engine.generate(prompts, NEW) == expect
    finish(engine)


def test_deepseek_shares_latent_and_indexer_pages():
    from kvjax.config import CacheConfig
    from kvjax.models.deepseek import DeepseekV32
    from flax import nnx

    config = tiny_deepseek_config()
    model = nnx.jit(lambda: DeepseekV32(config, rngs=nnx.Rngs(5)))()
    prompts = shared_prompts(np.random.default_rng(5))[:6]
    expect = greedy_oracle(model, prompts, NEW)
    cache = CacheConfig(page_size=4, num_pages=10, max_seqs=4, max_blocks_per_seq=8)
    with pytest.raises(ValueError, match="no GDN layers"):
        Engine(model, cache, prefix_caching=True, prefix_checkpoints=2)
    for overlap in (True, False):
        engine = Engine(model, cache, overlap=overlap, max_num_batched_tokens=BUDGET, use_decode_path=False,
                        cache_options={"indexer_fp8": False}, prefix_caching=True, debug=True)
        assert engine.generate(prompts, NEW) == expect
        s = engine.metrics.summary()
        assert s["prefix_hit_tokens"] > 0 and s["preemptions"] > 0
        assert engine.scheduler.prefix.config.num_checkpoints == 0
        finish(engine)


def test_settings_that_cannot_work_are_clear_errors(qwen):
    with pytest.raises(ValueError, match="num_checkpoints must be >= 1"):
        Engine(qwen, SMALL, prefix_caching=True, prefix_checkpoints=0)
    with pytest.raises(ValueError, match="need prefix_caching=True"):
        Engine(qwen, SMALL, prefix_checkpoints=2)
    with pytest.raises(ValueError, match="recycle must be one of"):
        Engine(qwen, SMALL, prefix_caching=True, prefix_recycle="lazy")
    with pytest.raises(ValueError, match="prefix_caching must be True or False"):
        Engine(qwen, SMALL, prefix_caching="yes")


def test_checkpoint_slots_sized_and_allocated(qwen):
    engine = Engine(qwen, SMALL, prefix_caching=True, prefix_checkpoints=3)
    assert engine.caches.gdn.max_seqs == SMALL.max_seqs + 3
    assert list(engine.scheduler.prefix.checkpoint_slots) == [5, 6, 7]
    base = sizing.size_cache(qwen, dtype=jnp.float32)
    more = sizing.size_cache(qwen, dtype=jnp.float32, num_checkpoints=8)
    assert more.cache_bytes <= more.budget_bytes and more.num_checkpoints == 8
    assert base.cache_config.num_pages - more.cache_config.num_pages == -(-8 * more.slot_bytes // more.page_bytes) \
        or base.cache_config.num_pages - more.cache_config.num_pages == 8 * more.slot_bytes // more.page_bytes
    sized = Engine(qwen, prefix_caching=True)
    allocated = sum(x.nbytes for x in jax.tree_util.tree_leaves(sized.caches))
    assert allocated == sized.cache_sizing.cache_bytes
    assert sized.cache_sizing.num_checkpoints == sized.cache_config.max_seqs


def test_speculative_decoding_keeps_room_for_a_verification_steps_states(qwen):
    """Default sizing pays for a verification step's per-position states (``K + 1`` state slots per sequence) before
    the pages, as it pays for checkpoint slots; a bad count is refused."""
    from kvjax.sched.drafter import SpeculativeConfig

    base = sizing.size_cache(qwen, dtype=jnp.float32)
    spec = sizing.size_cache(qwen, dtype=jnp.float32, verify_positions=5)
    extra = 5 * base.cache_config.max_seqs
    assert spec.verify_slots == extra and base.verify_slots == 0
    assert base.cache_config.num_pages - spec.cache_config.num_pages in (
        extra * spec.slot_bytes // spec.page_bytes, -(-extra * spec.slot_bytes // spec.page_bytes))
    assert spec.cache_bytes + extra * spec.slot_bytes <= spec.budget_bytes
    assert "kept for a verification step's states" in spec.describe()
    sized = Engine(qwen, speculative=SpeculativeConfig(method="ngram", num_draft_tokens=3))
    assert sized.cache_sizing.verify_slots == 4 * sized.cache_config.max_seqs
    with pytest.raises(ValueError, match="verify_positions must be an int >= 0"):
        sizing.size_cache(qwen, dtype=jnp.float32, verify_positions=-1)


def test_copy_slots_matches_numpy():
    rng = np.random.default_rng(0)
    pool = gdn_pool.create(GDNConfig(2, 4, 8, 8, 4), 3, 7, conv_dtype=jnp.float32)
    pool = gdn_pool.GDNStatePool(conv=jnp.asarray(rng.standard_normal(pool.conv.shape), jnp.float32),
                                 ssm=jnp.asarray(rng.standard_normal(pool.ssm.shape), jnp.float32))
    src = np.array([5, -1, 2, 0, 3, 9], np.int32)
    dst = np.array([1, 4, 6, 7, -1, 2], np.int32)  # valid pairs: 5->1, 2->6 (0, -1 and 9 copy nothing)
    out = jax.jit(gdn_checkpoints.copy_slots)(pool, jnp.asarray(src), jnp.asarray(dst))
    for name in ("conv", "ssm"):
        want = np.array(getattr(pool, name))
        want[:, 1], want[:, 6] = want[:, 5], want[:, 2]
        np.testing.assert_array_equal(np.asarray(getattr(out, name)), want)
    slots = jnp.asarray([3, 4], jnp.int32)
    restored = gdn_checkpoints.restore(pool, jnp.asarray([6, -1], jnp.int32), slots)
    np.testing.assert_array_equal(np.asarray(restored.ssm[:, 3]), np.asarray(pool.ssm[:, 6]))
    np.testing.assert_array_equal(np.asarray(restored.ssm[:, 4]), np.asarray(pool.ssm[:, 4]))
    saved = gdn_checkpoints.save(pool, slots, jnp.asarray([-1, 7], jnp.int32))
    np.testing.assert_array_equal(np.asarray(saved.conv[:, 7]), np.asarray(pool.conv[:, 4]))
    np.testing.assert_array_equal(np.asarray(saved.conv[:, 3]), np.asarray(pool.conv[:, 3]))


def test_run_and_simulate_commands_with_prefix_caching(capsys):
    from kvjax.__main__ import main

    rc = main(["run", "--requests", "4", "--scale", "0.004", "--memory-requests", "1.5", "--no-progress",
               "--prefix-caching"])
    out = capsys.readouterr().out
    assert rc == 0 and "identical tokens in every run and repeat: yes" in out and "timely+prefix" in out
    rc = main(["simulate", "--prefix-caching", "--workload", "multi-turn", "--requests", "8", "--scale", "0.02",
               "--max-seqs", "4", "--max-tokens", "128", "--page-size", "16", "--window", "32", "--json", "-"])
    import json
    data = json.loads(capsys.readouterr().out)
    assert rc == 0 and [r["mode"] for r in data["results"]] == ["off", "eager", "keep_tail"]
    off, _, keep = data["results"]
    assert off["cached_tokens"] == 0 < keep["cached_tokens"] and keep["computed_tokens"] < off["computed_tokens"]
