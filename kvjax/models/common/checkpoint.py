"""Checkpoint helpers shared by the model loaders.

They read a ``save_pretrained`` directory (``config.json`` + ``model.safetensors`` or a sharded
``model.safetensors.index.json``) into host numpy arrays, and :class:`TensorSource` hands tensors out by name
with shape, float-dtype and finiteness checks; :func:`check_param_dtype` checks a loader's ``dtype`` option.
Every problem raises :class:`kvjax.errors.CheckpointError` naming the file, key or tensor.
Loaders build the whole parameter tree before returning (:func:`assign_params`: all or nothing), so nothing
partially loaded ever escapes.
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterable, Mapping

import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvjax.errors import CheckpointError


def read_json_object(file: str | os.PathLike) -> dict:
    """The JSON object in ``file``; :class:`CheckpointError` if it cannot be read or parsed, or is not an object."""
    try:
        with open(file) as f:
            obj = json.load(f)
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"cannot parse {os.fspath(file)!r}: {err}") from err
    if not isinstance(obj, dict):
        raise CheckpointError(f"{os.fspath(file)!r} must hold a JSON object, got {type(obj).__name__}")
    return obj


def read_config(path: str | os.PathLike) -> dict:
    """Read ``<path>/config.json``; :class:`CheckpointError` if absent or not a JSON object."""
    file = os.path.join(os.fspath(path), "config.json")
    if not os.path.isfile(file):
        raise CheckpointError(f"no config.json in {os.fspath(path)!r}")
    return read_json_object(file)


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
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index!r}: weight_map must be a non-empty object of tensor name -> shard file, "
                                  f"got {weight_map!r:.200}")
        bad = next(((k, v) for k, v in weight_map.items() if not isinstance(v, str) or not v), None)
        if bad is not None:
            raise CheckpointError(f"{index!r}: weight_map[{bad[0]!r}] must be a shard file name, got {bad[1]!r}")
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


def check_param_dtype(dtype: Any) -> np.dtype:
    """``dtype`` as a numpy dtype if it is a floating dtype (float32, bfloat16, float16, ...); otherwise
    :class:`CheckpointError` naming it (parameters, activations and caches of the models are floats)."""
    try:
        out = jnp.dtype(dtype)
    except TypeError:
        raise CheckpointError(f"dtype must be a floating dtype such as jnp.float32 or jnp.bfloat16, got {dtype!r}") \
            from None
    if not jnp.issubdtype(out, jnp.floating):
        raise CheckpointError(f"dtype must be a floating dtype such as jnp.float32 or jnp.bfloat16, got {out}")
    return out


class TensorSource:
    """Named checkpoint tensors handed out with shape, dtype and value checks; tracks which were used.

    ``prefixes`` are tried in order for every name (e.g. ``("model.language_model.", "model.")`` for a
    multimodal wrapper), so a loader asks for ``"layers.0.mlp.up_proj.weight"`` once. ``check_finite``: a tensor
    holding NaN or inf (after the cast :meth:`take` makes) raises :class:`CheckpointError`.
    """

    def __init__(self, tensors: Mapping[str, np.ndarray], *, prefixes: Iterable[str] = ("",),
                 check_finite: bool = True):
        self.tensors = dict(tensors)
        self.prefixes = tuple(prefixes)
        self.check_finite = bool(check_finite)
        self.used: set[str] = set()

    def key(self, name: str) -> str | None:
        for prefix in self.prefixes:
            if prefix + name in self.tensors:
                return prefix + name
        return None

    def has(self, name: str) -> bool:
        return self.key(name) is not None

    def take(self, name: str, shape: tuple[int, ...], dtype=np.float32) -> np.ndarray:
        """The tensor ``name`` cast to ``dtype``; :class:`CheckpointError` if missing, of the wrong shape, stored
        with a non-float dtype (an integer tensor would be cast silently), or (``check_finite``) not finite."""
        key = self.key(name)
        if key is None:
            tried = [p + name for p in self.prefixes]
            raise CheckpointError(f"checkpoint is missing tensor {tried[0]!r} (tried {tried})")
        value = self.tensors[key]
        if tuple(value.shape) != tuple(shape):
            raise CheckpointError(
                f"tensor {key!r} has shape {tuple(value.shape)}, expected {tuple(shape)}"
            )
        if not jnp.issubdtype(value.dtype, jnp.floating):
            raise CheckpointError(f"tensor {key!r} has non-float dtype {value.dtype}; parameters are floats")
        out = np.asarray(value).astype(dtype)
        if self.check_finite and not np.isfinite(out).all():
            bad = int(out.size - np.isfinite(out).sum())
            raise CheckpointError(f"tensor {key!r} holds {bad} NaN / inf values (as {np.dtype(dtype)}); pass "
                                  "check_finite=False to load it anyway")
        self.used.add(key)
        return out

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
    flat = check_values(state, values)
    for path, var in flat.items():
        var.set_value(jnp.asarray(values[path], var.get_value().dtype))
    nnx.update(model, state)
    return model


def check_values(state: nnx.State, values: Mapping[tuple, Any]) -> dict[tuple, nnx.Variable]:
    """``{path: variable}`` of ``state`` after checking that ``values`` has exactly its paths and shapes;
    :class:`CheckpointError` names the first mismatch."""
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
    return flat


def abstract_model(build) -> nnx.Module:
    """``build()`` traced with ``nnx.eval_shape``: a model skeleton with no real parameters (no init cost).

    Fill it with :func:`assign_params` (loaders) before use.
    """
    return nnx.eval_shape(build)
