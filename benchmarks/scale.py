"""Scaling out on one machine of G devices (issue 34): data parallel, tensor parallel, one process per device,
DeepSeek on a mesh; tok/s, ms per step, ratios to one device and tokens equality, as one JSON.

Usage (repo root)::

    python benchmarks/scale.py --out OUT/scale.json                   # G = every device JAX sees
    python benchmarks/scale.py --only tp,profile --gpus 2               # some sections, 2 of the devices
    python benchmarks/scale.py --only tp,profile --gpus 1               # the tp model on one device, profiled
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/scale.py --smoke   # CPU, small sizes

Sections (``--only``, default all, in this order):

- ``dp``: ``kvjax run``'s workload of the ``gpu`` preset with G times its requests (``--smoke``: ``cpu``, cut down),
  both recycle policies, on one device and on ``--devices G`` (a ``Gx1`` mesh, the same pages per device), in this
  process
  (:func:`kvjax.cli.run.run_policy`, the command's own code): tok/s (median over ``--repeats``), per device, the
  ratio to one device and whether the tokens equal one device's.
- ``procs``: the same workload served by G processes of ``python -m kvjax run --coordinator ...`` started by this
  script, one engine per process on its own device (``--local-devices i`` on GPUs) and its share of the requests
  (one run per ``--share`` mode: ``dynamic``, claimed while running, and / or ``static``, split up front): tok/s
  (summed, and ``wall_tokens_per_s``: all tokens over the slowest process's wall less its compiling steps) against
  one device and the single-controller run, its tokens (digest) against theirs.
- ``tp``: the ``tp`` preset's model (a dense 3.7B Qwen3.5, bf16; ``--smoke``: its head counts at a tiny width, f32)
  in steady decode at ``--rows`` rows (64), ``recycle="timely"``, 512-token prompts, the engine's default decode
  bursts: one device, ``--mesh 1xG`` (tensor parallel; ``auto``'s all-reduce, XLA's ``psum`` as ``1xG psum`` and, for
  G > 2, the one-shot kernel as ``1xG mosaic``) and ``--mesh Gx1`` (data parallel, rows / G per device): ms
  per decode sub-step (wall over ``--steps`` steps), tok/s, ratio to one device, whether every row's first tokens
  equal one device's (bf16: they may not).
- ``profile``: a trace of ``--profile-steps`` decode steps of the ``tp`` runs named by ``--profile`` (default
  ``1xG``; also ``one``, ``1xG psum``, ``1xG mosaic``, ``Gx1``), written under ``--trace-dir`` and summed by kernel
  class (``trace_kernels.py``: collectives vs GEMMs vs the rest) per GPU and per step, with the collectives'
  share. Without ``tp`` in ``--only`` only the traced runs are built. No device records on CPU (the trace is
  written, the classes empty).
- ``allreduce``: the op ``all_reduce`` over a ``1xG`` mesh at 16 to 4096 rows of 4096 bf16 (and 64 rows of f32)
  a device, XLA's ``psum`` and the one-shot Mosaic GPU kernel (where it runs): per GPU the device time of a sum in
  a chain of them, the error against numpy, whether every device holds the same bits.
- ``deepseek``: a small DeepSeek-V3.2 (MLA + DSA, f32) on ``1x2`` and ``2x1``: greedy and sampled tokens against
  one device's.

Each section's figures are written to ``--out`` as soon as it ends. A section that kills the process (an XLA
crash) takes the later ones with it: run such sections in separate invocations.

The model weights of ``tp`` are drawn on the devices (:func:`kvjax.models.qwen3_5.init_random_on_device`),
the same values on every mesh. The persistent compilation cache is on (``--compile-cache``, default a folder of
the output's) so engines of the same shapes (``none`` and ``timely``) compile once; the processes of ``procs``
compile apart.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path[:0] = [HERE, REPO]

SECTIONS = ("dp", "procs", "tp", "profile", "allreduce", "deepseek")
TP_PROMPT = 512  # tokens each decoding row has before the timed steps


def _mesh(d: int, m: int):
    import jax
    import numpy as np

    return jax.sharding.Mesh(np.array(jax.devices()[: d * m]).reshape(d, m), ("data", "model"))


def _release() -> None:
    """Drop what the previous configuration left (engines, models): its device memory goes back."""
    gc.collect()


# ---------------------------------------------------------------------------------------------- dp


def dp_preset(smoke: bool):
    from kvjax.cli.run import PRESETS

    return dataclasses.replace(PRESETS["cpu"], requests=4, scale=0.01) if smoke else PRESETS["gpu"]


def dp_requests(g: int, smoke: bool) -> int:
    """Requests of the data-parallel runs: the preset's per device (G devices serve G times the work of one, and
    one device serves the same workload at its own concurrency)."""
    return dp_preset(smoke).requests * g


def dp_section(g: int, repeats: int, smoke: bool) -> dict:
    """Both policies on one device and on a ``Gx1`` mesh: the rows, and each mesh run's tokens per policy."""
    from kvjax.cli.run import build_model, run_policy, tokens_digest
    from kvjax.sched.workload import cache_for, seed_workload

    p = dataclasses.replace(dp_preset(smoke), requests=dp_requests(g, smoke))
    workload = seed_workload(p.requests, scale=p.scale, vocab=p.vocab, seed=0)
    cache = cache_for(workload, num_kv_heads=p.kv_heads, page_size=p.page_size, full_requests=p.memory_requests,
                      max_seqs=p.max_seqs)
    model = build_model(p)
    rows, base = [], {}
    for devices in (1, g):
        mesh = None if devices == 1 else _mesh(devices, 1)
        for recycle in ("none", "timely"):
            out, s, _ = run_policy(model, workload, cache, p, recycle, progress=False, mesh=mesh, repeats=repeats,
                                   name=f"{recycle} x{devices}")
            if devices == 1:
                base[recycle] = (s["generated_tokens_per_s"], out)
            rate, one = base[recycle]
            rows.append(dict(run=f"{'one device' if devices == 1 else f'--devices {devices}'} {recycle}",
                             recycle=recycle, devices=devices, tokens_per_s=s["generated_tokens_per_s"],
                             tokens_per_s_repeats=s["generated_tokens_per_s_repeats"],
                             wall_tokens_per_s=s["wall_tokens_per_s"],
                             tokens_per_s_per_device=s["generated_tokens_per_s_per_device"],
                             ms_per_step=1e3 * s["step_time_median_s"], host_share=s["host_share"],
                             tokens_per_step=s["generated_tokens_per_step"], ratio=s["generated_tokens_per_s"] / rate,
                             identical_to_one_device=out == one, tokens_digest=tokens_digest(out),
                             pages_per_device=s["pages_per_device"],
                             page_util_device_peak=s.get("page_util_device_peak"),
                             compile_s=s["compile_time_s"]))
            _print(rows[-1])
    return {"preset": "cpu (smoke)" if smoke else "gpu", "rows": rows}


