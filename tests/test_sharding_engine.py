"""The engine on a ``("data", "model")`` mesh (:mod:`kvjax.engine.runner`): same tokens as one device.

On 8 CPU devices (a subprocess with ``XLA_FLAGS=--xla_force_host_platform_device_count=8``, as
``test_sharding.py``), for both families, every configuration of :data:`MATRIX` (overlap x decode bursts x prefix
caching x meshes 1x1, 2x1, 1x2, 2x2: a pairwise cover in CI, all 32 with ``KVJAX_FULL_MATRIX=1``) serves greedy and
sampled requests (f32) with timely SWA recycling (Qwen3.5), preemption (pages short), an abort and a fault, and
gives the synchronous single-device engine's tokens, compiles each step shape once per greedy / sampling mode,
keeps its allocators consistent and holds total / N of the caches per device (total / D for DeepSeek's latent
pages, replicated over ``"model"``). Two processes
(``jax.distributed`` with gloo CPU collectives on a free localhost port, 2 CPU devices each, one 2x2 mesh) give
the same tokens as one process. The host parts (pages per model shard, per-pool validation, refused options)
run in the main process.
"""

from __future__ import annotations

import json
import os
import sys

import jax
import numpy as np
import pytest

from kvjax.config import AttentionConfig, CacheConfig
from kvjax.engine.engine import Engine
from kvjax.inputs import StepInputs
from kvjax.errors import InvalidPlanError
from kvjax.sched.blocks import BlockAllocator
from helpers.engine import step_events
from helpers.faults import fail_device_step
from helpers.models import MESH_FAMILIES, VOCAB, mesh_qwen_model
from helpers.procs import free_port, pytest_on_cpu_devices, run_processes

INNER = os.environ.get("KVJAX_MESH_ENGINE_INNER") == "1"
inner = pytest.mark.skipif(not INNER, reason="runs in the 8-device subprocess of test_mesh_engine_on_8_cpu_devices")
MESHES = [(1, 2), (2, 1), (2, 2), (1, 4)]
NEW, ABORT = 6, 3  # new tokens per request; the request aborted after its third token
PAGES = {"qwen3_5": 24, "deepseek": 6}  # pages per layer on one device (short: preemption); on a mesh / M where
# the heads are split (the same pages per head)
HERE = os.path.dirname(os.path.abspath(__file__))


def _cache(num_pages: int) -> CacheConfig:
    return CacheConfig(page_size=4, num_pages=num_pages, max_seqs=4, max_blocks_per_seq=8)


ENGINE_ARGS = dict(max_num_batched_tokens=16, token_buckets=(16,), row_buckets=(4,), block_buckets=(8,))


def _prompts(vocab: int) -> list[list[int]]:
    """Six prompts of 6-16 tokens; four start with the same 4 tokens (one page), so a second pass hits a prefix
    cache."""
    rng = np.random.default_rng(11)
    system = rng.integers(0, vocab, 4).tolist()
    return [(system if i % 3 else []) + rng.integers(0, vocab, int(n) - (4 if i % 3 else 0)).tolist()
            for i, n in enumerate(rng.integers(6, 17, 6))]


class Injected(Exception):
    pass


def _arm_fault(engine: Engine, at: int) -> None:
    """The ``at``-th device step of ``engine`` raises :class:`Injected` after it was dispatched (its caches
    donated), once."""
    fail_device_step(engine, at, Injected)


def _scenario(engine: Engine, prompts, temperatures=(0.0, 1.0), new: int = NEW) -> dict[int, list[int]]:
    """Every prompt greedy, then every prompt sampled (temperature 1; indices ``n + i``) on the same engine, ``new``
    tokens each;
    the prompt ``ABORT`` of each pass aborted at its third token; an :class:`Injected` fault (if armed) recovered
    from. Returns the tokens per index."""
    out: dict[int, list[int]] = {}
    for temperature in temperatures:
        first = len(out)
        for i, p in enumerate(prompts):
            engine.add_request(p, new, temperature=temperature, seed=3, index=first + i)
            out[first + i] = []
        aborted = False
        while engine.has_unfinished():
            try:
                events = step_events(engine)
            except Injected:
                continue
            cut = False  # the aborted request's later tokens of this same step (speculation) are not kept
            for ev in events:
                if ev.index == first + ABORT and cut:
                    continue
                out[ev.index].append(ev.token)  # a token of a later step after the abort fails the check below
                if ev.index == first + ABORT and ev.position == 2 and not aborted:
                    engine.abort(ev.request_id)
                    aborted = cut = True
        assert aborted and len(out[first + ABORT]) == 3
        engine.check_integrity()
    engine.clear_prefix_cache()
    assert engine.is_idle()
    return out


