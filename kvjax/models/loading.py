"""``load_pretrained(path)``: a Hugging Face ``save_pretrained`` directory -> a kvjax model; what else the folder
holds: :func:`load_generation_config` (``generation_config.json``: eos and the sampling defaults) and
:func:`load_tokenizer` (a ``transformers`` tokenizer, loaded offline from the folder).

Dispatch is on ``config.json``: first ``architectures[0]``, then ``model_type``, looked up in
:data:`LOADERS` (``name -> "module:function"``, imported lazily). A loader is called as
``fn(path: str, config: dict, **options) -> model`` and must build and check the whole model before returning
(nothing partially loaded escapes). To add a model family, add one line to :data:`LOADERS`.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import os
from typing import Any

from jax.sharding import Mesh

from kvjax.errors import CheckpointError
from kvjax.models.common.checkpoint import config_get, read_config, read_json_object
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
    generation = load_generation_config(path, config)  # a bad file fails before the weights are read
    module, _, attr = target.partition(":")
    fn = getattr(importlib.import_module(module), attr)
    model = fn(path, config, **options)
    vocab = int(model.vocab_size)
    for key, ids in (("eos_token_id", generation.eos_token_ids), ("bos_token_id", (generation.bos_token_id,)),
                     ("pad_token_id", (generation.pad_token_id,))):
        bad = [i for i in ids if i is not None and i >= vocab]
        if bad:
            raise CheckpointError(f"{generation.source}: {key} {bad[0]} is outside the vocabulary [0, {vocab})")
    model.generation_config = generation
    return model


GENERATION_FILE = "generation_config.json"


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
    """What a checkpoint says about generating with it: its ``generation_config.json`` (Hugging Face's
    ``GenerationConfig``), else the token ids in its ``config.json``. ``None`` / ``()``: not given.

    ``eos_token_ids``: every end-of-sequence id (Hugging Face allows one or a list; Qwen checkpoints list two);
    :attr:`eos_token_id` is the first; an ``Engine`` stops at every one of them by default. The sampling fields
    (``temperature``, ``top_k``, ``top_p``, ``do_sample``, ``max_new_tokens``) are the checkpoint's suggested
    defaults, reported as stored; kvjax applies none of them by itself. ``source``: the file they came from.
    """

    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    do_sample: bool | None = None
    max_new_tokens: int | None = None
    source: str | None = None

    @property
    def eos_token_id(self) -> int | None:
        """The first end-of-sequence id (``None`` if the checkpoint gives none): ``Engine(model,
        eos_token_id=model.generation_config.eos_token_id)``."""
        return self.eos_token_ids[0] if self.eos_token_ids else None


def _token_ids(value: Any, key: str, source: str) -> tuple[int, ...]:
    """An HF token-id field (``None``, an int or a list of ints) as a tuple; :class:`CheckpointError` naming
    ``key`` and ``source`` otherwise."""
    items = [] if value is None else value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in items):
        raise CheckpointError(f"{source}: {key} must be a token id >= 0 or a list of them, got {value!r}")
    return tuple(dict.fromkeys(items))  # order kept, duplicates dropped


def load_generation_config(path: str | os.PathLike, config: dict | None = None) -> GenerationConfig:
    """The :class:`GenerationConfig` of the checkpoint folder ``path``: its ``generation_config.json`` where there
    is one, else the ``eos_token_id`` / ``bos_token_id`` / ``pad_token_id`` of its ``config.json`` (or of that
    file's ``text_config``), as Hugging Face does; an empty one if neither gives any. ``config``: the folder's
    ``config.json`` already read. :func:`load_pretrained` attaches it to the model as ``model.generation_config``.

    Raises :class:`kvjax.errors.CheckpointError` naming the file and the key for a file that is not a JSON object
    or a field of the wrong type (a negative or non-integer token id, a non-number temperature, ...)."""
    path = os.fspath(path)
    file = os.path.join(path, GENERATION_FILE)
    if os.path.isfile(file):
        raw, source = read_json_object(file), file
    else:
        config = read_config(path) if config is None else config
        text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
        raw = {k: v for k in ("eos_token_id", "bos_token_id", "pad_token_id")
               if (v := config.get(k) if config.get(k) is not None else text.get(k)) is not None}
        source = os.path.join(path, "config.json")

    def one_id(key: str) -> int | None:
        ids = _token_ids(raw.get(key), key, source)
        if len(ids) > 1:
            raise CheckpointError(f"{source}: {key} must be one token id, got {raw.get(key)!r}")
        return ids[0] if ids else None

    def number(key: str, kind: type | tuple, ok) -> Any:
        try:
            value = config_get(raw, key, None, kind=kind)
        except CheckpointError as err:
            raise CheckpointError(f"{source}: {err}") from None
        if value is not None and not ok(value):
            raise CheckpointError(f"{source}: {key} out of range, got {value!r}")
        return value

    return GenerationConfig(
        eos_token_ids=_token_ids(raw.get("eos_token_id"), "eos_token_id", source),
        bos_token_id=one_id("bos_token_id"), pad_token_id=one_id("pad_token_id"),
        temperature=number("temperature", (int, float), lambda v: math.isfinite(v) and v >= 0),
        top_k=number("top_k", int, lambda v: v >= 0),
        top_p=number("top_p", (int, float), lambda v: 0 < v <= 1),
        do_sample=number("do_sample", bool, lambda v: True),  # config_get rejects a non-bool
        max_new_tokens=number("max_new_tokens", int, lambda v: v >= 1),
        source=source)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")


def load_tokenizer(path: str | os.PathLike):
    """The tokenizer saved in the checkpoint folder ``path`` (a ``transformers`` ``PreTrainedTokenizerBase``,
    loaded with ``AutoTokenizer.from_pretrained(path, local_files_only=True)``: nothing is downloaded), or
    ``None`` where the folder holds no tokenizer file (:data:`TOKENIZER_FILES`).

    The engine takes and returns token ids: ``tok(text)["input_ids"]`` in, ``tok.decode(ids)`` out. Raises
    ``ImportError`` saying what to install where the folder has a tokenizer and ``transformers`` is missing, and
    :class:`kvjax.errors.CheckpointError` naming the folder where ``transformers`` cannot load it."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint directory {path!r} does not exist")
    if not any(os.path.isfile(os.path.join(path, name)) for name in TOKENIZER_FILES):
        return None
    try:
        from transformers import AutoTokenizer
    except ImportError as err:
        raise ImportError(f"the tokenizer in {path!r} needs transformers (pip install transformers)") from err
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, TypeError, KeyError, json.JSONDecodeError) as err:
        raise CheckpointError(f"cannot load the tokenizer in {path!r}: {err}") from err
    except Exception as err:  # the tokenizers library raises its own Exception types for a corrupt file
        raise CheckpointError(f"cannot load the tokenizer in {path!r}: {type(err).__name__}: {err}") from err
