"""kvcache: fast, frugal CPU KV-cache offloading for vLLM.

Rust implementations of vLLM's CPU-offloading cache policies (``LRUCachePolicy``,
``ARCCachePolicy``) and manager (``OffloadingManager``), decision-identical to vLLM 0.33.0's
and 0.34.0's (``vllm_semantics="0.33"``/``"0.34"``; by default the installed vLLM's), and
kvcache's own policy for multi-turn traffic, ``TurnCachePolicy``.
``import kvcache`` imports neither vLLM nor torch; ``kvcache.vllm`` is the adapter vLLM loads by
configuration, and ``kvcache.transfer`` moves chunks between GPU and host memory.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from kvcache._context import ReqContext
from kvcache._core import (
    POLICY_KINDS,
    BaseCachePolicy,
    ChunkStatus,
    DuplicateKeyError,
    InvalidArgumentError,
    InvalidChunkError,
    InvalidKeyError,
    InvalidStateError,
    InvalidTypeError,
    KeyNotFoundError,
    KvCacheError,
    NotEvictableError,
    OutOfMemoryError,
    OutOfRangeError,
    PoolClosedError,
    ReentrantCallError,
    TransferError,
    UnsupportedOperationError,
    __version__,
    order_request_keys,
)
from kvcache._semantics import VLLM_SEMANTICS
from kvcache._types import (
    EvictedKeys,
    LoadStoreSpec,
    LookupResult,
    OffloadingEvent,
    PrepareStoreOutput,
)
from kvcache.manager import ManagerStats, OffloadingManager

if TYPE_CHECKING:  # at run time served by ``__getattr__`` below
    from kvcache._core import ARCCachePolicy, LRUCachePolicy, TurnCachePolicy
    from kvcache.vllm import KvCacheOffloadingSpec, KvCacheTieringOffloadingSpec  # noqa: F401

__all__ = [
    "VLLM_SEMANTICS",
    "ARCCachePolicy",
    "BaseCachePolicy",
    "ChunkStatus",
    "DuplicateKeyError",
    "EvictedKeys",
    "InvalidArgumentError",
    "InvalidChunkError",
    "InvalidKeyError",
    "InvalidStateError",
    "InvalidTypeError",
    "KeyNotFoundError",
    "KvCacheError",
    "LRUCachePolicy",
    "LoadStoreSpec",
    "LookupResult",
    "ManagerStats",
    "NotEvictableError",
    "OffloadingEvent",
    "OffloadingManager",
    "OutOfMemoryError",
    "OutOfRangeError",
    "PoolClosedError",
    "PrepareStoreOutput",
    "ReentrantCallError",
    "ReqContext",
    "TransferError",
    "TurnCachePolicy",
    "UnsupportedOperationError",
    "__version__",
    "order_request_keys",
]

#: Every policy class of the Rust core's list, by its class name.
_POLICY_CLASSES = {cls.__name__: cls for cls in POLICY_KINDS.values()}
#: kvcache.vllm's specs, also found here: ``"spec_module_path": "kvcache"`` works as
#: ``"kvcache.vllm"`` does (vLLM's factory looks the spec name up in that module).
_SPECS = ("KvCacheOffloadingSpec", "KvCacheTieringOffloadingSpec")
#: vLLM's ``CachePolicyFactory`` (both releases): a lookup from there is vLLM building a policy
#: (``"cache_policy_module_path": "kvcache"``).
_VLLM_POLICY_FACTORY = "vllm.v1.kv_offload.cpu.policies.factory"


def __getattr__(name: str) -> Any:
    # The policy classes are served from here rather than from the module's globals so that
    # vLLM's factory, which asserts that the class it loads is a vLLM CachePolicy, is answered
    # by kvcache.vllm (which registers the classes as such) without importing vLLM otherwise.
    if name in _POLICY_CLASSES:
        if sys._getframe(1).f_globals.get("__name__") == _VLLM_POLICY_FACTORY:
            from kvcache.vllm import policy_for_vllm_factory

            return policy_for_vllm_factory(name, __name__)
        return _POLICY_CLASSES[name]
    if name in _SPECS:
        try:
            import kvcache.vllm
        except ImportError as exc:
            raise AttributeError(
                f"kvcache.{name} is kvcache.vllm's, which needs vLLM: {exc}", name=name
            ) from exc
        return getattr(kvcache.vllm, name)
    # vLLM's factories report a bare AttributeError for a misspelled spec or policy class.
    import difflib

    close = difflib.get_close_matches(name, [*_SPECS, *_POLICY_CLASSES], n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}{hint}", name=name)


def __dir__() -> list[str]:
    return sorted({*globals(), *_POLICY_CLASSES})
