"""Building blocks shared by the toy models: RMSNorm variants, RoPE, and checkpoint loading helpers.

Numerics follow Hugging Face transformers exactly (norms in float32, RoPE angles in float32), so a model built
from these pieces can match its ``transformers`` counterpart to float32 round-off.

Loading helpers read a ``save_pretrained`` directory (``config.json`` + ``model.safetensors`` or a sharded
``model.safetensors.index.json``) into host numpy arrays, and :class:`TensorSource` hands tensors out by name
with shape checks. Every problem raises :class:`kvjax.errors.CheckpointError` naming the file, key or tensor.
Loaders build the whole parameter tree before returning, so nothing partially loaded ever escapes.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Iterable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvjax.errors import CheckpointError

# --------------------------------------------------------------------------------------------------- norms


def rms_norm(
    x: jax.Array,  # [..., D]
    weight: jax.Array,  # [D]
    eps: float,
    *,
    zero_centered: bool = False,
) -> jax.Array:  # [..., D] in x's dtype
    """RMSNorm in float32. ``zero_centered``: scale by ``1 + weight`` (Qwen3.5), else by ``weight``.

    Matches HF rounding: Qwen3.5's zero-centred norm multiplies in f32 then casts; the Llama-style norm casts
    the normalised activations to the input dtype before multiplying by the weight.
    """
    xf = x.astype(jnp.float32)
    normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    if zero_centered:
        return (normed * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)
    return weight * normed.astype(x.dtype)


def gated_rms_norm(
    x: jax.Array,  # [..., D]
    gate: jax.Array,  # [..., D]
    weight: jax.Array,  # [D]
    eps: float,
) -> jax.Array:  # [..., D] in x's dtype
    """``weight * rmsnorm(x) * silu(gate)`` (norm before gate), as Qwen3.5's ``RMSNormGated``."""
    xf = x.astype(jnp.float32)
    normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    out = weight * normed.astype(x.dtype)
    return (out * jax.nn.silu(gate.astype(jnp.float32))).astype(x.dtype)


class RMSNorm(nnx.Module):
    """RMSNorm with a learned scale ``weight: [D]`` (``zero_centered``: init 0, scale ``1 + weight``)."""

    def __init__(self, dim: int, eps: float = 1e-6, *, zero_centered: bool = False, dtype=jnp.float32):
        self.eps = float(eps)
        self.zero_centered = bool(zero_centered)
        init = jnp.zeros if zero_centered else jnp.ones
        self.weight = nnx.Param(init((dim,), dtype))  # [D]

    def __call__(self, x: jax.Array) -> jax.Array:  # [..., D] -> [..., D]
        return rms_norm(x, self.weight[...], self.eps, zero_centered=self.zero_centered)


class GatedRMSNorm(nnx.Module):
    """``weight * rmsnorm(x) * silu(gate)`` with ``weight: [D]`` initialised to ones."""

    def __init__(self, dim: int, eps: float = 1e-6, *, dtype=jnp.float32):
        self.eps = float(eps)
        self.weight = nnx.Param(jnp.ones((dim,), dtype))  # [D]

    def __call__(self, x: jax.Array, gate: jax.Array) -> jax.Array:  # [..., D], [..., D] -> [..., D]
        return gated_rms_norm(x, gate, self.weight[...], self.eps)


class Linear(nnx.Module):
    """``y = x @ kernel (+ bias)`` with ``kernel: [in, out]`` (the transpose of a torch ``Linear.weight``)."""

    def __init__(self, d_in: int, d_out: int, *, bias: bool = False, rngs: nnx.Rngs, dtype=jnp.float32):
        scale = 1.0 / math.sqrt(d_in)
        self.kernel = nnx.Param(scale * jax.random.normal(rngs.params(), (d_in, d_out), dtype))  # [in, out]
        self.bias = nnx.Param(jnp.zeros((d_out,), dtype)) if bias else None  # [out] | None

    def __call__(self, x: jax.Array) -> jax.Array:  # [..., in] -> [..., out]
        y = jnp.matmul(x, self.kernel[...], precision=jax.lax.Precision.HIGHEST)
        return y if self.bias is None else y + self.bias[...]


# --------------------------------------------------------------------------------------------------- RoPE


