"""kvcache's Rust policies as vLLM sees them: registered as vLLM ``CachePolicy`` classes, found
by class name in ``kvcache.vllm`` (``cache_policy_module_path``), and the rule for which
configured policy kvcache's Rust manager runs.

vLLM's ``CachePolicyFactory`` asserts that a class it loads subclasses its ``CachePolicy``: the
Rust classes are registered as *virtual* subclasses (``CachePolicy.register``) on import.
"""

from __future__ import annotations

import logging

from vllm.v1.kv_offload.cpu.policies.base import CachePolicy as _VllmCachePolicy
from vllm.v1.kv_offload.cpu.policies.factory import CachePolicyFactory

from kvcache import _extra_config as settings
from kvcache._core import POLICY_KINDS
from kvcache.vllm._version import RUNNING_VLLM_SEMANTICS

logger = logging.getLogger("kvcache.vllm")

#: Every Rust policy class by its class name, as vLLM's configuration names it; the list
#: comes from the Rust core.
POLICY_CLASSES = {cls.__name__: cls for cls in POLICY_KINDS.values()}
for _policy_cls in POLICY_CLASSES.values():
    _VllmCachePolicy.register(_policy_cls)

#: The module whose ``getattr`` means "vLLM's own manager is about to build this policy".
VLLM_POLICY_FACTORY = CachePolicyFactory.__module__

#: Policy names kvcache's Rust manager runs, by the name given in ``eviction_policy``.
RUST_POLICIES = settings.RUST_POLICIES
#: ``cache_policy_module_path`` values that mean "kvcache's policies" (or none given).
OUR_MODULES = settings.OUR_MODULES


def policy_for_vllm_factory(name: str, module: str) -> type:
    """Policy class ``name``, as vLLM's ``CachePolicyFactory`` loads it from ``module``
    (``cache_policy_module_path``), with kvcache's start-up line."""
    logger.info(
        "kvcache policy ready: manager=vLLM's policy=%s (kvcache, Rust, vLLM %s protocol) "
        "worker=vLLM's (loaded by vLLM's CachePolicyFactory from %s)",
        name,
        RUNNING_VLLM_SEMANTICS,
        module,
    )
    return POLICY_CLASSES[name]


def rust_policy(name: str, module_path: str | None) -> str | None:
    """``"lru"``/``"arc"``/``"turn"`` when kvcache's Rust manager runs policy ``name`` from
    ``module_path``; None for an out-of-tree Python policy (vLLM's manager must run it).

    Broader than ``OffloadingManager(cache_policy=...)``, which follows vLLM's factory: with
    kvcache's module path a registered short name (``"arc"``) also means kvcache's policy here,
    and the spec warns about it (see ``KvCacheOffloadingSpec``)."""
    if module_path not in OUR_MODULES:
        return None
    return RUST_POLICIES.get(name)
