"""The prefix cache's records: block keys, cache entries, tracked rows, what a match returns, and the config.

Keys. Block ``b`` of a prompt (tokens ``[b*ps, (b+1)*ps)``) is keyed by a 64-bit hash of (key of block ``b-1``,
its tokens) (:func:`block_key`), so a key covers every token before it; an :class:`Entry` stores its parent key
and tokens, and a lookup that finds a key with other contents (a hash collision) stops there. An entry holds one
page per KV head (``-1`` where that head's page was given up) and, for models with GDN layers, maybe a checkpoint
slot: the recurrent state after its block, in a GDN-pool slot ``max_seqs + 1 .. max_seqs + num_checkpoints``
(beside the running requests' slots ``1..max_seqs``; the device copies are the engine's). The cache itself
(lookup, publishing, eviction) is :class:`kvjax.sched.prefix_cache.PrefixCache`.
"""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np

from kvjax.config import is_int

RECYCLE_MODES = ("eager", "keep_tail")
ROOT = 0  # parent key of block 0
NO_ANCHOR = 1 << 62


@dataclasses.dataclass(frozen=True)
class PrefixCacheConfig:
    """``num_checkpoints``: GDN checkpoint slots (must be >= 1 when ``gdn`` is True, 0 otherwise is fine);
    ``gdn``: the model has recurrent (GDN) layers, so a match ends only at a checkpoint; ``recycle``: what
    happens to a cached page a request recycles (``eager`` | ``keep_tail``); ``host_bytes``: the host tier's
    budget (0: no host tier; :mod:`kvjax.sched.prefix_host`), with ``page_bytes`` (one page of one KV head
    over every layer and role) and ``ckpt_bytes`` (one GDN checkpoint slot) to count it."""

    num_checkpoints: int = 0
    gdn: bool = True
    recycle: str = "keep_tail"
    host_bytes: int = 0
    page_bytes: int = 0
    ckpt_bytes: int = 0

    def __post_init__(self) -> None:
        if not is_int(self.num_checkpoints) or self.num_checkpoints < 0:
            raise ValueError(f"PrefixCacheConfig.num_checkpoints must be an int >= 0, got {self.num_checkpoints!r}")
        if not isinstance(self.gdn, bool):
            raise ValueError(f"PrefixCacheConfig.gdn must be a bool, got {self.gdn!r}")
        if self.gdn and self.num_checkpoints < 1:
            raise ValueError("PrefixCacheConfig: a model with GDN layers resumes only from a checkpoint of its "
                             "recurrent state, so num_checkpoints must be >= 1 (0 would never hit)")
        if self.recycle not in RECYCLE_MODES:
            raise ValueError(f"PrefixCacheConfig.recycle must be one of {RECYCLE_MODES}, got {self.recycle!r}")
        for name in ("host_bytes", "page_bytes", "ckpt_bytes"):
            if not is_int(getattr(self, name)) or getattr(self, name) < 0:
                raise ValueError(f"PrefixCacheConfig.{name} must be an int >= 0, got {getattr(self, name)!r}")
        if self.host_bytes and (self.page_bytes < 1 or (self.gdn and self.ckpt_bytes < 1)):
            raise ValueError(f"PrefixCacheConfig: a host tier (host_bytes={self.host_bytes}) needs page_bytes >= 1 "
                             f"and, with GDN layers, ckpt_bytes >= 1; got {self.page_bytes}, {self.ckpt_bytes}")


@dataclasses.dataclass(frozen=True)
class PrefixMatch:
    """What :meth:`PrefixCache.match` found for a prompt."""

    num_tokens: int  # m * page_size tokens served from the cache (0: a miss)
    pages: np.ndarray  # i64[H_kv, m]: pages of the matched blocks, -1 holes (blocks a SWA head no longer needs)
    cursor: np.ndarray  # i64[H_kv]: recycle cursor of each head after attaching (first block not yet handled)
    checkpoint: int  # GDN slot holding the state after m blocks; -1 without GDN layers or on a miss
    chain_blocks: int  # leading prompt blocks whose keys are cached (>= m)
    stops: tuple  # token counts (> num_tokens) where the request's state should be checkpointed
    keys: tuple  # keys of the chain_blocks cached blocks
    host: np.ndarray | None = None  # i64[H_kv, m]: host ids of needed blocks that attach loads (-1: none)
    ckpt_host: int = -1  # host id of the checkpoint attach loads into a device slot (checkpoint is then -1)


class Entry:
    """One cached prompt block: its key, parent key, depth (block index), tokens, one page per KV head (``-1``:
    none) and how many are set (``resident``), its GDN checkpoint slot, its host copies (host tier), children
    count, anchor bookkeeping and its last-use stamp."""

    __slots__ = ("key", "parent", "depth", "tokens", "pages", "resident", "ckpt", "children", "anchor", "near", "host",
                 "hckpt", "used")

    def __init__(self, key: int, parent: int, depth: int, tokens: np.ndarray, pages: np.ndarray) -> None:
        self.key, self.parent, self.depth = key, parent, depth
        self.tokens = tokens  # i32[page_size]
        self.pages = pages  # i64[H_kv]; -1 where the cache holds no page for that head
        self.resident = int((pages >= 0).sum())  # heads with a page on the device (kept equal by every writer)
        self.ckpt = -1  # GDN checkpoint slot, -1 none
        self.host = np.full_like(pages, -1)  # i64[H_kv]: host id of a head's spilled page (host tier), -1 none
        self.hckpt = -1  # host id of the spilled checkpoint, -1 none
        self.children = 0  # cached entries whose parent is this one
        self.anchor = False
        self.near = NO_ANCHOR  # depth of the nearest anchor in this entry's subtree (itself included)
        self.used = 0  # last-use stamp (PrefixCache: increasing along its LRU order)


class Row:
    """A tracked request: its prompt (and its int32 bytes, ``data``), blocks published so far, the key they end
    at, the last reusable block (``end``), the token counts where its state is checkpointed (``stops``)."""

    __slots__ = ("prompt", "data", "published", "parent", "end", "stops", "dead")

    def __init__(self, prompt: np.ndarray, published: int, parent: int, end: int, stops: list[int]) -> None:
        self.prompt, self.published, self.parent, self.end, self.stops = prompt, published, parent, end, stops
        self.data = np.ascontiguousarray(prompt, np.int32).tobytes()
        self.dead = False  # a hash collision stopped publishing


def block_key(parent: int, tokens: np.ndarray) -> int:
    """64-bit key of a block: hash of (parent key, the block's tokens as int32)."""
    return block_key_bytes(parent, np.ascontiguousarray(tokens, np.int32).tobytes())


def block_key_bytes(parent: int, data: bytes) -> int:
    """:func:`block_key` of the block whose int32 tokens are the bytes ``data``."""
    h = hashlib.blake2b(int(parent).to_bytes(8, "little"), digest_size=8)
    h.update(data)
    return int.from_bytes(h.digest(), "little") or 1
