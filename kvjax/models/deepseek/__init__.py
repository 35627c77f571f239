"""Toy DeepSeek-V3.2 (MLA + DSA lightning indexer, dense MLP and MoE layers) with Hugging Face parity.

:mod:`~kvjax.models.deepseek.config` (``DeepseekConfig``), :mod:`~kvjax.models.deepseek.attention` (MLA + DSA,
``StepMeta``), :mod:`~kvjax.models.deepseek.layers` (MoE, decoder layer), :mod:`~kvjax.models.deepseek.model`
(``DeepseekV32``), :mod:`~kvjax.models.deepseek.loading` (HF checkpoints). The public names are re-exported here.
"""

from kvjax.models.deepseek.config import DeepseekConfig
from kvjax.models.deepseek.loading import from_hf, load
from kvjax.models.deepseek.model import DeepseekV32

__all__ = ["DeepseekConfig", "DeepseekV32", "from_hf", "load"]
