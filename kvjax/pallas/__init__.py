"""Pallas kernels only. Each module: kernel body, ``pallas_call`` builder, jitted wrapper.

Kernels are reached through :mod:`kvjax.ops` (``impl="pallas" | "interpret" | "auto"``), never imported by
callers directly; no config or environment imports inside a kernel module.
"""

import jax


def hopper_gpu() -> bool:
    """Whether JAX's default device is a Hopper (sm_90) GPU: where ``"auto"`` routes to Mosaic GPU kernels."""
    try:
        dev = jax.devices()[0]
    except RuntimeError:
        return False
    return dev.platform == "gpu" and str(getattr(dev, "compute_capability", "")).startswith("9")
