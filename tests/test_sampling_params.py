"""``SamplingParams`` and what it controls: argument checks, top-k / top-p sampling on the device, stop ids.

Oracles: for top-k / top-p, the exact distribution computed in numpy (float64: softmax of ``logits /
temperature`` restricted to the top-k, then to the smallest most-probable set whose renormalised mass reaches
top-p, renormalised), against which the tokens that the engine's device sampling function
(:func:`kvjax.engine.sampling.sample`, the one the jitted step calls) draws for many rows with distinct keys are
compared by a chi-square test at significance :data:`ALPHA` (the keys are fixed, so the test is deterministic;
ALPHA is its false-alarm rate over key choices); the same comparison must reject samples drawn with the filter
switched off. For the engine: the keyword form (``max_new_tokens``, ``temperature=``, ``seed=``) gives the same
tokens as ``SamplingParams``; a run without stop ids, truncated after the first stop id, for stop ids and the
engine's eos ids (Qwen3.5 with an SWA head and DeepSeek-V3.2); decode bursts against single steps.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy import stats

from kvjax.config import CacheConfig
from kvjax.engine import Engine, SamplingParams
from kvjax.engine import sampling
from kvjax.models.loading import GenerationConfig
from kvjax.sched.request import MAX_STOP_IDS
from helpers.engine import BUDGET, SMALL, assert_idle, random_prompts
from helpers.models import VOCAB, qwen_swa_model, tiny_deepseek_config

ALPHA = 1e-3  # significance of each chi-square test
NEW = 9
BUCKETS = dict(token_buckets=(BUDGET,), row_buckets=(SMALL.max_seqs,), block_buckets=(SMALL.max_blocks_per_seq,))


@pytest.fixture(scope="module")
def qwen():
    return qwen_swa_model()


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(np.random.default_rng(21), (23, 9, 37, 3, 18, 12))


def make_engine(model, **kw) -> Engine:
    return Engine(model, SMALL, recycle="timely", max_num_batched_tokens=BUDGET, **{**BUCKETS, **kw})


@pytest.fixture(scope="module")
def engine(qwen):
    """An engine with no eos (decode bursts on, the default), shared by the tests that only queue requests."""
    return make_engine(qwen, eos_token_id=None)


def truncate_at(tokens: list[int], stops) -> list[int]:
    """``tokens`` up to and including the first of ``stops``."""
    for i, t in enumerate(tokens):
        if t in stops:
            return tokens[: i + 1]
    return tokens


def frequent_tokens(outs: list[list[int]], n: int) -> list[int]:
    """The ``n`` tokens that occur (not as a request's first token) in most of ``outs``' requests."""
    seen = [set(o[1:]) for o in outs]
    tokens = sorted({t for s in seen for t in s}, key=lambda t: (-sum(t in s for s in seen), t))
    return tokens[:n]


# ---- argument checks ---------------------------------------------------------------------------------------


BAD_PARAMS = {
    "temperature negative": (dict(temperature=-0.5), "SamplingParams.temperature"),
    "temperature nan": (dict(temperature=float("nan")), "SamplingParams.temperature"),
    "temperature str": (dict(temperature="0.5"), "SamplingParams.temperature"),
    "top_k negative": (dict(top_k=-1), "SamplingParams.top_k"),
    "top_k float": (dict(top_k=2.5), "SamplingParams.top_k"),
    "top_k bool": (dict(top_k=True), "SamplingParams.top_k"),
    "top_p zero": (dict(top_p=0.0), "SamplingParams.top_p"),
    "top_p above 1": (dict(top_p=1.5), "SamplingParams.top_p"),
    "top_p nan": (dict(top_p=float("nan")), "SamplingParams.top_p"),
    "top_p str": (dict(top_p="0.9"), "SamplingParams.top_p"),
    "seed beyond int32": (dict(seed=2**31), "SamplingParams.seed"),
    "seed float": (dict(seed=1.5), "SamplingParams.seed"),
    "max_tokens zero": (dict(max_tokens=0), "SamplingParams.max_tokens"),
    "max_tokens float": (dict(max_tokens=8.0), "SamplingParams.max_tokens"),
    "stop ids a str": (dict(stop_token_ids="12"), "SamplingParams.stop_token_ids"),
    "stop ids an int": (dict(stop_token_ids=12), "SamplingParams.stop_token_ids"),
    "stop id negative": (dict(stop_token_ids=[3, -1]), "SamplingParams.stop_token_ids"),
    "stop id float": (dict(stop_token_ids=[3, 1.0]), "SamplingParams.stop_token_ids"),
    "too many stop ids": (dict(stop_token_ids=list(range(MAX_STOP_IDS + 1))), "SamplingParams.stop_token_ids"),
}


@pytest.mark.parametrize("name", list(BAD_PARAMS))
def test_bad_sampling_params_name_the_value(name):
    kw, match = BAD_PARAMS[name]
    with pytest.raises(ValueError, match=match) as err:
        SamplingParams(**kw)
    shown = f"{MAX_STOP_IDS + 1} distinct" if name == "too many stop ids" else repr(next(iter(kw.values())))
    assert shown in str(err.value)  # the message shows the bad value


def test_sampling_params_normalise_and_are_frozen():
    p = SamplingParams(temperature=1, top_k=None, top_p=1, seed=np.int32(3), max_tokens=np.int64(4),
                       stop_token_ids=np.array([5, 2, 5]))
    assert (p.temperature, p.top_k, p.top_p, p.seed, p.max_tokens, p.stop_token_ids) == (1.0, 0, 1.0, 3, 4, (5, 2))
    assert p == SamplingParams(temperature=1.0, top_k=0, seed=3, max_tokens=4, stop_token_ids=(5, 2))
    assert type(p.seed) is int and type(p.top_k) is int and not p.filtered
    assert SamplingParams(temperature=0.5, top_p=0.9).filtered and not SamplingParams(top_k=3).filtered  # greedy
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.top_k = 3


BAD_CALLS = {
    "stop id = vocab": dict(params=SamplingParams(max_tokens=4, stop_token_ids=[VOCAB])),
    "one of the per-prompt params bad": dict(params=[SamplingParams(max_tokens=4),
                                                     SamplingParams(max_tokens=4, stop_token_ids=[VOCAB + 3]),
                                                     SamplingParams(max_tokens=4)]),
    "params count != prompts": dict(params=[SamplingParams(max_tokens=4)] * 2),
    "params and temperature": dict(params=SamplingParams(max_tokens=4), temperature=0.5),
    "params and seed": dict(params=SamplingParams(max_tokens=4), seed=1),
    "params and max_new_tokens": dict(params=SamplingParams(max_tokens=4), max_new_tokens=4),
    "lengths twice": dict(params=4, max_new_tokens=4),
    "no lengths": dict(),
    "params mixed with ints": dict(params=[SamplingParams(max_tokens=4), 4, 4]),
    "a dict": dict(params={"temperature": 0.5}),
    "short-form top_p": dict(params=4, top_p=0.5),
}


@pytest.mark.parametrize("name", list(BAD_CALLS))
def test_bad_calls_queue_nothing(engine, prompts, name):
    call = BAD_CALLS[name]
    error = TypeError if "top_p" in call else ValueError  # an unknown keyword is Python's TypeError
    for run in (engine.generate, lambda *a, **k: list(engine.stream(*a, **k)), engine.stream):
        with pytest.raises(error):
            run(prompts[:3], **call)
        assert_idle(engine)
    params = call.get("params")
    if isinstance(params, SamplingParams) or name == "one of the per-prompt params bad":
        one = params if isinstance(params, SamplingParams) else params[1]
        with pytest.raises(error):
            engine.add_request(prompts[0], one, **{k: v for k, v in call.items() if k != "params"})
        assert_idle(engine)


def test_too_many_stop_ids_with_the_engines_eos(qwen, prompts):
    eng = make_engine(qwen, eos_token_id=[1, 2, 3])
    assert eng.eos_token_ids == (1, 2, 3) and eng.eos_token_id == 1
    ok = SamplingParams(max_tokens=2, stop_token_ids=[1, 2, 3, 4, 5, 6, 7, 8])  # 8 distinct with the eos ids
    bad = SamplingParams(max_tokens=2, stop_token_ids=[4, 5, 6, 7, 8, 9])  # 9
    with pytest.raises(ValueError, match=f"9 distinct stop ids, at most {MAX_STOP_IDS}"):
        eng.add_request(prompts[0], bad)
    with pytest.raises(ValueError, match="stop_token_ids of prompt 1"):
        eng.generate(prompts[:2], [ok, bad])
    assert_idle(eng)
    rid = eng.add_request(prompts[0], ok)
    assert eng.scheduler.requests[rid].eos_token_ids == (1, 2, 3, 4, 5, 6, 7, 8)
    eng.abort(rid)
    assert_idle(eng)
    for bad_eos in ([1, VOCAB], list(range(MAX_STOP_IDS + 1)), "none", [1.0], [[1, 2]]):
        with pytest.raises(ValueError, match="eos_token_id"):
            make_engine(qwen, eos_token_id=bad_eos)


# ---- top-k / top-p against the exact distribution ----------------------------------------------------------


LOGITS = np.array([2.0, 1.3, 1.1, 0.4, 0.2, -0.3, -1.0, 0.9, -0.1, 0.5], np.float32)  # V = 10, distinct
CASES = [  # (temperature, top_k, top_p)
    (1.0, 3, 1.0),
    (0.7, 0, 0.6),
    (1.0, 3, 0.6),  # top-p over the top-3's renormalised mass: keeps 2 (over the full distribution: 3)
    (1.5, 6, 0.8),
    (1.0, 0, 1.0),  # off
    (0.8, 10, 0.999999),  # k = V: off; p just under 1
]


def reference(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """f64[V]: the exact distribution of a sampling row (see the module docstring)."""
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-z, kind="stable")
    keep = np.zeros(len(z), bool)
    k = top_k if 0 < top_k < len(z) else len(z)
    keep[order[:k]] = True
    q = np.where(keep, p, 0.0)
    q /= q.sum()
    if top_p < 1:
        mass = np.cumsum(q[order]) - q[order]  # mass of the more probable tokens
        keep[order[mass >= top_p]] = False
    q = np.where(keep, q, 0.0)
    return q / q.sum()


def draw(temperature, top_k, top_p, rows: int) -> np.ndarray:
    """i32[C, rows]: tokens the device sampling function draws for each of ``C`` cases (``temperature``,
    ``top_k``, ``top_p``: one per case), one row per key (distinct seeds), all cases in one batch."""
    n = len(temperature)
    B = n * rows
    keys = sampling.row_keys(jnp.arange(B, dtype=jnp.int32), jnp.full(B, 3, jnp.int32), jnp.full(B, 17, jnp.int32))
    logits = jnp.broadcast_to(jnp.asarray(LOGITS), (B, LOGITS.size))
    rep = lambda x, dt: jnp.repeat(jnp.asarray(x, dt), rows)  # noqa: E731
    out = jax.jit(sampling.sample)(logits, keys, rep(temperature, jnp.float32), rep(top_k, jnp.int32),
                                   rep(top_p, jnp.float32))
    return np.asarray(out).reshape(n, rows)


def chi_square(tokens: np.ndarray, expect: np.ndarray) -> float:
    """The p-value of a chi-square goodness-of-fit test of ``tokens`` (i32[N]) against the distribution
    ``expect`` (f64[V]); 0 if a token of probability 0 was drawn (an infinite statistic)."""
    counts = np.bincount(tokens, minlength=expect.size)
    support = expect > 0
    if counts[~support].any():
        return 0.0
    if support.sum() == 1:
        return 1.0
    return float(stats.chisquare(counts[support], expect[support] * counts.sum()).pvalue)


ABLATIONS = {  # what a sampler that ignores part of the parameters draws
    "as given": lambda t, k, p: (t, k, p),
    "top-k ignored": lambda t, k, p: (t, 0, p),
    "top-p ignored": lambda t, k, p: (t, k, 1.0),
    "both ignored": lambda t, k, p: (t, 0, 1.0),
}


@pytest.fixture(scope="module")
def drawn():
    """name -> i32[len(CASES), rows]: the draws of each case's parameters as :data:`ABLATIONS` changes them."""
    out = {}
    for name, change in ABLATIONS.items():
        t, k, p = (list(c) for c in zip(*(change(*case) for case in CASES)))
        out[name] = draw(t, k, p, rows=6000)
    return out


@pytest.mark.parametrize("case", range(len(CASES)))
def test_top_k_top_p_match_the_exact_distribution(drawn, case):
    """The engine's sampler passes the test; a sampler ignoring top-k, top-p or both fails it wherever that
    changes the distribution (the same keys drawn with those parameters switched off)."""
    expect = reference(LOGITS, *CASES[case])
    tokens = drawn["as given"][case]
    assert set(np.unique(tokens)) <= set(np.flatnonzero(expect)), "a token outside the top-k / top-p set"
    pvalue = chi_square(tokens, expect)
    assert pvalue > ALPHA, f"chi-square p = {pvalue:.2e} for {CASES[case]}: {np.bincount(tokens, minlength=10)}"
    for name, change in ABLATIONS.items():
        if np.abs(reference(LOGITS, *change(*CASES[case])) - expect).max() > 0.02:
            assert chi_square(drawn[name][case], expect) < ALPHA, f"the test misses a sampler with {name}"


def test_the_cases_catch_each_ablation():
    """Every way of ignoring a parameter changes the distribution of some case (so the test above catches it)."""
    for name, change in ABLATIONS.items():
        if name != "as given":
            assert any(np.abs(reference(LOGITS, *change(*c)) - reference(LOGITS, *c)).max() > 0.02 for c in CASES)


def test_reference_orders_top_k_before_top_p():
    """Case 2 tells the two orders apart: top-p of the top-3's renormalised mass keeps 2 tokens, of the full
    distribution 3 (the engine must match the first)."""
    assert (reference(LOGITS, 1.0, 3, 0.6) > 0).sum() == 2
    assert (reference(LOGITS, 1.0, 0, 0.6) > 0).sum() == 3


def test_a_rows_token_does_not_depend_on_the_batch():
    """Unfiltered and greedy rows draw the same token whether or not another row of the batch filters (the
    filter runs under ``lax.cond`` for the whole batch), and filtered rows the same alone or in a batch."""
    rng = np.random.default_rng(4)
    B, V = 24, 61
    logits = jnp.asarray(rng.normal(0, 2, (B, V)), jnp.float32)
    keys = sampling.row_keys(jnp.arange(B, dtype=jnp.int32), jnp.zeros(B, jnp.int32), jnp.full(B, 9, jnp.int32))
    t = jnp.asarray(np.where(np.arange(B) % 5 == 0, 0.0, 1.2), jnp.float32)
    off_k, off_p = jnp.zeros(B, jnp.int32), jnp.ones(B, jnp.float32)
    fn = jax.jit(sampling.sample)
    plain = np.asarray(fn(logits, keys, t, off_k, off_p))  # no row filters: the filter's branch is skipped
    filt = np.arange(B) % 3 == 1
    k = jnp.asarray(np.where(filt, 4, 0), jnp.int32)
    p = jnp.asarray(np.where(filt, 0.7, 1.0), jnp.float32)
    mixed = np.asarray(fn(logits, keys, t, k, p))
    np.testing.assert_array_equal(mixed[~filt], plain[~filt])
    others = jnp.asarray(np.where(filt, 4, 2), jnp.int32), jnp.asarray(np.where(filt, 0.7, 0.5), jnp.float32)
    np.testing.assert_array_equal(np.asarray(fn(logits, keys, t, *others))[filt], mixed[filt])
    assert (mixed[filt] != plain[filt]).any()  # the filter did something


def test_filter_keeps_ties_and_at_least_one_token():
    logits = jnp.asarray([[1.0, 3.0, 3.0, 0.5], [5.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]], jnp.float32)
    out = np.asarray(sampling.filter_logits(logits, jnp.asarray([1, 0, 2], jnp.int32),
                                            jnp.asarray([1.0, 1e-6, 0.3], jnp.float32)))
    assert np.isfinite(out).tolist() == [[False, True, True, False], [True, False, False, False],
                                         [True, True, True, True]]
    np.testing.assert_array_equal(out[np.isfinite(out)], np.asarray(logits)[np.isfinite(out)])


# ---- the engine ----------------------------------------------------------------------------------------------


def test_sampling_params_equal_the_keyword_form(engine, prompts):
    lengths = [NEW, 3, NEW, 5, 1, NEW]
    short = engine.generate(prompts, lengths, temperature=0.8, seed=3)
    assert [len(o) for o in short] == lengths
    assert engine.generate(prompts, [SamplingParams(temperature=0.8, seed=3, max_tokens=m) for m in lengths]) == short
    one = SamplingParams(temperature=0.8, seed=3, max_tokens=NEW)
    want = engine.generate(prompts, one)
    assert [w[:m] for w, m in zip(want, lengths)] == short  # a token depends on (seed, index, length) only
    events = list(engine.stream(prompts, max_new_tokens=NEW, temperature=0.8, seed=3))
    assert [[ev.token for ev in events if ev.index == i] for i in range(len(prompts))] == want
    ids = [engine.add_request(p, one, index=i) for i, p in enumerate(prompts)]
    got = {rid: [] for rid in ids}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id] += out.tokens
    assert [got[rid] for rid in ids] == want
    assert_idle(engine)


