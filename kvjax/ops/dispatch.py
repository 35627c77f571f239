"""Implementation dispatch for the public ops.

Every op has a pure-jnp reference (the float32 oracle) and may register kernels by name. Kernels are
registered as ``"module:function"`` strings so that importing :mod:`kvjax.ops` never imports Pallas.
A kernel function takes the op's (validated) arguments plus a keyword ``interpret: bool``.

``impl`` values understood by :func:`resolve`:

- ``"reference"``: the pure-jnp oracle;
- ``"pallas"``: the op's primary kernel, compiled for the current backend;
- ``"interpret"``: the primary kernel in Pallas interpret mode (runs on CPU);
- ``"auto"``: the primary kernel where its platforms include the current backend, else the reference;
- any other registered name (e.g. ``"triton"``): that kernel, compiled.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from typing import Callable

import jax

from kvjax.errors import UnknownImplError

PRIMARY = "pallas"


@dataclasses.dataclass(frozen=True)
class _Kernel:
    target: str  # "module:function"
    platforms: tuple[str, ...]  # backends where the compiled kernel runs ("gpu", "tpu", ...)


_REFERENCES: dict[str, Callable] = {}
_KERNELS: dict[str, dict[str, _Kernel]] = {}


def register_reference(op: str, fn: Callable) -> None:
    """Register ``fn`` as the reference implementation of ``op``."""
    _REFERENCES[op] = fn
    _KERNELS.setdefault(op, {})


def register_kernel(op: str, name: str, target: str, *, platforms: tuple[str, ...] = ("gpu",)) -> None:
    """Register a kernel ``"module:function"`` for ``op`` under ``name`` (``"pallas"`` is the primary)."""
    if name in ("auto", "reference", "interpret"):
        raise ValueError(f"kernel name {name!r} is reserved")
    _KERNELS.setdefault(op, {})[name] = _Kernel(target, tuple(platforms))


@functools.cache
def _load(target: str) -> Callable:
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def available(op: str, platform: str | None = None) -> list[str]:
    """Implementation names usable for ``op`` on ``platform`` (default: the current JAX backend)."""
    platform = platform or jax.default_backend()
    names = ["reference"]
    for name, kernel in _KERNELS.get(op, {}).items():
        if platform in kernel.platforms:
            names.append(name)
        if name == PRIMARY:
            names.append("interpret")
    return names


def ops() -> list[str]:
    """All registered op names."""
    return sorted(_REFERENCES)


def resolve(op: str, impl: str) -> Callable:
    """Return the callable implementing ``op`` for ``impl``; raises :class:`UnknownImplError`."""
    if op not in _REFERENCES:
        raise UnknownImplError(f"unknown op {op!r}; registered ops: {ops()}")
    kernels = _KERNELS[op]
    platform = jax.default_backend()
    if impl == "reference":
        return _REFERENCES[op]
    if impl == "auto":
        primary = kernels.get(PRIMARY)
        if primary is not None and platform in primary.platforms:
            return functools.partial(_load(primary.target), interpret=False)
        return _REFERENCES[op]
    if impl == "interpret":
        if PRIMARY not in kernels:
            raise UnknownImplError(f"{op}: impl='interpret' needs a Pallas kernel; available: {available(op)}")
        return functools.partial(_load(kernels[PRIMARY].target), interpret=True)
    kernel = kernels.get(impl)
    if kernel is None:
        raise UnknownImplError(f"{op}: no implementation {impl!r}; available on {platform}: {available(op)}")
    if platform not in kernel.platforms:
        raise UnknownImplError(
            f"{op}: impl={impl!r} runs on {kernel.platforms}, not on the current backend {platform!r}; "
            f"available: {available(op)}"
        )
    return functools.partial(_load(kernel.target), interpret=False)
