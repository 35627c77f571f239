"""Unit tests of ``kvjax.experiments`` (what the notebooks share): size parameter, simulator sweeps and traces,
the retrieval task, the lossy recycle policy, model surgery (layouts), tour helpers, plots."""

from __future__ import annotations

import numpy as np
import pytest

from kvjax.config import AttentionConfig, CacheConfig
from kvjax.experiments import engine_runs, sweeps, tasks, tour
from kvjax.experiments.size import notebook_size
from kvjax.sched.blocks import BlockAllocator
from kvjax.sched.simulate import simulate
from kvjax.sched.workload import RequestSpec


# ---------------------------------------------------------------------------------------------- size


def test_notebook_size(monkeypatch):
    monkeypatch.delenv("KVJAX_NB_SIZE", raising=False)
    assert notebook_size() == "small"
    monkeypatch.setenv("KVJAX_NB_SIZE", "GPU")
    size = notebook_size()
    assert size == "gpu" and size.pick(small=1, gpu=2) == 2
    assert notebook_size("small").pick(small=1, gpu=2) == 1
    with pytest.raises(ValueError, match="KVJAX_NB_SIZE"):
        notebook_size("huge")


# ---------------------------------------------------------------------------------------------- sweeps


def _tiny_setup(rng) -> sweeps.SimSetup:
    wl = tuple(RequestSpec(rng.integers(1, 500, int(rng.integers(200, 400)), dtype=np.int32),
                           int(rng.integers(60, 120))) for _ in range(10))
    cache = CacheConfig(page_size=16, num_pages=4 * 80, max_seqs=16, max_blocks_per_seq=40)
    return sweeps.SimSetup(wl, cache, kv_heads=4, max_num_batched_tokens=128)


def test_trace_simulation_matches_simulator(rng):
    import dataclasses

    setup = _tiny_setup(rng)
    cfg = dict(swa_fraction=0.5, window=64, sinks=4, pool="shared")
    for recycle in ("none", "timely"):
        tr = sweeps.trace_simulation(setup, **cfg, recycle=recycle)
        res = dataclasses.asdict(simulate(list(setup.workload), setup.cache, setup.attention(0.5, 64, 4),
                                          max_num_batched_tokens=setup.max_num_batched_tokens, pool="shared",
                                          recycle=recycle))
        assert tr["row"].keys() == res.keys()
        for k, v in res.items():
            assert tr["row"][k] == pytest.approx(v) if isinstance(v, float) else tr["row"][k] == v, k
        assert len(tr["generated"]) == res["steps"]
        assert tr["generated"].sum() == sum(w.max_new_tokens for w in setup.workload)
        assert tr["running"].max() == res["peak_concurrency"] and tr["preemptions"][-1] == res["preemptions"]
        assert res["tokens_per_step"] <= res["bound_tokens_per_step"] + 1e-9
        sim = sweeps.SimSweep(setup)
        row = sim.trace(**cfg, recycle=recycle)["row"]
        assert row == {k: v for k, v in sim.run(**cfg, recycle=recycle).items() if k in row}  # memoised


def test_sim_sweep_rows_gains_and_memo(rng):
    setup = _tiny_setup(rng)
    sim = sweeps.SimSweep(setup)
    base = dict(swa_fraction=1.0, window=64, sinks=4, pool="shared")
    rows = sim.sweep("swa_fraction", [0.5, 1.0], base)
    assert [(r["value"], r["recycle"]) for r in rows] == [(0.5, "none"), (0.5, "timely"), (1.0, "none"),
                                                         (1.0, "timely")]
    n05, t05, n10, t10 = rows
    assert n05["tokens_per_step"] == n10["tokens_per_step"]  # none does not depend on the layout
    assert n05["swa_fraction"] == 0.5 and n10["swa_fraction"] == 1.0
    for n, t in ((n05, t05), (n10, t10)):
        assert n["gain"] == 1.0 and np.isclose(t["gain"], t["tokens_per_step"] / n["tokens_per_step"])
        assert np.isclose(t["bound_gain"], t["bound_tokens_per_step"] / n["bound_tokens_per_step"])
    # independent check of one timely row against the simulator
    direct = simulate(list(setup.workload), setup.cache, setup.attention(0.5, 64, 4),
                      max_num_batched_tokens=128, pool="shared", recycle="timely")
    assert t05["tokens_per_step"] == direct.tokens_per_step and t05["steps"] == direct.steps
    assert sweeps.select(rows, recycle="timely") == [t05, t10]
    table = sweeps.format_rows(rows)
    assert len(table.splitlines()) == 2 + len(rows)
    with pytest.raises(ValueError, match="vary"):
        sim.sweep("page_size", [1], base)
    with pytest.raises(ValueError, match="lacks"):
        sim.sweep("window", [1], dict(pool="shared"))


