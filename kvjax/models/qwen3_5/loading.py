"""Qwen3.5 parameters: random toy weights (:func:`init_random`) or a Hugging Face checkpoint (:func:`load`,
the loader :func:`kvjax.models.load_pretrained` dispatches to for ``Qwen3_5ForCausalLM`` /
``Qwen3_5ForConditionalGeneration`` / ``qwen3_5_text`` / ``qwen3_5``).
"""

from __future__ import annotations

import os
import zlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from kvjax.errors import CheckpointError
from kvjax.models.common.checkpoint import (TensorSource, abstract_model, assign_params, check_param_dtype,
                                            load_safetensors)
from kvjax.models.qwen3_5.config import Qwen3_5Config
from kvjax.models.qwen3_5.model import Qwen3_5ForCausalLM
from kvjax.models.qwen3_5.mtp import Qwen3_5MTP, attach
from kvjax.models.sharding import ShardedModel


def _distribution(path: tuple, shape: tuple[int, ...]) -> tuple[str, float, float]:
    """How a random parameter is drawn: ``("normal", 0, std)``, ``("log_uniform", low, high)`` or
    ``("constant", value, 0)`` (the module constructors' / HF init's distributions)."""
    last = str(path[-1])
    if last == "kernel":
        return "normal", 0.0, 1.0 / np.sqrt(shape[0])
    if (last == "weight" and len(shape) == 2) or last == "conv_weight":  # TorchLinear [out, in]; conv [C, K]
        return "normal", 0.0, 1.0 / np.sqrt(shape[1])
    if last == "embed_tokens":
        return "normal", 0.0, 0.02
    if last == "A_log":
        return "log_uniform", 0.01, 16.0
    if last == "dt_bias" or tuple(str(p) for p in path[-3:]) == ("linear_attn", "norm", "weight"):
        return "constant", 1.0, 0.0
    return "constant", 0.0, 0.0  # biases and zero-centred RMSNorm scales


def _hashed_uniform(shape: tuple[int, ...], stream: int, which: int) -> jax.Array:  # f32[shape] in (0, 1]
    """Uniform floats in ``(0, 1]``, each a hash (the murmur3 finaliser) of its element's linear index, ``stream``
    and ``which``: traceable, elementwise, the same values however the array is sharded."""
    index = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(len(shape))):
        index = index + jax.lax.broadcasted_iota(jnp.uint32, shape, axis) * np.uint32(stride % 2**32)
        stride *= shape[axis]
    x = index * np.uint32(2) + np.uint32(which) + np.uint32(stream * 0x9E3779B1 % 2**32)
    for shift, mult in ((16, 0x85EBCA6B), (13, 0xC2B2AE35)):
        x = (x ^ (x >> np.uint32(shift))) * np.uint32(mult)
    x = x ^ (x >> np.uint32(16))
    return ((x >> np.uint32(8)).astype(jnp.float32) + 1.0) * np.float32(2.0**-24)


def init_random(config: Qwen3_5Config, *, seed: int = 0, dtype=jnp.float32) -> Qwen3_5ForCausalLM:
    """A randomly initialised model, drawn on the host with numpy (fast: no per-shape device compiles).

    Same distributions as the module constructors / HF init: projections ``N(0, 1/fan_in)``, embeddings
    ``N(0, 0.02^2)``, ``A_log = log U(0.01, 16)``, ``dt_bias = 1``, zero-centred norms 0, gated norm 1.
    """
    dtype = check_param_dtype(dtype)
    model = abstract_model(lambda: Qwen3_5ForCausalLM(config, rngs=nnx.Rngs(0), dtype=dtype))
    rng = np.random.default_rng(seed)
    values = {}
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        shape = tuple(var.get_value().shape)
        kind, a, b = _distribution(path, shape)
        values[path] = (rng.normal(a, b, shape) if kind == "normal" else np.log(rng.uniform(a, b, shape))
                        if kind == "log_uniform" else np.full(shape, a))
    return assign_params(model, values)


