"""kvjax: the attention and KV-cache stack of an LLM server, in JAX and Pallas.

Subpackages: ``config`` (frozen configs), ``ops`` (public ops: references + kernel dispatch), ``pallas``
(kernels only), ``state`` (device pools as pytrees), ``sched`` (host allocators and scheduler, numpy only),
``models`` (toy Qwen3.5 and DeepSeek), ``engine`` (step function and engine loop).
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
