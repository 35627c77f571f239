"""Toy Qwen3.5 (GDN + gated attention) and DeepSeek (MLA + DSA) models, one package per family.

Every model satisfies :class:`kvjax.models.interface.CausalLM` (what the engine uses) and keeps its device state in
a :class:`kvjax.models.interface.ModelCaches`. ``load_pretrained(path)`` loads a Hugging Face ``save_pretrained``
directory (see :mod:`kvjax.models.loading`) with its ``generation_config.json`` as ``model.generation_config``
(:func:`load_generation_config`); ``load_tokenizer(path)`` the folder's tokenizer, if any;
``kvjax.models.qwen3_5.init_random`` builds toy weights.
"""

from kvjax.models.interface import CausalLM, ModelCaches
from kvjax.models.loading import GenerationConfig, load_generation_config, load_pretrained, load_tokenizer

__all__ = ["CausalLM", "GenerationConfig", "ModelCaches", "load_generation_config", "load_pretrained",
           "load_tokenizer"]
