"""Step parity for the toy Qwen3.5: chunked prefill + decode through the jitted ``step`` equals ``model.logits``.

The test drives a tiny host-side planner (``helpers.planner``, independent of ``kvjax.sched``): sequences of different lengths
share each step (prefill chunks of different sizes mixed with decode tokens), rows are shuffled every step,
GDN slots are random (never the row index), pages come from a shuffled shared free list, and with SWA heads
blocks that leave the window are recycled (table entry -1, page returned and reused by other heads/rows).
Steps where every row decodes take the decode kernels (``decode_only``). Every row's last-token logits must equal the full-sequence oracle ``model.logits`` at that position.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers.models import random_model, tiny_config
from helpers.planner import MAX_SEQS, NUM_PAGES, PAGE, T_BUCKETS, Planner
from kvjax.engine.step import make_step
from kvjax.errors import InvalidPlanError
from kvjax.inputs import StepInputs

TOL = 1e-4  # f32: max abs logit difference
POISON = 8192.0  # exact in bf16 too; far outside any activation


def run_schedule(model, rng, seqs, chunks, *, window=(), sinks=(), step_fn=None, params=None):
    """Drive all sequences through prefill chunks then decode; return {(sid, pos): logits}."""
    hkv = model.config.attention.num_kv_heads
    planner = Planner(rng, hkv, window, sinks)
    caches = model.init_caches(num_pages=NUM_PAGES, page_size=PAGE, max_seqs=MAX_SEQS)
    # poison every slot and page: nothing may be read before it is written (has_initial_state / masks)
    caches = jax.tree.map(lambda x: jnp.full_like(x, POISON), caches)
    if step_fn is None:
        graphdef, params = nnx.split(model)
        step_fn = make_step(graphdef)
    got = {}
    cursor = {sid: 0 for sid in range(len(seqs))}
    plans = {sid: list(c) for sid, c in enumerate(chunks)}
    for sid in range(len(seqs)):
        planner.add(sid)
    while any(cursor[s] < len(seqs[s]) for s in cursor):
        work = []
        for sid in range(len(seqs)):
            if cursor[sid] >= len(seqs[sid]):
                continue
            n = plans[sid].pop(0) if plans[sid] else 1
            n = min(n, len(seqs[sid]) - cursor[sid])
            work.append((sid, seqs[sid][cursor[sid]: cursor[sid] + n]))
            cursor[sid] += n
        inputs, expect = planner.plan(work)
        logits, caches = step_fn(params, caches, inputs)
        logits = np.asarray(logits)
        for r, sid, p in expect:
            got[(sid, p)] = logits[r]
        for sid in range(len(seqs)):
            if sid in planner.tables and cursor[sid] >= len(seqs[sid]):
                planner.finish(sid)
        planner.recycle()
    # the PAD slot was never written
    assert np.all(np.asarray(caches.gdn.conv[:, 0]) == POISON) and np.all(np.asarray(caches.gdn.ssm[:, 0]) == POISON)
    return got, planner


ORACLE_ROWS, ORACLE_LEN = 3, 40  # one oracle shape: one compile per model graph
_oracle = nnx.jit(lambda m, ids: m.logits(ids))


def check_against_oracle(model, seqs, got):
    """One jitted full-sequence call for all sequences (right-padded: causal, so padding changes nothing)."""
    batch = np.full((ORACLE_ROWS, ORACLE_LEN), 7, np.int32)
    for i, x in enumerate(seqs):
        batch[i, : len(x)] = x
    ref = np.asarray(_oracle(model, jnp.asarray(batch)))
    for (sid, p), row in got.items():
        np.testing.assert_allclose(row, ref[sid, p], atol=TOL, rtol=0, err_msg=f"seq {sid} pos {p}")


SEQ_LENS = (19, 9, 26)
CHUNKS = ([5, 8], [2, 3, 1], [11, 4])  # then decode one token at a time


@pytest.fixture(scope="module")
def base():
    """A random model and its step, jitted with at most one trace per token bucket plus the decode-only trace."""
    model = random_model(tiny_config(), seed=11)
    graphdef, params = nnx.split(model)
    return model, params, make_step(graphdef, max_traces=len(T_BUCKETS) + 1)


def test_step_chunked_prefill_and_decode_match_full_logits(rng, base):
    model, params, step_fn = base
    seqs = [rng.integers(0, 61, n).astype(np.int32) for n in SEQ_LENS]
    got, _ = run_schedule(model, rng, seqs, CHUNKS, step_fn=step_fn, params=params)
    assert len(got) > 20
    check_against_oracle(model, seqs, got)


def test_step_swa_heads_over_recycled_tables_match_masked_logits(rng):
    window, sinks = (5, 0), (1, 0)  # KV head 0: SWA with 1 sink; KV head 1: full attention
    layers = ("linear_attention", "full_attention")  # two layers keep the compile short
    base = random_model(tiny_config(layer_types=layers), seed=int(rng.integers(1 << 30)))
    model = base.with_swa(window, sinks)  # same parameters, SWA masks
    assert model.config.attention.window == window
    seqs = [rng.integers(0, 61, n).astype(np.int32) for n in (21, 9, 38)]  # long enough to recycle and reuse
    got, planner = run_schedule(model, rng, seqs, CHUNKS, window=window, sinks=sinks)
    assert planner.recycled >= 6 and planner.reused >= 3  # holes appeared and their pages were written again
    check_against_oracle(model, seqs, got)
    # that the oracle's SWA masks really differ from full attention is checked in test_qwen3_5.py
    # (test_tied_embeddings_load_and_match); here base and SWA model share parameters but not masks
    assert base.config.attention.window == (0, 0)


def test_step_attention_only_model_has_an_empty_gdn_pool_and_matches_full_logits(rng):
    """No GDN layer: ``init_caches`` gives a [0, S+1, ...] GDN pool and the step still matches ``logits``."""
    model = random_model(tiny_config(layer_types=("full_attention",)), seed=int(rng.integers(1 << 30)))
    caches = model.init_caches(num_pages=NUM_PAGES, page_size=PAGE, max_seqs=MAX_SEQS)
    assert caches.gdn.conv.shape[:2] == (0, MAX_SEQS + 1) and caches.gdn.ssm.shape[:2] == (0, MAX_SEQS + 1)
    seqs = [rng.integers(0, 61, n).astype(np.int32) for n in (7, 4, 10)]
    got, _ = run_schedule(model, rng, seqs, ([3, 2], [4], [6]))
    assert len(got) > 8
    check_against_oracle(model, seqs, got)


def test_step_bucketed_shapes_do_not_recompile(rng, base):
    """New lengths, chunkings and batch compositions reuse the bucketed traces (max_traces raises otherwise)."""
    model, params, step_fn = base
    seqs = [rng.integers(0, 61, n).astype(np.int32) for n in (23, 30, 12)]
    got, planner = run_schedule(model, rng, seqs, ([9, 2], [17, 2], [3]), step_fn=step_fn, params=params)
    assert len(got) > 30  # dozens of steps ran on at most len(T_BUCKETS) + 1 traces
    assert planner.signatures == {(32, False), (8, False), (8, True)}  # every allowed trace was used
    check_against_oracle(model, seqs, got)
    # one-token prompts: their first step starts fresh rows in poisoned slots on the prefill path, then decode
    seqs = [rng.integers(0, 61, n).astype(np.int32) for n in (6, 4)]
    got, planner = run_schedule(model, rng, seqs, ([1], [1]), step_fn=step_fn, params=params)
    assert planner.signatures == {(8, False), (8, True)}
    check_against_oracle(model, seqs, got)
    # a plan outside the buckets (another token count) would retrace, and the guard catches it
    planner = Planner(rng, 2, (), ())
    planner.add(0)
    odd, _ = planner.plan([(0, seqs[0][:5])])
    odd = StepInputs(**{**vars(odd), "token_ids": odd.token_ids[:7], "positions": odd.positions[:7],
                        "slot_mapping": odd.slot_mapping[:7]})
    caches = model.init_caches(num_pages=NUM_PAGES, page_size=PAGE, max_seqs=MAX_SEQS)
    with pytest.raises(AssertionError, match="traced"):
        step_fn(params, caches, odd)


def test_step_inputs_validate_rejects_bad_plans():
    ok = dict(
        token_ids=np.arange(3), positions=np.arange(3), cu_seqlens=[0, 3, 3], seq_lens=[3, 0], gdn_slots=[2, 0],
        has_initial_state=[False, False], block_tables=np.full((2, 2, 2), -1), slot_mapping=np.full((3, 2), -1),
        logits_indices=[2, 0],
    )
    StepInputs.from_numpy(**ok).validate(num_pages=4, page_size=4, max_slots=3)
    for key, value, match in [
        ("gdn_slots", [0, 0], "PAD slot"),
        ("gdn_slots", [3, 0], "outside"),
        ("block_tables", np.full((2, 2, 2), 4), "page ids"),
        ("cu_seqlens", [0, 3, 2], "non-decreasing"),
        ("seq_lens", [2, 0], "shorter"),
        ("slot_mapping", np.full((3, 1), -1), "slot_mapping"),
    ]:
        with pytest.raises(InvalidPlanError, match=match):
            StepInputs.from_numpy(**{**ok, key: value}).validate(num_pages=4, page_size=4, max_slots=3)
