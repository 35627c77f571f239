"""Token sampling: :class:`SamplingParams` (a request's sampling settings, checked on the host) and the device
side, greedy / temperature / top-k / top-p sampling with explicit PRNG keys.

Each row draws from its own key, derived from integers only (``seed``, the request's index in its batch of
prompts, and how many tokens the request knows so far): the token a request samples at a given length does
not depend on which other requests share the step, on preemption, or on the recycle policy. Greedy rows
(``temperature == 0``) take the argmax (lowest id on ties, as ``torch.argmax``) and ignore top-k / top-p.

A sampling row draws from ``softmax(logits / temperature)`` restricted as Hugging Face's and vLLM's samplers do:
first to the ``top_k`` largest logits, then to the smallest set of those whose renormalised probability mass
reaches ``top_p`` (the most probable first), renormalised (:func:`filter_logits`). Tokens whose logit equals the
last kept one are kept too (ties are kept together, so a row may keep more than ``top_k`` tokens).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.config import INT32_MAX, is_int
from kvjax.engine.args import check_max_new_tokens, check_seed, check_temperature
from kvjax.sched.request import check_stop_ids


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops (vLLM's ``SamplingParams`` names; frozen, checked when built).

    Fields:
      temperature: a finite float >= 0; ``0`` = greedy (the argmax; top-k / top-p then do nothing).
      top_k: sample among the ``top_k`` most probable tokens only; ``0`` or ``None`` = off (stored as ``0``).
      top_p: then among the smallest set of those whose probability mass reaches ``top_p``; in ``(0, 1]``,
        ``1.0`` = off.
      seed: an int32; with the prompt's index in its call and the tokens so far, it fixes the request's keys.
      max_tokens: generated tokens at most, an int >= 1 (the engine's ``max_new_tokens``; default 16 as vLLM).
      stop_token_ids: token ids that end the request when sampled (the token is delivered, as eos), in addition
        to the engine's ``eos_token_id``; any sequence of ints >= 0, stored as a tuple of distinct ids; together
        with the engine's eos ids at most :data:`~kvjax.sched.request.MAX_STOP_IDS` (checked when queued, with
        the vocabulary).

    Raises ``ValueError`` naming the field and the bad value. Unlike vLLM's, the default ``temperature`` is 0
    (greedy), as the engine's ``temperature=`` keyword.
    """

    temperature: float = 0.0
    top_k: int | None = 0
    top_p: float = 1.0
    seed: int = 0
    max_tokens: int = 16
    stop_token_ids: Sequence[int] = ()

    def __post_init__(self) -> None:
        def named(check, value):  # the args check, its message prefixed with the class
            try:
                return check(value)
            except ValueError as err:
                raise ValueError(f"SamplingParams.{err}") from None

        temperature = named(check_temperature, self.temperature)
        top_k = 0 if self.top_k is None else self.top_k
        if not is_int(top_k) or not 0 <= top_k <= INT32_MAX:
            raise ValueError(f"SamplingParams.top_k must be None or an int in [0, {INT32_MAX}] (0 or None: off), "
                             f"got {self.top_k!r}")
        top_p = self.top_p
        if isinstance(top_p, (bool, np.bool_)) or not isinstance(top_p, (int, float, np.integer, np.floating)) \
                or not math.isfinite(float(top_p)) or not 0 < float(top_p) <= 1:
            raise ValueError(f"SamplingParams.top_p must be a number in (0, 1] (1.0: off), got {top_p!r}")
        seed = named(check_seed, self.seed)
        max_tokens = named(lambda v: check_max_new_tokens(v, "max_tokens"), self.max_tokens)
        stops = check_stop_ids(() if self.stop_token_ids is None else self.stop_token_ids,
                               "SamplingParams.stop_token_ids", single=False)
        for name, value in (("temperature", temperature), ("top_k", int(top_k)), ("top_p", float(top_p)),
                            ("seed", seed), ("max_tokens", max_tokens), ("stop_token_ids", stops)):
            object.__setattr__(self, name, value)

    @property
    def filtered(self) -> bool:
        """The request samples with top-k or top-p (a greedy request never does)."""
        return self.temperature > 0 and (self.top_k > 0 or self.top_p < 1.0)


