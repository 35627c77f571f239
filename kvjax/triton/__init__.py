"""Optional Triton kernels called from JAX through jax-triton (GPU only).

Comparison baselines for the Pallas kernels, registered in the ops' backend tables (``impl="triton"``) below the
Pallas kernels, so ``impl="auto"`` does not take them. ``triton`` and ``jax_triton`` are optional dependencies
(the ``triton`` extra), imported only by this package's kernel modules, which the backend tables load lazily;
importing :mod:`kvjax`, :mod:`kvjax.ops` or this package never imports them. :func:`unsupported` is the check
the tables run before loading a kernel of this package; :func:`mla_decode_unsupported` adds the MLA kernel's tile
limits.
"""

from __future__ import annotations

import importlib.util

from kvjax.pallas.split_kv import tile_reason

__all__ = ["OPTIONAL", "mla_decode_unsupported", "unsupported"]

OPTIONAL = ("triton", "jax_triton")


def unsupported(*args, **kwargs) -> str | None:
    """Why no kernel of this package can run here (its optional packages are missing), or None; any call."""
    del args, kwargs
    missing = [name for name in OPTIONAL if importlib.util.find_spec(name) is None]
    if missing:
        return f"needs the optional package(s) {', '.join(missing)} (pip install 'kvjax[triton]')"
    return None


def mla_decode_unsupported(call, latent_pages) -> str | None:  # kvjax.ops.mla.MLADecodeCall, [P, page_size, R + r]
    """Backend-table check of :func:`kvjax.triton.mla_decode.mla_decode_triton`: :func:`unsupported`, then the
    Triton tile limits it shares with the Pallas kernel (:func:`kvjax.pallas.split_kv.tile_reason`)."""
    return unsupported() or tile_reason(call, latent_pages)
