"""Speculative decoding's rollback pieces against independent references: the per-position GDN and conv states
(:mod:`kvjax.ops.spec_states`) equal the final states of the recurrent / conv references run over each prefix of
the row; :func:`kvjax.state.gdn_spec.commit` writes exactly the accepted position's states into the rows' slots; the
n-gram drafter proposes the continuation of the latest earlier occurrence of the longest matching suffix, and its
device form (:mod:`kvjax.engine.ngram`, a verification burst's lookup) proposes exactly the host drafter's drafts."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.config import GDNConfig
from kvjax.engine import ngram
from kvjax.ops.conv import causal_conv1d_reference
from kvjax.ops.gdn import DeltaRuleCall, recurrent_gated_delta_rule_reference
from kvjax.ops.spec_states import verify_conv_states, verify_ssm_states
from kvjax.sched.drafter import BATCH_ROWS, NgramDrafter, PacedDrafter, SpeculativeConfig, ngram_sizes, propose_rows
from kvjax.state import gdn_pool, gdn_spec

ATOL = 2e-5  # f32, a few recurrent steps of O(1) values (the reference runs the same recurrence in another order)


def _row_inputs(rng, lens, hk=2, hv=4, kd=8, vd=8, pad=3):
    """Random GDN inputs of rows of ``lens`` tokens (then ``pad`` padding tokens), their initial states, and the
    verification index grid."""
    T = sum(lens) + pad
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
    k, v = f(T, hk, kd), f(T, hv, vd)
    g = -jnp.abs(f(T, hv))  # log-decay <= 0
    beta = jax.nn.sigmoid(f(T, hv))
    init = 0.5 * f(len(lens), hv, kd, vd)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    J = max(lens) + 1  # one position past the longest row: an invalid position
    index = jnp.asarray(cu[:-1, None] + np.arange(J), jnp.int32)
    valid = jnp.asarray(np.arange(J)[None, :] < np.asarray(lens)[:, None])
    return k, v, g, beta, init, cu, index, valid


@pytest.mark.parametrize("l2", [True, False])
def test_ssm_states_equal_the_recurrent_reference_over_each_prefix(l2):
    rng = np.random.default_rng(0)
    lens = [3, 1, 5, 2]
    k, v, g, beta, init, cu, index, valid = _row_inputs(rng, lens)
    got = np.asarray(verify_ssm_states(k, v, g, beta, init, index, valid, use_qk_l2norm=l2))  # [B, J, Hv, K, V]
    q = jnp.zeros_like(k)
    for b, n in enumerate(lens):
        for j in range(n):
            s = slice(int(cu[b]), int(cu[b]) + j + 1)
            _, final = recurrent_gated_delta_rule_reference(DeltaRuleCall(q[s], k[s], v[s], g[s], beta[s], jnp.array(
                [0, j + 1], jnp.int32), 1.0, use_qk_l2norm=l2), init[b: b + 1])
            np.testing.assert_allclose(got[b, j], np.asarray(final[0]), atol=ATOL, rtol=1e-5)


def test_conv_states_equal_the_conv_reference_over_each_prefix():
    rng = np.random.default_rng(1)
    lens, D, W = [4, 1, 3], 6, 4
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    T = int(cu[-1]) + 2
    x = jnp.asarray(rng.standard_normal((T, D)), jnp.float32)
    init = jnp.asarray(rng.standard_normal((len(lens), D, W - 1)), jnp.float32)
    weight = jnp.asarray(rng.standard_normal((D, W)), jnp.float32)
    J = max(lens)
    index = jnp.asarray(cu[:-1, None] + np.arange(J), jnp.int32)
    got = np.asarray(verify_conv_states(x, init, index))  # [B, J, D, W-1]
    for b, n in enumerate(lens):
        for j in range(n):
            s = slice(int(cu[b]), int(cu[b]) + j + 1)
            _, final = causal_conv1d_reference(x[s], weight, None, cu_seqlens=jnp.array([0, j + 1], jnp.int32),
                                               initial_state=init[b: b + 1])
            np.testing.assert_array_equal(got[b, j], np.asarray(final[0]))


def test_commit_writes_the_accepted_positions_states_and_nothing_else():
    rng = np.random.default_rng(2)
    cfg = GDNConfig(2, 4, 8, 8, 4)
    pool = gdn_pool.create(cfg, 2, 6, conv_dtype=jnp.float32)
    pool = gdn_pool.GDNStatePool(conv=jnp.asarray(rng.standard_normal(pool.conv.shape), jnp.float32),
                                 ssm=jnp.asarray(rng.standard_normal(pool.ssm.shape), jnp.float32))
    slots = jnp.array([3, 1, 5, 0], jnp.int32)  # row 3: padding
    first, count = jnp.array([0, 3, 4, 9], jnp.int32), jnp.array([3, 0, 2, 0], jnp.int32)  # row 1: no drafts
    spec = gdn_spec.attach(pool, first, count, 3).spec
    spec = gdn_spec.VerifyStates(first, count, jnp.asarray(rng.standard_normal(spec.conv.shape), jnp.float32),
                                 jnp.asarray(rng.standard_normal(spec.ssm.shape), jnp.float32))
    out = gdn_spec.commit(gdn_pool.GDNStatePool(pool.conv, pool.ssm, spec), slots, jnp.array([1, 2, 5, 0], jnp.int32))
    assert out.spec is None
    want_conv, want_ssm = np.array(pool.conv), np.array(pool.ssm)
    want_conv[:, 3], want_ssm[:, 3] = spec.conv[:, 0, 1], spec.ssm[:, 0, 1]
    want_conv[:, 5], want_ssm[:, 5] = spec.conv[:, 2, 1], spec.ssm[:, 2, 1]  # accepted 5 clipped to its last position
    np.testing.assert_array_equal(np.asarray(out.conv), want_conv)
    np.testing.assert_array_equal(np.asarray(out.ssm), want_ssm)


def test_burst_carries_the_buffers_between_sub_steps():
    """commit(keep=True) keeps the per-position buffers; the next attach reuses them (new rows, stale contents, no
    zeros written) and checks their shape; detach drops them."""
    rng = np.random.default_rng(3)
    pool = gdn_pool.create(GDNConfig(2, 4, 8, 8, 4), 2, 6, conv_dtype=jnp.float32)
    first, count = jnp.array([0, 3, 5], jnp.int32), jnp.array([3, 2, 0], jnp.int32)
    spec = gdn_spec.attach(pool, first, count, 3).spec
    spec = dataclasses.replace(spec, conv=jnp.asarray(rng.standard_normal(spec.conv.shape), jnp.float32),
                               ssm=jnp.asarray(rng.standard_normal(spec.ssm.shape), jnp.float32))
    kept = gdn_spec.commit(dataclasses.replace(pool, spec=spec), jnp.array([2, 4, 0], jnp.int32),
                           jnp.array([1, 0, 0], jnp.int32), keep=True)
    assert kept.spec is spec and kept.ssm[0, 2].tolist() == spec.ssm[0, 0, 1].tolist()
    first2, count2 = jnp.array([0, 1, 4], jnp.int32), jnp.array([2, 0, 3], jnp.int32)
    again = gdn_spec.attach(kept, first2, count2, 3).spec
    assert again.ssm is spec.ssm and again.conv is spec.conv  # reused, not zeroed
    np.testing.assert_array_equal(np.asarray(again.first), np.asarray(first2))
    np.testing.assert_array_equal(np.asarray(again.count), np.asarray(count2))
    with pytest.raises(ValueError, match="rows x positions"):
        gdn_spec.attach(kept, first2, count2, 4)
    assert gdn_spec.detach(kept).spec is None and gdn_spec.detach(kept).ssm is kept.ssm


def test_ngram_drafter():
    d = NgramDrafter(3, max_ngram=2)
    # suffix (7, 8) occurs at 1 and 5: the latest one's continuation
    assert d.propose(np.array([5, 7, 8, 1, 2, 7, 8, 4, 6, 7, 8]), 3).tolist() == [4, 6, 7]
    assert d.propose(np.array([5, 7, 8, 1, 2, 7, 8, 4, 6, 7, 8]), 1).tolist() == [4]
    assert d.propose(np.array([1, 2, 3, 4]), 3).tolist() == []  # no earlier occurrence
    assert d.propose(np.array([9, 1, 2, 9]), 3).tolist() == [1, 2, 9]  # the 1-gram (9) after no 2-gram
    assert d.propose(np.array([9, 1, 9]), 5).tolist() == [1, 9]  # the continuation runs to the end
    assert d.propose(np.array([3]), 3).tolist() == []


@pytest.mark.parametrize("K, max_ngram, min_ngram", [(1, 3, 1), (4, 3, 1), (3, 2, 2), (5, 4, 2)])
def test_device_lookup_proposes_the_host_drafters_drafts(K, max_ngram, min_ngram):
    """Random histories (small vocabularies: many repeats; lengths 0..L, the last ones full) through
    :func:`kvjax.engine.ngram.lookup` give, row by row, :class:`NgramDrafter`'s drafts then ``-1``; ``append`` then
    ``lookup`` equals the host drafter on the grown tokens."""
    rng = np.random.default_rng(K * 10 + max_ngram)
    host = NgramDrafter(K, max_ngram, min_ngram)
    B, L = 64, 40
    hist = np.where(np.arange(B)[:, None] % 2, rng.integers(0, 3, (B, L)), rng.integers(0, 8, (B, L))).astype(np.int32)
    length = np.concatenate([rng.integers(0, L + 1, B - 4), np.full(4, L)]).astype(np.int32)
    tokens = rng.integers(0, 3, (B, 3)).astype(np.int32)
    count = np.where(length <= L - 3, rng.integers(0, 4, B), 0).astype(np.int32)
    grown, grown_len = jax.jit(ngram.append)(jnp.asarray(hist), jnp.asarray(length), jnp.asarray(tokens),
                                             jnp.asarray(count))
    assert (np.asarray(grown_len) == length + count).all()
    for h, n in ((hist, length), (np.asarray(grown), np.asarray(grown_len))):
        got = np.asarray(jax.jit(ngram.lookup, static_argnums=(2, 3, 4))(jnp.asarray(h), jnp.asarray(n), K,
                                                                           max_ngram, min_ngram))
        for b in range(B):
            want = host.propose(h[b, : n[b]], K).tolist()
            assert got[b].tolist() == want + [-1] * (K - len(want)), (b, h[b, : n[b]].tolist(), got[b], want)
    for b in range(B):  # the appended tokens follow the history; nothing past them changed
        row = np.asarray(grown)[b]
        assert row[length[b]: length[b] + count[b]].tolist() == tokens[b, : count[b]].tolist()
        assert (np.delete(row, np.arange(length[b], length[b] + count[b])) ==
                np.delete(hist[b], np.arange(length[b], length[b] + count[b]))).all()
    assert (np.asarray(ngram.leading(jnp.array([[3, -1, 4], [1, 2, 0], [-1, -1, -1]], jnp.int32))) == [1, 3, 0]).all()


@pytest.mark.parametrize("K, max_ngram, min_ngram", [(1, 3, 1), (4, 3, 1), (3, 2, 2), (5, 4, 2)])
def test_batched_host_lookup_proposes_the_drafters_drafts(K, max_ngram, min_ngram):
    """:func:`~kvjax.sched.drafter.propose_rows` (every row at once, as the scheduler drafts) gives each row
    :class:`NgramDrafter`'s own drafts, with per-row draft caps (random histories of small vocabularies, stale
    tokens past each row's length, lengths 0..L), also through the rule's :class:`PacedDrafter`; a drafter of
    another kind (a subclass) is asked row by row."""
    rng = np.random.default_rng(K * 7 + max_ngram)
    host = NgramDrafter(K, max_ngram, min_ngram)
    R, L = 64, 40
    hist = np.where(np.arange(R)[:, None] % 2, rng.integers(0, 3, (R, L + 5)), rng.integers(0, 8, (R, L + 5)))
    length = np.concatenate([rng.integers(0, L + 1, R - 4), np.full(4, L)])
    cap = rng.integers(1, K + 2, R)
    assert R >= BATCH_ROWS  # the lookup over every row at once
    for drafter in (host, PacedDrafter(host, flat_tokens=64)):
        got = propose_rows(drafter, hist, length, cap)
        for r in range(R):
            want = host.propose(hist[r, : length[r]], int(cap[r])).tolist()
            assert got[r].tolist() == want, (r, hist[r, : length[r]].tolist(), got[r], want)

    class Reversed(NgramDrafter):
        def propose(self, tokens, max_drafts):
            return super().propose(tokens, max_drafts)[::-1]

    other = Reversed(K, max_ngram, min_ngram)
    # the device's lookup is NgramDrafter's rule: a subclass verifies in single steps (the engine's and the
    # scheduler's view agree: no bursts, no device sizes)
    assert host.bursts and not other.bursts and not PacedDrafter(other, flat_tokens=64).bursts
    assert ngram_sizes(other) is None and ngram_sizes(host) == (max_ngram, min_ngram)
    got = propose_rows(other, hist, length, cap)
    assert all(g.tolist() == other.propose(hist[r, : length[r]], int(cap[r])).tolist() for r, g in enumerate(got))


def test_speculative_config_checks():
    assert SpeculativeConfig.of("ngram") == SpeculativeConfig()
    assert SpeculativeConfig.of(None) is None
    assert SpeculativeConfig.of("mtp") == SpeculativeConfig(method="mtp")
    for bad in (dict(method="eagle"), dict(num_draft_tokens=0), dict(num_draft_tokens=17), dict(min_ngram=3, max_ngram=2),
                dict(drafter=object())):
        with pytest.raises(ValueError):
            SpeculativeConfig(**bad)
    with pytest.raises(ValueError, match="speculative must be"):
        SpeculativeConfig.of(3)
