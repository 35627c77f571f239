"""Head-wise paged attention kernels: the split-KV decode (:mod:`.decode`), the ragged prefill in the Pallas Triton
lowering (:mod:`.prefill`) and as a Mosaic GPU kernel for Hopper (:mod:`.prefill_mgpu`), and the launch metadata they
share (:mod:`.common`). Which one runs is decided by the backend table of :func:`kvjax.ops.attention.paged_attention`,
never here: each kernel module exports its kernel and its ``unsupported()`` check.
"""

__all__ = ["common", "decode", "prefill", "prefill_mgpu"]
