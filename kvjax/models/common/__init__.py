"""Pieces shared by the model families: :mod:`~kvjax.models.common.layers` (norms, ``Linear``, SwiGLU ``MLP``),
:mod:`~kvjax.models.common.rope` (HF rotary embeddings) and :mod:`~kvjax.models.common.checkpoint` (config and
safetensors reading, checked parameter assignment).
"""

__all__ = ["checkpoint", "layers", "parallel", "rope"]