def test_long_prompt_workload(rng):
    wl = engine_runs.long_prompt_workload(20, prompt=(5, 9), output=(2, 3), vocab=50, seed=3)
    assert len(wl) == 20
    assert all(5 <= w.prompt.size <= 9 and 2 <= w.max_new_tokens <= 3 for w in wl)
    assert all(w.prompt.min() >= 1 and w.prompt.max() < 50 for w in wl)
    with pytest.raises(ValueError):
        engine_runs.long_prompt_workload(3, prompt=(9, 5), output=(2, 3), vocab=50)


# ---------------------------------------------------------------------------------------------- task


def test_retrieval_task_sample_is_consistent(rng):
    task = tasks.RetrievalTask(length=40, num_pairs=3, num_queries=3)
    x, t, m, dist = task.sample(rng, 64)
    assert x.shape == t.shape == m.shape == (64, 40) and dist.shape == (64, 3)
    assert (x[:, 0] == 0).all() and (t[:, :-1] == x[:, 1:]).all()
    c = task.context
    for i in range(64):
        row = x[i]
        store = np.flatnonzero((row >= task.store0) & (row < task.query0))
        assert len(store) == 3 and store.max() <= c
        keys = (row[store] - task.store0) // task.num_values
        vals = (row[store] - task.store0) % task.num_values
        assert len(set(keys.tolist())) == 3
        qpos = np.flatnonzero(m[i])
        assert (qpos == c + 1 + 2 * np.arange(3)).all()
        for j, p in enumerate(qpos):
            k = row[p] - task.query0
            where = store[keys == k]
            assert len(where) == 1
            assert t[i, p] == task.answer0 + vals[keys == k][0]
            assert dist[i, j] == p - where[0]
    prompts, answers, d = task.eval_set(rng, 16)
    assert prompts.shape == (16, c + 2) and answers.shape == d.shape == (16,)
    assert ((answers >= task.answer0) & (answers < task.vocab_size)).all()
    with pytest.raises(ValueError):
        tasks.RetrievalTask(num_pairs=9, num_keys=8)
    with pytest.raises(ValueError):
        tasks.RetrievalTask(length=10, num_pairs=4, num_queries=4)


def test_accuracy_by_distance(rng):
    correct = rng.random(200) < 0.6
    distance = rng.integers(0, 50, 200)
    edges = np.array([0, 10, 25, 50, 60])
    acc = tasks.accuracy_by_distance(correct, distance, edges)
    for i in range(3):
        sel = (distance >= edges[i]) & (distance < edges[i + 1])
        assert acc[i] == pytest.approx(correct[sel].mean())
    assert np.isnan(acc[3])


def _allocated(rng, *, heads=3, page=4, rows=4, max_blocks=12):
    att = AttentionConfig(heads, heads, 8, window=(0, 6, 6)[:heads], sinks=(0, 2, 2)[:heads])
    cache = CacheConfig(page_size=page, num_pages=heads * rows * max_blocks, max_seqs=rows,
                        max_blocks_per_seq=max_blocks)
    blocks = BlockAllocator(cache, att, "shared")
    lens = rng.integers(1, page * max_blocks, rows)
    for r in range(rows):
        blocks.allocate(r + 1, int(lens[r]))
    return blocks, np.arange(1, rows + 1), lens


@pytest.mark.parametrize("keep,heads,sinks", [(1, None, 0), (5, None, 3), (8, (1,), 0), (3, (0, 2), 6)])
def test_evict_early_frees_exactly_the_old_blocks(rng, keep, heads, sinks):
    blocks, rows, lens = _allocated(rng)
    before = blocks.tables.copy()
    policy = tasks.EvictEarly(keep, heads=heads, sinks=sinks)
    freed = policy.recycle(blocks, rows, lens)
    blocks.check_integrity()
    page = blocks.page_size
    chosen = set(range(blocks.num_heads)) if heads is None else set(heads)
    expect_freed = 0
    for r, L in zip(rows, lens):
        for h in range(blocks.num_heads):
            for b in range(blocks.num_blocks[r]):
                # oracle: every position of block b is older than keep for a query at L, no sink, not L's block
                old = (b + 1) * page - 1 < L - keep + 1 and b * page >= sinks and b < L // page
                gone = h in chosen and old
                assert (blocks.tables[r, h, b] == -1) == gone, (r, h, b, L)
                expect_freed += gone and before[r, h, b] >= 0
    assert freed == expect_freed
    assert policy.recycle(blocks, rows, lens) == 0  # idempotent: the cursor skips handled blocks
    with pytest.raises(ValueError):
        tasks.EvictEarly(0)


def test_evict_early_rejects_non_int_sinks():
    """A float sink count would be truncated by the int64 cast in free_blocks_before; it must raise instead."""
    for bad in (2.5, -1, True):
        with pytest.raises(ValueError, match="sinks must be an int >= 0"):
            tasks.EvictEarly(4, sinks=bad)


# ---------------------------------------------------------------------------------------------- model surgery


def _jit_logits(model, ids):
    import jax
    from flax import nnx

    graphdef, params = nnx.split(model)
    return np.asarray(jax.jit(lambda p, x: nnx.merge(graphdef, p).logits(x))(params, ids))


