"""What the engine needs from a model: the :class:`CausalLM` protocol and the :class:`ModelCaches` pytree.

Every model family (:mod:`kvjax.models.qwen3_5`, :mod:`kvjax.models.deepseek`) is an ``nnx.Module`` that
satisfies :class:`CausalLM`; the engine talks to a model only through it (it never names a model class). Both
families keep their device state in one :class:`ModelCaches` (paged roles by registry name, plus the per-slot
GDN state pool where the model has recurrent layers), which a jitted step takes donated and returns updated.
A model that drafts for speculative decoding from multi-token-prediction layers (Qwen3.5 with its ``mtp.*``
weights loaded) also offers ``forward_step_hidden`` and :func:`draft_head` (a :class:`DraftHead`). A step's
inputs are a :class:`kvjax.inputs.StepInputs`, registered here as a pytree (its arrays are the leaves,
``decode_only`` and ``max_query_len`` are static), so every model and every jitted step sees it as one.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, runtime_checkable

import jax

from kvjax.config import AttentionConfig
from kvjax.inputs import DEVICE_FIELDS, STATIC_FIELDS, StepInputs
from kvjax.state.gdn_pool import GDNStatePool


jax.tree_util.register_dataclass(StepInputs, data_fields=list(DEVICE_FIELDS), meta_fields=list(STATIC_FIELDS))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ModelCaches:
    """Device state of one model (a pytree: donate it to the step, use only the returned one afterwards).

    ``pages``: every paged role of every layer as :func:`kvjax.state.registry.create_caches` names them,
    ``{<role>_caches_<layer>: [P, page_size, ...]}`` (Qwen3.5: ``key``/``value`` single-head K/V pools of each
    full-attention layer; DeepSeek: the MLA latent ``key`` and the DSA indexer roles of each layer). A jitted
    step returns the dict in sorted-key order: go by name. ``gdn``: the slot-addressed GDN state pool of the
    linear-attention layers (pool layer ``i`` = ``i``-th GDN layer; slot 0 = PAD, never written), ``None`` for a
    model without recurrent layers.
    """

    pages: dict[str, jax.Array]  # {"<role>_caches_<layer>": [P, page_size, ...]}
    gdn: GDNStatePool | None = None  # conv [L_gdn, S+1, conv_dim, W-1], ssm f32[L_gdn, S+1, Hv, K, V] | None


@runtime_checkable
class CausalLM(Protocol):
    """A causal language model the engine can serve (an ``nnx.Module``; ``nnx.split`` gives its parameters).

    ``isinstance(model, CausalLM)`` checks that the members exist (not their signatures); the contract below
    is what each must do.
    """

    @property
    def vocab_size(self) -> int:
        """Number of token ids: inputs are ids in ``[0, vocab_size)``, logits are ``f32[..., vocab_size]``."""
        ...

    def attention_layout(self) -> AttentionConfig:
        """The block-table layout the scheduler manages: one table per KV head (``num_kv_heads`` heads with
        their per-head ``window``/``sinks``; a latent-cache model reports one head of the latent width). The
        scheduler's ``StepInputs.block_tables i32[B, Hkv, max_blocks]`` and ``slot_mapping i32[T, Hkv]`` have
        this many heads."""
        ...

    def init_caches(self, *, num_pages: int, page_size: int, max_seqs: int, dtype: Any, **options: Any
                    ) -> ModelCaches:
        """Zeroed caches: ``num_pages`` pages of ``page_size`` tokens per paged role (element dtype ``dtype``
        where the role has no fixed dtype), per-sequence state for slots ``0..max_seqs`` (slot 0 = PAD).
        ``options`` are family-specific (e.g. DeepSeek's ``kind``, ``indexer_fp8``); unknown ones raise
        ``TypeError``."""
        ...

    def forward_step(self, caches: ModelCaches, inputs: StepInputs) -> tuple[jax.Array, ModelCaches]:
        """One ragged step over ``inputs`` (:class:`kvjax.inputs.StepInputs`: ``T`` tokens of ``B``
        rows, prefill chunks and decode tokens mixed). Pure: writes this step's tokens into the caches at
        ``slot_mapping`` (and GDN states at ``gdn_slots``; padding writes nothing), attends through
        ``block_tables``, and returns ``(logits f32[B, vocab_size] at logits_indices, new caches)`` with the
        same structure, shapes and dtypes as ``caches``. Traceable under ``jax.jit`` with ``caches`` donated."""
        ...

    def logits(self, input_ids: jax.Array) -> jax.Array:
        """Full-sequence forward without a cache: ``i32[B, T]`` (positions ``0..T-1``) -> ``f32[B, T, vocab]``;
        the oracle of :meth:`forward_step`."""
        ...


@runtime_checkable
class DraftHead(Protocol):
    """Multi-token-prediction layers held beside a model (:func:`draft_head`; Qwen3.5's MTP layer,
    :class:`kvjax.models.qwen3_5.mtp.Qwen3_5MTP`): the drafter of ``speculative="mtp"``, run inside the jitted step
    (an ``nnx.Module``: ``nnx.split`` gives its parameters). Its K/V pools live in :attr:`ModelCaches.pages` beside
    the model's, named after the model's layers and addressed by the same block tables and slot mappings."""

    def init_caches(self, *, num_pages: int, page_size: int, dtype: Any, kv_cache_dtype: str = "auto"
                    ) -> dict[str, jax.Array]:
        """Its zeroed page pools ``{<role>_caches_<layer>: [P, page_size, ...]}`` (names distinct from the
        model's), ``num_pages`` as the model's."""
        ...

    def propose(self, model: Any, pages: dict[str, jax.Array], hidden: jax.Array, inputs: StepInputs,
                sampled: jax.Array, *, num_draft: int) -> tuple[jax.Array, dict[str, jax.Array]]:
        """After a model step (``hidden [T, H]``: its final-normed hidden states, ``forward_step_hidden``;
        ``inputs.logits_indices``: each row's last accepted token; ``sampled i32[B]``: the token after it): writes
        its K/V of the step's tokens (the catch-up) and returns ``(drafts i32[B, num_draft], new pages)`` (``-1``
        for rows without tokens)."""
        ...


def draft_head(model: Any) -> DraftHead | None:
    """The MTP layers ``model`` drafts with (``model.mtp_head()`` of a model that has ``forward_step_hidden``),
    or ``None`` when it has none (a DeepSeek model, a Qwen3.5 checkpoint without ``mtp.*`` weights)."""
    get = getattr(model, "mtp_head", None)
    if not callable(get) or not callable(getattr(model, "forward_step_hidden", None)):
        return None
    head = get()
    return head if isinstance(head, DraftHead) else None
