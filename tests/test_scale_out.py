"""Scaling out from the command line (issue 34): the ``tp`` preset, per-device figures, one process per device.

- The ``tp`` preset (a dense Qwen3.5 sized for tensor parallelism) is refused without a GPU (unless ``--force``); its
  full-size head counts split over 2, 4 and 8 model devices; at a tiny width with the same head counts and layer
  pattern its device-drawn weights (:func:`kvjax.models.qwen3_5.init_random_on_device`) give, on one device and on
  the meshes 1x4 and 2x2 (8 CPU devices, a subprocess), the same greedy tokens (f32), and a mesh draws the same
  parameters as the host path's :func:`~kvjax.models.sharding.shard_model` of the one-device model.
- Per-device page use: :func:`kvjax.engine.metrics.device_pages_used` against the pages in the allocators' tables,
  the summary's per-device lists against a direct computation, and the run table's per-device columns.
- Two processes of ``python -m kvjax run --coordinator ...`` (gloo, one CPU device each, a 2x1 mesh) give the
  same tokens as one process on one device; only process 0 writes the JSON.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kvjax.cli.run as cli_run
from kvjax.config import AttentionConfig, CacheConfig
from kvjax.engine.metrics import EngineMetrics, StepRecord, device_pages_used
from kvjax.sched.blocks import BlockAllocator

from helpers.procs import child_env, free_port, pytest_on_cpu_devices, run_processes

INNER = os.environ.get("KVJAX_SCALE_OUT_INNER") == "1"
inner = pytest.mark.skipif(not INNER, reason="runs in the 8-device subprocess of test_tp_preset_on_8_cpu_devices")
HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def tiny_tp() -> cli_run.Preset:
    """The ``tp`` preset's head counts and SWA layout at a tiny width, 4 layers of its pattern, f32."""
    p = cli_run.PRESETS["tp"]
    return dataclasses.replace(p, vocab=97, hidden=32, intermediate=64, layer_types=p.layer_types[:4], head_dim=16,
                               gdn=(p.gdn[0], p.gdn[1], 8, 8), dtype="float32", window=8, sinks=2, page_size=4)


# ---------------------------------------------------------------------------------------------- host parts


def test_tp_preset_is_refused_without_a_gpu(capsys):
    if jax.default_backend() == "gpu":
        pytest.skip("JAX sees a GPU here")
    assert cli_run.main(["--preset", "tp"]) == 2
    assert "--preset tp needs a GPU and JAX sees only cpu devices" in capsys.readouterr().err
    cli_run.check_device("tp", force=True)


@pytest.mark.parametrize("m", [2, 4, 8])
def test_tp_preset_heads_split_over_the_model_axis(m):
    """The full-size model's abstract graph (no weights) accepts a split over ``m`` model devices, each holding
    1/m of the query, KV and GDN heads."""
    from kvjax.models.common.checkpoint import abstract_model
    from kvjax.models.qwen3_5 import Qwen3_5ForCausalLM

    p = cli_run.PRESETS["tp"]
    model = abstract_model(lambda: Qwen3_5ForCausalLM(cli_run.model_config(p), rngs=nnx.Rngs(0),
                                                      dtype=jnp.bfloat16))
    local = model.shard_plan("model", m).local_config
    assert (local.attention.num_q_heads * m, local.attention.num_kv_heads * m) == (p.q_heads, p.kv_heads)
    assert (local.gdn.num_k_heads * m, local.gdn.num_v_heads * m) == p.gdn[:2]


def test_param_bytes_is_what_the_model_holds():
    model = cli_run.build_model(tiny_tp(), seed=1)
    assert cli_run.param_bytes(tiny_tp()) == sum(x.nbytes for x in jax.tree.leaves(nnx.state(model)))


@pytest.mark.parametrize("argv, needle", [
    (["--coordinator", "localhost:1234"], "needs all of --coordinator"),
    (["--num-processes", "2", "--process-id", "0"], "needs all of --coordinator"),
    (["--coordinator", "localhost:1234", "--num-processes", "2", "--process-id", "2"], "--process-id must be < "),
    (["--coordinator", "localhost", "--num-processes", "2", "--process-id", "0"], "must be HOST:PORT"),
    (["--coordinator", "h:1", "--num-processes", "2", "--process-id", "0", "--mesh", "1x3"], "split evenly"),
    (["--local-devices", "0"], "--local-devices needs --coordinator"),
    (["--share", "static"], "--share needs one engine per process"),
    (["--coordinator", "h:1", "--num-processes", "2", "--process-id", "0", "--devices", "2", "--share", "dynamic"],
     "--share needs one engine per process"),
])
def test_multi_process_flags_are_checked_before_any_work(argv, needle, capsys):
    assert cli_run.main(argv) == 2
    assert needle in capsys.readouterr().err


