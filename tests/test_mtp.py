"""Qwen3.5 MTP layers (issue 36): loading of the checkpoint's ``mtp.*`` tensors, parity with an independent
float32 numpy reference of the published architecture (vLLM ``qwen3_next_mtp`` / ``qwen3_5_mtp``), the paged
MTP step against the full-sequence MTP, and the greedy drafter against a chain of full-sequence MTP calls.

The reference below is written from the architecture and the checkpoint's tensor names alone (it reads the HF
tensors, never the kvjax module): ``fc`` on ``[norm(embed(x_{t+1})) | norm(h_t)]``, one gated full-attention
decoder layer at position ``t`` (zero-centred q/k norms, partial NeoX RoPE, GQA, output gate), the final norm and
the main model's LM head. Every MTP tensor, norm scales included, is drawn at random so no term can hide.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from safetensors.numpy import load_file  # noqa: E402

from helpers.hf import VOCAB, saved_hf_model, write_ckpt  # noqa: E402
from helpers.models import random_model, tiny_config  # noqa: E402
from helpers.planner import NUM_PAGES, PAGE, Planner  # noqa: E402
from kvjax.errors import CheckpointError  # noqa: E402
from kvjax.models import load_pretrained  # noqa: E402
from kvjax.models.common.checkpoint import assign_params  # noqa: E402
from kvjax.models.qwen3_5 import mtp as mtp_lib  # noqa: E402
from kvjax.state.registry import cache_name  # noqa: E402

TOL = 1e-4  # f32: max abs difference of logits / hidden states
POISON = 8192.0
LAYERS2 = dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])


# ---------------------------------------------------------------------------------------------- reference


def mtp_tensors(rng, config: dict, num_layers: int = 1) -> dict[str, np.ndarray]:
    """Random ``mtp.*`` tensors in the checkpoint's names and torch layouts (``[out, in]``) for an HF config."""
    h, i = config["hidden_size"], config["intermediate_size"]
    hq, hkv, d = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    shapes = {"mtp.fc.weight": (h, 2 * h), "mtp.pre_fc_norm_embedding.weight": (h,),
              "mtp.pre_fc_norm_hidden.weight": (h,), "mtp.norm.weight": (h,)}
    for n in range(num_layers):
        p = f"mtp.layers.{n}."
        shapes.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (2 * hq * d, h), p + "self_attn.k_proj.weight": (hkv * d, h),
            p + "self_attn.v_proj.weight": (hkv * d, h), p + "self_attn.o_proj.weight": (h, hq * d),
            p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,),
            p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h), p + "mlp.down_proj.weight": (h, i),
        })
    return {k: (0.3 if len(s) == 1 else 0.2) * rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}


def _norm(x, w, eps):  # zero-centred RMSNorm (Qwen3-Next / Qwen3.5): scale 1 + w
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * (1.0 + w)


def _rope(x, pos, theta, rotary):  # x [T, H, D]; NeoX rotate_half on the first `rotary` dims
    inv = 1.0 / theta ** (np.arange(0, rotary, 2) / rotary)
    ang = pos[:, None] * inv[None, :]
    cos, sin = np.concatenate([np.cos(ang)] * 2, -1)[:, None], np.concatenate([np.sin(ang)] * 2, -1)[:, None]
    r, rest = x[..., :rotary], x[..., rotary:]
    half = rotary // 2
    rot = np.concatenate([-r[..., half:], r[..., :half]], axis=-1)
    return np.concatenate([r * cos + rot * sin, rest], axis=-1)


