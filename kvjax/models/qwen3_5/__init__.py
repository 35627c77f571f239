"""Toy Qwen3.5 text model (GDN + gated attention) with Hugging Face parity.

:mod:`~kvjax.models.qwen3_5.config` (``Qwen3_5Config``), :mod:`~kvjax.models.qwen3_5.layers`,
:mod:`~kvjax.models.qwen3_5.model` (``Qwen3_5ForCausalLM``), :mod:`~kvjax.models.qwen3_5.loading`
(``init_random``, ``init_random_on_device``, HF checkpoints). The public names are re-exported here.
"""

from kvjax.models.qwen3_5.config import Qwen3_5Config
from kvjax.models.qwen3_5.loading import from_hf_config, init_random, init_random_on_device, load
from kvjax.models.qwen3_5.model import Qwen3_5ForCausalLM

__all__ = ["Qwen3_5Config", "Qwen3_5ForCausalLM", "from_hf_config", "init_random", "init_random_on_device", "load"]