def _allocator(pool: str) -> BlockAllocator:
    att = AttentionConfig(8, 4, 8, window=(4, 0, 4, 0))
    return BlockAllocator(CacheConfig(page_size=2, num_pages=16, max_seqs=3, max_blocks_per_seq=6), att, pool, 2)


class _Sched:
    def __init__(self, blocks: BlockAllocator) -> None:
        self.blocks = blocks


@pytest.mark.parametrize("pool", ["shared", "partitioned"])
def test_device_pages_used_counts_each_device_pool(pool):
    """Two data shards of two model shards each: the pages in use per device equal the distinct pages of the
    tables that fall in each device's range of global page ids, after allocation and after a row is freed."""
    rng = np.random.default_rng(0)
    shards = [_allocator(pool), _allocator(pool)]
    for d, b in enumerate(shards):
        for row in (1, 2):
            b.allocate(row, int(rng.integers(1, 7)) + 3 * d)

    def reference() -> list[int]:
        out = []
        for b in shards:
            pages = np.unique(b.tables[b.tables >= 0])
            out += [int(((pages >= m * 16) & (pages < (m + 1) * 16)).sum()) for m in range(2)]
        return out

    want = reference()
    assert device_pages_used([_Sched(b) for b in shards]) == tuple(want) and sum(want) > 0
    shards[1].free_row(1)
    assert device_pages_used([_Sched(b) for b in shards]) == tuple(reference()) != tuple(want)


def _record(step: int, used: tuple[int, ...], burst: int = 1) -> StepRecord:
    return StepRecord(step=step, num_tokens=4, num_seqs=2, bucket_tokens=8, bucket_rows=2, bucket_blocks=4,
                      decode_only=True, generated=2 * burst, running=2, waiting=0, preemptions=0,
                      pages_used=sum(used), pages_free=40 - sum(used), compiled=False, t_schedule=0.001,
                      t_inputs=0.001, t_dispatch=0.001, t_wait=0.001, t_update=0.001, t_step=0.01, t_exposed=0.0,
                      burst=burst, computed=2 * burst, pages_used_devices=used)


def test_summary_per_device_pages():
    """Per device: the mean over sub-steps (a burst of K weighs K) and the peak; utilisation of an equal share."""
    m = EngineMetrics()
    rows = [((3, 5, 0, 1), 1), ((7, 2, 4, 1), 4), ((1, 9, 2, 2), 2)]
    for i, (used, burst) in enumerate(rows):
        m.append(_record(i, used, burst))
    s = m.summary(num_pages=40)
    used = np.array([u for u, _ in rows], float)
    weights = np.array([b for _, b in rows], float)
    np.testing.assert_allclose(s["pages_used_device_mean"], (used * weights[:, None]).sum(0) / weights.sum())
    assert s["pages_used_device_peak"] == [7, 9, 4, 2]
    np.testing.assert_allclose(s["page_util_device_peak"], np.array([7, 9, 4, 2]) / 10)
    m.append(dataclasses.replace(_record(9, ()), pages_used_devices=()))  # a record without them: no lists
    assert "pages_used_device_mean" not in m.summary(num_pages=40)


def test_run_table_shows_per_device_figures():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    m = EngineMetrics()
    for i, used in enumerate([(3,), (8,)]):
        m.append(_record(i, used))
    s = dict(m.summary(num_pages=10), generated_tokens_per_s_repeats=[5.0], compile_time_s=0.0,
             generated_tokens_per_s_per_device=123.4, pages_per_device=10)
    table = cli_run.format_table({"none": s}, per_device=True)
    assert "tok/s/dev" in table and "123.4" in table and "0.800-0.800" in table
    assert cli_run.device_lines({"none": s}, mesh) == "# none: pages used per device, mean/peak of 10: (0,0) 6/8"


# ---------------------------------------------------------------------------------------------- 8 devices


@pytest.mark.slow
def test_tp_preset_on_8_cpu_devices():
    if INNER:
        pytest.skip("already inside the 8-device run")
    pytest_on_cpu_devices([f"{__file__}::test_tiny_tp_model_on_meshes_equals_one_device"],
                          inner="KVJAX_SCALE_OUT_INNER", devices=8, cwd=HERE)


