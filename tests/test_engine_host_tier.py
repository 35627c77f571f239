"""The prefix cache's host tier in the engine: the jitted copies against numpy, and the engine's tokens with a
host tier equal to those without (float32), with every engine feature on.

Oracles: a numpy replay of the copy log (for :class:`HostStore`), the engine without a host tier and uncached
greedy decoding (for the engine).
"""

from __future__ import annotations

import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from helpers.engine import BUDGET, SMALL, greedy_oracle
from helpers.faults import fail_device_step
from helpers.host_tier import op as _op, random_caches, replay_logs
from helpers.models import MESH_FAMILIES, VOCAB, qwen_swa_model, tiny_deepseek
from helpers.procs import pytest_on_cpu_devices
from kvjax.config import CacheConfig
from kvjax.engine.engine import Engine
from kvjax.engine.host_tier import HostStore, coalesce
from kvjax.models.interface import ModelCaches
from kvjax.models.sharding import shard_model
from kvjax.state.gdn_pool import GDNStatePool


def test_copies_match_a_numpy_replay(rng):
    """Random logs of spills, loads and drops (a load may read a spill of the same log) move exactly the named
    pages and checkpoint slots, in order; the host memory is released once every id is consumed or dropped."""
    P, S = 12, 6
    pages = {"key_caches_1": rng.standard_normal((P, 4, 3)).astype(np.float32),  # roles of several dtypes and
             "value_caches_1": rng.standard_normal((P, 4, 3)).astype(jnp.bfloat16),  # shapes share a packed row
             "key_fp8_caches_3": rng.standard_normal((P, 4, 2)).astype(jnp.float8_e4m3fn),
             "key_scale_caches_3": rng.standard_normal(P).astype(np.float32)}
    conv, ssm = rng.standard_normal((2, S, 5, 3)).astype(jnp.bfloat16), rng.standard_normal((2, S, 2, 2, 2)).astype(
        np.float32)
    caches = ModelCaches(pages={k: jnp.asarray(v) for k, v in pages.items()},
                         gdn=GDNStatePool(conv=jnp.asarray(conv), ssm=jnp.asarray(ssm)))
    replay_logs(HostStore(chunk=2), caches, rng, parts=1, pages=P, slots=S, page_at=lambda d, g: (g,),
                slot_at=lambda d, s: (slice(None), s))


def test_coalesce_joins_groups_only_where_no_page_changes_between(rng):
    """:func:`coalesce`: spills separated by loads of other pages join (an admission's spill, load, the next one's
    spill, load), a spill of a page a load before it wrote stays after that load, adjacent loads to one page stay
    apart, drops go last; the joined groups hold the same copies."""
    o1, i1, o2, i2 = _op("out", [1, 2], [10, 11]), _op("in", [5], [10]), _op("out", [3], [12], [2], [13]), \
        _op("in", [6], [12], [2], [13])
    got = coalesce([o1, i1, o2, _op("drop", (), [11]), i2])
    assert [op.kind for op in got] == ["out", "in", "drop"]
    assert got[0].pages_dev.tolist() == [1, 2, 3] and got[0].pages_host.tolist() == [10, 11, 12]
    assert got[0].ckpts_dev.tolist() == [2] and got[1].pages_dev.tolist() == [5, 6]
    assert got[1].ckpts_dev.tolist() == [2] and got[2].pages_host.tolist() == [11]
    stay = [_op("out", [1], [0]), _op("in", [3], [0]), _op("out", [3], [1]), _op("in", [3], [1])]
    assert [(op.kind, op.pages_dev.tolist()) for op in coalesce(stay)] == \
        [("out", [1]), ("in", [3]), ("out", [3]), ("in", [3])]
    k = int(rng.integers(2, 6))  # k admissions: spill k pages, load k others
    log = [op for j in range(k) for op in (_op("out", [j], [2 * j]), _op("in", [10 + j], [2 * j]))]
    assert [op.kind for op in coalesce(log)] == ["out", "in"]


# ---- the engine with a host tier ----------------------------------------------------------------------------

HOST = 1 << 20  # bytes: far more than the tiny model's cache (the device pool is what runs short)
TURNS, NEW = 3, 4


@pytest.fixture(scope="module")
def qwen():
    return qwen_swa_model()


def conversations(seed: int = 3, n: int = 6) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, int(rng.integers(12, 22))).tolist() for _ in range(n)]


