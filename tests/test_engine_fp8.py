"""fp8 K/V pages through the model and the engine: ``kv_cache_dtype`` (vLLM's name) checked by ``EngineOptions``,
default sizing counting the smaller pages and their scales, the f32 toy Qwen3.5's logits over fp8 caches against
f32 caches (step by step, pages filled over several steps), and greedy tokens through the engine."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kvjax.engine.engine import Engine
from kvjax.engine.options import EngineOptions
from kvjax.engine.step import make_step
from kvjax.inputs import StepInputs

from helpers.engine import greedy_oracle, make_engine, random_prompts
from helpers.models import VOCAB, qwen_swa_model, tiny_deepseek

LOGIT_TOL = 0.05  # max |logit error| / max |logit| of the toy model over fp8 pages (see the logits test)
TOKEN_SHARE = 0.85  # least share of greedy tokens equal to the f32 oracle's (see the greedy test)


def test_kv_cache_dtype_option_is_checked():
    assert EngineOptions().kv_cache_dtype == "auto"
    assert EngineOptions(kv_cache_dtype="fp8_e4m3").kv_cache_dtype == "fp8"
    for bad in ("fp8_e5m2", "float8", None, 8):
        with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
            EngineOptions(kv_cache_dtype=bad)
    with pytest.raises(ValueError, match="kv_cache_dtype as its own setting"):
        EngineOptions(cache_options={"kv_cache_dtype": "fp8"})


def test_a_model_without_fp8_pages_is_refused():
    with pytest.raises(ValueError, match="init_caches takes no kv_cache_dtype"):
        Engine(tiny_deepseek(), kv_cache_dtype="fp8")


def test_default_sizing_counts_fp8_pages_and_scales():
    model = qwen_swa_model()
    a = model.config.attention
    layers = len(model.config.attention_layers)
    fp8 = Engine(model, kv_cache_dtype="fp8", cache_dtype=jnp.bfloat16)  # the same conv state as bf16 pages
    bf16 = Engine(model, cache_dtype=jnp.bfloat16)
    ps = fp8.cache_config.page_size
    assert fp8.cache_sizing.page_bytes == layers * 2 * (ps * a.head_dim + 4)  # K and V: 1 B a value + f32 scale
    assert bf16.cache_sizing.page_bytes == layers * 2 * ps * a.head_dim * 2
    ratio = bf16.cache_sizing.page_bytes / fp8.cache_sizing.page_bytes
    assert ratio > 1.9
    assert fp8.cache_config.num_pages >= int(bf16.cache_config.num_pages * ratio)  # same budget, more pages
    assert fp8.caches.pages["key_caches_1"].dtype == jnp.float8_e4m3fn
    assert fp8.caches.pages["key_scale_caches_1"].shape == (fp8.cache_config.num_pages,)


def _teacher_forced_logits(step, model, caches, tokens, chunks, page_size=4):
    """Logits ``f32[steps, B, vocab]`` of every row's last token per step of ``step`` (:func:`make_step`): row ``b``
    feeds ``tokens[b]`` in chunks ``chunks`` (step sizes, the same for every row), each KV head of each row on its
    own pages (shuffled)."""
    rows, hkv = tokens.shape[0], model.config.attention.num_kv_heads
    max_blocks = -(-tokens.shape[1] // page_size)
    rng = np.random.default_rng(1)
    tables = rng.permutation(rows * hkv * max_blocks).reshape(rows, hkv, max_blocks).astype(np.int32)
    params = nnx.state(model)
    out, done = [], 0
    for n in chunks:
        pos = np.arange(done, done + n)
        slots = (tables[:, :, pos // page_size] * page_size + pos % page_size)  # [B, Hkv, n]
        inputs = StepInputs.from_numpy(
            token_ids=tokens[:, done:done + n].ravel(), positions=np.tile(pos, rows),
            cu_seqlens=np.arange(rows + 1) * n, seq_lens=np.full(rows, done + n),
            gdn_slots=np.arange(1, rows + 1), has_initial_state=np.full(rows, done > 0), block_tables=tables,
            slot_mapping=slots.transpose(0, 2, 1).reshape(rows * n, hkv), logits_indices=np.arange(1, rows + 1) * n - 1)
        logits, caches = step(params, caches, inputs)
        out.append(np.asarray(logits))
        done += n
    return np.stack(out)


def test_logits_over_fp8_pages_against_f32_pages():
    """The f32 toy model (SWA head included) teacher-forced through prefill chunks that end mid-page and then
    decode steps: the logits over fp8 pages stay within LOGIT_TOL of the largest logit of the f32 pages' logits,
    and fp8 pages do change them (so the test would see a broken dequantisation)."""
    chunks = (6, 3, 1, 1, 1, 1, 1, 1, 1)
    step = make_step(nnx.graphdef(qwen_swa_model()))  # one compilation per shape and cache kind for every seed
    for seed in range(2):
        model = qwen_swa_model(seed)
        tokens = np.random.default_rng(seed).integers(0, VOCAB, (3, sum(chunks))).astype(np.int32)
        outs = {}
        for kind in ("auto", "fp8"):
            caches = model.init_caches(num_pages=3 * 2 * 4, page_size=4, max_seqs=3, kv_cache_dtype=kind)
            outs[kind] = _teacher_forced_logits(step, model, caches, tokens, chunks)
        err = np.abs(outs["fp8"] - outs["auto"]).max() / np.abs(outs["auto"]).max()
        assert 0 < err <= LOGIT_TOL, (seed, err)


def test_greedy_tokens_over_fp8_pages_agree_with_the_oracle():
    """The engine (chunked prefill, timely SWA recycling, preemption) with fp8 pages against the uncached f32
    oracle: at least TOKEN_SHARE of the greedy tokens equal the oracle's, position by position (a token after a
    divergence continues another text and counts only where it happens to agree)."""
    same = total = 0
    for seed in range(3):
        model = qwen_swa_model(seed)
        prompts = random_prompts(np.random.default_rng(seed), [5, 19, 9, 30])
        want = greedy_oracle(model, prompts, 12)
        got = make_engine(model, kv_cache_dtype="fp8", eos_token_id=None).generate(prompts, max_new_tokens=12)
        same += sum(int(a == b) for g, w in zip(got, want) for a, b in zip(g, w))
        total += sum(len(w) for w in want)
    assert same / total >= TOKEN_SHARE, (same, total)


def test_run_flag_keeps_the_page_memory(monkeypatch, capsys):
    """``kvjax run --kv-cache-dtype fp8``: the engines get ``kv_cache_dtype="fp8"`` and as many fp8 pages as the
    preset's page memory holds (f32 pages on the cpu preset: 4 bytes a value against 1 plus a scale per page)."""
    import kvjax.cli.run as cli_run

    seen = {}

    class Stop(Exception):
        pass

    def record(model, workload, cache, p, recycle, **kw):
        seen[p.kv_cache_dtype] = cache.num_pages
        raise Stop

    monkeypatch.setattr(cli_run, "build_model", lambda *a, **k: None)
    monkeypatch.setattr(cli_run, "run_policy", record)
    for flag in ([], ["--kv-cache-dtype", "fp8"]):
        with pytest.raises(Stop):
            cli_run.main(["--requests", "2", "--repeats", "1", "--no-compile-cache"] + flag)
    p = cli_run.PRESETS["cpu"]
    assert seen["fp8"] == seen["auto"] * (2 * p.page_size * p.head_dim * 4) // (2 * (p.page_size * p.head_dim + 4))
    assert cli_run.main(["--kv-cache-dtype", "fp8_e5m2"]) == 2
    assert "--kv-cache-dtype" in capsys.readouterr().err
