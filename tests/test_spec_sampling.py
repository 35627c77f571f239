"""Speculative decoding keeps the target distribution (rejection sampling, :func:`kvjax.engine.sampling.verify_tokens`).

1. The acceptance rule alone: many rows with the same logits and drafts, different keys: the first emitted token is
   distributed as ``p_0`` whatever the draft (likely, unlikely, filtered out by top-k), and given that the first
   draft was kept, the next token as ``p_1`` (chi-square goodness of fit against the exact tempered, filtered
   softmax).
2. The engine: a small-vocabulary Qwen3.5 sampled at temperature 1 with the speculative engine (drafts that are
   often right and often wrong) and with the plain engine: two-sample chi-square on each generated position's
   token, and goodness of fit of the second token against its exact marginal computed from the uncached model.

Every draw is seeded, so the p-values are fixed numbers; the thresholds (1e-3) leave a wide margin for a correct
sampler and none for a biased one (the ablation below: accepting the draft outright is caught).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy import stats

from kvjax.config import CacheConfig
from kvjax.engine import sampling
from kvjax.engine.engine import Engine
from helpers.models import random_model, tiny_config

ALPHA = 1e-3


def _exact(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """f64[V]: the distribution :func:`sampling.sample` draws from (independent numpy: sort, keep, renormalise)."""
    z = logits.astype(np.float64) / temperature
    order = np.argsort(-z, kind="stable")
    k = len(z) if top_k <= 0 else top_k
    p = np.exp(z[order[:k]] - z[order[0]])
    p /= p.sum()
    keep = (np.cumsum(p) - p) < top_p
    kept = order[:k][keep]
    thr = z[kept].min()
    mask = z >= thr
    out = np.where(mask, np.exp(z - z.max()), 0.0)
    return out / out.sum()


def _gof(tokens: np.ndarray, p: np.ndarray) -> float:
    """Chi-square goodness-of-fit p-value of ``tokens`` against ``p`` (tokens of expected count < 5 pooled)."""
    counts = np.bincount(tokens, minlength=p.size).astype(np.float64)
    exp = p / p.sum() * counts.sum()
    big = exp >= 5
    obs = np.concatenate([counts[big], [counts[~big].sum()]])
    ex = np.concatenate([exp[big], [exp[~big].sum()]])
    if ex[-1] == 0:
        if obs[-1] > 0:  # tokens of probability 0 drawn
            return 0.0
        obs, ex = obs[:-1], ex[:-1]
    return float(stats.chisquare(obs, ex).pvalue)


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (4, 1.0), (0, 0.8)])
def test_verify_tokens_keep_the_target_distribution(top_k, top_p):
    rng = np.random.default_rng(0)
    N, K, V, temp = 6000, 2, 9, 0.9
    logits1 = rng.standard_normal((K + 1, V)).astype(np.float32) * 1.5
    p = [_exact(logits1[j], temp, top_k, top_p) for j in range(K + 1)]
    likely, unlikely = int(np.argmax(p[0])), int(np.argmin(p[0]))  # the unlikely one may be filtered out
    for d0 in (likely, unlikely):
        d1 = int(np.argsort(-p[1])[1])
        logits = jnp.broadcast_to(jnp.asarray(logits1), (N, K + 1, V))
        drafts = jnp.broadcast_to(jnp.array([d0, d1], jnp.int32), (N, K))
        keys = jax.vmap(lambda i: jax.vmap(lambda j: jax.random.fold_in(jax.random.key(i), j))(jnp.arange(K + 1)))(
            jnp.arange(N))
        toks, acc = sampling.verify_tokens(logits, drafts, jnp.full(N, K, jnp.int32), keys, jnp.full(N, temp),
                                           jnp.full(N, top_k, jnp.int32), jnp.full(N, top_p, jnp.float32), False)
        toks, acc = np.asarray(toks), np.asarray(acc)
        assert ((acc >= 1) == (toks[:, 0] == d0)).all()  # a kept draft is the emitted token
        assert _gof(toks[:, 0], p[0]) > ALPHA
        kept = acc >= 1
        if kept.sum() > 500:
            assert _gof(toks[kept, 1], p[1]) > ALPHA
        # the ablation: taking every draft would emit d0 always, far from p_0 unless p_0 is a point mass
        assert _gof(np.full(N, d0), p[0]) < ALPHA or p[0][d0] > 0.99


def test_greedy_rows_in_a_sampled_step_keep_the_argmax():
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.standard_normal((3, 3, 7)), jnp.float32)
    target = np.asarray(jnp.argmax(logits, -1))
    drafts = jnp.asarray(np.stack([target[0, :2], [target[1, 0], (target[1, 1] + 1) % 7], target[2, :2]]), jnp.int32)
    keys = jax.vmap(lambda i: jax.vmap(lambda j: jax.random.fold_in(jax.random.key(i), j))(jnp.arange(3)))(
        jnp.arange(3))
    toks, acc = sampling.verify_tokens(logits, drafts, jnp.array([2, 2, 0], jnp.int32), keys,
                                       jnp.zeros(3), jnp.zeros(3, jnp.int32), jnp.ones(3), False)
    assert np.asarray(acc).tolist() == [2, 1, 0]
    np.testing.assert_array_equal(np.asarray(toks), target)


class FixedDrafter:
    """Proposes the same continuation (``tokens``) after the prompt: right often where the model is peaked."""

    def __init__(self, prompt_len: int, tokens, k: int) -> None:
        self.num_draft_tokens, self.prompt_len, self.tokens = k, prompt_len, list(tokens)

    def propose(self, tokens, max_drafts):
        done = len(tokens) - self.prompt_len
        return np.asarray(self.tokens[done: done + max_drafts], np.int32)


VOCAB = 7


@pytest.fixture(scope="module")
def small_vocab_model():
    import dataclasses

    cfg = dataclasses.replace(tiny_config(window=(6, 0), sinks=(2, 0), layer_types=("linear_attention",
                                                                                     "full_attention")), vocab_size=VOCAB)
    return random_model(cfg, seed=3)


def test_speculative_engine_samples_the_plain_engines_distribution(small_vocab_model):
    model = small_vocab_model
    prompt = [1, 4, 2, 6, 0, 3]
    N, NEW, K = 1200, 3, 2
    cache = CacheConfig(page_size=4, num_pages=64, max_seqs=16, max_blocks_per_seq=4)
    ids = jnp.asarray([prompt + [0] * 2], jnp.int32)
    fwd = nnx.jit(lambda m, x: m.logits(x))
    p0 = np.asarray(jax.nn.softmax(fwd(model, ids)[0, len(prompt) - 1]), np.float64)
    second = np.array([[*prompt, t, 0] for t in range(VOCAB)], np.int32)
    p1_given = np.asarray(jax.nn.softmax(fwd(model, jnp.asarray(second))[:, len(prompt)], -1), np.float64)
    p1 = p0 @ p1_given  # the exact marginal of the second generated token
    guess = [int(np.argmax(p0)), int(np.argmax(p1_given[int(np.argmax(p0))])), 0]
    outs = {}
    for name, spec in (("plain", None), ("spec", FixedDrafter(len(prompt), guess, K))):
        eng = Engine(model, cache, max_num_batched_tokens=64, speculative=spec, eos_token_id=None)
        params = [sampling.SamplingParams(temperature=1.0, seed=11, max_tokens=NEW)] * N
        outs[name] = np.asarray(eng.generate([prompt] * N, params))  # i64[N, NEW]
        if spec is not None:
            s = eng.metrics.summary()
            assert 0.1 < s["acceptance_rate"] < 0.9, s["acceptance_rate"]  # drafts both kept and rejected
    # the first token is sampled before any draft, with the same keys: identical
    np.testing.assert_array_equal(outs["spec"][:, 0], outs["plain"][:, 0])
    for j in range(1, NEW):
        table = np.stack([np.bincount(outs[n][:, j], minlength=VOCAB) for n in ("plain", "spec")])
        table = table[:, table.sum(0) > 0]
        assert stats.chi2_contingency(table).pvalue > ALPHA, (j, table)
    assert _gof(outs["spec"][:, 1], p1) > ALPHA
    assert _gof(outs["plain"][:, 1], p1) > ALPHA