# ---------------------------------------------------------------------------------------------- host parts


def test_allocator_pages_per_model_shard():
    """shards=2: each head's pages lie in its model shard's range, one free list per shard, page_base maps to
    local ids; recycling a head returns the page to its own shard; partitioned heads stay in their shard."""
    att = AttentionConfig(4, 4, 8, window=(2, 0, 2, 0))
    b = BlockAllocator(CacheConfig(page_size=2, num_pages=8, max_seqs=2, max_blocks_per_seq=4), att, "shared", 2)
    assert b.num_pages == 16 and b.page_base.tolist() == [0, 0, 8, 8] and b.free_pages() == [8, 8]
    b.allocate(1, 6)  # 3 blocks on every head: 6 pages of each shard
    t = b.tables[1, :, :3]
    assert ((t // 8) == np.array([0, 0, 1, 1])[:, None]).all() and b.free_pages() == [2, 2]
    assert b.can_fit(1) and not b.can_fit(2)
    b.free_ranges(np.array([1]), np.array([2]), np.array([0]), np.array([2]))  # head 2 (shard 1) recycles 2
    assert b.free_pages() == [2, 4]
    b.check_integrity()
    local = np.where(b.tables[1] >= 0, b.tables[1] - b.page_base[:, None], -1)
    assert local.max() < 8
    b.free_row(1)
    assert b.free_pages() == [8, 8]
    p = BlockAllocator(CacheConfig(page_size=2, num_pages=8, max_seqs=2, max_blocks_per_seq=4), att, "partitioned", 2)
    p.allocate(1, 4)
    assert ((p.tables[1, :, :2] // 4) == np.arange(4)[:, None]).all() and p.free_pages() == [2, 2, 2, 2]
    p.check_integrity()
    with pytest.raises(ValueError, match="shards must be an int >= 1 dividing num_kv_heads=4"):
        BlockAllocator(CacheConfig(page_size=2, num_pages=8, max_seqs=2, max_blocks_per_seq=4), att, "shared", 3)


def test_validate_pages_unique_per_pool():
    """page_groups: the same local id on heads of two pools is fine; twice in one pool, or past the pool, is not."""
    def inputs(bt):
        sm = np.array([[bt[0, h, 0] * 2 if bt[0, h, 0] >= 0 else -1 for h in range(2)]], np.int32)
        return StepInputs.from_numpy(token_ids=[0], positions=[0], cu_seqlens=[0, 1], seq_lens=[1], gdn_slots=[1],
                                     has_initial_state=[False], block_tables=bt, slot_mapping=sm,
                                     logits_indices=[0])

    same = np.array([[[3], [3]]], np.int32)  # i32[B=1, Hkv=2, 1]: local page 3 on both heads
    kw = dict(num_pages=4, page_size=2, max_slots=2)
    inputs(same).validate(**kw, page_groups=np.array([0, 1]))
    with pytest.raises(InvalidPlanError, match="appear in more than one"):
        inputs(same).validate(**kw, page_groups=np.array([0, 0]))
    with pytest.raises(InvalidPlanError, match="outside"):
        inputs(np.array([[[4], [0]]], np.int32)).validate(**kw, page_groups=np.array([0, 1]))


@pytest.mark.parametrize("mesh", ["2x2", (2, 2), np.zeros((1, 1))])
def test_a_mesh_that_is_not_a_mesh_is_refused(mesh):
    with pytest.raises(ValueError, match="mesh must be a jax.sharding.Mesh"):
        Engine(mesh_qwen_model(), _cache(8), mesh=mesh)


def test_cli_mesh_usage_errors(capsys):
    import kvjax.cli.run as cli_run

    for argv, msg in ((["--mesh", "3"], "--mesh must be DATAxMODEL"), (["--devices", "2", "--mesh", "1x2"], "not both"),
                      (["--mesh", "64x2"], "needs 128 devices")):
        assert cli_run.main(argv) == 2
        assert msg in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- 8 devices


# overlap x decode_burst x prefix caching x mesh: all 32 with KVJAX_FULL_MATRIX=1; in CI a pairwise cover (every
# pair of two factors' levels in some run, each mesh with both levels of each option): 8 runs per family
MATRIX_MESHES = [(1, 1), (2, 1), (1, 2), (2, 2)]
FULL = [(o, b, p, m) for m in MATRIX_MESHES for o in (True, False) for b in (1, "auto") for p in (False, True)]
COVER = [(True, 1, False, (1, 1)), (False, "auto", True, (1, 1)), (True, "auto", True, (2, 1)),
         (False, 1, False, (2, 1)), (True, 1, True, (1, 2)), (False, "auto", False, (1, 2)),
         (True, "auto", False, (2, 2)), (False, 1, True, (2, 2))]
MATRIX = FULL if os.environ.get("KVJAX_FULL_MATRIX") == "1" else COVER


@pytest.mark.parametrize("family", ["qwen3_5", "deepseek"])
@pytest.mark.slow
def test_mesh_engine_on_8_cpu_devices(family):
    if INNER:
        pytest.skip("already inside the 8-device run")
    tests = [f"{__file__}::test_engine_matrix_equals_the_synchronous_engine[{family}]",
             f"{__file__}::test_speculation_on_meshes_equals_plain_decoding[{family}]"]
    if family == "qwen3_5":
        tests += [f"{__file__}::test_mesh_steps_hold_no_zero_sized_array",
                  f"{__file__}::test_bursts_on_meshes_equal_plain_decoding"]
    pytest_on_cpu_devices(tests, inner="KVJAX_MESH_ENGINE_INNER", devices=8, cwd=HERE, timeout=840)


@inner
def test_mesh_steps_hold_no_zero_sized_array():
    """No step of a 2x1 mesh (single steps whose rows fill the token output, and bursts) lowers with a zero-sized
    array. A full-width ``zeros.at[:B].set(tokens)`` lowers to a scatter with an empty index constant, which
    ``shard_map`` passes into the manual computation as a zero-sized operand, and XLA's GPU compile of that
    crashes on two GPUs (the CPU compile does not, so the lowering is what this test reads)."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]).reshape(2, 1), ("data", "model"))
    for burst in (1, 4):
        engine = Engine(mesh_qwen_model(), _cache(PAGES["qwen3_5"]), mesh=mesh, decode_burst=burst, **ENGINE_ARGS)
        step, texts = engine.runner.step, {}

        def lowering_step(caches, buf, prev, layout, greedy_only, step=step, texts=texts):
            if layout not in texts:
                texts[layout] = engine.runner.lower(caches, buf, prev, layout, greedy_only).as_text()
            return step(caches, buf, prev, layout, greedy_only)

        engine.runner.step = lowering_step
        engine.generate(_prompts(VOCAB)[:4], 6)
        assert any(layout.burst == burst for layout in texts), f"burst {burst}: no such step ran"
        for layout, text in texts.items():
            assert "tensor<0x" not in text, f"burst {burst}, {layout.fields[:2]}: a zero-sized array in the step"


@inner
@pytest.mark.parametrize("family", ["qwen3_5", "deepseek"])
def test_engine_matrix_equals_the_synchronous_engine(family):
    """Every configuration of :data:`MATRIX` (overlap, decode bursts, prefix caching, mesh) with greedy and
    sampled requests, an abort, preemption (pages short) and a fault gives the tokens of the synchronous
    single-device engine without bursts or caching, compiles each step shape once per greedy / sampling mode,
    keeps its allocators consistent and holds total / N of the caches per device (total / D for DeepSeek's
    latent pages, replicated over ``"model"``)."""
    model = MESH_FAMILIES[family]()
    prompts = _prompts(VOCAB)
    recycle = "timely" if family == "qwen3_5" else "none"
    one = Engine(model, _cache(PAGES[family]), recycle=recycle, overlap=False, decode_burst=1, **ENGINE_ARGS)
    want = _scenario(one, prompts)
    assert sum(r.preemptions for r in one.metrics.records) > 0
    for overlap, burst, prefix, (d, m) in MATRIX:
        name = f"overlap={overlap} burst={burst} prefix={prefix} mesh {d}x{m}"
        mesh = jax.sharding.Mesh(np.array(jax.devices()[: d * m]).reshape(d, m), ("data", "model"))
        heads_split = family == "qwen3_5"
        engine = Engine(model, _cache(PAGES[family] // m if heads_split else PAGES[family]), mesh=mesh,
                        recycle=recycle, overlap=overlap, decode_burst=burst, prefix_caching=prefix, debug=True,
                        **ENGINE_ARGS)
        _arm_fault(engine, at=4)
        got = _scenario(engine, prompts)
        assert got == want, name
        summary = engine.metrics.summary()
        assert engine.num_recoveries == 1, name
        assert summary["preemptions"] > 0, f"{name}: no preemption"
        assert not prefix or summary["prefix_hit_tokens"] > 0, f"{name}: no prefix hit"
        assert burst == 1 or max(r.burst for r in engine.metrics.records) > 1, f"{name}: no burst"
        assert engine.num_traces <= 2 * summary["shapes"], f"{name}: {engine.num_traces} traces"
        total = sum(x.nbytes for x in jax.tree.leaves(engine.caches))
        share = d * m if engine.sharded.plan.pages_over_model else d
        for dev in mesh.devices.ravel():
            assert engine.sharded.device_nbytes(engine.caches, dev) == total // share


@inner
@pytest.mark.parametrize("family", ["qwen3_5", "deepseek"])
def test_speculation_on_meshes_equals_plain_decoding(family, monkeypatch):
    """A host drafter (K = 2, the rule off: rows draft whenever they can; the oracle drafter of
    ``helpers.spec``, so rows accept 0..K drafts) on 2x1 and 2x2 meshes with prefix caching, timely recycling
    (Qwen3.5), preemption, an abort and a fault: the greedy tokens of the synchronous single-device engine without
    speculation. Every data shard drafts for its own rows; a step where one shard verifies is a verification step
    on every shard (``engine.verify.verification_plans``)."""
    from kvjax.engine import pipeline, verify
    from kvjax.sched.drafter import SpeculativeConfig
    from helpers.spec import OracleDrafter

    filled = []  # steps where a shard without drafts took part in another shard's verification

    def spy(plans):
        filled.append(len({p.draft_len is None for p in plans}) > 1)
        return verify.verification_plans(plans)

    monkeypatch.setattr(pipeline, "verification_plans", spy)
    model = MESH_FAMILIES[family]()
    prompts = _prompts(VOCAB)
    recycle = "timely" if family == "qwen3_5" else "none"
    one = Engine(model, _cache(PAGES[family]), recycle=recycle, overlap=False, decode_burst=1, **ENGINE_ARGS)
    want = _scenario(one, prompts, (0.0,))
    for d, m in ((2, 1), (2, 2)):
        name = f"mesh {d}x{m}"
        mesh = jax.sharding.Mesh(np.array(jax.devices()[: d * m]).reshape(d, m), ("data", "model"))
        drafter = OracleDrafter(prompts, [want[i] for i in range(len(prompts))], 2, seed=d * m)
        engine = Engine(model, _cache(PAGES[family] // m if family == "qwen3_5" else PAGES[family]), mesh=mesh,
                        recycle=recycle, prefix_caching=True, debug=True,
                        speculative=SpeculativeConfig(num_draft_tokens=2, drafter=drafter, flat_tokens=None),
                        **ENGINE_ARGS)
        _arm_fault(engine, at=4)
        assert _scenario(engine, prompts, (0.0,)) == want, name
        s = engine.metrics.summary()
        assert engine.num_recoveries == 1 and s["preemptions"] > 0, name
        assert 0 < s["drafts_accepted"] < s["drafts_proposed"] <= drafter.proposed, (name, s)
        assert any(filled), f"{name}: no step where one data shard verified and another did not"
        filled.clear()


def _period(perm: np.ndarray, x: int) -> int:
    """The length of the cycle of the permutation ``perm`` through ``x``."""
    n, y = 1, int(perm[x])
    while y != x:
        n, y = n + 1, int(perm[y])
    return n


@inner
@pytest.mark.parametrize("method", ["mtp", "ngram"])
def test_bursts_on_meshes_equal_plain_decoding(method):
    """Verification bursts (K = 2, the rule off, decode bursts of 4) drafted by the MTP layer (``"mtp"``: the
    successor model of ``helpers.spec``, whose MTP drafts are mostly accepted; 2x1 and 2x2 meshes, 1x2 passes too,
    left out for time: each mesh compiles its three step shapes) or by the n-gram lookup on the device (``"ngram"``:
    each data shard's rows' histories packed per burst; the 2x2 mesh) with prefix caching (a second pass of the
    same prompts hits it), timely recycling, preemption, an abort and a fault: the greedy tokens of the synchronous
    single-device engine without speculation; drafts accepted, verification bursts ran (on every data shard at
    once), and a step where one data shard verified and the other did not."""
    pytest.importorskip("optax")
    from kvjax.engine import pipeline, verify
    from kvjax.sched.drafter import SpeculativeConfig
    from helpers.spec import successor_model

    filled = []  # steps where a shard without drafts took part in another shard's verification

    def spy(plans):
        filled.append(len({p.draft_len is None for p in plans if p.num_seqs}) > 1)
        return verify.verification_plans(plans)

    rng = np.random.default_rng(3)
    model, task = successor_model(rng)
    starts = rng.integers(1, VOCAB, 3)
    if method == "ngram":  # chains of cycles of at most 8 tokens: the prompts hold a cycle, the lookup finds drafts
        starts = np.array([x for x in range(1, VOCAB) if _period(task.perm, x) <= 8][:3])
    chains = task.chains(np.repeat(starts, 2), 13)
    prompts = [list(map(int, c[:n])) for c, n in zip(chains, (9, 13, 5, 11, 7, 6))]
    new = NEW if method == "mtp" else 14  # n-gram: outputs long enough to repeat the chains' short cycles
    pages = 14 if method == "mtp" else 18  # per KV head on one device: short (preemption)
    one = Engine(model, _cache(pages), recycle="timely", overlap=False, decode_burst=1, **ENGINE_ARGS)
    want = _scenario(one, prompts, (0.0, 0.0), new)  # the second pass hits the prefix cache
    assert sum(r.preemptions for r in one.metrics.records) > 0
    for d, m in ((2, 1), (2, 2)) if method == "mtp" else ((2, 2),):
        name = f"{method}, mesh {d}x{m}"
        mesh = jax.sharding.Mesh(np.array(jax.devices()[: d * m]).reshape(d, m), ("data", "model"))
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(pipeline, "verification_plans", spy)
            engine = Engine(model, _cache(pages // m), mesh=mesh, recycle="timely", prefix_caching=True, debug=True,
                            decode_burst=4, use_decode_path=False,  # one step shape fewer to compile
                            speculative=SpeculativeConfig(method=method, num_draft_tokens=2, flat_tokens=None),
                            **ENGINE_ARGS)
            _arm_fault(engine, at=4)
            assert _scenario(engine, prompts, (0.0, 0.0), new) == want, name
        s = engine.metrics.summary()
        assert engine.num_recoveries == 1 and s["preemptions"] > 0 and s["prefix_hit_tokens"] > 0, (name, s)
        assert 0 < s["drafts_accepted"] <= s["drafts_proposed"], (name, s)
        assert any(r.burst > 1 and r.verify_rows > 0 for r in engine.metrics.records), f"{name}: no verification burst"
        assert any(filled), f"{name}: no step where one data shard verified and another did not"
        filled.clear()


# ---------------------------------------------------------------------------------------------- two processes


def _worker(process_id: int, port: int, out: str) -> None:
    """One of two processes (2 CPU devices each) serving the scenario on a global 2x2 mesh."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_num_cpu_devices", 2)
    jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=2, process_id=process_id)
    assert jax.process_count() == 2 and len(jax.devices()) == 4 and len(jax.local_devices()) == 2
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))
    engine = Engine(mesh_qwen_model(), _cache(PAGES["qwen3_5"] // 2), mesh=mesh, recycle="timely", **ENGINE_ARGS)
    with open(out, "w") as f:
        json.dump(_scenario(engine, _prompts(VOCAB), (1.0,)), f)
    jax.distributed.shutdown()


@pytest.mark.slow
def test_two_processes_equal_one_process(tmp_path):
    if INNER:
        pytest.skip("runs in the main test process")
    port = free_port()
    run_processes([[sys.executable, __file__, "worker", str(i), str(port), str(tmp_path / f"{i}.json")]
                   for i in range(2)], cwd=HERE)
    want = _scenario(Engine(mesh_qwen_model(), _cache(PAGES["qwen3_5"]), recycle="timely", **ENGINE_ARGS), _prompts(VOCAB),
                     (1.0,))
    for i in range(2):
        got = {int(k): v for k, v in json.loads((tmp_path / f"{i}.json").read_text()).items()}
        assert got == want, f"process {i}"


if __name__ == "__main__" and sys.argv[1:2] == ["worker"]:
    _worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
