"""DeepSeek-V3.2 step parity: chunked prefill + token-by-token decode over the paged MLA latent cache and the
DSA indexer cache gives the logits of the full-sequence forward (``model.logits``).

Several sequences of different lengths share every step (mixed prefill chunks and decode tokens, rows shuffled,
one padding row, padding tokens), pages are handed out in random order, and the step compiles once.
Tolerance: 1e-4 max abs diff in float32 (absorbed vs un-absorbed MLA differ by f32 round-off only).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kvjax.inputs import StepInputs
from kvjax.engine.step import make_step
from kvjax.models.deepseek import DeepseekConfig, DeepseekV32
from kvjax.models.interface import ModelCaches

PAGE, MAX_BLOCKS, NUM_PAGES, T_BUCKET, B_BUCKET = 4, 5, 24, 16, 4
LENGTHS = (11, 6, 17)  # total tokens per sequence
CHUNKS = ((5, 4), (3,), (7, 6))  # prefill chunk sizes; the rest is decoded one token per step


def _config(topk: int, rope_dim: int = 8) -> DeepseekConfig:
    return DeepseekConfig(
        vocab_size=61, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=3,
        q_lora_rank=40, kv_lora_rank=32, qk_nope_head_dim=12, qk_rope_head_dim=rope_dim, v_head_dim=16,
        index_n_heads=8, index_head_dim=16, index_topk=topk,
        rope_parameters=(("beta_fast", 32), ("beta_slow", 1), ("factor", 2.0), ("mscale", 1.0),
                         ("mscale_all_dim", 0.7), ("original_max_position_embeddings", 16),
                         ("rope_theta", 10000.0), ("rope_type", "yarn")),
        max_position_embeddings=32,
    )


def _model(topk: int, seed: int, rope_dim: int = 8) -> DeepseekV32:
    model = DeepseekV32(_config(topk, rope_dim), rngs=nnx.Rngs(seed))
    # Norm weights away from 1 and the indexer LayerNorm bias away from 0, so every parameter matters.
    key = jax.random.key(seed + 1)
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        if var[...].ndim == 1:
            key, sub = jax.random.split(key)
            base = 0.0 if path[-1] == "bias" else 1.0
            var[...] = base + 0.3 * jax.random.normal(sub, var[...].shape)
    return model


def _schedule(rng: np.random.Generator):
    """Per step: list of (seq, start, n) in a shuffled row order."""
    plans = []
    for b, (length, chunks) in enumerate(zip(LENGTHS, CHUNKS)):
        sizes = list(chunks) + [1] * (length - sum(chunks))
        starts = np.cumsum([0] + sizes[:-1])
        plans.append([(b, int(s), n) for s, n in zip(starts, sizes)])
    steps = []
    for i in range(max(len(p) for p in plans)):
        rows = [p[i] for p in plans if i < len(p)]
        steps.append([rows[j] for j in rng.permutation(len(rows))])
    return steps


def _inputs(rows, tokens, tables, n_logits: int) -> StepInputs:
    """StepInputs for one step: real rows first, then padding rows; ``n_logits`` logits indices (arange)."""
    ids = np.zeros(T_BUCKET, np.int32)
    pos = np.zeros(T_BUCKET, np.int32)
    slot = np.full((T_BUCKET, 1), -1, np.int32)
    cu = np.zeros(B_BUCKET + 1, np.int32)
    lens = np.zeros(B_BUCKET, np.int32)
    bt = np.full((B_BUCKET, 1, MAX_BLOCKS), -1, np.int32)
    t = 0
    for r, (b, start, n) in enumerate(rows):
        p = np.arange(start, start + n)
        ids[t:t + n] = tokens[b][p]
        pos[t:t + n] = p
        slot[t:t + n, 0] = tables[b][p // PAGE] * PAGE + p % PAGE
        cu[r + 1] = cu[r] + n
        lens[r] = start + n
        bt[r, 0] = tables[b]
        t += n
    cu[len(rows) + 1:] = cu[len(rows)]
    assert t <= T_BUCKET
    return StepInputs(
        token_ids=jnp.asarray(ids), positions=jnp.asarray(pos), cu_seqlens=jnp.asarray(cu),
        seq_lens=jnp.asarray(lens), gdn_slots=jnp.zeros(B_BUCKET, jnp.int32),
        has_initial_state=jnp.asarray(lens > cu[1:] - cu[:-1]), block_tables=jnp.asarray(bt),
        slot_mapping=jnp.asarray(slot), logits_indices=jnp.arange(n_logits, dtype=jnp.int32),
    )


def _run_steps(model: DeepseekV32, rng: np.random.Generator, *, kind: str, indexer_fp8: bool):
    """Drive every step; returns (tokens [3, max_len], dict (seq, pos) -> step logits f32[vocab])."""
    vocab = model.config.vocab_size
    tokens = [rng.integers(0, vocab, size=n).astype(np.int32) for n in LENGTHS]
    perm = rng.permutation(NUM_PAGES)
    tables, k = [], 0
    for n in LENGTHS:
        nb = -(-n // PAGE)
        row = np.full(MAX_BLOCKS, -1, np.int32)
        row[:nb] = perm[k:k + nb]
        tables.append(row)
        k += nb
    caches = model.init_caches(num_pages=NUM_PAGES, page_size=PAGE, kind=kind, indexer_fp8=indexer_fp8)
    graphdef, state = nnx.split(model)
    step = make_step(graphdef, max_traces=1)  # every step has the same bucketed shapes: one compile
    got = {}
    for rows in _schedule(rng):
        inputs = _inputs(rows, tokens, tables, T_BUCKET)
        logits, caches = step(state, caches, inputs)
        logits = np.asarray(logits)
        assert np.isfinite(logits).all()
        t = 0
        for b, start, n in rows:
            for j in range(n):
                got[(b, start + j)] = logits[t + j]
            t += n
    padded = np.zeros((len(LENGTHS), max(LENGTHS)), np.int32)
    for b, tok in enumerate(tokens):
        padded[b, : len(tok)] = tok
    return padded, got, caches


def _check(model, padded, got, *, indexer_fp8: bool, latent_fp8: bool = False):
    # Causal: the logits of a sequence's prefix do not depend on the (padding) tokens after it.
    ref = np.asarray(model.logits(jnp.asarray(padded), indexer_fp8=indexer_fp8, latent_fp8=latent_fp8))
    assert len(got) == sum(LENGTHS)
    worst = max(float(np.abs(v - ref[b, p]).max()) for (b, p), v in got.items())
    assert worst <= 1e-4, worst
    return ref


@pytest.mark.parametrize(
    "kind, indexer_fp8",
    [("mla", True), ("mla", False), ("dsa", True)],
    ids=["f32-latent+fp8-indexer", "f32-latent+f32-indexer", "dsa-fp8-latent+fp8-indexer"],
)
def test_step_matches_logits_sparse_topk(rng, kind, indexer_fp8):
    """index_topk (4) < most context lengths: the indexer's selection decides the output. The oracle rounds
    exactly what the cache rounds (fp8 indexer keys; for the DSA layout also the fp8 latent / bf16 rope key)."""
    model = _model(topk=4, seed=3)
    padded, got, caches = _run_steps(model, rng, kind=kind, indexer_fp8=indexer_fp8)
    latent_fp8 = kind == "dsa"
    ref = _check(model, padded, got, indexer_fp8=indexer_fp8, latent_fp8=latent_fp8)
    want = jnp.float8_e4m3fn if indexer_fp8 else jnp.float32
    roles = (("key", "key_scale", "key_rope") if latent_fp8 else ("key",)) + ("indexer", "indexer_scale")
    names = [f"{role}_caches_{layer}" for layer in range(2) for role in roles]  # (layer, role priority)
    assert list(model.init_caches(num_pages=2, page_size=PAGE, kind=kind, indexer_fp8=indexer_fp8).pages) == names
    assert sorted(caches.pages) == sorted(names)  # (jit returns dicts in sorted-key order)
    assert caches.pages["indexer_caches_1"].dtype == want
    assert caches.pages["key_caches_1"].dtype == (jnp.float8_e4m3fn if latent_fp8 else jnp.float32)
    if kind == "mla" and indexer_fp8:
        return
    # The selection matters: the same weights with a top-k covering everything give different logits.
    dense = _model(topk=64, seed=3)
    ref_dense = np.asarray(dense.logits(jnp.asarray(padded), indexer_fp8=indexer_fp8, latent_fp8=latent_fp8))
    assert np.abs(ref_dense - ref).max() > 1e-2


def test_step_matches_logits_dense_topk(rng):
    """index_topk >= every length: sparse attention is dense MLA; fp8 keys cannot change the selection."""
    model = _model(topk=64, seed=5)
    padded, got, _ = _run_steps(model, rng, kind="mla", indexer_fp8=True)
    ref = _check(model, padded, got, indexer_fp8=True)
    ref_f32 = np.asarray(model.logits(jnp.asarray(padded)))
    np.testing.assert_allclose(ref, ref_f32, atol=1e-5, rtol=0)


def test_step_leaves_unwritten_pages_and_pad_rows_alone(rng):
    """Pages no sequence owns keep their (poisoned) contents; only mapped slots are written."""
    model = _model(topk=4, seed=7)
    caches = model.init_caches(num_pages=NUM_PAGES, page_size=PAGE, kind="dsa")
    poison = ModelCaches(pages={name: jnp.full_like(v, 7) for name, v in caches.pages.items()})
    tokens = [rng.integers(0, 61, size=n).astype(np.int32) for n in LENGTHS]
    tables = [np.array([2 * b, 2 * b + 1, -1, -1, -1], np.int32) for b in range(3)]
    rows = [(0, 0, 5), (2, 0, 3), (1, 0, 6)]
    graphdef, state = nnx.split(model)
    step = make_step(graphdef, donate=False)
    _, new = step(state, poison, _inputs(rows, tokens, tables, B_BUCKET))
    touched = np.zeros((NUM_PAGES, PAGE), bool)
    for b, _, n in rows:
        p = np.arange(n)
        touched[tables[b][p // PAGE], p % PAGE] = True
    assert sorted(new.pages) == sorted(poison.pages) and new.gdn is None
    for name in poison.pages:
        o, c = np.asarray(poison.pages[name].astype(jnp.float32)), np.asarray(new.pages[name].astype(jnp.float32))
        assert (c[~touched] == o[~touched]).all(), name
        assert (c[touched] != o[touched]).any(axis=-1).all(), name  # every written token row changed


def test_step_with_pallas_sparse_kernel_interpret(rng):
    """The step's sparse MLA attention through the Pallas kernel (interpret mode on CPU) equals the reference.
    The kernel's tiles need power-of-two ``R``, ``r`` >= 16 (it declines rope_dim 8), hence rope_dim 16 here."""
    model = _model(topk=4, seed=9, rope_dim=16)
    tokens = [rng.integers(0, 61, size=n).astype(np.int32) for n in LENGTHS]
    perm = rng.permutation(NUM_PAGES)
    tables = [np.concatenate([perm[5 * b:5 * b + 3], [-1, -1]]).astype(np.int32) for b in range(3)]
    rows = [(1, 0, 6), (0, 0, 5), (2, 0, 4)]
    graphdef, state = nnx.split(model)
    out = {}
    for impl in ("reference", "interpret"):
        step = jax.jit(lambda s, c, i, impl=impl: nnx.merge(graphdef, s).forward_step(c, i, impl=impl))
        caches = model.init_caches(num_pages=NUM_PAGES, page_size=PAGE)
        out[impl], _ = step(state, caches, _inputs(rows, tokens, tables, 15))
    np.testing.assert_allclose(np.asarray(out["interpret"]), np.asarray(out["reference"]), atol=1e-4, rtol=0)