def test_layout_keeps_the_function_within_the_window(rng):
    import jax.numpy as jnp

    task = tasks.RetrievalTask(length=24, num_pairs=2, num_queries=2)
    model = tasks.task_model(task, window=(4, 0), sinks=(1, 0), hidden=16, seed=int(rng.integers(1000)))
    ids = jnp.asarray(rng.integers(0, task.vocab_size, (2, 24)), jnp.int32)
    ref = _jit_logits(model, ids)
    full = tasks.with_layout(model, window=(0, 0), sinks=(0, 0))
    assert full.config.attention.window == (0, 0)
    out = _jit_logits(full, ids)
    np.testing.assert_allclose(out[:, :4], ref[:, :4], rtol=0, atol=1e-5)  # masks agree within the window
    assert np.abs(out - ref).max() > 1e-4  # and differ once the SWA head's window excludes keys


# ---------------------------------------------------------------------------------------------- tour + plots


def test_paged_swa_batch_holes_follow_the_rule(rng):
    window, sinks, page = (0, 8, 8, 0), (0, 2, 2, 0), 4
    tables, lens = tour.paged_swa_batch(rng, seq_lens=(37, 22, 9), window=window, sinks=sinks, page_size=page,
                                       num_pages=96)
    used = tables[tables >= 0]
    assert len(np.unique(used)) == len(used)
    for b, n in enumerate(lens):
        for h in range(4):
            for blk in range(-(-int(n) // page)):
                hole = window[h] > 0 and blk * page >= sinks[h] and (blk + 1) * page <= n - 1 - window[h] + 1
                assert (tables[b, h, blk] == -1) == hole


def test_compare_impls_paged_attention(rng):
    case = next(c for c in tour.op_cases(rng) if c.op == "paged_attention")
    rows = tour.compare_impls(case)
    assert [r["impl"] for r in rows][0] == "reference"
    assert "pallas:interpret" in [r["impl"] for r in rows]
    assert all(r["max_abs_diff"] < 1e-4 and r["error"] == "" for r in rows)


def test_compare_impls_reports_missing_backend(rng):
    import jax.numpy as jnp

    value = jnp.asarray(rng.standard_normal(5), jnp.float32)

    def run(impl):
        if impl == "reference":
            return value
        raise ImportError("no module named jax_triton")

    rows = tour.compare_impls(tour.OpCase("paged_attention", "-", run))
    assert rows[0]["impl"] == "reference" and rows[0]["max_abs_diff"] == 0.0
    assert all(np.isnan(r["max_abs_diff"]) and "jax_triton" in r["error"] for r in rows[1:]) and len(rows) > 1


def test_benchmark_scripts_lists_files(tmp_path):
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "b.py").write_text('"""Times things.\n\nUsage: ``python benchmarks/b.py``\n"""\n')
    assert tour.benchmark_scripts(tmp_path) == [
        {"script": "benchmarks/b.py", "what": "Times things.", "usage": "Usage: ``python benchmarks/b.py``"}]


def test_plots_draw_given_numbers(rng):
    import matplotlib

    matplotlib.use("Agg")
    from kvjax.experiments import plots

    rows = [dict(value=v, pool="shared", recycle=r, tokens_per_step=float(rng.random()),
                 bound_tokens_per_step=1.0, peak_concurrency=int(rng.integers(1, 9)))
            for v in (0.5, 1.0) for r in ("none", "timely")]
    fig = plots.sweep_figure(rows, vary="swa_fraction", xlabel="x")
    a = fig.axes[0]
    assert len(a.lines) == 4
    np.testing.assert_allclose(a.lines[0].get_ydata(), [r["tokens_per_step"] for r in rows if r["recycle"] == "none"])
    tr = {"none": dict(pages_used=rng.integers(0, 10, 7), running=rng.integers(0, 3, 7), num_pages=10)}
    assert len(plots.pages_figure(tr).axes) == 2
    tables, lens = tour.paged_swa_batch(rng, seq_lens=(13, 7), window=(0, 4), sinks=(0, 0), page_size=2)
    fig = plots.block_table_figure(tables, lens, page_size=2, window=(0, 4), sinks=(0, 0))
    assert len(fig.axes) == 3  # two sequences + colour bar
    fig = plots.accuracy_figure({"none": 1.0, "evict": 0.5}, {"evict": np.array([1.0, 0.2])}, np.array([0, 5, 10]),
                                chance=0.1)
    assert [round(p.get_height(), 3) for p in fig.axes[0].patches] == [1.0, 0.5]


def test_max_abs_diff_handles_masked_infinities():
    """Scores masked with -inf on both sides agree (0); an inf on one side only, or a NaN, is a difference."""
    a = np.array([[1.0, -np.inf], [0.5, 2.0]])
    assert tour._max_abs_diff(a, a.copy()) == 0.0
    assert tour._max_abs_diff(a, a + 0.25 * np.isfinite(a)) == 0.25
    b = a.copy()
    b[0, 1] = 3.0
    assert tour._max_abs_diff(a, b) == np.inf
    b[0, 1] = np.nan
    assert tour._max_abs_diff(a, b) == np.inf