def test_a_profiler_trace_shows_the_step_phases(engine, prompts, tmp_path):
    """Each step's host phases are ``jax.profiler.TraceAnnotation`` s: a trace of a run records them."""
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=4)
    engine.generate(prompts[:2], params)  # compiled outside the trace
    with jax.profiler.trace(str(tmp_path)):
        engine.generate(prompts[:2], params)
    data = b"".join(p.read_bytes() for p in tmp_path.rglob("*.xplane.pb"))
    for phase in ("schedule", "inputs", "dispatch", "advance", "wait", "update"):
        assert f"kvjax.{phase}".encode() in data, phase
    assert_idle(engine)


def test_top_k_top_p_bursts_equal_single_steps_and_add_no_trace(qwen, prompts):
    """Requests with top-k / top-p (mixed with plain sampling and greedy ones) get the same tokens from decode
    bursts (the default) as from single steps, and top-k / top-p compile nothing more than plain sampling."""
    mixed = [SamplingParams(temperature=1.0, top_k=5, seed=1, max_tokens=NEW),
             SamplingParams(temperature=0.9, top_p=0.8, seed=2, max_tokens=NEW),
             SamplingParams(temperature=1.2, top_k=8, top_p=0.9, seed=3, max_tokens=NEW),
             SamplingParams(temperature=1.0, seed=4, max_tokens=NEW),
             SamplingParams(max_tokens=NEW),
             SamplingParams(temperature=1.1, top_k=3, top_p=0.5, seed=6, max_tokens=NEW)]
    plain = [dataclasses.replace(p, top_k=0, top_p=1.0) for p in mixed]
    outs = {}
    for burst in ("auto", 1):
        eng = make_engine(qwen, decode_burst=burst, eos_token_id=None)
        base = eng.generate(prompts, plain)
        traces = eng.num_traces
        outs[burst] = eng.generate(prompts, mixed)
        assert eng.num_traces == traces, "top-k / top-p compiled another step"
        assert outs[burst] != base
        assert eng.metrics.summary()["preemptions"] > 0
        assert_idle(eng)
        if burst == "auto":
            assert max(r.burst for r in eng.metrics.records) > 1
    assert outs["auto"] == outs[1]
    # the plain-sampling requests (3: temperature only, 4: greedy) do not notice their neighbours' filters
    assert [outs[1][i] for i in (3, 4)] == [base[i] for i in (3, 4)]


