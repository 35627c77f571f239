"""Bottom helpers every layer may import, importing nothing of kvjax but :mod:`kvjax.errors`: ragged-batch
indexing (:mod:`~kvjax.base.ragged`), host-side argument checks (:mod:`~kvjax.base.checks`), blockwise fp8
(:mod:`~kvjax.base.fp8`), the masked softmax (:mod:`~kvjax.base.softmax`) and device facts
(:mod:`~kvjax.base.device`)."""

__all__ = ["checks", "device", "fp8", "ragged", "slots", "softmax"]  # modules: import what you need from them
