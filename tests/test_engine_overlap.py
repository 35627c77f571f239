"""The overlapped engine (plan step N+1 while step N runs) equals the synchronous one token for token; cache
sizing without a CacheConfig; the host-time metrics.

Oracles: the synchronous engine (``overlap=False``) and uncached greedy decoding (``greedy_oracle``), truncated
after the first eos for eos runs. Models: tiny f32 Qwen3.5 with an SWA head (timely recycling, a pool small
enough to preempt) and tiny DeepSeek-V3.2.
"""

from __future__ import annotations

import logging

import jax
import numpy as np
import pytest
from flax import nnx

from kvjax.config import CacheConfig
from kvjax.engine import sizing
from kvjax.engine.engine import Engine
from helpers.engine import BUDGET, SMALL, assert_idle, greedy_oracle, random_prompts, step_events, truncate_at
from helpers.models import qwen_swa_model, tiny_deepseek_config

NEW = 8


@pytest.fixture(scope="module")
def qwen():
    return qwen_swa_model()


@pytest.fixture(scope="module")
def case(qwen):
    prompts = random_prompts(np.random.default_rng(21), (23, 9, 37, 3, 18, 30, 12))
    return prompts, greedy_oracle(qwen, prompts, NEW)


def qwen_engine(model, overlap: bool, **kw) -> Engine:
    return Engine(model, SMALL, overlap=overlap, recycle="timely", max_num_batched_tokens=BUDGET, **kw)


def spy_schedule(engine: Engine) -> list[bool]:
    """Record, at every schedule(), whether an earlier step's tokens were still unread (the overlap)."""
    seen, sched = [], engine.scheduler
    real = sched.schedule
    sched.schedule = lambda *a: (seen.append(sched.has_unresolved()), real(*a))[1]
    return seen


def stream_all(engine: Engine, prompts, **kw) -> tuple[list[list[int]], list]:
    got, events = [[] for _ in prompts], []
    for ev in engine.stream(prompts, NEW, **kw):
        assert ev.position == len(got[ev.index])
        got[ev.index].append(ev.token)
        events.append(ev)
    return got, events


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_overlap_equals_sync_qwen(qwen, case, temperature):
    prompts, expect = case
    outs, traces = {}, {}
    for overlap in (True, False):
        engine = qwen_engine(qwen, overlap, debug=True)
        seen = spy_schedule(engine)
        outs[overlap], events = stream_all(engine, prompts, temperature=temperature, seed=5)
        assert all(ev.finished == (ev.position == NEW - 1) for ev in events)
        assert engine.metrics.summary()["preemptions"] > 0
        assert sum(seen) > len(seen) // 2 if overlap else not any(seen)
        traces[overlap] = engine.num_traces
        assert_idle(engine)
    assert outs[True] == outs[False]
    assert traces[True] == traces[False]  # the same buckets: the overlap adds no compilation
    if temperature == 0.0:
        assert outs[True] == expect


def test_eos_one_step_late_never_emits_the_extra_token(qwen, case):
    prompts, expect = case
    counts = {}
    for tok in {t for o in expect for t in o[1:-1]}:  # a token some outputs reach mid-way
        counts[tok] = sum(tok in o[:-1] for o in expect)
    eos = max(counts, key=counts.get)
    want = [truncate_at(o, eos) for o in expect]
    assert sum(len(w) < NEW for w in want) >= 2
    computed = {}
    for overlap in (True, False):
        engine = qwen_engine(qwen, overlap, eos_token_id=eos)
        got, events = stream_all(engine, prompts)
        assert got == want
        assert all(ev.finished == (ev.token == eos or ev.position == NEW - 1) for ev in events)
        assert engine.metrics.summary()["generated_tokens"] == sum(map(len, want))
        computed[overlap] = engine.metrics.summary()["computed_tokens"]
        assert_idle(engine)
    assert computed[True] >= computed[False]  # rows run one step too long are computed, never emitted