def init_random_on_device(config: Qwen3_5Config, *, seed: int = 0, dtype=jnp.bfloat16,
                          mesh: Mesh | None = None, all_reduce: str = "auto") -> Qwen3_5ForCausalLM | ShardedModel:
    """A randomly initialised model drawn by one jitted call on the devices (:func:`init_random`'s distributions):
    for models of billions of parameters, whose numpy draw and host -> device copy would take minutes. ``mesh``: a
    :class:`~kvjax.models.sharding.ShardedModel` whose devices draw only their own shards (every process of a
    multi-process mesh must call it alike). Each value is a hash of ``seed``, the parameter's path and the
    element's index (:func:`_hashed_uniform`; elementwise, so XLA compiles it in moments and each device computes
    its shard's indices): the model is the same on one device and on any mesh (not :func:`init_random`'s)."""
    dtype = check_param_dtype(dtype)
    model = abstract_model(lambda: Qwen3_5ForCausalLM(config, rngs=nnx.Rngs(0), dtype=dtype))

    def draw(path: tuple, shape: tuple[int, ...]) -> jax.Array:  # traceable: this parameter's global value
        kind, a, b = _distribution(path, shape)
        stream = zlib.crc32(f"{seed}/{'/'.join(map(str, path))}".encode())
        if kind == "normal":  # Box-Muller on two hashed uniforms
            u1, u2 = _hashed_uniform(shape, stream, 0), _hashed_uniform(shape, stream, 1)
            z = jnp.sqrt(-2.0 * jnp.log(u1)) * jnp.cos(2.0 * np.pi * u2)
            return (a + b * z).astype(dtype)
        if kind == "log_uniform":  # a few values per layer (A_log): drawn on the host, exact on every mesh
            with jax.ensure_compile_time_eval():  # computed now, a constant of the traced draw
                u = np.asarray(_hashed_uniform(shape, stream, 0))
            return jnp.asarray(np.log(a + (b - a) * u.astype(np.float64)), dtype)
        return jnp.full(shape, a, dtype)

    if mesh is not None:
        return ShardedModel(model, draw, mesh, all_reduce=all_reduce)
    flat = list(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    arrays = jax.jit(lambda: [draw(path, tuple(var.get_value().shape)) for path, var in flat])()
    return assign_params(model, {path: x for (path, _), x in zip(flat, arrays)})


def from_hf_config(cfg: dict[str, Any], *, seed: int = 0, dtype=jnp.float32) -> Qwen3_5ForCausalLM:
    """A randomly initialised model of the shape an HF config dict describes."""
    return init_random(Qwen3_5Config.from_hf(cfg), seed=seed, dtype=dtype)


def _hf_name(path: tuple) -> tuple[str, bool]:
    """HF tensor name of an nnx parameter path and whether the value is transposed (``kernel``)."""
    parts = [str(p) for p in path]
    if parts[-1] == "kernel":
        return ".".join(parts[:-1] + ["weight"]), True
    if parts[-1] == "conv_weight":
        return ".".join(parts[:-1] + ["conv1d", "weight"]), False
    if parts == ["model", "embed_tokens"]:
        return "model.embed_tokens.weight", False
    return ".".join(parts), False


def load(path: str | os.PathLike, config: dict[str, Any], *, dtype=jnp.float32, window: tuple[int, ...] = (),
         sinks: tuple[int, ...] = (), check_finite: bool = True, mesh=None):
    """Load an HF Qwen3.5 checkpoint directory (``Qwen3_5ForCausalLM`` or the text tower of the multimodal
    ``Qwen3_5ForConditionalGeneration``). Raises :class:`CheckpointError` naming a missing, mis-shaped,
    non-float, non-finite (unless ``check_finite=False``) or unexpected tensor, or a non-float ``dtype``; the
    model is returned only when every parameter is loaded. A checkpoint's ``mtp.*`` tensors (its
    multi-token-prediction layers) are loaded too, checked alike, and kept beside the model: read them with
    :func:`kvjax.models.qwen3_5.mtp.mtp_of` (``None`` without them; host values, also with ``mesh``).
    ``window``/``sinks`` (per KV head) turn on SWA heads in the full-attention layers and the MTP layers
    (research option; HF parity needs them off). ``mesh`` (a ``("data", "model")`` ``jax.sharding.Mesh``): a
    :class:`kvjax.models.sharding.ShardedModel` instead, each parameter's shards placed from host memory
    directly on their devices."""
    dtype = check_param_dtype(dtype)
    cfg = Qwen3_5Config.from_hf(config)
    if window or sinks:
        try:
            cfg = cfg.with_swa(tuple(window), tuple(sinks))
        except ValueError as err:
            raise CheckpointError(f"invalid SWA option: {err}") from err
    tensors = load_safetensors(path)
    model = abstract_model(lambda: Qwen3_5ForCausalLM(cfg, rngs=nnx.Rngs(0), dtype=dtype))
    renamed = {}
    for name, value in tensors.items():
        if name.startswith("model.language_model."):
            name = "model." + name[len("model.language_model."):]
        renamed[name] = value
    src = TensorSource(renamed, check_finite=check_finite)
    values = {}
    for p, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        name, transposed = _hf_name(p)
        shape = tuple(var.get_value().shape)
        if name.endswith("conv1d.weight"):
            values[p] = src.take(name, (shape[0], 1, shape[1])).reshape(shape)
        elif transposed:
            values[p] = src.take(name, shape[::-1]).T
        else:
            values[p] = src.take(name, shape)
    mtp = _load_mtp(src, cfg, config, dtype)
    extra = src.unused(ignore_prefixes=("model.visual.", "model.mtp."))
    if model.config.tie_word_embeddings:
        extra = [e for e in extra if e != "lm_head.weight"]
    if extra:
        raise CheckpointError(f"checkpoint has tensors the config does not describe: {extra[:8]}")
    if mesh is not None:
        return attach(ShardedModel(model, values, mesh), mtp)
    return attach(assign_params(model, values), mtp)


def _mtp_num_layers(config: dict[str, Any], names: list[str]) -> int:
    """MTP layer count: the config's ``mtp_num_hidden_layers`` (Qwen3.5) or ``num_nextn_predict_layers``
    (Qwen3-Next), else one more than the highest ``mtp.layers.<i>`` of the checkpoint."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    for key in ("mtp_num_hidden_layers", "num_nextn_predict_layers"):
        value = text.get(key, config.get(key))
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise CheckpointError(f"config key {key!r} must be an int >= 0, got {value!r}")
            return value
    found = [int(n.split(".")[2]) for n in names if n.startswith("mtp.layers.") and n.split(".")[2].isdigit()]
    return max(found, default=-1) + 1


def _load_mtp(src: TensorSource, cfg: Qwen3_5Config, config: dict[str, Any], dtype) -> Qwen3_5MTP | None:
    """The checkpoint's ``mtp.*`` tensors as :class:`~kvjax.models.qwen3_5.mtp.Qwen3_5MTP` (host values), or
    ``None`` without any; a missing or mis-shaped MTP tensor is a :class:`CheckpointError`, and any ``mtp.*``
    tensor the MTP layers do not describe is left unused (refused by the caller)."""
    names = sorted(n for n in src.tensors if n.startswith("mtp."))
    if not names:
        return None
    n = _mtp_num_layers(config, names)
    if n == 0:
        return None  # the config says none: every mtp.* tensor is refused as undescribed
    mtp = abstract_model(lambda: Qwen3_5MTP(cfg, num_layers=n, rngs=nnx.Rngs(0), dtype=dtype))
    values = {}
    for p, var in nnx.to_flat_state(nnx.state(mtp, nnx.Param)):
        name, transposed = _hf_name(("mtp", *p))
        shape = tuple(var.get_value().shape)
        values[p] = src.take(name, shape[::-1]).T if transposed else src.take(name, shape)
    return assign_params(mtp, values)