def talk(engine: Engine, first: list[list[int]], seed: int = 4) -> list[list[list[int]]]:
    """``TURNS`` turns of every conversation, one ``generate`` call per turn (more conversations than the device
    cache holds: turn ``t + 1`` finds turn ``t``'s blocks evicted); returns each turn's outputs."""
    rng = np.random.default_rng(seed)
    prompts, turns = first, []
    for _ in range(TURNS):
        out = engine.generate(prompts, NEW)
        turns.append(out)
        prompts = [p + o + rng.integers(0, VOCAB, 3).tolist() for p, o in zip(prompts, out)]
    return turns


@pytest.fixture(scope="module")
def reference(qwen):
    """Tokens of the device-only cache, checked against uncached greedy decoding on the last turn."""
    engine = Engine(qwen, SMALL, recycle="timely", max_num_batched_tokens=BUDGET, prefix_caching=True,
                    decode_burst=1)
    turns = talk(engine, conversations())
    rng, prompts = np.random.default_rng(4), conversations()
    for out in turns[:-1]:
        prompts = [p + o + rng.integers(0, VOCAB, 3).tolist() for p, o in zip(prompts, out)]
    assert turns[-1] == greedy_oracle(qwen, prompts, NEW)
    return turns, engine.metrics.summary()


def finish(engine: Engine) -> None:
    engine.check_integrity()
    engine.clear_prefix_cache()
    assert engine.is_idle() and engine.scheduler.prefix.cached_pages() == 0


@pytest.mark.parametrize("overlap,burst", [(True, 4), (True, 1), (False, 1)], ids=["overlap-burst", "overlap", "sync"])
def test_tokens_equal_the_device_only_cache(qwen, reference, overlap, burst):
    """Same tokens (f32) as without a host tier, with timely recycling, chunked prefill and preemption; later
    turns are served from the host (fewer prompt tokens computed) and the copies are counted."""
    want, device_only = reference
    engine = Engine(qwen, SMALL, overlap=overlap, recycle="timely", max_num_batched_tokens=BUDGET, debug=True,
                    prefix_caching=True, host_cache_bytes=HOST, decode_burst=burst)
    assert talk(engine, conversations()) == want
    s = engine.metrics.summary()
    assert s["prefix_hit_tokens_host"] > 0 and s["host_bytes_out"] > 0 and s["host_bytes_in"] > 0
    assert s["prefill_tokens"] < device_only["prefill_tokens"]
    assert s["prefix_hit_tokens"] == s["prefix_hit_tokens_host"] + s["prefix_hit_tokens_device"]
    assert 0 <= s["copy_share"] < 1 and s["preemptions"] > 0
    assert engine.host_store.stats.pages_in == engine.scheduler.prefix.host.pages_in
    finish(engine)
    assert engine.scheduler.prefix.host.used_bytes == 0 and not engine.host_store.slabs


def test_a_small_host_budget_evicts_and_keeps_the_tokens(qwen, reference):
    want, _ = reference
    engine = Engine(qwen, SMALL, recycle="timely", max_num_batched_tokens=BUDGET, prefix_caching=True,
                    host_cache_bytes=6000, decode_burst=1)
    assert talk(engine, conversations()) == want
    host = engine.scheduler.prefix.host
    assert host.evictions > 0 and host.used_bytes <= host.capacity_bytes
    finish(engine)


def test_aborts_while_blocks_are_in_flight(qwen, reference):
    """Requests aborted right after the step that loaded their blocks from the host (the step still on the
    device in overlap mode) free everything; the others' tokens are unchanged, and the next turn still hits."""
    want, _ = reference
    engine = Engine(qwen, SMALL, recycle="timely", max_num_batched_tokens=BUDGET, prefix_caching=True,
                    host_cache_bytes=HOST, decode_burst=1)
    first = conversations()
    engine.generate(first, NEW)
    rng = np.random.default_rng(4)
    prompts = [p + o + rng.integers(0, VOCAB, 3).tolist() for p, o in zip(first, want[0])]
    ids = [engine.add_request(p, NEW, index=i) for i, p in enumerate(prompts)]
    got = {rid: [] for rid in ids}
    aborted = set()
    while engine.has_unfinished():
        loads = engine.scheduler.prefix.host.pages_in
        outs = engine.step()
        for out in outs:
            if out.request_id not in aborted:
                got[out.request_id] += out.tokens
        if engine.scheduler.prefix.host.pages_in > loads and len(aborted) < 2:
            rid = next(r for r in engine.scheduler.running if r.request_id not in aborted).request_id
            engine.abort(rid)
            aborted.add(rid)
        engine.check_integrity()
    assert aborted
    for i, rid in enumerate(ids):
        if rid not in aborted:
            assert got[rid] == want[1][i]
    finish(engine)


