"""Decode bursts (``Engine(decode_burst=K)``: up to K decode sub-steps per dispatch) generate the same tokens as
single steps, token for token.

Oracles: the same engine with ``decode_burst=1`` and uncached greedy decoding (``greedy_oracle``), truncated
after the first eos for eos runs. Models: tiny f32 Qwen3.5 with an SWA head (timely recycling, a pool small
enough to preempt) and tiny DeepSeek-V3.2. The scheduler half (what a burst plan allocates, reserves and
resolves) is checked against the plans of single steps.
"""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

from kvjax.config import CacheConfig
from kvjax.engine.engine import Engine
from kvjax.sched.plan import build_plan
from helpers.engine import BUDGET, SMALL, assert_idle, greedy_oracle, random_prompts, step_events, truncate_at
from helpers.faults import POINTS, Injected, arm
from helpers.models import qwen_swa_model, tiny_deepseek_config
from helpers.sched import sched_with

NEW = 11  # not a multiple of the bursts below: requests end inside a burst
K = 4


@pytest.fixture(scope="module")
def qwen():
    return qwen_swa_model()


@pytest.fixture(scope="module")
def case(qwen):
    prompts = random_prompts(np.random.default_rng(33), (23, 9, 37, 3, 18, 30, 12))
    return prompts, greedy_oracle(qwen, prompts, NEW)


def engine(model, burst: int, overlap: bool, **kw) -> Engine:
    return Engine(model, SMALL, overlap=overlap, recycle="timely", max_num_batched_tokens=BUDGET,
                  decode_burst=burst, **kw)


def bursts(eng: Engine) -> list[int]:
    return [r.burst for r in eng.metrics.records]


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_burst_equals_single_steps_qwen(qwen, case, overlap, temperature):
    prompts, expect = case
    outs = {}
    for burst in (1, K):
        eng = engine(qwen, burst, overlap, debug=True)
        events = list(eng.stream(prompts, NEW, temperature=temperature, seed=5))
        got = [[ev.token for ev in events if ev.index == i] for i in range(len(prompts))]
        assert all([ev.position for ev in events if ev.index == i] == list(range(NEW)) for i in range(len(prompts)))
        assert all(ev.finished == (ev.position == NEW - 1) for ev in events)
        assert eng.metrics.summary()["preemptions"] > 0
        outs[burst] = got
        assert_idle(eng)
        if burst == K:
            assert max(bursts(eng)) == K and eng.metrics.summary()["steps"] < sum(map(len, expect))
    assert outs[K] == outs[1]
    if temperature == 0.0:
        assert outs[K] == expect


def test_a_burst_step_delivers_one_output_per_request(qwen, case):
    """``Engine.step`` returns one ``StepOutput`` per request per step: a burst step's carries up to ``K`` tokens
    (positions continuing the request's, ``finished`` on its last); together they equal the oracle."""
    prompts, expect = case
    eng = engine(qwen, K, True)
    ids = [eng.add_request(p, NEW, index=i) for i, p in enumerate(prompts)]
    got = {rid: [] for rid in ids}
    sizes = []
    while eng.has_unfinished():
        outs = eng.step()
        assert len({o.request_id for o in outs}) == len(outs)
        for out in outs:
            assert out.tokens and out.position == len(got[out.request_id]) and out.index == ids.index(out.request_id)
            got[out.request_id] += out.tokens
            assert out.finished == (len(got[out.request_id]) == NEW)
            sizes.append(len(out.tokens))
    assert [got[rid] for rid in ids] == expect
    assert max(sizes) == K and min(sizes) >= 1
    assert_idle(eng)


def test_burst_stops_at_eos_and_emits_nothing_after(qwen, case):
    prompts, expect = case
    counts = {tok: sum(tok in o[1:-1] for o in expect) for tok in {t for o in expect for t in o[1:-1]}}
    eos = max(counts, key=counts.get)
    want = [truncate_at(o, eos) for o in expect]
    assert sum(len(w) < NEW for w in want) >= 2
    for overlap in (True, False):
        eng = engine(qwen, K, overlap, eos_token_id=eos)
        events = list(eng.stream(prompts, NEW))
        got = [[ev.token for ev in events if ev.index == i] for i in range(len(prompts))]
        assert got == want
        assert all(ev.finished == (ev.token == eos or ev.position == NEW - 1) for ev in events)
        assert max(bursts(eng)) == K
        assert_idle(eng)