@inner
def test_tiny_tp_model_on_meshes_equals_one_device():
    from kvjax.engine.engine import Engine
    from kvjax.models.sharding import shard_model

    p = tiny_tp()
    one = cli_run.build_model(p, seed=3)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, p.vocab, int(n)).tolist() for n in rng.integers(5, 30, 5)]
    kw = dict(max_num_batched_tokens=32, token_buckets=(8, 32), row_buckets=(4,), block_buckets=(12,))
    want = Engine(one, CacheConfig(page_size=4, num_pages=96, max_seqs=4, max_blocks_per_seq=12),
                  recycle="timely", **kw).generate(prompts, 6)
    for d, m in [(1, 4), (2, 2)]:
        mesh = jax.sharding.Mesh(np.array(jax.devices()[: d * m]).reshape(d, m), ("data", "model"))
        sharded = cli_run.build_model(p, seed=3, mesh=mesh)
        host = shard_model(one, mesh)  # the host path over the one-device weights: the same placed parameters
        for (path, a), (_, b) in zip(nnx.to_flat_state(sharded.params), nnx.to_flat_state(host.params)):
            assert a.get_value().sharding == b.get_value().sharding, path
            np.testing.assert_array_equal(np.asarray(a.get_value()), np.asarray(b.get_value()), err_msg=str(path))
        cache = CacheConfig(page_size=4, num_pages=96 // m, max_seqs=4, max_blocks_per_seq=12)
        got = Engine(sharded, cache, recycle="timely", **kw).generate(prompts, 6)
        assert got == want, f"mesh {d}x{m}"


# ---------------------------------------------------------------------------------------------- two processes


def test_claims_hand_out_every_chain_once_largest_first():
    """``Claims`` over one counter (a stand-in for the coordinator's): processes claiming in any interleaving get
    every chain exactly once, each process its chains in the order of ``chains`` (largest first, a chain's turns
    together), then ``[]`` for good; a claim without ``wait`` never blocks; an error of the counter reaches the
    caller. ``StaticClaims`` hands out its ``shares`` part once."""
    import itertools
    import threading

    from kvjax.cli.processes import Claims, StaticClaims, share_claims
    from kvjax.sched.dispatch import chains, shares
    from kvjax.sched.workload import multi_turn_workload, seed_workload

    rng = np.random.default_rng(5)
    for workload in (seed_workload(23, scale=0.01, seed=3),
                     multi_turn_workload(7, turns=3, first_len=40, message_len=8, output_len=5, seed=4)):
        order = chains(workload)
        cost = [sum(workload[i].total_len for i in c) for c in order]
        assert cost == sorted(cost, reverse=True) and sorted(i for c in order for i in c) == list(range(len(workload)))
        assert all(workload[i].after in c for c in order for i in c if workload[i].after >= 0)

        def counter():  # a fresh coordinator: the threads of the last workload's claims cannot reach it
            counters: dict[str, itertools.count] = {}
            lock = threading.Lock()

            def increment(key: str, n: int) -> int:
                assert n == 1
                with lock:
                    return next(counters.setdefault(key, itertools.count(1)))
            return increment

        increment = counter()
        procs = [Claims(workload, "none 0", increment) for _ in range(3)]
        got: list[list[list[int]]] = [[], [], []]
        while not all(c.done for c in procs):
            p = int(rng.integers(3))
            chain = procs[p].claim(wait=bool(rng.integers(2)))
            got[p] += [chain] if chain else []
        assert sorted(map(tuple, sum(got, []))) == sorted(map(tuple, order))  # every chain once
        rank = {tuple(c): i for i, c in enumerate(order)}
        assert all([rank[tuple(c)] for c in g] == sorted(rank[tuple(c)] for c in g) for g in got)
        assert all(c.claim(wait=True) == [] for c in procs)
        fresh = Claims(workload, "none 1", increment)  # another key: its own counter
        assert fresh.claim(wait=True) == order[0]
        parts = shares(workload, 3)
        for p in range(3):
            st = StaticClaims(workload, 3, p)
            assert (st.claim(), st.done, st.claim()) == (parts[p], True, [])

    def broken(key: str, n: int) -> int:
        raise ConnectionError("coordinator gone")

    with pytest.raises(ValueError, match="share must be 'dynamic' or 'static', got 'round-robin'"):
        share_claims([], "round-robin", 2)
    assert isinstance(share_claims(seed_workload(3, scale=0.01, seed=3), "static", 2)("x"), StaticClaims)
    with pytest.raises(ConnectionError, match="coordinator gone"):
        Claims(seed_workload(3, scale=0.01, seed=3), "x", broken).claim(wait=True)
    assert Claims([], "x", increment=lambda k, n: 1).done


def test_gather_served_rebuilds_the_workload_order_and_refuses_gaps_and_doubles():
    """``gather_served`` in one process: the requests' tokens in workload order; a request missing or served
    twice is an ``AssertionError`` (the second needs two processes, so only the first is checked here)."""
    from kvjax.cli.processes import gather_served

    served = {2: [7, 8, 9], 0: [1], 1: []}
    assert gather_served(served, 3) == [[1], [], [7, 8, 9]]
    with pytest.raises(AssertionError, match=r"requests \[3\] were served by no process"):
        gather_served(served, 4)


@pytest.mark.parametrize("mesh", [[], ["--share", "static"], ["--devices", "2"]],
                         ids=["one engine per process", "static share", "one mesh"])
@pytest.mark.slow
def test_two_processes_of_the_command_equal_one_process(tmp_path, mesh):
    """Two processes give one process's tokens: each with its own engine on the requests it claims (data parallel,
    the default), or on a share fixed up front, or both on one 2x1 mesh over their devices."""
    if INNER:
        pytest.skip("runs in the main test process")
    run = [sys.executable, "-m", "kvjax", "run", "--requests", "3", "--scale", "0.01", "--repeats", "2",
           "--no-compile-cache"]
    port = free_port()
    logs = run_processes([run + mesh + ["--coordinator", f"localhost:{port}", "--num-processes", "2",
                                        "--process-id", str(i), "--json", str(tmp_path / f"{i}.json")]
                          for i in range(2)], cwd=REPO)
    assert "recycle" in logs[0] and "recycle" not in logs[1]  # only process 0 prints the table
    assert not (tmp_path / "1.json").exists()  # ... and writes the JSON
    two = json.loads((tmp_path / "0.json").read_text())
    env = child_env()
    r = subprocess.run(run + ["--json", "-"], env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    one = json.loads(r.stdout)
    assert (two["processes"], two["mesh"], one["mesh"]) == (2, [2, 1] if "--devices" in mesh else None, None)
    assert two["tokens_digest"] == one["tokens_digest"]
    assert two["results"]["none"]["generated_tokens"] == one["results"]["none"]["generated_tokens"] > 0
    if "--devices" in mesh:
        assert two["results"]["none"]["devices"] == 2
        assert len(two["results"]["none"]["pages_used_device_peak"]) == 2  # one pool per device, each step
    else:  # the figures of both engines, combined
        per = two["results"]["none"]["generated_tokens_per_s_processes"]
        assert len(per) == 2 and all(r >= 0 for r in per) and sum(per) > 0  # dynamic: one may claim all 3
        assert two["results"]["none"]["generated_tokens_per_s"] == pytest.approx(sum(per), rel=1e-5)
        res = two["results"]["none"]
        assert res["wall_tokens_per_s"] > 0 and len(res["wall_s"]) == len(res["wall_net_s"]) == 2
        assert all(0 < n <= w for n, w in zip(res["wall_net_s"], res["wall_s"]))  # less the compiling steps
        assert res["requests_served"] == sum(res["requests_served_processes"]) == 3  # every request, once
        assert "requests), " in logs[0]


def test_device_drawn_weights_follow_the_init_distributions():
    """The hashed draw of ``init_random_on_device``: projections N(0, 1/fan_in), embeddings N(0, 0.02^2), A_log the
    log of U(0.01, 16), dt_bias 1, norms 0, within the sampling error of the sizes drawn; different seeds differ."""
    from kvjax.models.qwen3_5 import init_random_on_device

    config = cli_run.model_config(dataclasses.replace(tiny_tp(), hidden=256, intermediate=512, vocab=1024))
    flat = dict(nnx.to_flat_state(nnx.state(init_random_on_device(config, seed=1, dtype=jnp.float32), nnx.Param)))
    other = dict(nnx.to_flat_state(nnx.state(init_random_on_device(config, seed=2, dtype=jnp.float32), nnx.Param)))
    seen = set()
    for path, var in flat.items():
        x = np.asarray(var.get_value(), np.float64)
        name = str(path[-1])
        if name == "kernel" and x.size > 4096:
            std = 1 / np.sqrt(x.shape[0])
            assert abs(x.mean()) < 5 * std / np.sqrt(x.size) and abs(x.std() / std - 1) < 0.03, path
            assert abs(np.mean(np.abs(x) < std) - 0.6827) < 0.01, path  # normal, not uniform: 68% within 1 std
            assert not np.array_equal(x, np.asarray(other[path].get_value())), path
            seen.add("kernel")
        elif name == "embed_tokens":
            assert abs(x.std() / 0.02 - 1) < 0.03, path
            seen.add("embed")
        elif name == "A_log":
            assert np.log(0.01) <= x.min() and x.max() <= np.log(16) and len(np.unique(x)) == x.size, path
            seen.add("A_log")
        elif name == "dt_bias":
            assert (x == 1).all(), path
    assert seen == {"kernel", "embed", "A_log"}
