"""Toy Qwen3.5 (GDN + gated attention) and DeepSeek (MLA + DSA) models.

``load_pretrained(path)`` loads a Hugging Face ``save_pretrained`` directory (see :mod:`kvjax.models.loading`).
"""

from kvjax.models.loading import load_pretrained