def call_params(num_prompts: int, params: Any, max_new_tokens: Any, temperature: Any, seed: Any
                ) -> list[SamplingParams]:
    """One :class:`SamplingParams` per prompt of a ``generate`` / ``stream`` call (``ValueError``, naming the bad
    value, before anything is queued).

    Either ``params`` is a :class:`SamplingParams` (all prompts) or a sequence of one per prompt, with
    ``max_new_tokens``, ``temperature`` and ``seed`` left ``None``; or the short form: the lengths as an int or one
    int per prompt (in ``params``' place or as ``max_new_tokens=``, not both), with ``temperature`` (default 0)
    and ``seed`` (default 0) for every prompt.
    """
    if isinstance(params, SamplingParams) or (isinstance(params, (list, tuple)) and params
                                              and all(isinstance(p, SamplingParams) for p in params)):
        given = [name for name, v in (("max_new_tokens", max_new_tokens), ("temperature", temperature),
                                      ("seed", seed)) if v is not None]
        if given:
            raise ValueError(f"{', '.join(given)} given with SamplingParams: set them in the SamplingParams "
                             "(max_tokens, temperature, seed)")
        if isinstance(params, SamplingParams):
            return [params] * num_prompts
        if len(params) != num_prompts:
            raise ValueError(f"{len(params)} SamplingParams for {num_prompts} prompts (give one, or one per prompt)")
        return list(params)
    if params is not None and max_new_tokens is not None:
        raise ValueError(f"the lengths given twice: params={params!r:.40} and max_new_tokens={max_new_tokens!r:.40}")
    lengths = params if params is not None else max_new_tokens
    if lengths is None:
        raise ValueError("give SamplingParams, or max_new_tokens (an int or one per prompt)")
    if is_int(lengths):
        lengths = [lengths] * num_prompts
    elif isinstance(lengths, (Sequence, np.ndarray)) and not isinstance(lengths, (str, bytes)):
        lengths = list(lengths)
        if len(lengths) != num_prompts:
            raise ValueError(f"max_new_tokens has {len(lengths)} entries for {num_prompts} prompts")
        if any(isinstance(m, SamplingParams) for m in lengths):
            raise ValueError("params mixes SamplingParams and ints: give one SamplingParams per prompt, or ints")
    else:
        raise ValueError(f"params must be a SamplingParams, one per prompt, an int or one int per prompt "
                         f"(max_new_tokens), got {lengths!r:.80}")
    temperature = check_temperature(0.0 if temperature is None else temperature)
    seed = check_seed(0 if seed is None else seed)
    return [SamplingParams(temperature=temperature, seed=seed,
                           max_tokens=check_max_new_tokens(m, f"max_new_tokens of prompt {i}"))
            for i, m in enumerate(lengths)]


# ---- the device side (inside the jitted step) -------------------------------------------------------------


def row_keys(seeds: jax.Array, streams: jax.Array, counters: jax.Array) -> jax.Array:
    """One typed PRNG key per row: ``fold_in(fold_in(key(seed), stream), counter)``.

    ``seeds``, ``streams``, ``counters``: i32[B] -> key[B].
    """
    def one(s, i, n):
        return jax.random.fold_in(jax.random.fold_in(jax.random.key(s), i), n)

    return jax.vmap(one)(seeds, streams, counters)


