"""The ``run`` command's presets: the toy Qwen3.5 and the workload each one serves, the model it builds, and the
checks made before any work (sizes against this machine's memory, a GPU preset without a GPU).

Presets: ``cpu`` (default; f32, small enough for a laptop CPU), ``gpu`` (bf16, a larger model and workload for
one accelerator) and ``tp`` (bf16, a dense Qwen3.5 of 3.7B parameters sized for tensor parallelism, with room for
pages on one 80 GB GPU, 64 rows; its weights are drawn by one jitted call on the devices, each device drawing its
shards). ``gpu`` and ``tp`` are refused where JAX sees no GPU unless ``--force``. Each uses few bucket shapes (one
block-table width, one row count, two token counts) so that each run compiles about three times.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvjax.cli.args import check_memory
from kvjax.config import AttentionConfig, GDNConfig
from kvjax.errors import UsageError
from kvjax.sched.workload import seed_footprint

LINEAR_ATTENTION, ATTENTION = "linear_attention", "full_attention"  # Qwen3.5 layer types


@dataclasses.dataclass(frozen=True)
class Preset:
    # model
    vocab: int
    hidden: int
    intermediate: int
    layer_types: tuple[str, ...]
    q_heads: int
    kv_heads: int
    head_dim: int
    gdn: tuple[int, int, int, int]  # Hk, Hv, K, V
    dtype: str
    # workload and memory
    requests: int
    scale: float  # of the seed's mean lengths (10,599 prompt / 4,054 output tokens)
    swa_fraction: float
    window: int
    sinks: int
    page_size: int
    memory_requests: float  # page memory = this many mean-length requests on every head without recycling
    max_seqs: int
    max_tokens: int  # token budget per step
    token_buckets: tuple[int, ...] | None  # None: the scheduler's powers of two
    row_buckets: tuple[int, ...] | None
    needs_gpu: bool = False  # refused where JAX sees no GPU (unless --force)
    device_init: bool = False  # random weights drawn by a jitted call on the devices (sharded over a mesh)
    kv_cache_dtype: str = "auto"  # K/V pages: "auto" (dtype) or "fp8" (fp8 pages, the same page memory)


_G, _A = LINEAR_ATTENTION, ATTENTION
PRESETS = {
    "cpu": Preset(vocab=512, hidden=64, intermediate=128, layer_types=(_G, _G, _G, _A), q_heads=8, kv_heads=4,
                  head_dim=32, gdn=(2, 4, 16, 16), dtype="float32", requests=16, scale=0.02, swa_fraction=0.75,
                  window=32, sinks=4, page_size=16, memory_requests=3.0, max_seqs=8, max_tokens=128,
                  token_buckets=(16, 128), row_buckets=(8,)),
    "gpu": Preset(vocab=32768, hidden=1024, intermediate=3072, layer_types=(_G, _G, _G, _A) * 2, q_heads=16,
                  kv_heads=4, head_dim=128, gdn=(4, 8, 128, 128), dtype="bfloat16", requests=32, scale=0.1,
                  swa_fraction=0.75, window=128, sinks=4, page_size=64, memory_requests=4.0, max_seqs=16,
                  max_tokens=1024, token_buckets=(16, 1024), row_buckets=(16,), needs_gpu=True),
    # a dense Qwen3.5 of 3.7B parameters (7.46 GB in bf16) where tensor parallelism can pay: one H100 holds it with
    # room for pages; decode runs at 64 rows
    "tp": Preset(vocab=32768, hidden=4096, intermediate=12288, layer_types=(_G, _G, _G, _A) * 4, q_heads=32,
                 kv_heads=8, head_dim=128, gdn=(16, 32, 128, 128), dtype="bfloat16", requests=64, scale=0.1,
                 swa_fraction=0.75, window=128, sinks=4, page_size=64, memory_requests=32.0, max_seqs=64,
                 max_tokens=2048, token_buckets=(64, 2048), row_buckets=(64,), needs_gpu=True, device_init=True),
}


def attention_layout(p: Preset) -> AttentionConfig:
    """The attention layers' KV heads: the first ``round(swa_fraction * kv_heads)`` SWA, the rest full."""
    return AttentionConfig.with_swa_fraction(p.q_heads, p.kv_heads, p.head_dim, swa_fraction=p.swa_fraction,
                                             window=p.window, sinks=p.sinks)


