"""Pallas kernels only, grouped by family: ``gdn/`` (chunked prefill, recurrent and slot decode, conv on the
pool), ``paged/`` (paged attention decode and prefill, Triton lowering and Mosaic GPU), ``mla/`` (MLA and DSA
decode, indexer); ``split_kv`` (stage 2 and the host side of every split-KV kernel) and ``mgpu_common`` (Mosaic
GPU helpers) serve several families.

Each kernel module: kernel body, ``pallas_call`` builder, jitted wrapper, and an ``unsupported(...)`` check of
the op's normalised call. Kernels are reached through the backend tables of :mod:`kvjax.ops`, which alone choose
between them; a kernel module never routes to another kernel and imports no config.
"""

__all__ = ["gdn", "mgpu_common", "mla", "paged", "split_kv", "swiglu"]  # kernel packages and modules
