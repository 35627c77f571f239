"""Backend tables: the one place where kvjax decides which implementation of an op runs.

Every op owns one :class:`BackendTable`: its float32 pure-jnp reference (the oracle, always able to run) and
the kernels that implement it, each a :class:`Backend` with a priority, the devices it runs on and an
``unsupported(*args, **kwargs) -> reason | None`` check of the op's normalised call (shapes, dtypes, static
options; never array values) and, optionally, a ``prefer(*args, **kwargs) -> reason | None`` rule that only
``"auto"`` applies: why auto passes over a call the kernel can run (where it was measured slower than a
lower-priority backend) while the kernel stays reachable by name there. Backends hold their kernel functions
themselves, so the import graph shows which kernels an op uses; only the optional Triton kernels
(:mod:`kvjax.triton`, which need ``jax_triton``) are named by :func:`lazy` and imported when first called.

``impl`` values understood by :meth:`BackendTable.choose`:

- ``"auto"``: the highest-priority backend that runs on the device, accepts the call and whose ``prefer`` rule
  does not decline it, else the reference;
- ``"reference"``: the oracle;
- a backend's name (``"pallas"``, ``"mosaic"``, ``"triton"``, ...): that kernel, compiled (its ``prefer`` rule
  ignored); an error naming the reason when it cannot take this call on this device;
- ``"interpret"``: the ``"pallas"`` backend in Pallas interpret mode (runs on CPU); ``"NAME:interpret"``
  interprets backend ``NAME``.

A kernel function takes the op's normalised call plus the keyword ``interpret: bool``; :meth:`BackendTable.choose`
binds that keyword with :func:`functools.partial`, so choosing adds no Python frame between the op and the kernel.
Kernel modules never choose between kernels: that is this table's job (``python -m kvjax info`` prints its
decisions).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from typing import Any, Callable, Mapping

from kvjax.base.device import DeviceKind, current_device
from kvjax.errors import UnknownImplError

PRIMARY = "pallas"  # the backend that impl="interpret" interprets
_RESERVED = ("auto", "reference", "interpret")


__all__ = ["PRIMARY", "Backend", "BackendTable", "lazy", "on_gpu", "on_hopper"]


def lazy(target: str) -> Callable:
    """The function ``"module:function"``, imported at its first call: for kernels of optional packages only
    (:mod:`kvjax.triton`); every other backend holds its function directly."""
    module, sep, attr = target.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"lazy target must be 'module:function', got {target!r}")

    def call(*args, **kwargs):
        return getattr(importlib.import_module(module), attr)(*args, **kwargs)

    call.__name__ = call.__qualname__ = attr
    call.target = target
    return call


def on_gpu(device: DeviceKind) -> str | None:
    """Device check of a kernel that runs on any CUDA GPU (the Triton lowering, jax-triton)."""
    return None if device.platform == "gpu" else f"needs a GPU, this is {device}"


def on_hopper(device: DeviceKind) -> str | None:
    """Device check of a Mosaic GPU kernel (TMA, wgmma): Hopper only."""
    return None if device.hopper else f"needs a Hopper GPU (sm_90), this is {device}"


@dataclasses.dataclass(frozen=True)
class Backend:
    """One implementation of an op.

    ``fn`` is the kernel function and ``unsupported`` its check (a :func:`lazy` function for optional packages).
    ``unsupported`` receives the op's normalised call (arrays may be tracers or ``jax.ShapeDtypeStruct``)
    and returns why this kernel cannot take it, or ``None``. ``device`` says why a device cannot run it.
    ``prefer`` (same arguments as ``unsupported``): why ``"auto"`` does not take it for a call it can run, or
    ``None``; a by-name ``impl`` ignores it (``None``: auto takes it whenever it can).
    ``interpretable``: runs in Pallas interpret mode on CPU (``impl="NAME:interpret"``).
    """

    name: str
    fn: Callable
    priority: int
    device: Callable[[DeviceKind], str | None] = on_gpu
    unsupported: Callable[..., str | None] | None = None
    prefer: Callable[..., str | None] | None = None  # auto only: why auto passes over a call it can run
    interpretable: bool = True
    note: str = ""  # why it sits where it does (measurement, shapes), shown by ``kvjax info``

    def __post_init__(self):
        if self.name in _RESERVED or ":" in self.name or not self.name:
            raise ValueError(f"backend name {self.name!r} is reserved or malformed")
        for field in ("fn", "unsupported", "prefer", "device"):
            value = getattr(self, field)
            if not (callable(value) or (field in ("unsupported", "prefer") and value is None)):
                raise ValueError(f"backend {self.name!r}: {field} must be a function, got {value!r}")

    def shape_reason(self, args: tuple, kwargs: Mapping[str, Any]) -> str | None:
        """Why this kernel cannot take the call (``None``: it can), whatever the device."""
        return None if self.unsupported is None else self.unsupported(*args, **kwargs)

    def reason(self, device: DeviceKind, args: tuple, kwargs: Mapping[str, Any]) -> str | None:
        """Why this kernel cannot take the call on ``device`` (``None``: it can)."""
        return self.device(device) or self.shape_reason(args, kwargs)

    def auto_reason(self, device: DeviceKind, args: tuple, kwargs: Mapping[str, Any]) -> str | None:
        """Why ``"auto"`` does not take this kernel for the call on ``device`` (``None``: it does): :meth:`reason`,
        then the ``prefer`` rule (its reason prefixed ``"auto passes it over: "``)."""
        why = self.reason(device, args, kwargs)
        if why is not None or self.prefer is None:
            return why
        why = self.prefer(*args, **kwargs)
        return None if why is None else f"auto passes it over: {why}"


@dataclasses.dataclass(frozen=True)
class BackendTable:
    """The implementations of one op, tried by ``"auto"`` in descending ``priority``.

    ``examples`` maps a name (``"decode B=128 ..."``) to a function returning a representative normalised call
    ``(args, kwargs)`` built from ``jax.ShapeDtypeStruct``; ``kvjax info`` shows the choice for each.
    """

    op: str
    reference: Callable
    backends: tuple[Backend, ...] = ()
    examples: Mapping[str, Callable[[], tuple[tuple, dict]]] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        names = [b.name for b in self.backends]
        if len(set(names)) != len(names):
            raise ValueError(f"{self.op}: backend names repeat: {names}")
        object.__setattr__(self, "backends", tuple(sorted(self.backends, key=lambda b: -b.priority)))

    def names(self) -> list[str]:
        """Every implementation name of this op, reference first, then backends by priority."""
        return ["reference"] + [b.name for b in self.backends]

    def backend(self, name: str) -> Backend:
        """The backend called ``name``; :class:`UnknownImplError` listing the others if there is none."""
        for b in self.backends:
            if b.name == name:
                return b
        raise UnknownImplError(f"{self.op}: no implementation {name!r}; implementations: {self.names()}")

    def available(self, device: DeviceKind | None = None) -> list[str]:
        """Implementation names that run on ``device`` for some call (``"NAME:interpret"`` everywhere)."""
        device = device or current_device()
        out = ["reference"]
        for b in self.backends:
            if b.device(device) is None:
                out.append(b.name)
        out += [f"{b.name}:interpret" for b in self.backends if b.interpretable]
        return out

    def explain(self, args: tuple, kwargs: Mapping[str, Any],
                device: DeviceKind | None = None) -> list[tuple[str, str | None]]:
        """``(name, reason or None)`` for every backend in priority order, then the reference (never declines):
        what ``"auto"`` would take on ``device`` is the first entry without a reason (a reason includes a
        ``prefer`` rule's, :meth:`Backend.auto_reason`)."""
        device = device or current_device()
        return [(b.name, b.auto_reason(device, args, kwargs)) for b in self.backends] + [("reference", None)]

    def choose(self, impl: str, args: tuple, kwargs: Mapping[str, Any],
               device: DeviceKind | None = None) -> tuple[str, Callable]:
        """``(name, callable)`` implementing the normalised call ``args, kwargs`` for ``impl``.

        Raises :class:`UnknownImplError` for an unknown name, or a named backend that cannot run here or cannot
        take this call (the message says why).
        """
        named = self._named(impl)
        if impl == "reference":
            return "reference", self.reference
        device = device or current_device()
        if impl == "auto":
            for b in self.backends:
                if b.auto_reason(device, args, kwargs) is None:
                    return b.name, _bind(b, interpret=False)
            return "reference", self.reference
        b, interpret = named
        why = b.shape_reason(args, kwargs) if interpret else b.reason(device, args, kwargs)
        if why is not None:
            raise UnknownImplError(f"{self.op}: impl={impl!r} cannot take this call: {why}")
        return impl, _bind(b, interpret=interpret)

    def validate_impl(self, impl: str) -> None:
        """Reject an impl name that can never resolve (before any tracing); shape checks happen at call time."""
        self._named(impl)

    def _named(self, impl: str) -> tuple[Backend, bool] | None:
        """``(backend, interpret)`` that ``impl`` names (``None`` for ``"auto"`` / ``"reference"``);
        :class:`UnknownImplError` for a name that can never resolve."""
        if not isinstance(impl, str):
            raise UnknownImplError(f"{self.op}: impl must be a string, got {impl!r}")
        if impl in ("auto", "reference"):
            return None
        name, _, mode = impl.partition(":")
        if impl == "interpret":
            name, mode = PRIMARY, "interpret"
        if mode not in ("", "interpret"):
            raise UnknownImplError(f"{self.op}: impl {impl!r} is not 'NAME' or 'NAME:interpret'")
        b = self.backend(name)
        if mode == "interpret" and not b.interpretable:
            raise UnknownImplError(f"{self.op}: backend {name!r} has no interpret mode")
        return b, mode == "interpret"

    def __call__(self, impl: str, *args, **kwargs):
        """Run the normalised call with the implementation :meth:`choose` picks for ``impl``."""
        _, fn = self.choose(impl, args, kwargs)
        return fn(*args, **kwargs)


def _bind(backend: Backend, *, interpret: bool) -> Callable:
    return functools.partial(backend.fn, interpret=interpret)  # a partial: no Python frame of its own
