"""Engine-test helpers: the small cache and token budget the engine tests serve with, the uncached greedy oracle,
random prompts, a checked step, the idle check and EOS truncation."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvjax.config import CacheConfig
from kvjax.engine.engine import Engine

from helpers.models import VOCAB

BUDGET = 16  # tokens per step: below the longest prompt, so prefill is chunked
# 2 block buckets (8, 16 blocks of 4 tokens); max_seqs 4 -> one row bucket; budget 16 -> one token bucket
SMALL = CacheConfig(page_size=4, num_pages=26, max_seqs=4, max_blocks_per_seq=16)  # forces preemption


def greedy_oracle(model, prompts, max_new: int) -> list[list[int]]:
    """Greedy decoding by full-sequence ``model.logits`` (no cache). Causal, so right padding to one fixed
    length changes no logit at a real position (and compiles once)."""
    lens = [len(p) for p in prompts]
    width = -(-(max(lens) + max_new) // 8) * 8
    ids = np.zeros((len(prompts), width), np.int32)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = p
    fwd = nnx.jit(lambda m, x: m.logits(x))
    out = [[] for _ in prompts]
    for _ in range(max_new):
        logits = np.asarray(fwd(model, jnp.asarray(ids)))
        for i in range(len(prompts)):
            tok = int(np.argmax(logits[i, lens[i] - 1]))
            out[i].append(tok)
            ids[i, lens[i]] = tok
            lens[i] += 1
    return out


def random_prompts(rng, lengths) -> list[list[int]]:
    """One prompt of random token ids (``0..VOCAB-1``) per length."""
    return [rng.integers(0, VOCAB, n).tolist() for n in lengths]


def step_events(engine: Engine) -> list:
    """One ``engine.step()``, its :class:`StepOutput` s checked (at least one token each; a request's outputs,
    held ones from earlier steps first, continue each other's positions) and turned into per-token
    :class:`TokenEvent` s."""
    outs = engine.step()
    nxt: dict[int, int] = {}
    for out in outs:
        assert out.tokens and nxt.get(out.request_id, out.position) == out.position, outs
        nxt[out.request_id] = out.position + len(out.tokens)
    return [ev for out in outs for ev in out.events()]


def assert_idle(engine: Engine) -> None:
    """Nothing running or queued, every slot and page free, the scheduler's invariants hold."""
    engine.check_integrity()
    assert engine.is_idle()
    s = engine.scheduler
    assert s.slots.num_free == engine.cache_config.max_seqs
    assert sum(s.blocks.free_pages()) == engine.cache_config.num_pages


def make_engine(model, **kw) -> Engine:
    """An engine on :data:`SMALL` with one token, row and block bucket and no decode path: a single compile per
    greedy / sampling mode."""
    return Engine(model, SMALL, recycle="timely", max_num_batched_tokens=16, token_buckets=(16,),
                  row_buckets=(4,), block_buckets=(16,), use_decode_path=False, **kw)


def truncate_at(out: list[int], eos: int) -> list[int]:
    """``out`` up to and including its first ``eos`` (all of it without one)."""
    return out[: out.index(eos) + 1] if eos in out else out


def stream_aborting(engine: Engine, prompts, max_new: int, expect, indices=(1, 4), after: int = 3) -> None:
    """Stream ``prompts`` through ``engine``, aborting the requests at ``indices`` once they have ``after`` tokens;
    every request's tokens must be a prefix of ``expect`` (the aborted ones) or all of it (the others)."""
    got: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    aborted = set()
    for ev in engine.stream(prompts, max_new):
        got[ev.index].append(ev.token)
        if ev.index in indices and ev.position >= after and ev.request_id not in aborted:
            engine.abort(ev.request_id)
            aborted.add(ev.request_id)
    for i, e in enumerate(expect):
        assert got[i] == e[: len(got[i])] and (i in indices or got[i] == e), i
    assert len(aborted) == len(indices)


def prefix_sharing_prompts(rng) -> list[list[int]]:
    """Six prompts on two random bases of 17 and 22 tokens (prefix-cache hits): two and one more of the first with
    their own tails, two of the second with tails, and a 9-token prefix of the second."""
    base = random_prompts(rng, (17, 22))
    return [base[0] + random_prompts(rng, (n,))[0] for n in (3, 6)] + [base[1] + [5, 9]] + \
        [base[0] + random_prompts(rng, (4,))[0], base[1] + random_prompts(rng, (7,))[0], base[1][:9]]


def fault_midway(monkeypatch, engine: Engine, prompts, max_new: int, expect, ready) -> None:
    """Serve ``prompts`` on ``engine`` step by step until ``ready()`` holds, then fail the next step inside the
    device call (``helpers.faults.Injected``), recover and finish: each request's tokens must be ``expect``'s and
    the engine must have recovered once."""
    import pytest

    from helpers.faults import Injected, arm

    ids = [engine.add_request(p, max_new, index=i) for i, p in enumerate(prompts)]
    out = {rid: [] for rid in ids}

    def step() -> None:
        for ev in step_events(engine):
            out[ev.request_id].append(ev.token)

    while not ready():
        assert engine.has_unfinished(), "the requests finished before the fault's moment came"
        step()
    with monkeypatch.context() as m:
        arm(m, engine, "inside device", Injected)
        with pytest.raises(Injected):
            while True:
                step()
    while engine.has_unfinished():
        step()
    assert engine.num_recoveries == 1 and [out[rid] for rid in ids] == list(expect)