def test_abort_mid_stream_equals_sync(qwen, case):
    prompts, expect = case
    runs = {}
    for overlap in (True, False):
        engine = qwen_engine(qwen, overlap)
        got, aborted = [[] for _ in prompts], {}
        for ev in engine.stream(prompts, NEW):
            got[ev.index].append(ev.token)
            if ev.index in (1, 4) and ev.position == 2:
                aborted[ev.index] = engine.abort(ev.request_id)
                engine.check_integrity()
            if ev.index == 0 and ev.position == 0:  # still waiting: never runs
                aborted[6] = engine.abort(ev.request_id + 6)
        assert all(aborted[i] == got[i] == expect[i][:3] for i in (1, 4)) and aborted[6] == got[6] == []
        runs[overlap] = got
        assert_idle(engine)
    assert runs[True] == runs[False]
    assert [runs[True][i] for i in (0, 2, 3, 5)] == [expect[i] for i in (0, 2, 3, 5)]


def test_overlap_equals_sync_deepseek():
    from kvjax.models.deepseek import DeepseekV32

    config = tiny_deepseek_config()
    model = nnx.jit(lambda: DeepseekV32(config, rngs=nnx.Rngs(5)))()
    prompts = random_prompts(np.random.default_rng(6), (21, 4, 13, 26, 8))
    expect = greedy_oracle(model, prompts, 6)
    cache = CacheConfig(page_size=4, num_pages=14, max_seqs=4, max_blocks_per_seq=8)
    for temperature in (0.0, 0.7):
        outs = {}
        for overlap in (True, False):
            engine = Engine(model, cache, overlap=overlap, recycle="timely", max_num_batched_tokens=BUDGET,
                            use_decode_path=False, cache_options={"indexer_fp8": False}, token_buckets=(16,),
                            row_buckets=(4,), block_buckets=(8,))
            outs[overlap] = engine.generate(prompts, 6, temperature=temperature, seed=2)
            assert engine.metrics.summary()["preemptions"] > 0
            assert_idle(engine)
        assert outs[True] == outs[False]
        if temperature == 0.0:
            assert outs[True] == expect


def test_step_returns_the_previous_steps_tokens(qwen, case):
    """Stepping by hand: the first overlapped step dispatches and returns nothing; every token arrives once, in
    order; the synchronous engine returns each step's own tokens."""
    prompts, expect = case
    for overlap in (True, False):
        engine = qwen_engine(qwen, overlap)
        ids = [engine.add_request(prompts[i], NEW, index=i) for i in (1, 3)]
        first = step_events(engine)
        assert (first == []) == overlap  # both prompts fit the first step (9 + 3 <= 16 tokens): they sample
        got = {rid: [] for rid in ids}
        for ev in first:
            got[ev.request_id].append(ev.token)
        while engine.has_unfinished():
            for ev in step_events(engine):
                got[ev.request_id].append(ev.token)
        assert [got[rid] for rid in ids] == [expect[1], expect[3]]
        assert len(engine.metrics) == engine.scheduler.step  # one record per device step
        assert_idle(engine)


# ---- metrics ------------------------------------------------------------------------------------------------


def test_host_time_metrics(qwen, case):
    prompts, _ = case
    for overlap in (True, False):
        engine = qwen_engine(qwen, overlap)
        engine.generate(prompts, NEW)
        for r in engine.metrics.records:
            assert 0 <= r.t_exposed <= r.t_host + 1e-9 and r.t_host <= r.t_step + 1e-9
            assert r.t_schedule + r.t_inputs + r.t_dispatch + r.t_wait + r.t_update <= r.t_step + 1e-9
            if not overlap:  # synchronous: the device waits while the host plans, builds inputs and applies tokens
                assert r.t_schedule + r.t_inputs + r.t_dispatch + r.t_update <= r.t_exposed + 1e-9
        s = engine.metrics.summary()
        assert 0 <= s["host_share"] <= s["host_total_share"] + 1e-9 <= 1 + 1e-9
        assert s["exposed_host_time_median_s"] <= s["host_time_median_s"] + 1e-9
        assert s["generated_tokens"] == NEW * len(prompts)


# ---- default cache sizing -----------------------------------------------------------------------------------