def test_a_fault_inside_the_copies_recovers(qwen, reference, monkeypatch):
    """A load that fails after some of its copies ran (the caches half written) is a fault of the step: the engine
    recovers (caches, scheduler, prefix cache and host tier rebuilt) and gives the tokens of an uninterrupted run."""
    from kvjax.engine import host_tier

    want, _ = reference

    class Injected(Exception):
        pass

    real, calls = host_tier.HostStore._in, []

    def failing(self, caches, op):
        calls.append(1)
        if len(calls) == 2:
            real(self, caches, op)
            raise Injected("a copy failed mid-step")
        return real(self, caches, op)

    monkeypatch.setattr(host_tier.HostStore, "_in", failing)
    engine = Engine(qwen, SMALL, recycle="timely", max_num_batched_tokens=BUDGET, prefix_caching=True,
                    host_cache_bytes=HOST, decode_burst=1)
    with pytest.raises(Injected):
        talk(engine, conversations())
    assert engine.num_recoveries == 1 and engine.scheduler.prefix.host.used_bytes == 0
    assert not engine.host_store.slabs
    monkeypatch.setattr(host_tier.HostStore, "_in", real)
    engine.clear_prefix_cache()
    engine.check_integrity()
    assert talk(engine, conversations()) == want
    finish(engine)


def test_idle_time_beginning_during_the_copies_is_exposed(qwen, reference, monkeypatch):
    """Overlap mode: when the step in flight ends while a plan's copies are being issued, the device idles from
    then on; ``t_exposed`` counts that time (the idleness probe runs between the groups of copies, not only after
    them). Each log's first spill / load waits for the device; every later group of that log sleeps ``NAP``
    first, device idle: the steps' ``t_exposed`` add up to at least the naps."""
    nap, naps, state = 0.02, [], {"groups": 0, "probed": False}
    real_apply = HostStore._apply

    def apply(self, caches, ops, probe=None):
        state.update(groups=0, probed=probe is not None)
        return real_apply(self, caches, ops, probe)

    def group(real):
        def run(self, caches, op):
            if state["groups"] == 0:
                jax.block_until_ready(caches)  # the step in flight ends while the copies are issued
            elif state["probed"]:
                time.sleep(nap)
                naps.append(nap)
            state["groups"] += 1
            return real(self, caches, op)
        return run

    monkeypatch.setattr(HostStore, "_apply", apply)
    monkeypatch.setattr(HostStore, "_in", group(HostStore._in))
    monkeypatch.setattr(HostStore, "_out", group(HostStore._out))
    engine = Engine(qwen, SMALL, overlap=True, recycle="timely", max_num_batched_tokens=BUDGET,
                    prefix_caching=True, host_cache_bytes=HOST, decode_burst=1)
    assert talk(engine, conversations()) == reference[0]
    exposed = sum(r.t_exposed for r in engine.metrics.records)
    assert naps and exposed >= sum(naps), (exposed, len(naps))


def test_host_tier_arguments_are_checked(qwen):
    with pytest.raises(ValueError, match="power of two"):
        HostStore(chunk=3)
    with pytest.raises(ValueError, match="needs prefix_caching=True"):
        Engine(qwen, SMALL, host_cache_bytes=HOST)
    with pytest.raises(ValueError, match="must be an int >= 0"):
        Engine(qwen, SMALL, prefix_caching=True, host_cache_bytes=-1)
    with pytest.raises(ValueError, match="holds no page"):
        Engine(qwen, SMALL, prefix_caching=True, host_cache_bytes=10)
    assert Engine(qwen, SMALL, prefix_caching=True).host_store is None
    assert "host tier of 0.50 GiB" in Engine(qwen, SMALL, prefix_caching=True, host_cache_bytes=1 << 29).describe()


def test_run_command_with_a_host_tier(capsys):
    from kvjax.__main__ import main

    rc = main(["run", "--requests", "4", "--scale", "0.004", "--memory-requests", "1.5", "--no-progress",
               "--prefix-caching", "--host-cache-gb", "0.01", "--repeats", "1"])
    out = capsys.readouterr().out
    assert rc == 0 and "timely+prefix+host" in out and "identical tokens in every run and repeat: yes" in out
    assert main(["run", "--host-cache-gb", "1"]) == 2
    assert "--host-cache-gb needs --prefix-caching" in capsys.readouterr().err


