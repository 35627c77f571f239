"""Speculative decoding's MTP drafter inside the engine's jitted step (``speculative="mtp"``).

With ``speculative="mtp"`` every step of the engine (prefill chunks, decode tokens, verifications, verification
bursts) where the step-cost rule drafts (``PackLayout.draft``: some plan's ``spec_k > 0``) also drafts:
the model step returns its final-normed hidden states beside the logits (``forward_step_hidden``), the step's
tokens are sampled / verified as without drafting, then, in the same jitted call, the model's MTP layer
(:class:`~kvjax.models.interface.DraftHead`, :mod:`kvjax.models.qwen3_5.mtp`) runs its catch-up over the step's
tokens and ``K - 1`` one-token draft steps (:func:`draft`). The step returns :class:`StepTokens`: the tokens it
returns without drafting (``i32[R]``, or a verification's ``i32[B * (K + 2)]``) and each row's ``K`` drafts
``i32[B, K]``. The host records them (:class:`kvjax.sched.drafter.StepDrafter`) and the next plan verifies them
(:func:`kvjax.sched.spec.propose`, under the rule that shortens or turns drafts off).

The catch-up pairs each row's last accepted token ``p`` with the token after it: the one the step sampled (the
bonus token after a verification, the first output after a prompt's last chunk) or, for a prompt chunk that does
not end its prompt, the prompt's next token (``SampleInputs.next_ids``, :func:`kvjax.sched.spec.next_tokens`). The
MTP pools sit in :attr:`~kvjax.models.interface.ModelCaches.pages` beside the model's and are addressed by the same
block tables and slot mappings, so recycling, prefix caching (whose host tier copies every pool by name),
preemption and aborts serve them unchanged.

On a ``("data", "model")`` mesh (:mod:`kvjax.models.sharding`) the MTP layer is split like the model's own layers
(:meth:`~kvjax.models.sharding.ShardedModel.shard_head`: its attention heads and MLP columns over ``"model"``, in the
model's KV-head placement; ``fc`` and the norms replicated), its pools are created per device like the model's
pages (a KV head's MTP pages on the device that holds its model pages), and every drafting step runs inside the
step's ``shard_map`` for each data shard: ``StepTokens.drafts`` is ``i32[D, B, K]``, each shard's drafts for its own
rows (recorded by that shard's :class:`~kvjax.sched.drafter.StepDrafter`).

A key the MTP layer wrote for a rejected draft, a draft step or a prefix-cache block whose next token differs only
changes later drafts, never a token: drafts are verified.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from kvjax.inputs import StepInputs
from kvjax.models.interface import DraftHead, ModelCaches, draft_head


class StepTokens(NamedTuple):
    """What a step of a drafting engine returns in place of its tokens (a pytree)."""

    tokens: jax.Array  # i32[R] (an ordinary step) or i32[B * (K + 2)] (a verification): as without drafting
    drafts: jax.Array  # i32[B, K]: each row's drafts, continuing its tokens after the step; -1: a row without tokens


class Drafting(NamedTuple):
    """The traceable calls of a drafting step (built by :class:`kvjax.engine.runner.Runner`)."""

    hidden_step: Callable  # (params, caches, inputs) -> (logits f32[B, V], hidden [T, H], caches)
    propose: Callable  # (params, caches, hidden [T, H], inputs, sampled i32[B]) -> (drafts i32[B, K], caches)


def draft(drafting: Drafting, params: Any, caches: ModelCaches, hidden: jax.Array, inputs: StepInputs,
          last: jax.Array, sampled: jax.Array, next_ids: jax.Array) -> tuple[jax.Array, ModelCaches]:
    """Each row's drafts after a step (traceable): ``last`` (i32[B]) its last accepted token's index in the step,
    ``sampled`` (i32[B]) the token the step sampled after it, ``next_ids`` (i32[B]) the known token there (a prompt
    chunk's next token) or -1. Returns ``(i32[B, K], caches with the MTP pools written)``."""
    after = jnp.where(next_ids >= 0, next_ids, sampled).astype(jnp.int32)
    return drafting.propose(params, caches, hidden, dataclasses.replace(inputs, logits_indices=last), after)


def check_head(model: Any, speculative: Any) -> DraftHead | None:
    """The MTP layers an engine drafts with: ``None`` unless ``speculative`` is ``"mtp"`` without a drafter object;
    ``ValueError`` naming the problem where the model has none (on a mesh: give the model itself with ``mesh=``,
    not a ``ShardedModel``, whose parameters leave its MTP layers out)."""
    if speculative is None or speculative.method != "mtp" or speculative.drafter is not None:
        return None
    head = draft_head(model)
    if head is None:
        raise ValueError(f"speculative='mtp' drafts with the model's MTP layers, and this {type(model).__name__} has "
                         "none: a Qwen3.5 model whose checkpoint has mtp.* weights (load_pretrained), or one given "
                         "layers with kvjax.models.qwen3_5.mtp.attach(model, head); or use speculative='ngram'")
    return head


def head_caches(head: DraftHead, cache_args: dict) -> dict[str, jax.Array]:
    """The MTP pools for an engine's cache arguments (``Runner.init_caches``'s: pages, page size, dtype, fp8)."""
    return head.init_caches(num_pages=cache_args["num_pages"], page_size=cache_args["page_size"],
                            dtype=cache_args.get("dtype", jnp.float32),
                            kv_cache_dtype=cache_args.get("kv_cache_dtype", "auto"))
