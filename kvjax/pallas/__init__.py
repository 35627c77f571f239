"""Pallas kernels only. Each module: kernel body, ``pallas_call`` builder, jitted wrapper.

Kernels are reached through :mod:`kvjax.ops` (``impl="pallas" | "interpret" | "auto"``), never imported by
callers directly; no config or environment imports inside a kernel module.
"""
