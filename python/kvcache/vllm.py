"""The adapter vLLM 0.33.0 loads by configuration.

Point vLLM's CPU offloading at kvcache's Rust policies with::

    kv_connector_extra_config = {
        "eviction_policy": "ARCCachePolicy",  # or "LRUCachePolicy"
        "cache_policy_module_path": "kvcache.vllm",
    }

vLLM's ``CachePolicyFactory`` imports this module, looks the class up by name and asserts it is
a subclass of its ``CachePolicy``. The Rust classes are registered as *virtual* subclasses of
that ABC (``CachePolicy.register``), which satisfies ``issubclass`` without putting a Python
class in front of the Rust methods, so calls cost no more than calling the Rust class directly.
Importing this module imports vLLM; ``import kvcache`` does not.
"""

from __future__ import annotations

from vllm.v1.kv_offload.cpu.policies.base import CachePolicy as _VllmCachePolicy

from kvcache._core import ARCCachePolicy, LRUCachePolicy

__all__ = ["ARCCachePolicy", "LRUCachePolicy"]

_VllmCachePolicy.register(LRUCachePolicy)
_VllmCachePolicy.register(ARCCachePolicy)