def test_abort_inside_a_burst(qwen, case):
    prompts, expect = case
    eng = engine(qwen, K, True)
    got, aborted = [[] for _ in prompts], {}
    for ev in eng.stream(prompts, NEW):
        got[ev.index].append(ev.token)
        if ev.index in (1, 4) and ev.position == 5:
            aborted[ev.index] = eng.abort(ev.request_id)
            eng.check_integrity()
    assert all(aborted[i] == got[i] == expect[i][:6] for i in (1, 4))
    assert [got[i] for i in (0, 2, 3, 5, 6)] == [expect[i] for i in (0, 2, 3, 5, 6)]
    assert max(bursts(eng)) == K
    assert_idle(eng)


def test_burst_equals_single_steps_deepseek():
    from kvjax.models.deepseek import DeepseekV32

    model = nnx.jit(lambda: DeepseekV32(tiny_deepseek_config(), rngs=nnx.Rngs(5)))()
    prompts = random_prompts(np.random.default_rng(6), (21, 4, 13, 26, 8))
    expect = greedy_oracle(model, prompts, 7)
    cache = CacheConfig(page_size=4, num_pages=20, max_seqs=4, max_blocks_per_seq=8)
    for temperature in (0.0, 0.7):
        outs = {}
        for burst in (1, 3):
            eng = Engine(model, cache, recycle="timely", max_num_batched_tokens=BUDGET, use_decode_path=False,
                         cache_options={"indexer_fp8": False}, token_buckets=(16,), row_buckets=(4,),
                         block_buckets=(8,), decode_burst=burst)
            outs[burst] = eng.generate(prompts, 7, temperature=temperature, seed=2)
            assert max(bursts(eng)) == burst
            assert_idle(eng)
        assert outs[3] == outs[1]
        if temperature == 0.0:
            assert outs[3] == expect