def cache_nbytes(caches) -> int:
    return sum(x.nbytes for x in jax.tree_util.tree_leaves(caches))


def test_engine_without_cache_config_sizes_one(qwen, case, caplog):
    prompts, expect = case
    with caplog.at_level(logging.INFO, logger="kvjax.engine.engine"):
        engine = Engine(qwen, use_decode_path=False, row_buckets=(8,), token_buckets=(256,), block_buckets=(128,))
    s = engine.cache_sizing
    assert s is not None and engine.cache_config is s.cache_config
    assert any("cache sized from" in m and str(s.cache_config.num_pages) in m for m in caplog.messages)
    assert str(s.cache_config.num_pages) in engine.describe() and "overlap=on" in engine.describe()
    assert cache_nbytes(engine.caches) == s.cache_bytes <= s.budget_bytes == sizing.CPU_BUDGET
    assert s.cache_bytes > 0.9 * s.budget_bytes  # most of the budget is used
    gdn = cache_nbytes(engine.caches.gdn)  # the GDN state slots count, one per sequence + PAD
    assert s.slot_bytes == gdn // (s.cache_config.max_seqs + 1) > 0
    assert s.page_bytes * s.cache_config.num_pages == cache_nbytes(engine.caches.pages)
    assert engine.generate(prompts[:3], 3) == [e[:3] for e in expect[:3]]
    assert_idle(engine)


