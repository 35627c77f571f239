"""Gated DeltaNet kernels (Pallas, Triton lowering): the chunked prefill (:mod:`.chunk`, with its preparation
stage :mod:`.prep`), the recurrent decode / verification and the slot decode step (:mod:`.recurrent`), the
causal conv1d on the GDN conv pool (:mod:`.conv`), and the state-pool convention they share (:mod:`.common`).
Which one runs is decided by the backend tables of :mod:`kvjax.ops.gdn`, :mod:`kvjax.ops.gdn_on_pool` and
:mod:`kvjax.ops.conv`, never here: each kernel module exports its kernels and their ``unsupported()`` checks.
"""

__all__ = ["chunk", "common", "conv", "prep", "recurrent"]
