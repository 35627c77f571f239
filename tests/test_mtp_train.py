"""MTP head on the retrieval toy (issue 36): a few hundred optax steps with the main model frozen lift the greedy
two-ahead acceptance at the answer positions well above chance (``1 / num_values``)."""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

pytest.importorskip("optax")

from kvjax.experiments import mtp_train, tasks  # noqa: E402
from kvjax.models.qwen3_5 import mtp as mtp_lib  # noqa: E402

TASK = tasks.RetrievalTask(length=20, num_pairs=2, num_queries=2)


def test_two_ahead_targets_are_the_answers(rng):
    x, t, m, _ = TASK.sample(rng, 16)
    nxt, tgt, w = mtp_train.two_ahead(TASK, x, m)
    assert nxt.shape == tgt.shape == w.shape == (16, TASK.length - 2)
    assert (nxt == x[:, 1:-1]).all() and (tgt == t[:, 1:-1]).all()  # x_{t+1} and x_{t+2} at position t
    assert (w.sum(axis=1) == TASK.num_queries).all()
    assert ((tgt[w > 0] >= TASK.answer0) & (tgt[w > 0] < TASK.vocab_size)).all()
    assert ((nxt[w > 0] >= TASK.query0) & (nxt[w > 0] < TASK.answer0)).all()  # the MTP input is the query token
    _, _, every = mtp_train.two_ahead(TASK, x, m, on="all")
    assert (every == 1).all()
    with pytest.raises(ValueError, match="on must be one of"):
        mtp_train.two_ahead(TASK, x, m, on="queries")


@pytest.mark.slow  # ~15 s on 2 CPU cores: the main model's 100 steps and the MTP head's 200
def test_training_lifts_acceptance_well_above_chance(rng):
    seed = int(rng.integers(1000))
    model, hist = tasks.train(tasks.task_model(TASK, window=(4, 0), sinks=(1, 0), hidden=32, seed=seed), TASK,
                              steps=100, seed=seed)
    assert hist["accuracy"][-20:].mean() > 0.9  # the main model answers
    frozen = {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model))}
    start = mtp_lib.init(model.config, seed=seed)
    before = mtp_train.mtp_acceptance(model, start, TASK, seed=seed + 1)
    mtp, h = mtp_train.train_mtp(model, TASK, steps=200, seed=seed, mtp=start)
    after = mtp_train.mtp_acceptance(model, mtp, TASK, seed=seed + 1)
    chance = 1 / TASK.num_values
    assert before["chance"] == after["chance"] == chance and after["positions"] == 256 * TASK.num_queries
    assert before["acceptance"] < 2 * chance
    assert after["acceptance"] >= 3 * chance, (before, after)
    assert h["loss"][-20:].mean() < 0.7 * h["loss"][:20].mean()
    for p, v in nnx.to_flat_state(nnx.state(model)):  # the main model stayed frozen
        np.testing.assert_array_equal(np.asarray(v.get_value()), frozen[p])
    assert not np.array_equal(np.asarray(mtp.fc.kernel[...]), np.asarray(start.fc.kernel[...]))


def test_chained_draft_step_equals_the_dense_layer_on_its_own_inputs(rng):
    """Draft step 2 of :func:`mtp_train.chained` at position ``t`` is what the MTP layer computes for the pair
    ``(g1_{t-1}, x_{t+1})`` at ``t`` over step 1's keys at ``0..t-1``: the dense layer run on that sequence (step 1's
    inputs before ``t``, step 2's at ``t``). Step 1 is the dense layer itself."""
    import jax.numpy as jnp

    from kvjax.experiments.spec_runs import CopyTask, copy_model

    task = CopyTask(vocab=24, length=16, min_period=3, max_period=5)
    model = copy_model(task, hidden=32, layer_types=("full_attention",), window=(5, 0), sinks=(1, 0),
                       seed=int(rng.integers(100)))
    layers = mtp_lib.init(model.config, seed=int(rng.integers(100)))
    x, *_ = task.sample(rng, 3)
    hidden = model.hidden_states(jnp.asarray(x))[:, :-1]  # [3, 15, H]
    nxt = jnp.asarray(x[:, 1:])
    g1, g2, g3 = mtp_train.chained(layers, model, hidden, nxt, 3)
    np.testing.assert_allclose(np.asarray(g1), np.asarray(layers.dense(model, hidden, nxt)), rtol=1e-5, atol=1e-5)
    for t in (1, 6, 14):  # inside and past the SWA head's window
        h = jnp.concatenate([hidden[:, :t], g1[:, t - 1: t]], axis=1)
        ref = layers.dense(model, h, nxt[:, : t + 1])[:, t]
        np.testing.assert_allclose(np.asarray(g2[:, t]), np.asarray(ref), rtol=1e-5, atol=1e-5)
    assert not np.allclose(np.asarray(g2), np.asarray(g3))  # step 3 reads step 2's states


def test_train_mtp_checks_targets_and_depth():
    model = tasks.task_model(TASK, window=(0,), sinks=(0,), hidden=16)
    for bad in (dict(targets="truth"), dict(depth=0), dict(depth=True)):
        with pytest.raises(ValueError, match="targets|depth"):
            mtp_train.train_mtp(model, TASK, steps=1, **bad)