def test_stop_ids_end_requests_qwen(engine, prompts):
    free = engine.generate(prompts, NEW, temperature=0.7, seed=8)
    stops = frequent_tokens(free, 2)
    want = [truncate_at(o, stops) for o in free]
    assert sum(len(w) < NEW for w in want) >= 3
    params = SamplingParams(temperature=0.7, seed=8, max_tokens=NEW, stop_token_ids=stops)
    events = list(engine.stream(prompts, params))
    got = [[ev.token for ev in events if ev.index == i] for i in range(len(prompts))]
    assert got == want
    assert all(ev.finished == (ev.token in stops or ev.position == NEW - 1) for ev in events)
    # one stop id for some prompts only
    per = [params if i % 2 else SamplingParams(temperature=0.7, seed=8, max_tokens=NEW) for i in range(len(prompts))]
    assert engine.generate(prompts, per) == [want[i] if i % 2 else free[i] for i in range(len(prompts))]
    assert_idle(engine)


def test_two_eos_ids_from_the_generation_config_stop_at_either(prompts):
    """An engine built without ``eos_token_id`` takes the model's ``generation_config.eos_token_ids`` (two, as
    Qwen's); a request stops at whichever it samples first, in single steps and in bursts; ``None`` turns eos off;
    a request's stop ids add to the engine's."""
    model = qwen_swa_model()
    free = make_engine(model, eos_token_id=None).generate(prompts, NEW)  # greedy
    a, b, c = frequent_tokens(free, 3)
    ends = [truncate_at(o, (a, b)) for o in free]
    assert any(e[-1] == a and len(e) < NEW for e in ends) and any(e[-1] == b and len(e) < NEW for e in ends)
    model.generation_config = GenerationConfig(eos_token_ids=(a, b))
    for burst in ("auto", 1):
        eng = make_engine(model, decode_burst=burst)
        assert eng.eos_token_ids == (a, b)
        assert eng.generate(prompts, NEW) == ends
        more = SamplingParams(max_tokens=NEW, stop_token_ids=[c])
        assert eng.generate(prompts, more) == [truncate_at(o, (a, b, c)) for o in free]
        assert_idle(eng)
    assert make_engine(model, eos_token_id=None, decode_burst=1).eos_token_ids == ()
    assert make_engine(model, eos_token_id=c, decode_burst=1).eos_token_ids == (c,)