def reference_mtp(t: dict, config: dict, hidden: np.ndarray, next_ids: np.ndarray, window: int = 0):
    """One sequence: hidden [T, H] (main model at positions 0..T-1), next_ids [T] -> (MTP hidden [T, H],
    logits [T, vocab]) in float64. ``window`` (KV head 0 only, research option): sliding-window mask."""
    f = {k: np.asarray(v, np.float64) for k, v in t.items()}
    eps = config.get("rms_norm_eps", 1e-6)
    hq, hkv, d = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    rope = config["rope_parameters"]
    rotary = int(d * rope["partial_rotary_factor"])
    n = len(next_ids)
    pos = np.arange(n, dtype=np.float64)
    emb = f["model.embed_tokens.weight"][next_ids]
    x = np.concatenate([_norm(emb, f["mtp.pre_fc_norm_embedding.weight"], eps),
                        _norm(np.asarray(hidden, np.float64), f["mtp.pre_fc_norm_hidden.weight"], eps)], -1)
    x = x @ f["mtp.fc.weight"].T
    p = "mtp.layers.0."
    h = _norm(x, f[p + "input_layernorm.weight"], eps)
    qg = (h @ f[p + "self_attn.q_proj.weight"].T).reshape(n, hq, 2 * d)
    q, gate = qg[..., :d], qg[..., d:].reshape(n, hq * d)
    k = (h @ f[p + "self_attn.k_proj.weight"].T).reshape(n, hkv, d)
    v = (h @ f[p + "self_attn.v_proj.weight"].T).reshape(n, hkv, d)
    q = _rope(_norm(q, f[p + "self_attn.q_norm.weight"], eps), pos, rope["rope_theta"], rotary)
    k = _rope(_norm(k, f[p + "self_attn.k_norm.weight"], eps), pos, rope["rope_theta"], rotary)
    o = np.zeros((n, hq, d))
    i_, j_ = np.arange(n)[:, None], np.arange(n)[None, :]
    for head in range(hq):
        kv = head // (hq // hkv)
        mask = (j_ <= i_) & ((window == 0) | (kv != 0) | (i_ - j_ < window))
        s = np.where(mask, q[:, head] @ k[:, kv].T * d ** -0.5, -np.inf)
        w = np.exp(s - s.max(-1, keepdims=True))
        o[:, head] = (w / w.sum(-1, keepdims=True)) @ v[:, kv]
    x = x + (o.reshape(n, hq * d) * (1 / (1 + np.exp(-gate)))) @ f[p + "self_attn.o_proj.weight"].T
    h = _norm(x, f[p + "post_attention_layernorm.weight"], eps)
    a, b = h @ f[p + "mlp.gate_proj.weight"].T, h @ f[p + "mlp.up_proj.weight"].T
    x = x + (a / (1 + np.exp(-a)) * b) @ f[p + "mlp.down_proj.weight"].T
    g = _norm(x, f["mtp.norm.weight"], eps)
    head_w = f["lm_head.weight"] if "lm_head.weight" in f else f["model.embed_tokens.weight"]
    return g, g @ head_w.T


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny HF Qwen3.5 checkpoint (GDN + full attention) plus random ``mtp.*`` tensors: (config, tensors)."""
    _, path = saved_hf_model(tmp_path_factory.mktemp("m"), seed=7, **LAYERS2)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    return config, {**tensors, **mtp_tensors(np.random.default_rng(7), config)}


_dense = nnx.jit(lambda model, mtp, h, ids: mtp.logits(model, mtp.dense(model, h, ids)))


@pytest.mark.parametrize("tied", [False, True])
def test_loaded_mtp_matches_reference(tmp_path, saved, rng, tied):
    config, tensors = saved
    if tied:
        config = {**config, "tie_word_embeddings": True}
        tensors = {k: v for k, v in tensors.items() if k != "lm_head.weight"}
    model = load_pretrained(write_ckpt(tmp_path / "c", {**config, "mtp_num_hidden_layers": 1}, tensors))
    mtp = mtp_lib.mtp_of(model)
    assert isinstance(mtp, mtp_lib.Qwen3_5MTP) and mtp.num_layers == 1 and (model.lm_head is None) == tied
    np.testing.assert_array_equal(np.asarray(mtp.fc.kernel[...]), tensors["mtp.fc.weight"].T)
    np.testing.assert_array_equal(np.asarray(mtp.layers[0].self_attn.q_norm.weight[...]),
                                  tensors["mtp.layers.0.self_attn.q_norm.weight"])
    b, n = 2, 13
    hidden = rng.standard_normal((b, n, config["hidden_size"])).astype(np.float32) * 2.0
    ids = rng.integers(0, VOCAB, (b, n))
    out = np.asarray(_dense(model, mtp, jnp.asarray(hidden), jnp.asarray(ids, jnp.int32)))
    assert out.shape == (b, n, VOCAB) and out.dtype == np.float32
    for r in range(b):
        _, ref = reference_mtp(tensors, config, hidden[r], ids[r])
        assert np.abs(ref).max() > 1.0
        np.testing.assert_allclose(out[r], ref, atol=TOL, rtol=0)
    # the order of the concatenation matters: swapping the two pre-fc norms changes the output
    swapped = {**tensors, "mtp.pre_fc_norm_embedding.weight": tensors["mtp.pre_fc_norm_hidden.weight"],
               "mtp.pre_fc_norm_hidden.weight": tensors["mtp.pre_fc_norm_embedding.weight"]}
    _, other = reference_mtp(swapped, config, hidden[0], ids[0])
    assert np.abs(other - out[0]).max() > 1e-2


def test_swa_option_reaches_the_mtp_layer(tmp_path, saved, rng):
    config, tensors = saved
    model = load_pretrained(write_ckpt(tmp_path / "c", config, tensors), window=(4, 0), sinks=(0, 0))
    mtp = mtp_lib.mtp_of(model)
    assert mtp.config.attention.window == (4, 0)
    hidden = rng.standard_normal((1, 12, config["hidden_size"])).astype(np.float32)
    ids = rng.integers(0, VOCAB, (1, 12))
    out = np.asarray(_dense(model, mtp, jnp.asarray(hidden), jnp.asarray(ids, jnp.int32)))[0]
    np.testing.assert_allclose(out, reference_mtp(tensors, config, hidden[0], ids[0], window=4)[1], atol=TOL, rtol=0)
    assert np.abs(out - reference_mtp(tensors, config, hidden[0], ids[0])[1]).max() > 1e-3


# ------------------------------------------------------------------------------------------------ loading


def test_checkpoint_without_mtp_has_none(tmp_path, saved):
    config, tensors = saved
    model = load_pretrained(write_ckpt(tmp_path / "c", config, {k: v for k, v in tensors.items()
                                                                 if not k.startswith("mtp.")}))
    assert mtp_lib.mtp_of(model) is None


def test_layer_count_from_config_or_keys(tmp_path, saved, rng):
    config, tensors = saved
    two = {**tensors, **mtp_tensors(rng, config, num_layers=2)}
    model = load_pretrained(write_ckpt(tmp_path / "a", config, two))  # no config key: counted from the names
    assert mtp_lib.mtp_of(model).num_layers == 2
    with pytest.raises(CheckpointError, match=r"mtp\.layers\.1\."):  # the config says one: layer 1 is undescribed
        load_pretrained(write_ckpt(tmp_path / "b", {**config, "mtp_num_hidden_layers": 1}, two))
    with pytest.raises(CheckpointError, match=r"mtp\.fc\.weight"):  # the config says none
        load_pretrained(write_ckpt(tmp_path / "c", {**config, "num_nextn_predict_layers": 0}, tensors))
    with pytest.raises(CheckpointError, match="mtp_num_hidden_layers"):
        load_pretrained(write_ckpt(tmp_path / "d", {**config, "mtp_num_hidden_layers": -1}, tensors))


@pytest.mark.parametrize("case", ["missing", "misshaped", "unknown", "non-finite"])
def test_bad_mtp_tensors_are_named(tmp_path, saved, case):
    config, tensors = saved
    name = "mtp.layers.0.self_attn.k_proj.weight"
    bad = dict(tensors)
    if case == "missing":
        del bad[name]
        match = r"missing tensor 'mtp\.layers\.0\.self_attn\.k_proj\.weight'"
    elif case == "misshaped":
        bad[name] = np.ones((bad[name].shape[0] + 1, bad[name].shape[1]), np.float32)
        match = r"mtp\.layers\.0\.self_attn\.k_proj\.weight' has shape"
    elif case == "unknown":
        bad["mtp.extra_proj.weight"] = np.ones((2, 2), np.float32)
        match = r"mtp\.extra_proj\.weight"
    else:
        bad[name] = bad[name].copy()
        bad[name][0, 0] = np.nan
        match = r"k_proj\.weight' holds 1 NaN"
    with pytest.raises(CheckpointError, match=match):
        load_pretrained(write_ckpt(tmp_path / "c", config, bad))


# ---------------------------------------------------------------------------------- paged step and drafter


def _mtp_for(model, seed):
    mtp = mtp_lib.init(model.config, seed=seed)
    r = np.random.default_rng(seed)
    return assign_params(mtp, {p: 0.3 * r.standard_normal(v.get_value().shape)
                               for p, v in nnx.to_flat_state(nnx.state(mtp))})


@pytest.fixture(scope="module")
def toy():
    """A random two-layer model whose KV head 0 is SWA (window 6, 1 sink), random MTP layers, jitted calls."""
    model = random_model(tiny_config(window=(6, 0), sinks=(1, 0), layer_types=("linear_attention", "full_attention")),
                         seed=3)
    mtp = _mtp_for(model, 4)
    main = nnx.jit(lambda m, c, i: m.forward_step_hidden(c, i))
    hidden = nnx.jit(lambda m, ids: m.hidden_states(ids))
    step = nnx.jit(lambda m, t, pages, h, nxt, i: t.step(m, pages, h, nxt, i.positions, cu_seqlens=i.cu_seqlens,
                                                          seq_lens=i.seq_lens, block_tables=i.block_tables,
                                                          slot_mapping=i.slot_mapping))
    propose = nnx.jit(lambda m, t, pages, h, i, s, k: mtp_lib.mtp_propose(m, t, pages, h, i, s, num_draft=k),
                      static_argnums=6)
    return model, mtp, main, hidden, step, propose


def _lookahead(planner, sid: int, last: int) -> None:
    """Give row ``sid`` the pages of every position up to ``last`` now (the drafts' lookahead slots)."""
    table = planner.tables[sid]
    for h in range(table.shape[0]):
        for blk in range(last // PAGE + 1):
            if table[h, blk] < 0:
                table[h, blk] = planner.free.pop()


def _poisoned(model, mtp):
    caches = jax.tree.map(lambda x: jnp.full_like(x, POISON), model.init_caches(num_pages=NUM_PAGES, page_size=PAGE,
                                                                               max_seqs=6))
    pages = {k: jnp.full_like(v, POISON) for k, v in mtp_lib.init_mtp_caches(mtp, num_pages=NUM_PAGES,
                                                                              page_size=PAGE).items()}
    return caches, pages


def test_mtp_caches_follow_the_registry(toy):
    model, mtp, *_ = toy
    pages = mtp_lib.init_mtp_caches(mtp, num_pages=NUM_PAGES, page_size=PAGE)
    li = model.config.num_layers  # after the main model's layers
    assert sorted(pages) == [cache_name("key", li), cache_name("value", li)]
    assert pages[cache_name("key", li)].shape == (NUM_PAGES, PAGE, model.config.attention.head_dim)
    fp8 = mtp_lib.init_mtp_caches(mtp, num_pages=NUM_PAGES, page_size=PAGE, kv_cache_dtype="fp8")
    assert cache_name("key_scale", li) in fp8 and fp8[cache_name("key", li)].dtype == jnp.float8_e4m3fn


def test_paged_step_matches_full_sequence_mtp(toy, rng):
    """Chunked prefill then decode over head-wise tables with SWA recycling: the main step's hidden states equal
    ``hidden_states`` and the paged MTP step at every token equals the full-sequence MTP."""
    model, mtp, main, hidden, step, _ = toy
    seqs = [rng.integers(0, 61, n).astype(np.int32) for n in (23, 9, 30)]
    chunks = ([6, 9], [4], [12, 11])
    full_h = np.asarray(hidden(model, jnp.asarray(np.stack([np.resize(s, 31) for s in seqs]))))
    ref = {}
    for i, s in enumerate(seqs):
        ids = np.resize(np.append(s[1:], 0), 31)
        ref[i] = np.asarray(mtp.dense(model, jnp.asarray(full_h[i:i + 1]), jnp.asarray(ids[None], jnp.int32)))[0]
    caches, pages = _poisoned(model, mtp)
    planner = Planner(rng, 2, (6, 0), (1, 0))
    cursor = [0, 0, 0]
    for i in range(3):
        planner.add(i)
    checked = 0
    while any(cursor[i] < len(seqs[i]) for i in range(3)):
        work = []
        for i in range(3):
            if cursor[i] < len(seqs[i]):
                n = min(chunks[i].pop(0) if chunks[i] else 1, len(seqs[i]) - cursor[i])
                work.append((i, seqs[i][cursor[i]:cursor[i] + n]))
                cursor[i] += n
        inputs, expect = planner.plan(work)
        _, h, caches = main(model, caches, inputs)
        nxt = np.zeros(inputs.num_tokens, np.int32)
        where = []
        for r, sid, _ in expect:
            lo, hi = inputs.cu_seqlens[r], inputs.cu_seqlens[r + 1]
            p = inputs.positions[lo:hi]
            nxt[lo:hi] = np.append(seqs[sid], 0)[p + 1]  # the token after each position (0 after the last)
            where.append((sid, lo, hi, p))
        g, pages = step(model, mtp, pages, h, jnp.asarray(nxt), inputs)
        h, g = np.asarray(h), np.asarray(g)
        for sid, lo, hi, p in where:
            np.testing.assert_allclose(h[lo:hi], full_h[sid, p], atol=TOL, rtol=0)
            np.testing.assert_allclose(g[lo:hi], ref[sid][p], atol=TOL, rtol=0, err_msg=f"seq {sid} pos {p}")
            checked += hi - lo
        for i in range(3):
            if i in planner.tables and cursor[i] >= len(seqs[i]):
                planner.finish(i)
        planner.recycle()
    assert checked == sum(len(s) for s in seqs) and planner.recycled > 0


ORACLE_LEN = 24  # one padded shape for every oracle call (causal: the padding changes nothing before it)
_chain_step = nnx.jit(lambda model, mtp, h, ids: mtp.dense(model, h, ids))


def _oracle_drafts(model, mtp, hidden_fn, committed: np.ndarray, follow: int, k: int) -> list[int]:
    """Drafts by full-sequence MTP calls: committed tokens x_0..x_p, the token after them, K steps (each feeds
    its MTP hidden state and its draft back at the next position)."""
    n = len(committed)
    h = np.zeros((ORACLE_LEN, model.config.hidden_size), np.float32)
    nxt = np.zeros(ORACLE_LEN, np.int32)
    h[:n] = np.asarray(hidden_fn(model, jnp.asarray(np.resize(committed, ORACLE_LEN)[None])))[0, :n]
    nxt[:n] = np.append(committed[1:], follow)
    drafts = []
    for i in range(n - 1, n - 1 + k):
        g = np.asarray(_chain_step(model, mtp, jnp.asarray(h[None]), jnp.asarray(nxt[None])))[0, i]
        d = int(np.argmax(np.asarray(mtp.logits(model, jnp.asarray(g)))))
        drafts.append(d)
        h[i + 1], nxt[i + 1] = g, d
    return drafts


def test_propose_matches_chained_full_sequence_mtp(toy, rng):
    """Prefill then a verification step whose rows accept 0, 1 or 3 of 3 drafts (their rejected tail is written by
    the main model and the catch-up): the drafts equal greedy full-sequence MTP chains from the committed tokens."""
    model, mtp, main, hidden, _, propose = toy
    k = 3
    prompts = [rng.integers(0, 61, n).astype(np.int32) for n in (11, 5, 8)]
    caches, pages = _poisoned(model, mtp)
    planner = Planner(rng, 2, (6, 0), (1, 0))
    for i, p in enumerate(prompts):
        planner.add(i)
        _lookahead(planner, i, len(p) + k - 2)  # draft step k writes position len(p) - 1 + k
    inputs, expect = planner.plan([(i, p) for i, p in enumerate(prompts)])
    logits, h, caches = main(model, caches, inputs)
    first = rng.integers(0, 61, 3).astype(np.int32)  # "sampled" after each prompt (any token)
    sampled = np.zeros(len(inputs.seq_lens), np.int32)
    for r, sid, _ in expect:
        sampled[r] = first[sid]
    drafts, pages = propose(model, mtp, pages, h, inputs, jnp.asarray(sampled), k)
    drafts = np.asarray(drafts)
    for r, sid, _ in expect:
        assert drafts[r].tolist() == _oracle_drafts(model, mtp, hidden, prompts[sid], first[sid], k), sid
    assert (drafts[[r for r in range(len(sampled)) if r not in {e[0] for e in expect}]] == -1).all()
    # verification of x_n = first and the 3 drafts, + 2 more tokens so that the tables hold the pages of every
    # draft position (the lookahead slots); everything after a row's accepted drafts is a rejected tail
    accept = [0, 1, 3]
    rows = []
    for sid in range(3):
        d = drafts[[e[0] for e in expect if e[1] == sid][0]]
        rows.append(np.concatenate([[first[sid]], d, rng.integers(0, 61, 2)]).astype(np.int32))
    inputs, expect = planner.plan(list(enumerate(rows)))
    _, h, caches = main(model, caches, inputs)
    last = np.asarray(inputs.logits_indices).copy()
    bonus = rng.integers(0, 61, 3).astype(np.int32)
    sampled = np.zeros(len(inputs.seq_lens), np.int32)
    for r, sid, _ in expect:
        last[r] = inputs.cu_seqlens[r] + accept[sid]
        sampled[r] = bonus[sid]
    inputs = dataclasses.replace(inputs, logits_indices=last)
    drafts2, pages = propose(model, mtp, pages, h, inputs, jnp.asarray(sampled), k)
    drafts2 = np.asarray(drafts2)
    for r, sid, _ in expect:
        committed = np.concatenate([prompts[sid], rows[sid][:accept[sid] + 1]])
        assert drafts2[r].tolist() == _oracle_drafts(model, mtp, hidden, committed, bonus[sid], k), sid


def test_propose_rejects_bad_arguments(toy):
    model, mtp, *_ = toy
    pages = mtp_lib.init_mtp_caches(mtp, num_pages=4, page_size=PAGE)
    with pytest.raises(ValueError, match="num_draft"):
        mtp_lib.mtp_propose(model, mtp, pages, jnp.zeros((2, 32)), None, jnp.zeros(1, jnp.int32), num_draft=0)
    two = mtp_lib.init(model.config, num_layers=2)
    with pytest.raises(NotImplementedError, match="one MTP layer"):
        mtp_lib.mtp_propose(model, two, pages, jnp.zeros((2, 32)), None, jnp.zeros(1, jnp.int32), num_draft=2)
    with pytest.raises(ValueError, match="num_layers"):
        mtp_lib.init(model.config, num_layers=0)
    other = random_model(tiny_config(layer_types=("full_attention",)), seed=1)
    mismatched = mtp_lib.init(other.config.with_swa((3, 0)))
    with pytest.raises(ValueError, match="MTP layers built for"):
        mismatched.combine(model, jnp.zeros((1,), jnp.int32), jnp.zeros((1, 32)))


def test_fp8_mtp_pages_track_float_pages(toy, rng):
    """fp8 MTP pages (per-page scales, kv_cache_dtype="fp8"): a prefill step then a one-token step read back
    close to the float pages' result (e4m3 keeps 3 mantissa bits), and the quantisation is really there."""
    model, mtp, main, _, step, _ = toy
    seqs = [rng.integers(0, 61, n).astype(np.int32) for n in (14, 7)]
    out = {}
    for kind in ("auto", "fp8"):
        caches = model.init_caches(num_pages=NUM_PAGES, page_size=PAGE, max_seqs=6)
        planner = Planner(np.random.default_rng(1), 2, (6, 0), (1, 0))
        for i in range(2):
            planner.add(i)
        pages = mtp_lib.init_mtp_caches(mtp, num_pages=NUM_PAGES, page_size=PAGE, kv_cache_dtype=kind)
        got = []
        for work in ([(i, s[:-1]) for i, s in enumerate(seqs)], [(i, s[-1:]) for i, s in enumerate(seqs)]):
            inputs, expect = planner.plan(work)
            _, h, caches = main(model, caches, inputs)
            nxt = np.roll(np.asarray(inputs.token_ids), -1)
            g, pages = step(model, mtp, pages, h, jnp.asarray(nxt), inputs)
            got.append(np.asarray(g)[np.asarray(inputs.logits_indices)[[r for r, _, _ in expect]]])
        out[kind] = np.concatenate(got)
    scale = np.abs(out["auto"]).max()
    err = np.abs(out["fp8"] - out["auto"]).max()
    assert 0 < err < 0.1 * scale, (err, scale)


def test_draft_op_matches_the_layer_loop(toy, rng):
    """The one-token draft steps as the op ``kvjax.ops.draft.draft_steps`` (its float32 reference on this host) and
    as the layer's own ragged steps (``draft_loop``, what a mesh shard runs): the same drafts and pages, on the toy
    with a SWA head with a sink, partial rotary, a hole, a row past its table and a dead row."""
    model, mtp, *_ = toy
    assert mtp.draft_op_reason(model, {}) is None
    assert mtp.draft_op_reason(model, {cache_name("key_scale", mtp.first_layer): None}) == "fp8 pages"
    pages = {k: jnp.asarray(rng.normal(0, 1, v.shape).astype(np.float32))
             for k, v in mtp_lib.init_mtp_caches(mtp, num_pages=NUM_PAGES, page_size=PAGE).items()}
    hkv, max_blocks, b = model.config.attention.num_kv_heads, 3, 4
    tables = rng.permutation(np.arange(1, NUM_PAGES))[:b * hkv * max_blocks].reshape(b, hkv, max_blocks)
    tables[1, 0, 1] = -1
    g = jnp.asarray(rng.normal(0, 1, (b, model.config.hidden_size)).astype(np.float32))
    tok = jnp.asarray(rng.integers(0, model.config.vocab_size, b), jnp.int32)
    p0 = jnp.asarray([4, max_blocks * PAGE - 3, 2 * PAGE - 2, 1], jnp.int32)
    live = jnp.asarray([True, True, True, False])
    args = (model, mtp, pages, g, tok, p0, live, jnp.asarray(tables.astype(np.int32)), 4)
    d_op, p_op = nnx.jit(mtp_lib.draft_op, static_argnums=8)(*args)
    d_loop, p_loop = nnx.jit(mtp_lib.draft_loop, static_argnums=8)(*args)
    np.testing.assert_array_equal(np.asarray(d_op)[:3], np.asarray(d_loop)[:3])
    for name in pages:
        np.testing.assert_allclose(np.asarray(p_op[name]), np.asarray(p_loop[name]), rtol=1e-5, atol=1e-5)
        assert (np.asarray(p_op[name]) != np.asarray(pages[name])).any(), name
