"""Engine robustness: bad arguments change nothing, concurrent consumers lose no token, and a fault at any
point of a step leaves an engine that recovers by itself (preemption by recompute) with unchanged outputs.

Oracle: the same engine's uninterrupted greedy run, itself checked against uncached greedy decoding
(``greedy_oracle`` of ``helpers.engine``). One engine per mode (overlapped, the default, and synchronous; one
bucket set, one compile each) serves every test here; each test ends with the engine idle (every slot and page
free, ``check_integrity``). In overlap mode every fault point has a step in flight.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvjax.engine.engine import Engine
from helpers.engine import SMALL, assert_idle, greedy_oracle, make_engine, random_prompts, step_events
from helpers.faults import POINTS, Injected, arm
from helpers.models import VOCAB, qwen_swa_model

NEW = 8


@pytest.fixture(scope="module")
def model():
    return qwen_swa_model()


@pytest.fixture(scope="module")
def case(model):
    prompts = random_prompts(np.random.default_rng(99), (23, 9, 37, 3, 18, 30))
    return prompts, greedy_oracle(model, prompts, NEW)


@pytest.fixture(scope="module", params=[True, False], ids=["overlap", "sync"])
def engine(model, case, request):
    eng = make_engine(model, overlap=request.param)
    prompts, expect = case
    assert eng.generate(prompts, NEW) == expect
    assert eng.metrics.summary()["preemptions"] > 0
    return eng


# ---- item 1: bad arguments are rejected before anything is queued -------------------------------------------


BAD_CALLS = {
    "seed str": dict(seed="x"),
    "seed float": dict(seed=1.5),
    "seed bool": dict(seed=True),
    "seed beyond int32": dict(seed=2**31),
    "max_new float": dict(max_new_tokens=2.5),
    "max_new float in list": dict(max_new_tokens=[NEW, 2.5, NEW]),
    "max_new zero": dict(max_new_tokens=0),
    "max_new str": dict(max_new_tokens="8"),
    "temperature str": dict(temperature="0.5"),
    "temperature nan": dict(temperature=float("nan")),
    "temperature negative": dict(temperature=-0.1),
    "token id = vocab": dict(prompts=[[1, 2], [3, VOCAB], [4]]),
    "token id negative": dict(prompts=[[1, 2], [3, -1], [4]]),
    "token id float": dict(prompts=[[1, 2], [3.0, 1.5], [4]]),
    "prompt not a list of prompts": dict(prompts=[1, 2, 3]),
    "empty prompt": dict(prompts=[[1, 2], [], [4]]),
}


@pytest.mark.parametrize("name", list(BAD_CALLS))
def test_bad_arguments_queue_nothing(engine, case, name):
    prompts, expect = case
    call = {"prompts": prompts[:3], "max_new_tokens": NEW, **BAD_CALLS[name]}
    for run in (engine.generate, lambda *a, **k: list(engine.stream(*a, **k))):
        with pytest.raises(ValueError):
            run(**call)
        assert_idle(engine)
    with pytest.raises(ValueError):
        engine.stream(**call)  # checked when called, not at the first next()
    assert_idle(engine)
    bad = BAD_CALLS[name]
    if "prompts" not in bad and "max_new_tokens" not in bad:
        with pytest.raises(ValueError):
            engine.add_request(prompts[0], NEW, **bad)
        assert_idle(engine)
    assert engine.generate(prompts[:3], NEW) == expect[:3]  # the engine still serves
    assert_idle(engine)


@pytest.mark.parametrize("index", [-1, 2**31, 1.0, "0"])
def test_bad_index_queues_nothing(engine, case, index):
    with pytest.raises(ValueError, match="index"):
        engine.add_request(case[0][0], NEW, index=index)
    assert_idle(engine)


@pytest.mark.parametrize("eos", [VOCAB, -1, 2.0, True])
def test_eos_outside_vocab_rejected(model, eos):
    with pytest.raises(ValueError, match="eos_token_id"):
        Engine(model, SMALL, eos_token_id=eos)


# ---- item 2: concurrent consumers ---------------------------------------------------------------------------


def test_two_streams_consumed_alternately_get_every_token(engine, case):
    prompts, expect = case
    a, b = engine.stream(prompts[:3], NEW), engine.stream(prompts[3:], NEW)
    got_a, got_b = [[] for _ in range(3)], [[] for _ in range(3)]
    live = {"a": a, "b": b}
    while live:
        for name in list(live):
            ev = next(live[name], None)
            if ev is None:
                del live[name]
                continue
            (got_a if name == "a" else got_b)[ev.index].append(ev.token)
            assert ev.finished == (len((got_a if name == "a" else got_b)[ev.index]) == NEW)
    assert got_a == expect[:3] and got_b == expect[3:]
    assert_idle(engine)


def test_generate_inside_a_stream_loop_loses_nothing(engine, case):
    prompts, expect = case
    outer = [[] for _ in range(3)]
    inner = None
    for ev in engine.stream(prompts[:3], NEW):
        outer[ev.index].append(ev.token)
        if inner is None:
            inner = engine.generate(prompts[3:], NEW)
    assert outer == expect[:3] and inner == expect[3:]
    assert_idle(engine)


def test_manual_requests_keep_their_events_while_a_stream_steps(engine, case):
    """Events of ``add_request`` requests produced by a stream's steps come back from the next ``step()``."""
    prompts, expect = case
    rid = engine.add_request(prompts[4], NEW, index=0)
    got = []
    assert engine.generate(prompts[:2], NEW) == expect[:2]
    while not got or not got[-1].finished:
        got += [ev for ev in step_events(engine) if ev.request_id == rid]
    assert [ev.token for ev in got] == expect[4] and [ev.position for ev in got] == list(range(NEW))
    assert_idle(engine)


