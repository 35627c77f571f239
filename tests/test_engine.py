"""Engine: continuous batching over the jitted step equals uncached greedy decoding, token for token.

Oracles: greedy decoding by repeated ``model.logits`` on the whole sequence (no cache) for Qwen3.5 with SWA
heads and for DeepSeek-V3.2 (MLA + DSA, top-k below the context length), and Hugging Face ``generate``
(``do_sample=False``) on a tiny random ``Qwen3_5ForCausalLM`` checkpoint. Engine runs use a token budget below
the longest prompt (chunked prefill), a page pool small enough to force preemption by recompute, both recycle
policies and both pool policies. After every run every slot and page is free (``check_integrity``).
Each engine builds and compiles its own device step (``Engine.num_traces`` counts that engine's traces only).
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kvjax.config import CacheConfig
from kvjax.engine.engine import Engine
from kvjax.errors import RequestTooLongError

from helpers.engine import BUDGET, SMALL, assert_idle, greedy_oracle, random_prompts, step_events
from helpers.models import VOCAB, qwen_swa_model, tiny_deepseek_config

@pytest.fixture(scope="module")
def qwen():
    return qwen_swa_model()


@pytest.fixture(scope="module")
def qwen_case(qwen):
    rng = np.random.default_rng(1234)
    prompts = random_prompts(rng, (23, 9, 37, 3, 18, 30))  # longest 37 + 8 > 32 tokens -> 16-block bucket
    return prompts, greedy_oracle(qwen, prompts, 8)


@pytest.mark.parametrize("recycle,pool", [("none", "shared"), ("timely", "shared"), ("timely", "partitioned")])
def test_greedy_engine_matches_uncached_oracle_qwen(qwen, qwen_case, recycle, pool, tmp_path):
    prompts, expect = qwen_case
    assert max(map(len, prompts)) > BUDGET  # chunked prefill is exercised
    engine = Engine(qwen, SMALL, recycle=recycle, pool=pool, max_num_batched_tokens=BUDGET, debug=True)
    got = engine.generate(prompts, 8)
    assert got == expect
    summary = engine.metrics.summary()
    assert summary["preemptions"] > 0  # the small pool forced preemption by recompute
    assert summary["generated_tokens"] == 8 * len(prompts)
    assert summary["running_peak"] >= 2
    assert_idle(engine)
    cols = engine.metrics.to_dict()
    assert all(u + f == SMALL.num_pages for u, f in zip(cols["pages_used"], cols["pages_free"]))
    engine.metrics.to_json(tmp_path / "m.json")
    assert json.loads((tmp_path / "m.json").read_text())["summary"]["generated_tokens"] == 8 * len(prompts)


def test_timely_recycling_frees_pages_and_changes_no_token(qwen, qwen_case):
    """Stepping by hand: with ``timely`` the SWA head's rows get holes (pages returned) while the full head's
    rows never do; with ``none`` no row has a hole. Tokens equal the oracle either way."""
    prompts, expect = qwen_case
    for recycle in ("none", "timely"):
        engine = Engine(qwen, SMALL, recycle=recycle, max_num_batched_tokens=BUDGET)
        ids = [engine.add_request(p, 8, index=i) for i, p in enumerate(prompts)]
        holes = np.zeros(2, np.int64)  # per KV head: (row, block) holes seen below num_blocks
        got = {rid: [] for rid in ids}
        while engine.has_unfinished():
            for ev in step_events(engine):
                got[ev.request_id].append(ev.token)
            blocks = engine.scheduler.blocks
            for req in engine.scheduler.running:
                n = blocks.num_blocks[req.slot]
                holes += (blocks.tables[req.slot, :, :n] == -1).sum(axis=1)
        assert [got[rid] for rid in ids] == expect
        assert holes[1] == 0  # full-attention head: never recycled
        assert (holes[0] > 0) == (recycle == "timely")
        assert_idle(engine)


def test_sampling_is_schedule_independent(qwen):
    """Temperature sampling: keys come from (seed, prompt index, length), so recycling, pool size and
    preemption change no token; another seed changes them."""
    rng = np.random.default_rng(7)
    prompts = random_prompts(rng, (12, 5, 20, 9, 14))
    outs = {}
    for recycle, pool in (("none", "shared"), ("timely", "shared"), ("timely", "partitioned")):
        engine = Engine(qwen, SMALL, recycle=recycle, pool=pool, max_num_batched_tokens=BUDGET,
                        use_decode_path=False)
        outs[recycle, pool] = engine.generate(prompts, 6, temperature=1.0, seed=3)
        outs[recycle, pool, "preemptions"] = engine.metrics.summary()["preemptions"]
        assert_idle(engine)
    runs = [outs[k] for k in (("none", "shared"), ("timely", "shared"), ("timely", "partitioned"))]
    assert runs[0] == runs[1] == runs[2]
    assert outs["none", "shared", "preemptions"] > 0
    assert engine.generate(prompts, 6, temperature=1.0, seed=4) != runs[0]
    greedy = engine.generate(prompts, 6)
    assert greedy != runs[0]
    assert all(0 <= t < VOCAB for o in runs[0] for t in o)


def test_abort_mid_run_and_closed_stream_free_everything(qwen, qwen_case):
    prompts, expect = qwen_case
    engine = Engine(qwen, SMALL, recycle="timely", max_num_batched_tokens=BUDGET)
    got = [[] for _ in prompts]
    aborted = {}
    for ev in engine.stream(prompts, 8):
        got[ev.index].append(ev.token)
        if not aborted:  # prompt 5 is still waiting (4 rows): abort it before it ever runs
            aborted[5] = engine.abort(ev.request_id + 5 - ev.index)
        if ev.index == 1 and ev.position == 2:  # running: abort after its third token
            aborted[1] = engine.abort(ev.request_id)
            engine.check_integrity()
    assert aborted[5] == [] and got[5] == []
    assert got[1] == expect[1][:3] == aborted[1]
    assert [got[i] for i in (0, 2, 3, 4)] == [expect[i] for i in (0, 2, 3, 4)]
    assert_idle(engine)
    with pytest.raises(ValueError, match="unknown request id"):
        engine.abort(10_000)
    stream = engine.stream(prompts, 8)
    next(stream)
    stream.close()  # the caller stops listening: what is left is aborted
    assert_idle(engine)


def test_requests_that_cannot_fit_are_rejected_cleanly(qwen, qwen_case):
    prompts, expect = qwen_case
    engine = Engine(qwen, SMALL, recycle="timely", max_num_batched_tokens=BUDGET)
    too_long = [i % VOCAB for i in range(SMALL.max_seq_len)]  # + 8 new > page_size * max_blocks_per_seq
    with pytest.raises(RequestTooLongError, match="prompt 1 "):
        engine.generate([prompts[0], too_long, prompts[2]], 8)
    assert_idle(engine)  # nothing queued, nothing allocated
    tiny_pool = Engine(qwen, CacheConfig(page_size=4, num_pages=6, max_seqs=4, max_blocks_per_seq=16),
                       max_num_batched_tokens=BUDGET)
    with pytest.raises(RequestTooLongError, match="pages"):  # fits the table, never the pages
        tiny_pool.generate([prompts[2]], 8)
    assert_idle(tiny_pool)
    with pytest.raises(ValueError, match="outside"):
        engine.generate([[1, 2, VOCAB]], 2)
    with pytest.raises(ValueError, match="non-empty"):
        engine.generate([[]], 2)
    with pytest.raises(ValueError, match="temperature"):
        engine.generate([[1, 2]], 2, temperature=-1.0)
    assert_idle(engine)
    assert engine.generate(prompts[:3], 8) == expect[:3]  # still serves after the rejections
    assert_idle(engine)


def test_no_recompilation_after_warmup_over_500_steps(qwen):
    """500 steps with requests arriving and leaving (prefill chunks, decodes, preemptions, two block-table
    buckets): the device step traces only on a step whose (T, B, blocks, decode_only) key is new."""
    engine = Engine(qwen, SMALL, recycle="timely", max_num_batched_tokens=BUDGET)
    rng = np.random.default_rng(11)
    traces0 = engine.num_traces
    added = 0
    while len(engine.metrics) < 500:
        s = engine.scheduler
        while len(s.running) + len(s.waiting) + len(s.preempted) < 6:
            engine.add_request(rng.integers(0, VOCAB, int(rng.integers(1, 40))), int(rng.integers(1, 16)),
                               index=added)
            added += 1
        engine.step()
    while engine.has_unfinished():
        engine.step()
    recs = engine.metrics.records
    keys = [(r.bucket_tokens, r.bucket_rows, r.bucket_blocks, r.decode_only, r.burst > 1) for r in recs]
    first = {k: i for i, k in reversed(list(enumerate(keys)))}
    compiled_at = [i for i, r in enumerate(recs) if r.compiled]
    assert all(first[keys[i]] == i for i in compiled_at)  # never a second trace of a seen shape
    assert engine.num_traces - traces0 == len(compiled_at) <= len(set(keys))
    assert len({r.bucket_blocks for r in recs}) == 2 and len({r.decode_only for r in recs}) == 2
    assert len({r.num_seqs for r in recs}) >= 3 and sum(r.preemptions for r in recs) > 0
    assert_idle(engine)


def test_greedy_engine_matches_uncached_oracle_deepseek():
    from kvjax.models.deepseek import DeepseekV32

    config = tiny_deepseek_config()
    model = nnx.jit(lambda: DeepseekV32(config, rngs=nnx.Rngs(5)))()
    rng = np.random.default_rng(5)
    prompts = random_prompts(rng, (21, 4, 13, 26, 8))
    expect = greedy_oracle(model, prompts, 6)
    cache = CacheConfig(page_size=4, num_pages=14, max_seqs=4, max_blocks_per_seq=8)
    for recycle in ("none", "timely"):
        engine = Engine(model, cache, recycle=recycle, max_num_batched_tokens=BUDGET, use_decode_path=False,
                        cache_options={"indexer_fp8": False})  # f32 indexer keys: the oracle's top-k
        assert engine.generate(prompts, 6) == expect
        assert engine.metrics.summary()["preemptions"] > 0
        assert_idle(engine)


def test_greedy_engine_matches_hf_generate(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from kvjax.models import load_pretrained

    cfg = transformers.Qwen3_5TextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        layer_types=["linear_attention", "full_attention"],
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    hf = transformers.Qwen3_5ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(torch.randn_like(p) * (0.3 if "norm" in name else 0.2))
    hf.save_pretrained(tmp_path / "ckpt")
    model = load_pretrained(tmp_path / "ckpt")
    rng = np.random.default_rng(3)
    prompts = random_prompts(rng, (19, 6, 11))
    new = 6
    expect = []
    with torch.no_grad():
        for p in prompts:
            out = hf.generate(torch.tensor([p]), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
            expect.append(out[0, len(p):].tolist())
    cache = CacheConfig(page_size=4, num_pages=16, max_seqs=2, max_blocks_per_seq=8)
    engine = Engine(model, cache, recycle="timely", max_num_batched_tokens=BUDGET, use_decode_path=False)
    assert engine.generate(prompts, new) == expect
    assert engine.metrics.summary()["preemptions"] > 0
    assert_idle(engine)


def test_run_command_small_workload(tmp_path, capsys):
    """``python -m kvjax run`` end to end on a shrunken workload: table, JSON and PNG written, same tokens."""
    from kvjax.__main__ import main

    js, png = tmp_path / "run.json", tmp_path / "run.png"
    rc = main(["run", "--requests", "4", "--scale", "0.004", "--memory-requests", "1.5", "--json", str(js),
               "--plot", str(png), "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0 and "identical tokens in every run and repeat: yes" in out
    data = json.loads(js.read_text())
    assert data["identical_tokens"] is True
    for name in ("none", "timely"):
        r = data["results"][name]
        assert r["generated_tokens"] == sum(data["steps"][name]["generated"]) > 0
        assert 0 < r["page_util_peak"] <= 1
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["run", "--requests", "0"]) == 2  # bad workload: clear error, exit status 2
    assert main(["run", "--decode-burst", "0"]) == 2


def test_run_command_with_decode_bursts(tmp_path, capsys):
    """``kvjax run --decode-burst 4``: the same tokens as without bursts, fewer steps."""
    from kvjax.__main__ import main

    args = ["run", "--requests", "4", "--scale", "0.004", "--memory-requests", "1.5", "--no-progress"]
    runs = {}
    for burst in ("1", "4"):
        js = tmp_path / f"run{burst}.json"
        assert main(args + ["--decode-burst", burst, "--json", str(js)]) == 0
        runs[burst] = json.loads(js.read_text())
    assert "decode burst 4" in capsys.readouterr().out
    for name in ("none", "timely"):
        one, four = runs["1"]["results"][name], runs["4"]["results"][name]
        assert four["generated_tokens"] == one["generated_tokens"] and four["steps"] < one["steps"]
    assert runs["4"]["identical_tokens"] is True


@pytest.mark.parametrize("kw,match", [
    (dict(max_traces=-1), "max_traces"), (dict(max_traces="2"), "max_traces"), (dict(max_traces=1.5), "max_traces"),
    (dict(max_traces=True), "max_traces"), (dict(debug="no"), "debug must be True or False"),
    (dict(use_decode_path="no"), "use_decode_path must be True or False"), (dict(overlap=1), "overlap"),
    (dict(cache_dtype=jnp.float8_e4m3fn), "cache_dtype"), (dict(cache_dtype="int8"), "cache_dtype"),
    (dict(cache_dtype="not a dtype"), "cache_dtype"), (dict(mesh="2x2"), "mesh must be a jax.sharding.Mesh"),
    (dict(prefix_caching=True, prefix_checkpoints=2**31), "prefix_checkpoints"),
    (dict(prefix_caching=True, prefix_checkpoints=2**30), "caches need"),
    (dict(decode_burst="fast"), "decode_burst"),
])
def test_engine_arguments_are_checked_at_construction(qwen, kw, match):
    """Each bad constructor argument is one clear ValueError before anything is built (they used to be accepted
    and fail at the first generate, or be read as truthy strings)."""
    with pytest.raises(ValueError, match=match):
        Engine(qwen, SMALL, **kw)