def rope_inv_freq(head_dim: int, rope_parameters: Mapping[str, Any], *,
                  max_position_embeddings: int | None = None) -> tuple[np.ndarray, float]:
    """Inverse frequencies ``f32[rotary_dim // 2]`` and the cos/sin scaling (``attention_factor``).

    ``rope_parameters`` is HF's dict: ``rope_theta``, optional ``partial_rotary_factor`` (rotary_dim =
    ``int(head_dim * factor)``) and ``rope_type`` ``"default"`` or ``"yarn"`` (``factor``,
    ``original_max_position_embeddings``, ``beta_fast``/``beta_slow``, ``mscale``/``mscale_all_dim``,
    ``attention_factor``, ``truncate``) with HF's formulas. Other rope types raise :class:`CheckpointError`.
    """
    rp = dict(rope_parameters)
    rope_type = rp.get("rope_type", rp.get("type", "default"))
    if "rope_theta" not in rp:
        raise CheckpointError(f"rope_parameters has no 'rope_theta': {rp!r}")
    base = float(rp["rope_theta"])
    dim = int(head_dim * float(rp.get("partial_rotary_factor", 1.0) or 1.0))
    if dim < 2 or dim % 2:
        raise CheckpointError(f"rotary dim {dim} (head_dim={head_dim}, rope_parameters={rp!r}) must be even >= 2")
    exponents = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    pos_freqs = np.float32(base) ** exponents
    if rope_type == "default":
        return (1.0 / pos_freqs).astype(np.float32), 1.0
    if rope_type != "yarn":
        raise CheckpointError(f"unsupported rope_type {rope_type!r} (supported: 'default', 'yarn')")
    orig = rp.get("original_max_position_embeddings")
    if orig is None:
        raise CheckpointError(f"yarn rope_parameters need 'original_max_position_embeddings': {rp!r}")
    factor = rp.get("factor")
    if factor is None:
        if max_position_embeddings is None:
            raise CheckpointError("yarn rope without 'factor' needs max_position_embeddings")
        factor = max_position_embeddings / orig
    factor = float(factor)

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = rp.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = rp.get("mscale"), rp.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)
    beta_fast = rp.get("beta_fast") or 32
    beta_slow = rp.get("beta_slow") or 1

    def correction_dim(rot: float) -> float:
        return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rp.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
    extrapolation = 1.0 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq.astype(np.float32), float(attention_factor)