def test_burst_plan_allocates_reserves_and_resolves():
    """Scheduler half: a burst plan covers every sub-step's page, reserves one token per sub-step at flat index
    ``j * B + b``, and resolving them equals applying single steps (same tokens, same counters)."""
    single, burst = sched_with(num_pages=200), sched_with(num_pages=200)
    lens, news = (5, 9, 3), (7, 2, 6)
    for s in (single, burst):
        for p, n in zip(lens, news):
            s.add_request(np.arange(1, p + 1), n)
        plan = s.schedule()  # the prompts, all in one step
        s.update(plan, np.full(plan.seq_lens.shape[0], 7))
    plan = burst.schedule(K)
    B = plan.seq_lens.shape[0]
    assert plan.burst == K and plan.burst_len[:3].tolist() == [K, 1, K]  # request 1 may sample 1 more token
    seq = plan.seq_lens[:3]
    for b in range(3):  # the tables cover the last sub-step's position on every head
        last = seq[b] - 1 + plan.burst_len[b] - 1
        assert (plan.block_tables[b, :, last // 4] >= 0).all()
    sampled = np.arange(K * B, dtype=np.int64) % 50 + 1
    burst.update(plan, sampled)
    row_of = {rid: b for b, rid in enumerate(plan.request_ids)}
    for j in range(K):  # single steps fed the same tokens, request by request
        p1 = single.schedule()
        fed = np.zeros(p1.seq_lens.shape[0], np.int64)
        fed[: p1.num_seqs] = [sampled[j * B + row_of[rid]] for rid in p1.request_ids]
        single.update(p1, fed)
    for s in (single, burst):
        s.check_integrity()
    got = {r.request_id: (r.output_ids.tolist(), r.num_computed) for r in burst.requests.values()}
    want = {r.request_id: (r.output_ids.tolist(), r.num_computed) for r in single.requests.values()}
    assert got == want and set(got) == {0, 2}  # request 1 finished at its max


def test_burst_only_when_no_queued_request_could_be_admitted():
    s = sched_with(num_pages=200, max_seqs=2)
    for p in (5, 40, 3):
        s.add_request(np.arange(1, p + 1), 9)
    plan = s.schedule(K)
    assert plan.burst_len is None  # prompts
    s.update(plan, np.ones(plan.seq_lens.shape[0], np.int64))
    plan = s.schedule(K)
    assert plan.burst_len is None and len(s.waiting) == 1  # a prompt still prefilling
    while plan.burst_len is None:  # both rows decode, the third request waits for a slot: bursts go on
        s.update(plan, np.ones(plan.seq_lens.shape[0] * K, np.int64))
        plan = s.schedule(K)
    assert len(s.waiting) == 1 and len(s.running) == 2 and plan.burst == K
    s.update(plan, np.ones(plan.seq_lens.shape[0] * K, np.int64))
    s.abort(s.running[0].request_id)  # a slot frees: the waiting request is admitted by an ordinary step
    plan = s.schedule(K)
    assert plan.burst_len is None and not s.waiting


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2", 65])
def test_bad_decode_burst_is_a_clear_error(qwen, bad):
    with pytest.raises(ValueError, match="decode_burst"):
        engine(qwen, bad, True)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_burst_with_prefix_caching_equals_single_steps(qwen, overlap):
    """Prompts sharing a prefix, twice (the second call hits the cache): bursts run, prompts hit, and the tokens
    are the single-step engine's and the uncached oracle's."""
    rng = np.random.default_rng(5)
    vocab = int(qwen.vocab_size)
    system = rng.integers(0, vocab, 13).tolist()
    prompts = [system + rng.integers(0, vocab, int(n)).tolist() for n in (4, 9, 2, 6)]
    expect = greedy_oracle(qwen, prompts, NEW)
    for burst in (1, K):
        eng = engine(qwen, burst, overlap, prefix_caching=True, debug=True)
        assert eng.generate(prompts, NEW) == expect and eng.generate(prompts, NEW) == expect
        assert eng.metrics.summary()["prefix_hit_tokens"] > 0
        assert (max(bursts(eng)) > 1) == (burst > 1)
        eng.check_integrity()


def test_build_plan_tables_cover_the_burst():
    s = sched_with(num_pages=200)
    s.add_request(np.arange(1, 8), 20)
    s.update(s.schedule(), np.array([3] * 8))
    t = s.rows
    slot = np.array([s.running[0].slot], np.int64)
    s.blocks.allocate(int(slot[0]), int(t.num_computed[slot][0]) + 30)
    plan = build_plan(s.step, slot, np.ones(1, np.int64), t, s.blocks, s.t_buckets, s.b_buckets, s.blk_buckets,
                      burst=np.array([30]))
    assert plan.block_tables.shape[2] * 4 >= plan.seq_lens[0] + 29 and plan.burst == 30


@pytest.mark.parametrize("point", POINTS)
def test_fault_during_a_burst_recovers_by_recompute(qwen, case, monkeypatch, point):
    """A fault at each point of a step while a burst is in flight: the engine recovers (the burst's reserved
    tokens are dropped and its requests recomputed) and the outputs equal an uninterrupted run."""
    prompts, expect = case[0][:3], case[1][:3]
    eng = engine(qwen, K, True)
    ids = [eng.add_request(p, NEW, index=i) for i, p in enumerate(prompts)]
    got = {rid: [] for rid in ids}

    def collect(events):
        for ev in events:
            got[ev.request_id].append(ev.token)
            assert ev.position == len(got[ev.request_id]) - 1

    while not (eng.pipeline.inflight and eng.pipeline.inflight[-1].plans[0].burst > 1):
        collect(step_events(eng))
    with monkeypatch.context() as m:
        arm(m, eng, point, Injected)
        with pytest.raises(Injected):
            while True:
                collect(step_events(eng))
    while eng.has_unfinished():
        collect(step_events(eng))
        eng.check_integrity()
    assert [got[rid] for rid in ids] == expect
    assert max(bursts(eng)) == K
    assert_idle(eng)


def test_advance_has_no_loop():
    """The device glue between sub-steps lowers without a loop: an XLA ``while`` leaves the CUDA graph the rest
    of a burst step runs in (on the H100 a ``searchsorted`` scan here split a burst into two graphs and 28 kernels
    launched one by one, benchmarks/HISTORY.md run 52)."""
    import jax
    import jax.numpy as jnp

    from kvjax.engine.burst import advance
    from kvjax.inputs import StepInputs

    B, H, M = 4, 2, 3
    r = np.random.default_rng(0)
    inputs = StepInputs(token_ids=jnp.asarray(r.integers(0, 50, B), jnp.int32),
                        positions=jnp.asarray(r.integers(0, 8, B), jnp.int32),
                        cu_seqlens=jnp.arange(B + 1, dtype=jnp.int32), seq_lens=jnp.full(B, 9, jnp.int32),
                        gdn_slots=jnp.arange(1, B + 1, dtype=jnp.int32), has_initial_state=jnp.ones(B, bool),
                        block_tables=jnp.asarray(r.integers(-1, 20, (B, H, M)), jnp.int32),
                        slot_mapping=jnp.zeros((B, H), jnp.int32), logits_indices=jnp.arange(B, dtype=jnp.int32),
                        decode_only=True)
    text = jax.jit(advance, static_argnums=3).lower(inputs, jnp.ones(B, jnp.int32), jnp.ones(B, bool), 4).as_text()
    assert "stablehlo.gather" in text or "stablehlo.dynamic_slice" in text  # the lowering is the real one
    assert "stablehlo.while" not in text and "stablehlo.case" not in text


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_abort_of_a_streamed_request_whose_last_events_are_queued(qwen, case, overlap):
    """A burst delivers a request's last tokens at once: aborting it at its first event (``finished`` False, the
    request already finished in the scheduler) drops its queued events and raises nothing; the others are
    untouched; a non-int id is refused."""
    prompts, expect = case
    eng = engine(qwen, K, overlap)
    got: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    stream = eng.stream(prompts, 3)  # 3 tokens: one burst after the prompt's step
    for ev in stream:
        got[ev.index].append(ev.token)
        if ev.index == 0 and ev.position == 0:
            assert not ev.finished
            assert eng.abort(ev.request_id) == [ev.token]
            with pytest.raises(ValueError, match="unknown request id"):
                eng.abort(ev.request_id)
            with pytest.raises(ValueError, match="request_id must be an int"):
                eng.abort(float(ev.request_id))
    assert got[0] == expect[0][:1]
    assert all(got[i] == expect[i][:3] for i in range(1, len(prompts)))
    assert_idle(eng)


def test_metrics_count_sub_steps(qwen, case):
    """The per-step figures researchers compare (tokens per step, running requests) mean the same with and without
    bursts: a burst of K weighs K sub-steps, and its running requests are its rows at each sub-step."""
    prompts, _ = case
    got = {}
    for burst in (1, 8):
        eng = engine(qwen, burst, True)
        eng.generate(prompts, 20)
        got[burst] = eng.metrics.summary()
    one, many = got[1], got[8]
    assert many["steps"] < many["sub_steps"] and one["steps"] == one["sub_steps"]
    assert many["generated_tokens"] == one["generated_tokens"]
    for key in ("generated_tokens_per_step", "running_mean"):
        assert abs(many[key] / one[key] - 1) < 0.15, (key, one[key], many[key])
    assert many["tokens_per_dispatch"] > many["generated_tokens_per_step"]


@pytest.mark.parametrize("seed", range(16))
def test_burst_ready_agrees_with_the_plan_it_predicts(seed):
    """``burst_ready(K)`` (asked of every data shard before a mesh step) says whether ``schedule(K)`` then returns a
    burst: the same answer although the question recycles. With timely recycling and a tight pool, the pages a
    running request's window gives back can let a queued request in: asked before recycling, admission looked
    impossible, so a shard promised a burst and then planned a prompt (the 2-GPU crash of a burst step holding
    prompt tokens)."""
    rng = np.random.default_rng(seed)
    s = sched_with(num_pages=24, max_seqs=6, recycle="timely")
    for _ in range(10):
        s.add_request(rng.integers(1, 50, int(rng.integers(3, 12))), int(rng.integers(4, 24)))
    bursts = 0
    for _ in range(400):
        if not s.has_unfinished():
            break
        ready = s.burst_ready(K)
        plan = s.schedule(K)
        assert ready == (plan.burst_len is not None), (s.step, ready, plan.burst_len, len(s.waiting))
        bursts += plan.burst_len is not None
        s.update(plan, rng.integers(1, 50, plan.seq_lens.shape[0] * plan.burst))
        s.check_integrity()
    assert not s.has_unfinished() and bursts > 0
