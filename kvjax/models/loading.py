"""``load_pretrained(path)``: a Hugging Face ``save_pretrained`` directory -> a kvjax model.

Dispatch is on ``config.json``: first ``architectures[0]``, then ``model_type``, looked up in
:data:`LOADERS` (``name -> "module:function"``, imported lazily). A loader is called as
``fn(path: str, config: dict, **options) -> model`` and must build and check the whole model before returning
(nothing partially loaded escapes). To add a model family, add one line to :data:`LOADERS`.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

from jax.sharding import Mesh

from kvjax.errors import CheckpointError
from kvjax.models.common.checkpoint import read_config
from kvjax.models.interface import CausalLM

LOADERS: dict[str, str] = {
    # architecture or model_type -> "module:function"
    "Qwen3_5ForCausalLM": "kvjax.models.qwen3_5.loading:load",
    "Qwen3_5ForConditionalGeneration": "kvjax.models.qwen3_5.loading:load",  # text tower only
    "qwen3_5_text": "kvjax.models.qwen3_5.loading:load",
    "qwen3_5": "kvjax.models.qwen3_5.loading:load",
    "DeepseekV32ForCausalLM": "kvjax.models.deepseek.loading:load",
    "deepseek_v32": "kvjax.models.deepseek.loading:load",
}


def resolve_loader(config: dict) -> tuple[str, str]:
    """``(matched name, "module:function")`` for a config dict; :class:`CheckpointError` if unknown."""
    archs = config.get("architectures") or []
    if not isinstance(archs, list):
        raise CheckpointError(f"config 'architectures' must be a list, got {archs!r}")
    for name in [*archs, config.get("model_type")]:
        if isinstance(name, str) and name in LOADERS:
            return name, LOADERS[name]
    raise CheckpointError(
        f"unknown architecture: architectures={archs!r}, model_type={config.get('model_type')!r}; "
        f"supported: {sorted(LOADERS)}"
    )


def load_pretrained(path: str | os.PathLike, **options: Any) -> CausalLM:
    """Load the model saved at ``path`` (``config.json`` + safetensors) with the loader its config names.

    ``options`` go to the family's loader (all accept ``dtype``, a floating dtype, ``check_finite``, default
    True, and ``mesh``; Qwen3.5 also ``window``/``sinks`` for SWA heads). With ``mesh`` (a
    ``jax.sharding.Mesh`` with axes ``("data", "model")``) the result is a
    :class:`kvjax.models.sharding.ShardedModel`: each parameter is read on the host and its shards placed
    directly on their devices (``jax.device_put`` with the NamedSharding of its rule,
    :func:`kvjax.models.sharding.param_spec`); no device ever holds a whole model-split parameter.

    Raises ``ValueError`` for a ``mesh`` that is not a ``Mesh`` (before reading anything) and
    :class:`kvjax.errors.CheckpointError` for a missing directory, an unknown architecture, a bad
    config, a non-float ``dtype``, or a missing / mis-shaped / integer-typed tensor or one holding NaN / inf
    (unless ``check_finite=False``); the message names it.
    """
    mesh = options.get("mesh")
    if mesh is not None and not isinstance(mesh, Mesh):
        raise ValueError(f"load_pretrained: mesh must be a jax.sharding.Mesh with axes ('data', 'model') or None, "
                         f"got {mesh!r}")
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint directory {path!r} does not exist")
    config = read_config(path)
    _, target = resolve_loader(config)
    module, _, attr = target.partition(":")
    fn = getattr(importlib.import_module(module), attr)
    return fn(path, config, **options)