def rope_cos_sin(
    positions: jax.Array,  # i32[...]
    inv_freq: jax.Array,  # f32[R/2]
    attention_factor: float = 1.0,
) -> tuple[jax.Array, jax.Array]:  # f32[..., R/2] each
    """cos/sin of ``position * inv_freq`` in float32, times ``attention_factor``."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    return jnp.cos(angles) * attention_factor, jnp.sin(angles) * attention_factor


def apply_rope(
    x: jax.Array,  # [..., H, D]
    cos: jax.Array,  # f32[..., R/2] (broadcast over H)
    sin: jax.Array,  # f32[..., R/2]
    *,
    interleaved: bool = False,
) -> jax.Array:  # [..., H, D] in x's dtype
    """Rotate the first ``R`` dims of each head (partial rotary: dims ``R..D`` pass through unchanged).

    ``interleaved=False``: NeoX / HF ``rotate_half`` layout (pairs ``(i, i + R/2)``). ``interleaved=True``:
    DeepSeek layout (pairs ``(2i, 2i+1)``), output de-interleaved ``[even', odd']`` exactly as HF's
    ``apply_rotary_pos_emb_interleave`` (q and k get the same permutation, so ``q.k`` is unchanged).
    cos/sin are cast to ``x.dtype`` first, as HF does.
    """
    half = cos.shape[-1]
    rot, rest = x[..., : 2 * half], x[..., 2 * half:]
    c = cos[..., None, :].astype(x.dtype)
    s = sin[..., None, :].astype(x.dtype)
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
    else:
        x1, x2 = rot[..., :half], rot[..., half:]
    out = jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
    return jnp.concatenate([out, rest], axis=-1) if rest.shape[-1] else out


# ----------------------------------------------------------------------------------------------- loading


def read_config(path: str | os.PathLike) -> dict:
    """Read ``<path>/config.json``; :class:`CheckpointError` if absent or not a JSON object."""
    file = os.path.join(os.fspath(path), "config.json")
    if not os.path.isfile(file):
        raise CheckpointError(f"no config.json in {os.fspath(path)!r}")
    try:
        with open(file) as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"cannot parse {file!r}: {err}") from err
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{file!r} must hold a JSON object, got {type(cfg).__name__}")
    return cfg


def config_get(cfg: Mapping[str, Any], key: str, default: Any = ..., *, kind: type | tuple = ()) -> Any:
    """``cfg[key]`` (or ``default``), checked against ``kind``; :class:`CheckpointError` names the key."""
    if key not in cfg or cfg[key] is None:
        if default is ...:
            raise CheckpointError(f"config is missing required key {key!r}")
        return default
    value = cfg[key]
    if kind and (not isinstance(value, kind) or (isinstance(value, bool) and bool not in _as_tuple(kind))):
        raise CheckpointError(f"config key {key!r} must be {kind}, got {value!r}")
    return value


def _as_tuple(kind) -> tuple:
    return kind if isinstance(kind, tuple) else (kind,)


def _read_safetensors(file: str) -> dict[str, np.ndarray]:
    from safetensors import safe_open

    out: dict[str, np.ndarray] = {}
    try:
        with safe_open(file, framework="numpy") as f:
            for name in f.keys():
                out[name] = f.get_tensor(name)
    except Exception as err:  # noqa: BLE001 — bf16 (no numpy dtype) or a corrupt file
        try:
            with safe_open(file, framework="flax") as f:
                for name in f.keys():
                    out[name] = np.asarray(f.get_tensor(name))
        except Exception as err2:  # noqa: BLE001
            raise CheckpointError(f"cannot read safetensors file {file!r}: {err}; {err2}") from err2
    return out


def load_safetensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """All tensors of a ``save_pretrained`` directory as host numpy arrays (single file or sharded index)."""
    path = os.fspath(path)
    single = os.path.join(path, "model.safetensors")
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(single):
        return _read_safetensors(single)
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as err:
            raise CheckpointError(f"cannot parse {index!r}: {err}") from err
        tensors: dict[str, np.ndarray] = {}
        for shard in sorted(set(weight_map.values())):
            shard_file = os.path.join(path, shard)
            if not os.path.isfile(shard_file):
                raise CheckpointError(f"shard {shard!r} listed in {index!r} is missing")
            tensors.update(_read_safetensors(shard_file))
        missing = sorted(set(weight_map) - set(tensors))
        if missing:
            raise CheckpointError(f"tensors listed in {index!r} not found in shards: {missing[:5]}")
        return tensors
    raise CheckpointError(f"no model.safetensors or model.safetensors.index.json in {path!r}")


class TensorSource:
    """Named checkpoint tensors handed out with shape checks; tracks which were used.

    ``prefixes`` are tried in order for every name (e.g. ``("model.language_model.", "model.")`` for a
    multimodal wrapper), so a loader asks for ``"layers.0.mlp.up_proj.weight"`` once.
    """

    def __init__(self, tensors: Mapping[str, np.ndarray], *, prefixes: Iterable[str] = ("",)):
        self.tensors = dict(tensors)
        self.prefixes = tuple(prefixes)
        self.used: set[str] = set()

    def key(self, name: str) -> str | None:
        for prefix in self.prefixes:
            if prefix + name in self.tensors:
                return prefix + name
        return None

    def has(self, name: str) -> bool:
        return self.key(name) is not None

    def take(self, name: str, shape: tuple[int, ...], dtype=np.float32) -> np.ndarray:
        """The tensor ``name`` cast to ``dtype``; :class:`CheckpointError` if missing or of the wrong shape."""
        key = self.key(name)
        if key is None:
            tried = [p + name for p in self.prefixes]
            raise CheckpointError(f"checkpoint is missing tensor {tried[0]!r} (tried {tried})")
        value = self.tensors[key]
        if tuple(value.shape) != tuple(shape):
            raise CheckpointError(
                f"tensor {key!r} has shape {tuple(value.shape)}, expected {tuple(shape)}"
            )
        self.used.add(key)
        return np.asarray(value).astype(dtype)

    def unused(self, ignore_prefixes: Iterable[str] = ()) -> list[str]:
        """Tensor names never taken (minus ``ignore_prefixes``), sorted."""
        ignore = tuple(ignore_prefixes)
        return sorted(k for k in self.tensors if k not in self.used and not k.startswith(ignore))


def assign_params(model: nnx.Module, values: Mapping[tuple, np.ndarray]) -> nnx.Module:
    """Replace every ``nnx.Param`` of ``model`` by ``values[path]`` (path as in ``nnx.state``); all or nothing.

    Raises :class:`CheckpointError` if a parameter has no value, a value has no parameter, or shapes differ.
    The model is modified only after every check has passed.
    """
    graphdef, state = nnx.split(model)
    flat = dict(nnx.to_flat_state(state))
    missing = [p for p in flat if p not in values]
    extra = [p for p in values if p not in flat]
    if missing or extra:
        raise CheckpointError(f"parameter tree mismatch: no value for {missing[:5]}, no parameter for {extra[:5]}")
    for path, var in flat.items():
        have = tuple(var.get_value().shape)
        if have != tuple(values[path].shape):
            raise CheckpointError(
                f"parameter {'.'.join(map(str, path))} has shape {have}, value has {tuple(values[path].shape)}"
            )
    for path, var in flat.items():
        var.set_value(jnp.asarray(values[path], var.get_value().dtype))
    nnx.update(model, state)
    return model


def abstract_model(build) -> nnx.Module:
    """``build()`` traced with ``nnx.eval_shape``: a model skeleton with no real parameters (no init cost).

    Fill it with :func:`assign_params` (loaders) before use.
    """
    return nnx.eval_shape(build)
