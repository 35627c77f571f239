"""CPU smoke run of ``benchmarks/scale.py`` (issue 34) and its trace parser ``benchmarks/trace_kernels.py``.

``scale.py --smoke --only tp,profile`` on 8 host devices (a subprocess; G = 2): the tiny ``tp`` model gives the same
first tokens on one device, ``1x2`` and ``2x1``; the ``1x2`` run is traced and the trace parsed (a CPU trace has no
device records). With ``KVJAX_FULL_SCALE_SMOKE=1`` every section (about 90 s on 2 cores): also one device and
``--devices 2`` give the same tokens (f32) under both policies, two processes of ``kvjax run`` the single
controller's, DeepSeek on ``1x2`` / ``2x1`` one device's. In CI those paths are covered by ``test_scale_out.py``
(two processes through the command) and ``test_sharding_engine.py`` (both families on meshes). The parser's
classes are checked on the kernel names CUDA GPUs report (NCCL, cuBLAS, XLA fusions, Pallas kernels).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.bench import BENCH, bench_module
from helpers.procs import compile_cache_env


@pytest.fixture(scope="module")
def trace_kernels():
    with bench_module("trace_kernels") as module:
        yield module


@pytest.mark.parametrize("name, cls", [
    ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "collective"),
    ("all-gather-start.3", "collective"),
    ("reduce_scatter_fusion", "collective"),
    ("psum_1857_0_fusion_1", "collective"),  # XLA's all-reduce of a shard_map psum on two H100s (HISTORY run 72)
    ("all_reduce_one_shot_mosaic_gpu_kernel", "collective"),  # kvjax.pallas.collective.allreduce_mgpu
    ("stream_executor::gpu::MultiGpuBarrierWithTimeout", "collective"),  # XLA's, before that kernel (2x H200)
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1", "gemm"),
    ("nvjet_tst_128x64_64x8_1x2_h_bz_TNN", "gemm"),
    ("cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8", "gemm"),
    ("triton_gemm_dot_general_2", "gemm"),
    ("Memcpy DtoD (Device -> Device)", "copy"),
    ("loop_reduce_fusion_3", "other"),
    ("input_multiply_reduce_fusion", "other"),
    ("gdn_slot_decode_kernel", "other"),
    ("paged_decode_split_kv", "other"),
])
def test_kernel_classes(trace_kernels, name, cls):
    assert trace_kernels.classify(name) == cls


def test_scale_smoke_on_8_cpu_devices(tmp_path):
    full = os.environ.get("KVJAX_FULL_SCALE_SMOKE") == "1"
    out = tmp_path / "scale.json"
    env = {**os.environ,
           "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()}
    cache = compile_cache_env().get("JAX_COMPILATION_CACHE_DIR")  # the tests' cache, not one beside --out
    r = subprocess.run([sys.executable, str(BENCH / "scale.py"), "--smoke", "--only",
                        "dp,procs,tp,profile,allreduce,deepseek" if full else "tp,profile,allreduce", "--out", str(out),
                        *(["--compile-cache", cache] if cache else [])],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    doc = json.loads(out.read_text())
    assert doc["devices"] == 2 and doc["smoke"]
    assert set(doc["sections"]) == ({"dp", "procs", "tp", "allreduce", "deepseek"} if full else {"tp", "allreduce"})
    ar = doc["sections"]["allreduce"]["rows"]
    assert [(r["rows"], r["dtype"], r["impl"]) for r in ar] == [
        (rows, dtype, impl) for rows, dtype in ((8, "bfloat16"), (32, "bfloat16"), (8, "float32"))
        for impl in ("reference", "mosaic")]
    for r in ar:  # on CPUs: XLA's psum, checked against numpy; the one-shot kernel refused with the reason
        if r["impl"] == "mosaic":
            assert "needs a Hopper GPU" in r["skipped"]
        else:
            bound = 1e-5 if r["dtype"] == "float32" else 2 ** -8 * 8  # one rounding of a sum of |x| < ~8
            assert r["max_err"] <= bound and r["same_on_every_device"] and r["us_per_sum"] == [], r
    if full:
        dp = doc["sections"]["dp"]["rows"]
        assert [(row["devices"], row["recycle"]) for row in dp] == [(1, "none"), (1, "timely"), (2, "none"),
                                                                   (2, "timely")]
        assert all(row["identical_to_one_device"] and row["tokens_per_s"] > 0 for row in dp)
        for row in dp:
            one = next(r for r in dp if r["devices"] == 1 and r["recycle"] == row["recycle"])
            assert row["ratio"] == pytest.approx(row["tokens_per_s"] / one["tokens_per_s"])
            assert row["tokens_per_s_per_device"] == pytest.approx(row["tokens_per_s"] / row["devices"])
        procs = doc["sections"]["procs"]["shares"]["dynamic"]
        assert procs["ok"] and all(row["identical_to_single_controller"] for row in procs["rows"])
        assert all(row["identical_greedy"] and row["identical_sampled"]
                   for row in doc["sections"]["deepseek"]["rows"][1:])
    tp = doc["sections"]["tp"]["rows"]
    assert [row["run"] for row in tp] == ["one", "1x2", "1x2 psum", "2x1"]
    assert [row["all_reduce"] for row in tp] == ["auto", "auto", "reference", "auto"]
    assert all(row["identical_tokens"] and row["compared_tokens"] >= 4 and row["ms_per_step"] > 0 for row in tp)
    assert [row.get("identical_to_auto") for row in tp] == [None, None, True, None]
    traced = [row for row in tp if "profile" in row]
    assert [row["run"] for row in traced] == ["1x2"]
    assert traced[0]["profile"]["gpus"] == {}  # a CPU trace: written and parsed, no device records
    assert any(Path(traced[0]["profile"]["trace_dir"]).rglob("*.xplane.pb"))


def test_one_device_runs_only_the_tp_sections(capsys, tmp_path):
    # --gpus 1: the tp model on one device, no mesh (issue 34's one-GPU floor); the other sections need G >= 2. A
    # refused command line changes nothing: no output folder, no compilation cache, JAX's settings as they were
    import jax

    cache = jax.config.jax_compilation_cache_dir
    out = ["--out", str(tmp_path / "out" / "scale.json")]
    with bench_module("scale") as scale:
        assert scale.tp_configs(1) == {"one": (None, "auto")}
        assert scale.tp_configs(2) == {"one": (None, "auto"), "1x2": ((1, 2), "auto"),
                                       "1x2 psum": ((1, 2), "reference"), "2x1": ((2, 1), "auto")}
        assert scale.tp_configs(4)["1x4 mosaic"] == ((1, 4), "mosaic")  # auto keeps psum over four devices
        for argv, message in ((["--gpus", "1", "--only", "dp,tp"], "--gpus 1 runs only the tp and profile"),
                              (["--gpus", "0"], "--gpus 0: need 1 to"),
                              (["--gpus", "1", "--only", "profile", "--profile", "1xG,one"], "runs are one"),
                              (["--share", "dynamic,round-robin"], "a comma list of dynamic, static")):
            with pytest.raises(SystemExit):
                scale.main(argv + out)
            assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists() and jax.config.jax_compilation_cache_dir == cache
