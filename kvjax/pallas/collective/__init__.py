"""Collective kernels: the one-shot all-reduce over a mesh axis (:mod:`.allreduce_mgpu`). Which one runs is
decided by the backend table of :func:`kvjax.ops.collective.all_reduce`, never here."""

__all__ = ["allreduce_mgpu"]