def test_stop_ids_end_requests_deepseek():
    from kvjax.models.deepseek import DeepseekV32

    model = nnx.jit(lambda: DeepseekV32(tiny_deepseek_config(), rngs=nnx.Rngs(5)))()
    prompts = random_prompts(np.random.default_rng(6), (21, 4, 13, 26, 8))
    cache = CacheConfig(page_size=4, num_pages=20, max_seqs=4, max_blocks_per_seq=8)
    eng = Engine(model, cache, recycle="timely", max_num_batched_tokens=BUDGET, use_decode_path=False,
                 cache_options={"indexer_fp8": False}, token_buckets=(16,), row_buckets=(4,), block_buckets=(8,))
    params = SamplingParams(temperature=0.9, top_k=6, top_p=0.9, seed=2, max_tokens=7)
    free = eng.generate(prompts, params)
    stops = frequent_tokens(free, 2)
    want = [truncate_at(o, stops) for o in free]
    assert sum(len(w) < 7 for w in want) >= 2
    stopped = SamplingParams(temperature=0.9, top_k=6, top_p=0.9, seed=2, max_tokens=7, stop_token_ids=stops)
    assert eng.generate(prompts, stopped) == want
    assert_idle(eng)


def test_stop_hits_in_the_row_table():
    """``RowTable.resolve`` / ``resolve_burst`` and the detached ``Request`` stop at any of a request's ids; the
    table's width grows to the widest bound request only."""
    from kvjax.sched.request import Request, RowTable

    def table(stops):
        t = RowTable(len(stops))
        assert t.eos.shape == (len(stops) + 1, 1)
        for slot, eos in enumerate(stops, 1):
            t.bind(Request(slot, np.array([1, 2]), 6, eos), slot)
        return t, np.arange(1, len(stops) + 1)

    stops = (None, 7, (7, 9), (9, 3, 11))
    t, slots = table(stops)
    assert t.eos.shape[1] in (3, 4) and t.eos[4, :3].tolist() == [9, 3, 11] and t.eos[1].max() == -1
    t.reserve(slots, np.arange(4), step=0)
    assert t.resolve(slots, np.array([7, 7, 9, 3])).tolist() == [False, True, True, True]
    assert t.num_tokens.tolist()[1:] == [3, 3, 3, 3] and t.num_pending.tolist()[1:] == [0, 0, 0, 0]

    t, slots = table(stops)
    t.reserve_burst(slots, np.arange(4), np.array([4, 4, 4, 4]), 4, step=0)
    grid = np.array([[9, 7, 3, 3], [5, 5, 7, 9], [5, 5, 9, 7], [5, 11, 9, 3]])  # i64[K, J]
    first = t.resolve_burst(slots, 0, np.arange(4), 4, grid)
    assert first.tolist() == [4, 2, 2, 1]
    assert t.num_tokens.tolist()[1:] == [6, 5, 5, 4] and t.num_pending.tolist()[1:] == [0, 0, 0, 0]
    assert t.tokens[4, :4].tolist() == [1, 2, 5, 11]

    detached = Request(9, np.array([1]), 5, [4, 6])
    assert detached.eos_token_ids == (4, 6) and detached.eos_token_id == 4
    assert not detached.append(5) and detached.append(6) and detached.complete
    assert detached.output_ids.tolist() == [5, 6]
    assert Request.resumed(detached).eos_token_ids == (4, 6)


