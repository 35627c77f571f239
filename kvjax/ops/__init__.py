"""The public numerical API of kvjax.

Each op validates its arguments on the host (trace time), normalises them, then runs the implementation its
backend table (:mod:`kvjax.ops.backends`) chooses for ``impl``: the pure-jnp float32 reference or a kernel.
:func:`tables` lists every table (``python -m kvjax info`` prints their choices).
"""

import importlib
import pkgutil

from kvjax.ops.attention import dense_attention_reference, paged_attention
from kvjax.ops.backends import Backend, BackendTable
from kvjax.ops.conv import causal_conv1d, causal_conv1d_update
from kvjax.ops.dsa import index_topk, indexer_scores, sparse_mla_decode, sparse_mla_decode_fp8
from kvjax.ops.gdn import chunk_gated_delta_rule, recurrent_gated_delta_rule
from kvjax.ops.mla import absorb_output, absorb_query, mla_decode, mla_prefill_reference, split_kv_b_proj

__all__ = [
    "Backend", "BackendTable", "absorb_output", "absorb_query", "causal_conv1d", "causal_conv1d_update",
    "chunk_gated_delta_rule", "dense_attention_reference", "index_topk", "indexer_scores", "mla_decode",
    "mla_prefill_reference", "paged_attention", "recurrent_gated_delta_rule", "sparse_mla_decode",
    "sparse_mla_decode_fp8", "split_kv_b_proj", "tables",
]


def tables() -> list[BackendTable]:
    """Every op's :class:`BackendTable`, sorted by op name (imports the op modules of this package, no kernel)."""
    found: dict[str, BackendTable] = {}
    for info in pkgutil.iter_modules(__path__):
        module = importlib.import_module(f"{__name__}.{info.name}")
        for value in vars(module).values():
            if isinstance(value, BackendTable):
                found[value.op] = value
    return [found[op] for op in sorted(found)]