# ---- item 3: a fault anywhere in a step ---------------------------------------------------------------------


@pytest.mark.parametrize("exc", [Injected, KeyboardInterrupt])
@pytest.mark.parametrize("point", POINTS)
@pytest.mark.parametrize("at_step", [3, 9])
def test_fault_in_a_step_recovers_by_recompute(engine, case, monkeypatch, point, exc, at_step):
    prompts, expect = case
    ids = [engine.add_request(p, NEW, index=i) for i, p in enumerate(prompts)]
    got = {rid: [] for rid in ids}

    def collect(events):
        for ev in events:
            got[ev.request_id].append(ev.token)
            assert ev.position == len(got[ev.request_id]) - 1
            assert ev.finished == (len(got[ev.request_id]) == NEW)

    for _ in range(at_step):
        collect(step_events(engine))
    with monkeypatch.context() as m:
        arm(m, engine, point, exc)
        with pytest.raises(exc, match="injected"):
            while True:
                collect(step_events(engine))
    engine.check_integrity()
    while engine.has_unfinished():
        collect(step_events(engine))
        engine.check_integrity()
    assert [got[rid] for rid in ids] == expect
    assert_idle(engine)
    assert engine.generate(prompts[:2], NEW) == expect[:2]


@pytest.mark.parametrize("point", POINTS)
def test_fault_inside_generate_leaves_a_working_engine(engine, case, monkeypatch, point):
    prompts, expect = case
    with monkeypatch.context() as m:
        arm(m, engine, point, Injected)
        with pytest.raises(Injected):
            engine.generate(prompts, NEW)
    assert_idle(engine)  # the interrupted call's requests were aborted
    assert engine.generate(prompts, NEW) == expect
    assert_idle(engine)


def test_fault_while_resolving_a_finishing_step_forgets_the_finished_request(engine, model, monkeypatch):
    """Found by the engine state machine: two one-token requests finish in one step; a fault after the second
    one took its token but before the scheduler let it go must not leave it known to the scheduler and unknown
    to the engine (``abort`` of its id raised ``KeyError``, the engine's bookkeeping split)."""
    prompts = random_prompts(np.random.default_rng(5), (1, 1))
    expect = greedy_oracle(model, prompts, 1)
    ids = [engine.add_request(p, 1, index=i) for i, p in enumerate(prompts)]
    got = {}
    with monkeypatch.context() as m:
        arm(m, engine, "inside update", Injected)
        with pytest.raises(Injected):
            while engine.has_unfinished():
                got.update({ev.request_id: ev.token for ev in step_events(engine)})
    while engine.has_unfinished():
        got.update({ev.request_id: ev.token for ev in step_events(engine)})
    got.update({ev.request_id: ev.token for ev in step_events(engine)})  # events read before the fault, if any
    assert [[got[rid]] for rid in ids] == expect
    assert engine.step() == []  # an idle engine: no step, no error
    for rid in ids:
        with pytest.raises(ValueError, match=str(rid)):
            engine.abort(rid)
    assert_idle(engine)


@pytest.mark.parametrize("kw,match", [(dict(token_buckets=(16, 8)), r"token_buckets.*max_num_batched_tokens.*\(16, 8\)"),
                                      (dict(row_buckets=(2,)), r"row_buckets.*max_seqs=4"),
                                      (dict(block_buckets=(0, 16)), r"block_buckets.*max_blocks_per_seq.*\(0, 16\)"),
                                      (dict(token_buckets=(4.0, 16)), r"token_buckets")])
def test_bad_bucket_sets_are_named(model, kw, match):
    with pytest.raises(ValueError, match=match):
        Engine(model, SMALL, max_num_batched_tokens=16, **kw)
