"""What the current JAX device is: the facts the backend tables and kernel launch heuristics read.

:class:`DeviceKind` is a plain value, so a backend table can be asked what it *would* choose on a device that
is not this one (``python -m kvjax info --device h100``).
"""

from __future__ import annotations

import dataclasses

import jax

_DEFAULT_SMS = 132  # an H100 SXM / H200: the launch heuristics' default when the runtime does not say


@dataclasses.dataclass(frozen=True)
class DeviceKind:
    """A device as the kernel choice sees it: platform (``"cpu" | "gpu" | "tpu"``), CUDA compute capability
    (``"9.0"`` on Hopper, ``None`` off NVIDIA) and streaming-multiprocessor count."""

    platform: str
    compute_capability: str | None = None
    num_sms: int = _DEFAULT_SMS

    def __post_init__(self):
        if self.platform not in ("cpu", "gpu", "tpu"):
            raise ValueError(f"DeviceKind.platform must be 'cpu', 'gpu' or 'tpu', got {self.platform!r}")
        if isinstance(self.num_sms, bool) or not isinstance(self.num_sms, int) or self.num_sms < 1:
            raise ValueError(f"DeviceKind.num_sms must be a positive int, got {self.num_sms!r}")

    @property
    def hopper(self) -> bool:
        """An sm_90 GPU: where the Mosaic GPU kernels (TMA, wgmma) run."""
        return self.platform == "gpu" and str(self.compute_capability or "").startswith("9")

    def __str__(self) -> str:
        if self.platform != "gpu":
            return self.platform
        return f"gpu sm_{str(self.compute_capability or '?').replace('.', '')} ({self.num_sms} SMs)"


NAMED = {
    "cpu": DeviceKind("cpu"),
    "h100": DeviceKind("gpu", "9.0", 132),
    "h200": DeviceKind("gpu", "9.0", 132),
    "a100": DeviceKind("gpu", "8.0", 108),
}


def current_device() -> DeviceKind:
    """The :class:`DeviceKind` of JAX's default device."""
    dev = jax.local_devices()[0]
    if dev.platform != "gpu":
        return DeviceKind(dev.platform if dev.platform in ("cpu", "tpu") else "cpu")
    cc = getattr(dev, "compute_capability", None)
    return DeviceKind("gpu", None if cc is None else str(cc), int(getattr(dev, "core_count", 0) or _DEFAULT_SMS))


def num_sms() -> int:
    """Streaming multiprocessors of the default device (132 where the runtime does not say)."""
    return current_device().num_sms


def next_pow2(n: int) -> int:
    """Smallest power of two ``>= n`` (1 for ``n <= 1``)."""
    return 1 << max(0, (int(n) - 1).bit_length())


def is_pow2(n: int) -> bool:
    """Whether ``n`` is a positive power of two."""
    return n >= 1 and n & (n - 1) == 0
