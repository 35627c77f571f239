"""Optional Triton kernels called from JAX through jax-triton (GPU only).

Used as comparison baselines for the Pallas kernels (``impl="triton"``). ``triton`` and ``jax_triton`` are
optional dependencies and are imported only inside this package's modules, which the op registry loads
lazily; importing :mod:`kvjax` or :mod:`kvjax.ops` never imports them.
"""
