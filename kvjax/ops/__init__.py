"""The public numerical API of kvjax.

Each op validates its arguments on the host (trace time), then dispatches on ``impl`` (see
:mod:`kvjax.ops.dispatch`) to its pure-jnp float32 reference or to a Pallas kernel.
"""

from kvjax.ops import dispatch
from kvjax.ops.dispatch import available, resolve
from kvjax.ops.gdn import chunk_gated_delta_rule, recurrent_gated_delta_rule
from kvjax.ops.attention import dense_attention_reference, paged_attention
from kvjax.ops.conv import causal_conv1d, causal_conv1d_update
from kvjax.ops.mla import absorb_output, absorb_query, mla_decode, mla_prefill_reference, split_kv_b_proj
from kvjax.ops.dsa import index_topk, indexer_scores, sparse_mla_decode, sparse_mla_decode_fp8