TIER_FILES = tuple(os.path.join(os.path.dirname(os.path.abspath(kvjax.__file__)), f)
                   for f in ("sched/prefix_cache.py", "sched/host_tier.py", "engine/host_tier.py",
                             "engine/host_copies.py", "sched/blocks.py"))


class TierInjected(Exception):
    pass


class TierFault:
    """``sys.settrace``: counts the line events of the host tier's code (the cache's spills and loads, the
    allocator, the store's copies) and raises ``exc`` at the ``at``-th."""

    def __init__(self, at: int | None = None, exc: type[BaseException] = TierInjected) -> None:
        self.at, self.exc, self.events = at, exc, 0

    def __call__(self, frame, event, arg):
        if not frame.f_code.co_filename.startswith(TIER_FILES):
            return None
        if event == "line":
            self.events += 1
            if self.events == self.at:
                raise self.exc(f"injected fault at tier event {self.at}")
        return self


def serve_turns(engine: Engine, fault: TierFault) -> tuple[list[list[list[int]]], int]:
    """:func:`talk` through ``step()`` under ``fault`` (every step traced); returns the turns' outputs and how many
    steps raised."""
    rng, prompts, turns, raised = np.random.default_rng(4), conversations(), [], 0
    for _ in range(TURNS):
        ids = {engine.add_request(p, NEW, index=i): i for i, p in enumerate(prompts)}
        got = [[] for _ in prompts]
        while engine.has_unfinished():
            sys.settrace(fault)
            try:
                outs = engine.step()
            except (TierInjected, KeyboardInterrupt):
                raised, outs = raised + 1, []
            finally:
                sys.settrace(None)
            engine.check_integrity()
            for out in outs:
                assert out.position == len(got[ids[out.request_id]])
                got[ids[out.request_id]] += out.tokens
        turns.append(got)
        prompts = [p + o + rng.integers(0, VOCAB, 3).tolist() for p, o in zip(prompts, got)]
    return turns, raised


def test_a_fault_at_any_line_of_the_tier(qwen, reference):
    """A fault (an exception or ``KeyboardInterrupt``) at sampled line events of the host tier's code, over a run
    that spills and loads: the step re-raises, the engine recovers, and the tokens are an uninterrupted run's
    (``KVJAX_FULL_FAULTS=1``: 40 points instead of 6)."""
    want, _ = reference
    engine = Engine(qwen, SMALL, recycle="timely", max_num_batched_tokens=BUDGET, prefix_caching=True,
                    host_cache_bytes=HOST, decode_burst=4)
    count = TierFault()
    assert serve_turns(engine, count) == (want, 0)
    finish(engine)
    samples = 40 if os.environ.get("KVJAX_FULL_FAULTS") == "1" else 6
    for k, n in enumerate(np.linspace(1, count.events, samples + 2)[1:-1].round().astype(int).tolist()):
        fault = TierFault(n, KeyboardInterrupt if k % 2 else TierInjected)
        got, raised = serve_turns(engine, fault)
        assert got == want, f"a fault at tier event {n} of {count.events} changed the tokens"
        assert raised == 1 or fault.events < n
        finish(engine)
    assert engine.num_recoveries >= samples - 1


def test_the_copies_cause_no_silent_recompilation(qwen):
    """Every backend compilation of a run with a host tier is a traced step shape or a traced copy: the copies'
    committed outputs do not make the step compile again for arguments committed differently."""
    from jax import monitoring

    compiles, counting = [], [True]

    def listen(event, duration, **kw):
        if counting[0] and event == "/jax/core/compile/backend_compile_duration":
            compiles.append(duration)

    monitoring.register_event_duration_secs_listener(listen)
    try:
        engine = Engine(qwen, SMALL, recycle="timely", max_num_batched_tokens=BUDGET, prefix_caching=True,
                        host_cache_bytes=HOST, decode_burst=4)
        compiles.clear()
        talk(engine, conversations())
    finally:
        counting[0] = False
    assert engine.host_store.traces > 0
    assert len(compiles) == engine.num_traces + engine.host_store.traces