def test_text_in_text_out_with_a_tokenizer(tmp_path):
    """With ``Engine(tokenizer=)``, ``generate`` takes text and returns text (the tokenizer's decode of the ids it
    generates for the encoded prompt); ids are still accepted; text without a tokenizer, or text mixed with ids, is
    a clear error and queues nothing."""
    import transformers
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    words = ["[UNK]", "</s>"] + [f"w{i}" for i in range(59)]  # 61 ids: the test model's vocabulary
    tok = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="</s>")
    model = qwen_swa_model()
    engine = Engine(model, SMALL, max_num_batched_tokens=BUDGET, tokenizer=fast, eos_token_id=None)
    texts = ["w3 w17 w5", "w40 w2"]
    ids = [fast.encode(t) for t in texts]
    want = engine.generate(ids, 5)
    assert engine.generate(texts, 5) == [fast.decode(o) for o in want]
    assert all(len(t.split()) == 5 for t in engine.generate(texts, 5))
    with pytest.raises(ValueError, match="not a mix"):
        engine.generate([texts[0], ids[1]], 5)
    with pytest.raises(ValueError, match="text prompts need"):
        Engine(model, SMALL, max_num_batched_tokens=BUDGET).generate(texts, 5)
    with pytest.raises(ValueError, match="tokenizer must have encode"):
        Engine(model, SMALL, tokenizer=object())
    assert engine.is_idle()