# ---------------------------------------------------------------------------------------------- procs


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def procs_section(g: int, repeats: int, smoke: bool, dp: dict | None, workdir: str,
                  share: str = "dynamic") -> dict:
    """G processes of ``kvjax run --share SHARE`` on one device each (``Gx1``): tok/s and tokens against the single
    controller."""
    import jax

    argv = (["--preset", "cpu", "--scale", "0.01"] if smoke else ["--preset", "gpu"]) + ["--requests",
                                                                                   str(dp_requests(g, smoke))]
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one CPU device per process
    env["PYTHONPATH"] = os.pathsep.join([REPO, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    gpu = jax.default_backend() == "gpu"
    procs, logs = [], []
    t0 = time.perf_counter()
    for i in range(g):
        cmd = [sys.executable, "-m", "kvjax", "run", *argv, "--repeats", str(repeats), "--no-compile-cache",
               "--share", share,
               "--coordinator", f"localhost:{port}", "--num-processes", str(g), "--process-id", str(i),
               "--json", os.path.join(workdir, f"procs_{i}.json")] + (["--local-devices", str(i)] if gpu else [])
        log = open(os.path.join(workdir, f"procs_{i}.log"), "w")  # a file, not a pipe: no process blocks on it
        procs.append(subprocess.Popen(cmd, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, text=True))
    try:
        for p in procs:
            p.wait(timeout=540)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        logs = [open(os.path.join(workdir, f"procs_{i}.log")).read() for i in range(g)]
    wall = time.perf_counter() - t0
    codes = [p.returncode for p in procs]  # 1: the runs' tokens differ (bf16: none vs timely may), still measured
    if codes[0] not in (0, 1) or not os.path.exists(os.path.join(workdir, "procs_0.json")):
        return {"ok": False, "returncodes": codes, "log_tail": logs[0][-3000:] if logs else ""}
    doc = json.load(open(os.path.join(workdir, "procs_0.json")))
    single = {r["recycle"]: r for r in (dp or {}).get("rows", []) if r["devices"] == g}
    one = {r["recycle"]: r for r in (dp or {}).get("rows", []) if r["devices"] == 1}
    rows = []
    for recycle in ("none", "timely"):
        s = doc["results"][recycle]
        sc, od = single.get(recycle), one.get(recycle)
        rows.append(dict(run=f"{g} processes ({share}) {recycle}", recycle=recycle, devices=g, share=share,
                         tokens_per_s=s["generated_tokens_per_s"],
                         tokens_per_s_repeats=s["generated_tokens_per_s_repeats"],
                         tokens_per_s_processes=s.get("generated_tokens_per_s_processes"),
                         requests_served_processes=s.get("requests_served_processes"),
                         wall_tokens_per_s=s.get("wall_tokens_per_s"),
                         wall_ratio=s["wall_tokens_per_s"] / od["wall_tokens_per_s"]
                         if od and s.get("wall_tokens_per_s") else None,
                         ms_per_step=1e3 * s["step_time_median_s"], host_share=s["host_share"],
                         vs_single_controller=s["generated_tokens_per_s"] / sc["tokens_per_s"] if sc else None,
                         ratio=s["generated_tokens_per_s"] / od["tokens_per_s"] if od else None,
                         identical_to_single_controller=(doc["tokens_digest"][recycle] == sc["tokens_digest"])
                         if sc else None,
                         identical_to_one_device=(doc["tokens_digest"][recycle] == od["tokens_digest"]) if od else None))
        _print(rows[-1])
    return {"ok": all(c in (0, 1) for c in codes), "returncodes": codes, "identical_tokens": doc["identical_tokens"],
            "wall_s": wall, "rows": rows}


# ---------------------------------------------------------------------------------------------- tp


def tp_preset(smoke: bool):
    from kvjax.cli.run import PRESETS

    p = PRESETS["tp"]
    if smoke:  # its head counts and SWA layout at a tiny width, 4 layers of its pattern
        p = dataclasses.replace(p, vocab=97, hidden=32, intermediate=64, layer_types=p.layer_types[:4], head_dim=16,
                                gdn=(p.gdn[0], p.gdn[1], 8, 8), dtype="float32", window=8, sinks=2, page_size=4)
    return p


def tp_engine(p, mesh, rows: int, prompt_len: int, new_tokens: int, budget: int, all_reduce: str = "auto"):
    """An engine on the ``tp`` model over ``mesh`` (None: one device) with ``rows`` requests queued: each data
    shard ``rows / D`` rows, the same pages per KV head on every mesh; ``all_reduce``: the sharded model's
    all-reduce ``impl``."""
    import numpy as np

    from kvjax.cli.run import build_model
    from kvjax.config import CacheConfig
    from kvjax.engine.engine import Engine

    d, m = (1, 1) if mesh is None else (mesh.shape["data"], mesh.shape["model"])
    per = rows // d
    blocks = -(-(prompt_len + new_tokens) // p.page_size)
    cache = CacheConfig(page_size=p.page_size, num_pages=per * p.kv_heads * blocks // m, max_seqs=per,
                        max_blocks_per_seq=blocks)
    model = build_model(p, seed=0, mesh=mesh, all_reduce=all_reduce)
    eng = Engine(model, cache, mesh=mesh, recycle="timely", max_num_batched_tokens=budget,
                 token_buckets=tuple(sorted({per, budget})), row_buckets=(per,), block_buckets=(blocks,))
    rng = np.random.default_rng(0)
    for i in range(rows):
        eng.add_request(rng.integers(0, p.vocab, prompt_len), new_tokens, index=i)
    return eng


def _steps(eng, n: int, tokens: dict) -> None:
    for _ in range(n):
        for out in eng.step():
            tokens.setdefault(out.index, []).extend(out.tokens)


def steady_decode(eng, rows: int, n: int, tokens: dict) -> dict:
    """Run ``eng`` until its steps decode every row without compiling, then time ``n`` steps (wall clock)."""
    import jax

    for _ in range(400):
        k = len(eng.metrics)
        _steps(eng, 3, tokens)
        recs = eng.metrics.records[k:]
        if len(recs) >= 2 and all(r.decode_only and r.num_seqs == rows and not r.compiled for r in recs[-2:]):
            break
    else:
        raise RuntimeError("the engine never reached steady decode")
    gc.collect()
    _steps(eng, 4, tokens)  # settle after the collection
    jax.block_until_ready(eng.caches)
    k = len(eng.metrics)
    t0 = time.perf_counter()
    _steps(eng, n, tokens)
    jax.block_until_ready(eng.caches)
    wall = time.perf_counter() - t0
    recs = eng.metrics.records[k:]
    if any(r.compiled or r.num_seqs != rows for r in recs):
        raise RuntimeError(f"steps left steady decode: {[(r.num_seqs, r.compiled) for r in recs]}")
    sub_steps = sum(r.burst for r in recs)  # decode sub-steps (the engine's default bursts run several per step)
    return dict(ms_per_step=1e3 * wall / sub_steps, tokens_per_s=sum(r.computed for r in recs) / wall,
                sub_steps_per_dispatch=sub_steps / len(recs),
                host_ms=1e3 * statistics.median((r.t_step - r.t_wait) / r.burst for r in recs),
                exposed_ms=1e3 * statistics.median(r.t_exposed / r.burst for r in recs),
                compile_s=sum(r.t_step for r in eng.metrics.records if r.compiled))


def profile_engine(eng, steps: int, trace_dir: str, tokens: dict) -> dict:
    """``steps`` engine steps under ``jax.profiler`` into ``trace_dir``; device time by kernel class per step."""
    import jax
    from trace_kernels import kernel_time_by_class

    jax.block_until_ready(eng.caches)
    k = len(eng.metrics)
    jax.profiler.start_trace(trace_dir)
    try:
        _steps(eng, steps, tokens)
        jax.block_until_ready(eng.caches)
    finally:
        jax.profiler.stop_trace()
    recs = eng.metrics.records[k:]
    sub_steps = round(steps * sum(r.burst for r in recs) / max(len(recs), 1))  # decode sub-steps traced
    return dict(trace_dir=trace_dir, steps=steps, sub_steps=sub_steps, **kernel_time_by_class(trace_dir, sub_steps))


def tp_configs(g: int) -> dict[str, tuple[tuple[int, int] | None, str]]:
    """The ``tp`` section's runs: name -> (mesh shape or None for one device without a mesh, the all-reduce
    ``impl`` of the sharded model's sums); ``g = 1``: the one device only. ``1xG psum`` is the tensor-parallel run
    with XLA's ``psum`` in place of ``auto``'s choice (the one-shot kernel on two Hopper GPUs); ``1xG mosaic``
    (G > 2, where ``auto`` keeps ``psum``) names the one-shot kernel."""
    if g == 1:
        return {"one": (None, "auto")}
    runs = {"one": (None, "auto"), f"1x{g}": ((1, g), "auto"), f"1x{g} psum": ((1, g), "reference")}
    if g > 2:
        runs[f"1x{g} mosaic"] = ((1, g), "mosaic")
    return {**runs, f"{g}x1": ((g, 1), "auto")}


def tp_section(g: int, rows: int, n: int, smoke: bool, runs: tuple[str, ...], profile: tuple[str, ...],
               profile_steps: int, trace_dir: str) -> dict:
    """The ``runs`` of :func:`tp_configs` in steady decode at ``rows`` rows (+ the profiles of ``profile``);
    ratios and tokens against the first run."""
    p = tp_preset(smoke)
    prompt = 16 if smoke else TP_PROMPT
    budget = 64 if smoke else 2048
    from kvjax.engine.options import AUTO_BURST

    new_tokens = (n + profile_steps + 60) * AUTO_BURST + (rows * prompt) // budget  # decode bursts of AUTO_BURST
    out, first, base, seen = [], None, None, {}
    for name, (shape, all_reduce) in ((k, v) for k, v in tp_configs(g).items() if k in runs):
        mesh = None if shape is None else _mesh(*shape)
        t0 = time.perf_counter()
        eng = tp_engine(p, mesh, rows, prompt, new_tokens, budget, all_reduce)
        build_s = time.perf_counter() - t0
        tokens: dict = {}
        row = dict(run=name, mesh=shape, all_reduce=all_reduce, rows=rows, build_s=build_s,
                   **steady_decode(eng, rows, n, tokens))
        if name in profile:
            row["profile"] = profile_engine(eng, profile_steps, os.path.join(trace_dir, name), tokens)
        firsts = [tokens[i] for i in sorted(tokens)]
        if first is None:
            first, base = firsts, row["tokens_per_s"]
        k = min(len(t) for t in firsts + first)  # every row's first k tokens
        row.update(ratio=row["tokens_per_s"] / base, compared_tokens=k, compared_with=out[0]["run"] if out else name,
                   identical_tokens=all(a[:k] == b[:k] for a, b in zip(firsts, first)))
        twin = seen.get(name.rsplit(" ", 1)[0]) if name.endswith((" psum", " mosaic")) else None
        if twin is not None:  # the same mesh with auto's all-reduce: the same tokens?
            k = min(len(t) for t in firsts + twin)
            row["identical_to_auto"] = all(a[:k] == b[:k] for a, b in zip(firsts, twin))
        seen[name] = firsts
        out.append(row)
        _print({k2: v for k2, v in row.items() if k2 != "profile"})
        if "profile" in row:
            from trace_kernels import format_classes

            print(format_classes(row["profile"]), flush=True)
        del eng
        _release()
    return {"preset": "tp (smoke: tiny width, f32)" if smoke else "tp", "param_bytes": _param_bytes(p),
            "rows": out}


def _param_bytes(p) -> int:
    from kvjax.cli.run import param_bytes

    return param_bytes(p)


# ---------------------------------------------------------------------------------------------- allreduce

AR_CHAIN = 20  # sums per jitted call: each the next one's input (times a constant), as a layer's sums follow


def allreduce_section(g: int, smoke: bool, work: str) -> dict:
    """The op ``all_reduce`` over the ``model`` axis of a ``1xG`` mesh, ``rows x hidden`` a device, by each
    implementation that runs here: per GPU the device time of a sum (the profiler's collective class: XLA's
    all-reduce fusion, or the one-shot kernel and the barrier XLA launches before it; a device that arrives first
    waits inside, so the GPUs differ), and the error against a float64 numpy sum of the same inputs."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    from trace_kernels import kernel_time_by_class

    from kvjax.errors import UnknownImplError
    from kvjax.ops.collective import TABLE, all_reduce

    mesh, spec = _mesh(1, g), P("data", "model")
    hidden = 256 if smoke else 4096
    cases = [(r, "bfloat16") for r in ((8, 32) if smoke else (16, 64, 256, 512, 1024, 2048, 4096))]
    cases.append((8 if smoke else 64, "float32"))
    out = []
    for rows, dtype in cases:
        x = jnp.asarray(np.random.default_rng(rows).standard_normal((1, g, rows, hidden)), dtype)
        want = np.asarray(x.astype(jnp.float32)).astype(np.float64).sum(1)[0]  # of the inputs as given
        xd = jax.device_put(x, NamedSharding(mesh, spec))
        for impl in ("reference", "mosaic"):
            row = dict(rows=rows, hidden=hidden, dtype=dtype, mib=rows * hidden * jnp.dtype(dtype).itemsize / 2**20,
                       impl=impl)
            try:
                TABLE.choose(impl, (jax.ShapeDtypeStruct((rows, hidden), dtype),), {"axis": "model", "size": g})
            except UnknownImplError as e:
                out.append(dict(row, skipped=str(e)))
                _print(out[-1])
                continue

            def one(v, impl=impl):
                return all_reduce(v[0, 0], "model", impl=impl)[None, None]

            def chain(v, impl=impl):
                w = v[0, 0]
                for _ in range(AR_CHAIN):
                    w = all_reduce(w * jnp.asarray(0.5, w.dtype), "model", impl=impl)
                return w[None, None]

            got = jax.jit(jax.shard_map(one, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))(xd)
            got = np.asarray(got.astype(jnp.float32))
            row["max_err"] = float(np.abs(got - want[None, None]).max())
            row["same_on_every_device"] = bool(all((got[0, j] == got[0, 0]).all() for j in range(g)))
            fn = jax.jit(jax.shard_map(chain, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))
            jax.block_until_ready(fn(xd))
            d = os.path.join(work, f"ar_{rows}_{dtype}_{impl}")
            calls = 1 if smoke else 5
            jax.profiler.start_trace(d)
            try:
                jax.block_until_ready([fn(xd) for _ in range(calls)])
            finally:
                jax.profiler.stop_trace()
            prof = kernel_time_by_class(d, calls * AR_CHAIN)
            row["us_per_sum"] = [round(1e3 * v["ms"]["collective"], 2) for v in prof["gpus"].values()]
            out.append(row)
            _print(row)
    return {"chain": AR_CHAIN, "rows": out}


# ---------------------------------------------------------------------------------------------- deepseek


def deepseek_model(smoke: bool):
    """A small DeepSeek-V3.2 (MLA latent cache, DSA indexer, a dense and a MoE layer), f32."""
    import numpy as np
    from flax import nnx

    from kvjax.models.deepseek import DeepseekConfig, DeepseekV32

    w = 1 if smoke else 4
    cfg = DeepseekConfig(
        vocab_size=61 * w, hidden_size=32 * w, intermediate_size=32 * w, num_hidden_layers=2,
        num_attention_heads=4 * w, q_lora_rank=24 * w, kv_lora_rank=16 * w, qk_nope_head_dim=8 * w,
        qk_rope_head_dim=8 * w, v_head_dim=8 * w, index_n_heads=4, index_head_dim=16 * w, index_topk=5 * w,
        rope_parameters=(("rope_theta", 10000.0), ("rope_type", "default")), mlp_layer_types=("dense", "sparse"),
        moe_intermediate_size=8 * w, n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
        n_shared_experts=1)
    model = DeepseekV32(cfg, rngs=nnx.Rngs(7))
    rng = np.random.default_rng(7)
    for _, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):  # norms and biases away from 1 / 0
        if var[...].ndim == 1:
            var[...] = var[...] + 0.3 * rng.standard_normal(var[...].shape).astype(np.float32)
    return model


def deepseek_section(smoke: bool) -> dict:
    """Greedy and sampled tokens of a small DeepSeek on one device and on ``1x2`` and ``2x1``."""
    import numpy as np

    from kvjax.config import CacheConfig
    from kvjax.engine.engine import Engine

    model = deepseek_model(smoke)
    vocab = model.config.vocab_size
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, vocab, int(n)).tolist() for n in rng.integers(6, 40, 6)]
    cache = CacheConfig(page_size=4, num_pages=64, max_seqs=4, max_blocks_per_seq=16)
    kw = dict(max_num_batched_tokens=32, token_buckets=(8, 32), row_buckets=(4,), block_buckets=(16,))
    new = 8

    def serve(mesh):
        eng = Engine(model, cache, mesh=mesh, **kw)
        t0 = time.perf_counter()
        greedy = eng.generate(prompts, new)
        sampled = eng.generate(prompts, new, temperature=1.0, seed=3)
        return greedy, sampled, time.perf_counter() - t0

    want_g, want_s, wall = serve(None)
    rows = [dict(run="one device", wall_s=wall)]
    for d, m in ((1, 2), (2, 1)):
        got_g, got_s, wall = serve(_mesh(d, m))
        rows.append(dict(run=f"{d}x{m}", wall_s=wall, identical_greedy=got_g == want_g,
                         identical_sampled=got_s == want_s))
        _print(rows[-1])
        _release()
    return {"dtype": "float32", "rows": rows}


# ---------------------------------------------------------------------------------------------- main


def _print(row: dict) -> None:
    print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()
                      if not isinstance(v, (list, dict)) or k == "mesh"}), flush=True)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="CPU sizes (host devices: XLA_FLAGS=...count=8)")
    ap.add_argument("--gpus", type=int, help="G: devices to scale over (default: all JAX sees; --smoke: 2); 1: "
                    "the tp and profile sections on one device")
    ap.add_argument("--only", default=",".join(SECTIONS), help=f"sections, comma list of {', '.join(SECTIONS)}")
    ap.add_argument("--repeats", type=int, help="dp / procs: serves per policy (default 2; --smoke 1)")
    ap.add_argument("--share", default="dynamic", help="procs: kvjax run's --share, comma list of dynamic, static "
                    "(one run of the processes each)")
    ap.add_argument("--rows", type=int, help="tp: decoding rows (default 64; --smoke 8)")
    ap.add_argument("--steps", type=int, help="tp: timed decode steps (default 30; --smoke 4)")
    ap.add_argument("--profile", help="profile: the tp runs to trace, comma list of one, 1xG, '1xG psum', "
                    "'1xG mosaic' (G > 2), Gx1 (default 1xG; --gpus 1: one)")
    ap.add_argument("--profile-steps", type=int, default=5, help="profile: decode steps in the trace")
    ap.add_argument("--out", default=os.path.join(HERE, "out", "scale.json"), help="the JSON")
    ap.add_argument("--trace-dir", help="profile: where the traces go (default: beside --out)")
    ap.add_argument("--compile-cache", help="persistent compilation cache (default: beside --out)")
    args = ap.parse_args(argv)
    sections = [s.strip() for s in args.only.split(",") if s.strip()]
    if set(args.share.split(",")) - {"dynamic", "static"}:
        ap.error(f"--share {args.share}: a comma list of dynamic, static")
    bad = [s for s in sections if s not in SECTIONS]
    if bad:
        ap.error(f"unknown section {bad[0]!r}; sections: {', '.join(SECTIONS)}")

    import jax

    from kvjax.cli import compile_cache

    g = args.gpus if args.gpus is not None else (2 if args.smoke else jax.device_count())
    if g < 1 or g > jax.device_count():
        ap.error(f"--gpus {g}: need 1 to {jax.device_count()} devices (JAX sees {jax.device_count()})")
    if g == 1 and set(sections) - {"tp", "profile"}:
        ap.error(f"--gpus 1 runs only the tp and profile sections (one device, no mesh), not {args.only!r}")
    smoke = args.smoke
    repeats = args.repeats or (1 if smoke else 2)
    rows = args.rows or (8 if smoke else 64)
    if rows % g:
        ap.error(f"--rows {rows} must be a multiple of G = {g} (the Gx1 mesh's rows per device)")
    n = args.steps or (4 if smoke else 30)
    names = {"one": "one", "1xG": f"1x{g}", "1xG psum": f"1x{g} psum", "1xG mosaic": f"1x{g} mosaic",
             "Gx1": f"{g}x1"}
    wanted = args.profile or ("one" if g == 1 else "1xG")
    profile = tuple(names.get(s.strip(), s.strip()) for s in wanted.split(",")) if "profile" in sections else ()
    if set(profile) - set(tp_configs(g)):
        ap.error(f"--profile {wanted}: runs are {', '.join(tp_configs(g))}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    base = os.path.splitext(os.path.abspath(args.out))[0]
    trace_dir = args.trace_dir or base + "_traces"
    compile_cache.enable(compile_cache.prepare(args.compile_cache or base + "_jax_cache"))
    tp_runs = tuple(tp_configs(g)) if "tp" in sections else profile  # --only profile: just the traced runs

    doc: dict = {"device": f"{jax.devices()[0].device_kind} ({jax.default_backend()})", "devices": g,
                 "smoke": smoke, "argv": argv, "jax": jax.__version__, "sections": {}}
    t_start = time.perf_counter()

    def save() -> None:
        doc["wall_s"] = time.perf_counter() - t_start
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1, default=str)

    for section in [s for s in SECTIONS if s in sections and not (s == "profile" and "tp" in sections)]:
        t0 = time.perf_counter()
        print(f"## {section}", flush=True)
        with tempfile.TemporaryDirectory() as work:
            if section == "dp":
                result = dp_section(g, repeats, smoke)
            elif section == "procs":
                result = {"shares": {share: procs_section(g, repeats, smoke, doc["sections"].get("dp"), work, share)
                                     for share in args.share.split(",")}}
            elif section in ("tp", "profile"):
                result = tp_section(g, rows, n, smoke, tp_runs, profile, args.profile_steps, trace_dir)
            elif section == "allreduce":
                result = allreduce_section(g, smoke, work)
            else:
                result = deepseek_section(smoke)
        result["section_s"] = time.perf_counter() - t0
        doc["sections"][section] = result
        save()
    print(f"wrote {args.out} ({time.perf_counter() - t_start:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
