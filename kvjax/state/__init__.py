"""Device-side state: GDN state pools and paged KV / latent / DSA caches as immutable pytrees.

Pools are updated only by vectorised scatter/gather and returned by value.
"""
from kvjax.state.gdn_pool import GDNStatePool
from kvjax.state.registry import DSACacheSpec, GQACacheSpec, MLACacheSpec, create_caches, create_kv_cache

__all__ = ["DSACacheSpec", "GDNStatePool", "GQACacheSpec", "MLACacheSpec", "create_caches", "create_kv_cache"]