def test_deepseek_latent_and_indexer_pages_through_the_host():
    """A model without GDN layers (no checkpoints): its latent and indexer pages spill and come back, and the
    tokens equal the device-only cache's (max_position_embeddings 64 bounds the conversations)."""
    model = tiny_deepseek()
    cache = CacheConfig(page_size=4, num_pages=24, max_seqs=4, max_blocks_per_seq=16)
    kw = dict(max_num_batched_tokens=BUDGET, use_decode_path=False, cache_options={"indexer_fp8": False},
              prefix_caching=True, decode_burst=1)
    first = conversations(seed=8, n=5)
    want = talk(Engine(model, cache, **kw), first)
    engine = Engine(model, cache, host_cache_bytes=HOST, **kw)
    assert talk(engine, first) == want
    s = engine.metrics.summary()
    assert s["prefix_hit_tokens_host"] > 0 and engine.scheduler.prefix.host.ckpts_out == 0
    finish(engine)


# ---- on a mesh: 8 CPU devices in a subprocess ------------------------------------------------------------------

INNER = os.environ.get("KVJAX_HOST_TIER_INNER") == "1"
inner = pytest.mark.skipif(not INNER, reason="runs in the 8-device subprocess of test_host_tier_on_8_cpu_devices")
MESH_RUNS = {"qwen3_5": [((1, 2), True, 1), ((2, 2), True, "auto")],  # (mesh, overlap, decode_burst)
             "deepseek": [((2, 1), False, 1), ((2, 2), True, "auto")]}
MESH_PAGES = {"qwen3_5": 48, "deepseek": 12}  # pages per KV head's pool: short (preemption, evictions)
MESH_CACHE = dict(page_size=4, max_seqs=4, max_blocks_per_seq=12)
MESH_ARGS = dict(max_num_batched_tokens=BUDGET, token_buckets=(16,), row_buckets=(4,), block_buckets=(12,))


def test_host_tier_on_8_cpu_devices():
    if INNER:
        pytest.skip("already inside the 8-device run")
    tests = [f"{__file__}::test_mesh_copies_match_a_numpy_replay", f"{__file__}::test_mesh_engine_with_a_host_tier"]
    pytest_on_cpu_devices(tests, inner="KVJAX_HOST_TIER_INNER", devices=8,
                          cwd=os.path.dirname(os.path.abspath(__file__)))


def _mesh(d: int, m: int) -> jax.sharding.Mesh:
    return jax.sharding.Mesh(np.array(jax.devices()[: d * m]).reshape(d, m), ("data", "model"))