def test_sizing_deepseek_has_no_state_slots():
    from kvjax.models.deepseek import DeepseekV32

    config = tiny_deepseek_config()
    model = nnx.eval_shape(lambda: DeepseekV32(config, rngs=nnx.Rngs(0)))
    s = sizing.size_cache(model, dtype=np.float32, max_seqs=4, max_seq_len=64)
    # per page and layer: latent key f32[16, 32 + 8], fp8 indexer [16, 16] + its f32 scales
    per_layer = 16 * 40 * 4 + 16 * 16 * 1 + 16 * (16 // config.quant_block) * 4
    assert s.slot_bytes == 0 and s.page_bytes == 2 * per_layer
    assert s.cache_config.max_blocks_per_seq == 4 and s.cache_config.num_pages == sizing.CPU_BUDGET // s.page_bytes


class FakeDevice:
    platform, device_kind = "gpu", "Fake GPU"

    def __init__(self, limit: int, used: int):
        self.stats = {"bytes_limit": limit, "bytes_in_use": used}

    def memory_stats(self):
        return self.stats


def test_sizing_takes_a_fraction_of_free_device_memory(qwen):
    dev = FakeDevice(limit=1 << 30, used=(1 << 30) - (100 << 20))  # 100 MiB free
    s = sizing.size_cache(qwen, dtype=np.float32, memory_fraction=0.5, device=dev)
    assert s.budget_bytes == 50 << 20 and s.cache_bytes <= s.budget_bytes < s.cache_bytes + s.page_bytes
    assert s.cache_config.max_seqs == sizing.MAX_SEQS["accelerator"] and "0.5 x 100.0 MiB free" in s.describe()
    with pytest.raises(ValueError, match="raise memory_fraction"):
        sizing.size_cache(qwen, dtype=np.float32, device=FakeDevice(limit=1 << 30, used=(1 << 30) - 4096))


@pytest.mark.parametrize("bad", [0, 0.0, -0.5, 1.01, float("nan"), "0.5", True, [0.5]])
def test_bad_memory_fraction_is_a_clear_error(qwen, bad):
    with pytest.raises(ValueError, match="memory_fraction must be a number in \\(0, 1\\]"):
        Engine(qwen, memory_fraction=bad)


def test_memory_fraction_with_a_cache_config_is_refused(qwen):
    with pytest.raises(ValueError, match="only without a cache_config"):
        Engine(qwen, SMALL, memory_fraction=0.5)
    with pytest.raises(ValueError, match="overlap must be True or False"):
        Engine(qwen, SMALL, overlap="yes")


def test_packed_inputs_round_trip_aligned(qwen, case):
    """One packed i32 buffer per step, one row per data shard: every field starts at a multiple of 256 bytes (kernel
    operands must be aligned: a Triton kernel refused a misaligned slice on the H100) and unpacks, inside a jit, to
    exactly each shard's plan arrays (``temperature`` and ``top_p`` bit for bit, ``counters`` = ``seq_lens``; page
    ids made local to each head's pool by ``page_base``)."""
    from kvjax.engine.inputs import PACK_ALIGN, pack_plans

    prompts, _ = case
    eng = qwen_engine(qwen, False)
    for i, p in enumerate(prompts[:3]):
        eng.add_request(p, NEW, index=i, temperature=0.5 + i, seed=7)
    plan = eng.scheduler.schedule()
    rng = np.random.default_rng(0)
    B = plan.seq_lens.shape[0]
    samplings = [dict(seeds=rng.integers(0, 2**31 - 1, B, dtype=np.int32),
                      streams=rng.integers(0, 99, B, dtype=np.int32),
                      temperature=rng.uniform(0.1, 3, B).astype(np.float32),
                      top_k=rng.integers(0, 40, B, dtype=np.int32), top_p=rng.uniform(0.1, 1, B).astype(np.float32))
                 for _ in range(2)]
    ps = eng.cache_config.page_size
    held = [plan.block_tables[:, h][plan.block_tables[:, h] >= 0] for h in range(plan.block_tables.shape[1])]
    page_base = np.array([h.min() if h.size else 0 for h in held], np.int64)  # as if each head had its own pool
    assert page_base.any()
    buf, layout = pack_plans([plan, plan], samplings, checkpoints=True, decode_only=False, page_base=page_base,
                             page_size=ps)
    assert buf.shape[0] == 2 and PACK_ALIGN * buf.itemsize % 256 == 0
    bt = np.where(plan.block_tables >= 0, plan.block_tables - page_base[:, None], -1)
    sm = np.where(plan.slot_mapping >= 0, plan.slot_mapping - page_base * ps, -1)
    for d, sampling in enumerate(samplings):
        expect = {**{n: getattr(plan, n) for n, _ in layout.fields if hasattr(plan, n)}, **sampling,
                  "block_tables": bt, "slot_mapping": sm,
                  "temperature": sampling["temperature"].view(np.int32), "top_p": sampling["top_p"].view(np.int32)}
        off = 0
        for name, shape in layout.fields:  # each field's values start at the next 256-byte boundary
            n = int(np.prod(shape))
            np.testing.assert_array_equal(buf[d, off: off + n], np.asarray(expect[name]).astype(np.int32).ravel(), name)
            off += -(-n // PACK_ALIGN) * PACK_ALIGN
        assert off == buf.shape[1]
        inputs, rows, copies = jax.jit(layout.unpack)(buf[d])
        for name in ("token_ids", "positions", "cu_seqlens", "seq_lens", "gdn_slots", "has_initial_state",
                     "logits_indices"):
            np.testing.assert_array_equal(np.asarray(getattr(inputs, name)), np.asarray(getattr(plan, name)), name)
        np.testing.assert_array_equal(np.asarray(inputs.block_tables), bt)
        np.testing.assert_array_equal(np.asarray(inputs.slot_mapping), sm)
        assert inputs.decode_only is False
        np.testing.assert_array_equal(np.asarray(rows.temperature), sampling["temperature"])
        np.testing.assert_array_equal(np.asarray(rows.top_k), sampling["top_k"])
        np.testing.assert_array_equal(np.asarray(rows.top_p), sampling["top_p"])
        np.testing.assert_array_equal(np.asarray(rows.seeds), sampling["seeds"])
        np.testing.assert_array_equal(np.asarray(rows.streams), sampling["streams"])
        np.testing.assert_array_equal(np.asarray(rows.counters), plan.seq_lens)
        np.testing.assert_array_equal(np.asarray(rows.prev_index), plan.prev_index)
        np.testing.assert_array_equal(np.asarray(copies.restore), plan.ckpt_restore)
        np.testing.assert_array_equal(np.asarray(copies.save), plan.ckpt_save)
