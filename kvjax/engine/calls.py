"""A ``generate`` / ``stream`` call's requests before they are queued: text prompts, checks and the progress bar.

:func:`check_call` turns the call's arguments into one :class:`Call` per prompt (text encoded by the engine's
tokenizer, every prompt, sampling setting and stop id checked by :mod:`kvjax.engine.args`), raising ``ValueError``
before anything is queued. :func:`progress_bar` is the optional tqdm bar over the call's tokens.
"""

from __future__ import annotations

import warnings
from typing import Any, NamedTuple, Sequence

import numpy as np

from kvjax.engine.args import check_prompts, stop_ids
from kvjax.engine.sampling import SamplingParams, call_params


class Call(NamedTuple):
    """One prompt of a call, checked."""

    prompt: np.ndarray  # i32[L]: its token ids
    params: SamplingParams  # how it samples, and its max_tokens
    stops: tuple  # tuple[int, ...]: the engine's eos ids, then its own stop ids


def is_text(prompts: Any, tokenizer: Any) -> bool:
    """``prompts`` are strings (``ValueError`` without a tokenizer, or when strings and token ids mix)."""
    if isinstance(prompts, str) or not isinstance(prompts, Sequence):
        return False
    text = [isinstance(p, str) for p in prompts]
    if not any(text):
        return False
    if not all(text):
        raise ValueError("prompts must be all strings (with a tokenizer) or all token-id sequences, not a mix")
    if tokenizer is None:
        raise ValueError("text prompts need Engine(..., tokenizer=...) (e.g. kvjax.models.load_tokenizer(path)); "
                         "or pass token ids")
    return True


def check_call(prompts: Any, params: Any, max_new_tokens: Any, temperature: Any, seed: Any, *, tokenizer: Any,
               vocab_size: int, eos_token_ids: tuple[int, ...]) -> list[Call]:
    """The checked :class:`Call` of every prompt of a ``generate`` / ``stream`` call (``Engine.generate`` says what
    each argument may be); text prompts are encoded by ``tokenizer`` first."""
    if is_text(prompts, tokenizer):
        prompts = [list(tokenizer.encode(text)) for text in prompts]
    checked = check_prompts(prompts, vocab_size)
    plist = call_params(len(checked), params, max_new_tokens, temperature, seed)
    return [Call(prompt, p, stop_ids(eos_token_ids, p, vocab_size, f"stop_token_ids of prompt {i}"))
            for i, (prompt, p) in enumerate(zip(checked, plist))]


def progress_bar(total: int, progress: bool | None) -> Any:
    """A tqdm bar over ``total`` tokens, or None: ``progress`` False, or None and ``total < 4096``, or no tqdm
    (warned)."""
    if progress is False or (progress is None and total < 4096):
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        warnings.warn("progress bar requested but tqdm is not installed", stacklevel=3)
        return None
    return tqdm(total=total, unit="tok", desc="generate")
