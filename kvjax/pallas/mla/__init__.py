"""MLA / DSA kernels: the split-KV MLA decode in the Pallas Triton lowering, dense and DSA-sparse
(:mod:`.decode`), as a Mosaic GPU kernel for Hopper (:mod:`.decode_mgpu`), the sparse decode over the fp8 DSA
key roles (:mod:`.dsa_sparse`) and the lightning-indexer scores (:mod:`.dsa_indexer`). The split-KV host side
they share is :mod:`kvjax.pallas.split_kv`; the stage-1 pieces the two Triton-lowered decode kernels share are
:mod:`.common`. Which one runs is decided by the backend tables of
:mod:`kvjax.ops.mla` and :mod:`kvjax.ops.dsa`, never here: each kernel module exports its kernel and its
``unsupported()`` check.
"""

__all__ = ["common", "decode", "decode_mgpu", "dsa_indexer", "dsa_sparse"]
