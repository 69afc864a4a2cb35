"""kvcache: fast, frugal CPU KV-cache offloading for vLLM.

Rust implementations of vLLM 0.33.0's CPU-offloading cache policies (``LRUCachePolicy``,
``ARCCachePolicy``) and manager (``OffloadingManager``), decision-identical to vLLM's.
``import kvcache`` imports neither vLLM nor torch; ``kvcache.vllm`` is the adapter vLLM loads by
configuration, and ``kvcache.transfer`` moves chunks between GPU and host memory.
"""

from kvcache._context import ReqContext
from kvcache._core import (
    POLICY_KINDS,
    ARCCachePolicy,
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
    LRUCachePolicy,
    NotEvictableError,
    OutOfMemoryError,
    OutOfRangeError,
    PoolClosedError,
    ReentrantCallError,
    TransferError,
    __version__,
    order_request_keys,
)
from kvcache._types import (
    EvictedKeys,
    LoadStoreSpec,
    LookupResult,
    OffloadingEvent,
    PrepareStoreOutput,
)
from kvcache.manager import ManagerStats, OffloadingManager

__all__ = [
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
    "__version__",
    "order_request_keys",
]

# Every policy class of the Rust core's list, by its class name (LRU and ARC are also imported
# by name above, for type checkers).
for _policy_cls in POLICY_KINDS.values():
    globals().setdefault(_policy_cls.__name__, _policy_cls)