def check_sizes(p: Preset) -> None:
    """Raise :class:`UsageError` before any work if the workload, the scheduler and the K/V pages of preset ``p``
    would not fit this machine (host memory, and device memory where JAX reports a limit)."""
    host, pages = seed_footprint(p.requests, scale=p.scale, num_kv_heads=p.kv_heads, page_size=p.page_size,
                                 full_requests=p.memory_requests, max_seqs=p.max_seqs)
    kv = p.layer_types.count(_A) * 2 * pages * p.page_size * p.head_dim * jnp.dtype(p.dtype).itemsize
    params = param_bytes(p)
    what = f"--requests {p.requests} --scale {p.scale:g} --memory-requests {p.memory_requests:g}"
    stats = jax.local_devices()[0].memory_stats() if jax.default_backend() != "cpu" else None
    limit = (stats or {}).get("bytes_limit")
    if limit is None:  # device memory is host memory
        check_memory(host + kv + params, what)
    else:
        check_memory(host, what)
        check_memory(kv + params, f"{what} ({pages} K/V pages per layer and {params / 1e9:.2f} GB of parameters)",
                     limit, "device memory")


def model_config(p: Preset):
    """The toy Qwen3.5's config: ``swa_fraction`` of the KV heads sliding-window (window, sinks)."""
    from kvjax.models.qwen3_5 import Qwen3_5Config

    return Qwen3_5Config(vocab_size=p.vocab, hidden_size=p.hidden, intermediate_size=p.intermediate,
                         layer_types=p.layer_types, attention=attention_layout(p), gdn=GDNConfig(*p.gdn, 4),
                         rope_theta=10000.0)


def param_bytes(p: Preset) -> int:
    """Bytes of preset ``p``'s parameters (from the model's shapes; nothing is allocated)."""
    from flax import nnx

    from kvjax.models.qwen3_5 import Qwen3_5ForCausalLM

    config, dtype = model_config(p), jnp.dtype(p.dtype)
    shapes = jax.eval_shape(lambda: nnx.state(Qwen3_5ForCausalLM(config, rngs=nnx.Rngs(0), dtype=dtype)))
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes))


def build_model(p: Preset, *, seed: int = 0, mesh: jax.sharding.Mesh | None = None, all_reduce: str = "auto"):
    """Random-weight toy Qwen3.5 of preset ``p`` (:func:`model_config`): drawn with numpy on the host, or, for a
    ``device_init`` preset, by one jitted call on the devices (a :class:`~kvjax.models.sharding.ShardedModel` over
    ``mesh`` if given, each device drawing its own shards; the same weights on one device and on any mesh; a
    host-drawn model is left for the engine to split). ``all_reduce``: the sums' implementation of the sharded
    model (:class:`~kvjax.models.sharding.ShardedModel`); other than ``"auto"`` a host-drawn model is split here."""
    from kvjax.models.qwen3_5 import init_random, init_random_on_device
    from kvjax.models.sharding import shard_model

    if p.device_init:
        return init_random_on_device(model_config(p), seed=seed, dtype=jnp.dtype(p.dtype), mesh=mesh,
                                     all_reduce=all_reduce)
    model = init_random(model_config(p), seed=seed, dtype=jnp.dtype(p.dtype))
    return shard_model(model, mesh, all_reduce=all_reduce) if mesh is not None and all_reduce != "auto" else model


def check_device(preset: str, force: bool) -> None:
    """Raise :class:`UsageError` for a ``needs_gpu`` preset (``gpu``, ``tp``) where JAX sees no GPU (unless
    ``force``): its bf16 model and workload would run for hours on a CPU."""
    backend = jax.default_backend()
    if PRESETS[preset].needs_gpu and backend != "gpu" and not force:
        raise UsageError(f"--preset {preset} needs a GPU and JAX sees only {backend} devices (its bf16 model and "
                         "workload would run for hours here): use --preset cpu, or add --force to run it anyway")
