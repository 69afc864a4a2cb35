"""kvcache: fast, frugal CPU KV-cache offloading for vLLM.

Rust implementations of vLLM's CPU-offloading cache policies (``LRUCachePolicy``,
``ARCCachePolicy``) and manager (``OffloadingManager``), decision-identical to vLLM 0.33.0's
and 0.34.0's (``vllm_semantics="0.33"``/``"0.34"``; by default the installed vLLM's), and
kvcache's own policy for multi-turn traffic, ``TurnCachePolicy``.
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
    TurnCachePolicy,
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

# Every policy class of the Rust core's list, by its class name (LRU, ARC and Turn are also
# imported by name above, for type checkers).
for _policy_cls in POLICY_KINDS.values():
    globals().setdefault(_policy_cls.__name__, _policy_cls)