def filter_threshold(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """f32[B]: each row's smallest kept logit under top-k then top-p (``-inf`` for a row with both off); the
    tokens at or above it are the row's top-k / top-p set (one sort per row).

    Args:
      logits: f32[B, V], already divided by the temperature.
      top_k: i32[B]; ``<= 0`` or ``>= V`` = off.
      top_p: f32[B]; ``>= 1`` = off.

    The kept set: the ``top_k`` largest logits, then the smallest prefix of those (most probable first) whose
    probability renormalised over them reaches ``top_p``, then every token whose logit ties the last kept one.
    """
    V = logits.shape[-1]
    desc = -jnp.sort(-logits, axis=-1)  # f32[B, V]: each row's logits, largest first
    off_k = (top_k <= 0) | (top_k >= V)  # bool[B]
    k = jnp.where(off_k, V, top_k)  # i32[B]
    in_k = jnp.arange(V)[None, :] < k[:, None]  # bool[B, V]
    e = jnp.where(in_k, jnp.exp(desc - desc[:, :1]), 0.0)
    probs = e / e.sum(-1, keepdims=True)  # f32[B, V]: the top-k distribution, sorted
    before = jnp.cumsum(probs, axis=-1) - probs  # f32[B, V]: mass of the more probable tokens
    keep = in_k & ((before < top_p[:, None]) | (top_p[:, None] >= 1.0))  # the first is always kept
    last = jnp.maximum(keep.sum(-1), 1) - 1  # i32[B]: rank of the last kept token
    threshold = jnp.take_along_axis(desc, last[:, None], axis=-1)[:, 0]  # f32[B]
    return jnp.where(off_k & (top_p >= 1.0), -jnp.inf, threshold)


def filter_logits(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """f32[B, V]: ``logits`` (f32[B, V], divided by the temperature) with every token outside each row's top-k /
    top-p set (:func:`filter_threshold`; ``top_k`` i32[B], ``top_p`` f32[B]) at ``-inf``, the others unchanged
    (bit for bit; a row with both off is the input's)."""
    return jnp.where(logits >= filter_threshold(logits, top_k, top_p)[:, None], logits, -jnp.inf)


def sample(logits: jax.Array, keys: jax.Array, temperature: jax.Array, top_k: jax.Array | None = None,
           top_p: jax.Array | None = None) -> jax.Array:
    """Sample one token per row.

    Args:
      logits: f32[B, vocab].
      keys: key[B] (typed PRNG keys, e.g. from :func:`row_keys`).
      temperature: f32[B]; ``0`` = greedy for that row, ``> 0`` = softmax(logits / temperature) sampling.
      top_k: i32[B] or None; ``0`` = off (:func:`filter_logits`).
      top_p: f32[B] or None; ``1.0`` = off.
    Returns:
      i32[B] token ids.

    With ``top_k`` / ``top_p`` the rows' thresholds (:func:`filter_threshold`, a sort) are computed under
    ``lax.cond``, only when some sampling row uses them: a step without top-k / top-p pays no sort, and one
    compiled step serves both. A row with both off gets the threshold ``-inf`` either way and keeps its logits
    bit for bit: a row's token does not depend on the other rows of the batch.
    """
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    on = temperature > 0  # bool[B]
    safe_t = jnp.where(on, temperature, 1.0).astype(jnp.float32)
    scaled = logits.astype(jnp.float32) / safe_t[:, None]  # f32[B, V]
    if top_k is not None or top_p is not None:
        B, V = logits.shape
        top_k = jnp.zeros(B, jnp.int32) if top_k is None else top_k
        top_p = jnp.ones(B, jnp.float32) if top_p is None else top_p
        used = on & (((top_k > 0) & (top_k < V)) | (top_p < 1.0))  # bool[B]
        # the branches take the raw logits (already in memory): ``scaled`` stays fused into the draw
        threshold = jax.lax.cond(used.any(), lambda x: filter_threshold(x.astype(jnp.float32) / safe_t[:, None],
                                                                        top_k, top_p),
                                 lambda x: jnp.full(B, -jnp.inf, jnp.float32), logits)  # f32[B]
        scaled = jnp.where(scaled >= threshold[:, None], scaled, -jnp.inf)
    drawn = jax.vmap(jax.random.categorical)(keys, scaled)
    return jnp.where(on, drawn.astype(jnp.int32), greedy)


def verify_tokens(logits: jax.Array, drafts: jax.Array, draft_len: jax.Array, keys: jax.Array,
                  temperature: jax.Array, top_k: jax.Array, top_p: jax.Array, greedy_only: bool
                  ) -> tuple[jax.Array, jax.Array]:
    """Speculative decoding's acceptance: which drafts a verification row keeps and the token after them.

    Args:
      logits: f32[B, J, V], the target's logits after each of row ``b``'s ``J = K + 1`` positions (its last
        known token, then its drafts).
      drafts: i32[B, K], the drafts (``drafts[b, j]`` was fed at position ``j + 1``); ``draft_len``: i32[B], how many
        of them are real (0: an ordinary row, which just samples at position 0).
      keys: key[B, J], the row's key at each position (:func:`row_keys` with the position's token count, the
        counter an ordinary step samples that token with).
      temperature, top_k, top_p: the rows' sampling parameters (f32[B], i32[B], f32[B]); ``greedy_only``
        (static): every row is greedy.
    Returns ``(tokens i32[B, J], accepted i32[B])``: ``accepted[b] = a``, the drafts kept; ``tokens[b, :a]`` are
    those drafts and ``tokens[b, a]`` the target's next token.

    Greedy rows keep the longest prefix of drafts equal to the argmax, then take the argmax. Sampling rows use
    rejection sampling with a point-mass proposal (Leviathan et al. 2023, Chen et al. 2023): draft ``d`` at
    position ``j`` is kept with probability ``p_j(d)`` (``p_j``: the row's tempered, top-k / top-p filtered
    distribution, as :func:`sample` draws from); at the first rejection the token is drawn from ``p_j`` without
    ``d``, renormalised; with every draft kept it is drawn from ``p_a`` (the draw :func:`sample` makes with that
    key). Each emitted token is then distributed as ``p`` given the tokens before it: the target distribution.
    The acceptance uniform and the residual draw use ``fold_in(key, 1)`` and ``fold_in(key, 2)``.
    """
    B, J, V = logits.shape
    K = J - 1
    j = jnp.arange(J, dtype=jnp.int32)
    real = j[None, :K] < draft_len[:, None]  # bool[B, K]
    if greedy_only:
        target = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # i32[B, J]
        keep = real & (drafts == target[:, :K])
        return target, jnp.cumprod(keep, axis=1).sum(1).astype(jnp.int32)
    flat = logits.reshape(B * J, V).astype(jnp.float32)
    rep = lambda x: jnp.repeat(x, J)  # noqa: E731  [B] -> [B * J]
    t, k, p = rep(temperature), rep(top_k), rep(top_p)
    fkeys = keys.reshape(B * J)
    full = sample(flat, fkeys, t, k, p).reshape(B, J)  # i32[B, J]: the ordinary draw (argmax for greedy rows)
    on = temperature > 0  # bool[B]
    safe_t = jnp.where(t > 0, t, 1.0)
    scaled = flat / safe_t[:, None]  # f32[B * J, V]
    used = (t > 0) & (((k > 0) & (k < V)) | (p < 1.0))
    threshold = jax.lax.cond(used.any(), lambda x: filter_threshold(x, k, p),
                             lambda x: jnp.full(B * J, -jnp.inf, jnp.float32), scaled)
    masked = jnp.where(scaled >= threshold[:, None], scaled, -jnp.inf).reshape(B, J, V)
    logp = jax.nn.log_softmax(masked[:, :K], axis=-1)  # f32[B, K, V]
    d = jnp.clip(drafts, 0, V - 1)
    p_d = jnp.exp(jnp.take_along_axis(logp, d[..., None], axis=-1)[..., 0])  # f32[B, K]
    u = jax.vmap(lambda key: jax.random.uniform(jax.random.fold_in(key, 1)))(fkeys).reshape(B, J)[:, :K]
    greedy_keep = drafts == jnp.argmax(logits[:, :K], axis=-1)
    keep = real & jnp.where(on[:, None], u < p_d, greedy_keep)  # bool[B, K]
    accepted = jnp.cumprod(keep, axis=1).sum(1).astype(jnp.int32)  # i32[B]
    resid = jnp.where(jax.nn.one_hot(d, V, dtype=jnp.bool_), -jnp.inf, masked[:, :K])  # f32[B, K, V]
    rkeys = jax.vmap(lambda key: jax.random.fold_in(key, 2))(keys[:, :K].reshape(B * K))
    resampled = jax.vmap(jax.random.categorical)(rkeys, resid.reshape(B * K, V)).reshape(B, K).astype(jnp.int32)
    pad = jnp.zeros((B, 1), jnp.int32)
    dpad, rpad = jnp.concatenate([drafts, pad], 1), jnp.concatenate([resampled, pad], 1)  # i32[B, J]
    a = accepted[:, None]
    rejected = (j[None, :] == a) & (a < draft_len[:, None]) & on[:, None]  # the position of a sampling row's rejection
    tokens = jnp.where(j[None, :] < a, dpad, jnp.where(rejected, rpad, full))
    return tokens.astype(jnp.int32), accepted
