"""Draft-layer kernels: a small draft layer's chained one-token steps in one Triton-lowered program per row
(:mod:`.steps`). Which one runs is decided by the backend table of :mod:`kvjax.ops.draft`."""