@inner
@pytest.mark.parametrize("family", ["qwen3_5", "deepseek"])
def test_mesh_copies_match_a_numpy_replay(family, rng):
    """On a 2x2 mesh, random logs per data shard move exactly the named pages and checkpoint slots of that shard
    (Qwen3.5: each page in its own model device's pool, a checkpoint's channels over both; DeepSeek: the latent
    pool replicated over ``"model"``), in order, and release the host memory at the end."""
    sharded = shard_model(MESH_FAMILIES[family](), _mesh(2, 2))
    num_pages = 8
    caches = random_caches(sharded.init_caches(num_pages=num_pages, page_size=4, max_seqs=4), rng)
    split = sharded.plan.pages_over_model
    store = HostStore(chunk=2, sharded=sharded)
    slots = 0 if caches.gdn is None else caches.gdn.ssm.shape[2]
    replay_logs(store, caches, rng, parts=2 if split else 1, pages=num_pages, slots=slots,
                page_at=(lambda d, g: (d, g // num_pages, g % num_pages)) if split else (lambda d, g: (d, g)),
                slot_at=lambda d, s: (d, slice(None), s))
    assert store.traces > 0


class MeshInjected(Exception):
    pass


def serve_with_faults(engine: Engine, want: list[list[list[int]]], fault_at: int) -> tuple[list, int]:
    """:func:`talk`'s turns through ``step()`` (each turn's prompts from ``want``, the reference's turns), the
    ``fault_at``-th device step raising :class:`MeshInjected` after its dispatch (recovered from), and request 2
    of turn 1 aborted after its first token. Returns every turn's tokens (the aborted request's cut short) and
    the aborted request's index."""
    fail_device_step(engine, fault_at, MeshInjected)
    rng, prompts, turns, aborted = np.random.default_rng(4), conversations(), [], 2
    for t in range(TURNS):
        ids = {engine.add_request(p, NEW, index=i): i for i, p in enumerate(prompts)}
        got = [[] for _ in prompts]
        while engine.has_unfinished():
            try:
                outs = engine.step()
            except MeshInjected:
                continue
            for out in outs:
                got[ids[out.request_id]] += out.tokens
                if t == 1 and ids[out.request_id] == aborted and len(got[aborted]) == 1:
                    engine.abort(out.request_id)
        engine.check_integrity()
        turns.append(got)
        prompts = [p + o + rng.integers(0, VOCAB, 3).tolist() for p, o in zip(prompts, want[t])]
    return turns, aborted


@inner
@pytest.mark.parametrize("family", ["qwen3_5", "deepseek"])
def test_mesh_engine_with_a_host_tier(family):
    """The host tier on meshes (each data shard's prefix cache with its own tier; pages split over ``"model"`` or
    replicated), with overlap or not, decode bursts, timely recycling (Qwen3.5), preemption, a fault and an abort:
    the tokens of the one-device engine with a device-only cache (float32), later turns served from the host,
    each step shape compiled once, and both tiers empty at the end."""
    model = MESH_FAMILIES[family]()
    recycle = "timely" if family == "qwen3_5" else "none"
    pages = MESH_PAGES[family]
    want = talk(Engine(model, CacheConfig(num_pages=pages, **MESH_CACHE), recycle=recycle, prefix_caching=True,
                       overlap=False, decode_burst=1, **MESH_ARGS), conversations())
    for (d, m), overlap, burst in MESH_RUNS[family]:
        name = f"{family} mesh {d}x{m} overlap={overlap} burst={burst}"
        split = family == "qwen3_5"
        engine = Engine(model, CacheConfig(num_pages=pages // m if split else pages, **MESH_CACHE), mesh=_mesh(d, m),
                        recycle=recycle, prefix_caching=True, host_cache_bytes=HOST, overlap=overlap,
                        decode_burst=burst, debug=True, **MESH_ARGS)
        got, aborted = serve_with_faults(engine, want, fault_at=5)
        for t, (g, w) in enumerate(zip(got, want)):
            for i, (a, b) in enumerate(zip(g, w)):
                assert a == (b[:1] if (t, i) == (1, aborted) else b), f"{name}: turn {t}, conversation {i}"
        s = engine.metrics.summary()
        assert engine.num_recoveries == 1 and s["preemptions"] > 0, (name, s["preemptions"])
        assert s["prefix_hit_tokens_host"] > 0 and s["host_bytes_out"] > 0 and s["host_bytes_in"] > 0, name
        assert engine.num_traces <= 2 * s["shapes"], f"{name}: {engine.num_traces} traces"
        assert ("GiB per data shard" in engine.describe()) == (d > 1), name
        finish(engine)
        assert all(sc.prefix.host.used_bytes == 0 for sc in engine.schedulers) and not engine.host_store.slabs, name


def _tier_worker(process_id: int, port: int, out: str) -> None:
    """One of two processes (``jax.distributed``, 2 CPU devices each) serving :func:`talk` on a global 2x2 mesh
    with a host tier."""
    import json

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_num_cpu_devices", 2)
    jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=2, process_id=process_id)
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))
    engine = Engine(MESH_FAMILIES["qwen3_5"](), CacheConfig(num_pages=MESH_PAGES["qwen3_5"] // 2, **MESH_CACHE),
                    mesh=mesh, recycle="timely", prefix_caching=True, host_cache_bytes=HOST, **MESH_ARGS)
    turns = talk(engine, conversations())
    with open(out, "w") as f:
        json.dump({"turns": turns, "host_hits": engine.metrics.summary()["prefix_hit_tokens_host"]}, f)
    jax.distributed.shutdown()


def test_two_processes_with_a_host_tier_equal_one_device(tmp_path):
    """One 2x2 mesh over two processes (one controller each, as one process per GPU): each process's host tier
    holds its devices' slab parts, and both give the one-device engine's tokens with a device-only cache."""
    import json

    from helpers.procs import free_port, run_processes

    if INNER:
        pytest.skip("runs in the main test process")
    port = free_port()
    run_processes([[sys.executable, __file__, "worker", str(i), str(port), str(tmp_path / f"{i}.json")]
                   for i in range(2)], cwd=os.path.dirname(os.path.abspath(__file__)))
    want = talk(Engine(MESH_FAMILIES["qwen3_5"](), CacheConfig(num_pages=MESH_PAGES["qwen3_5"], **MESH_CACHE),
                       recycle="timely", prefix_caching=True, **MESH_ARGS), conversations())
    for i in range(2):
        got = json.loads((tmp_path / f"{i}.json").read_text())
        assert got["turns"] == want and got["host_hits"] > 0, f"process {i}"


if __name__ == "__main__" and sys.argv[1:2] == ["worker"]:
    _tier_worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
