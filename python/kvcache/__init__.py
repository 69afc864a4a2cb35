"""kvcache: fast, frugal CPU KV-cache offloading for vLLM.

Rust implementations of vLLM 0.33.0's CPU-offloading cache policies (``LRUCachePolicy``,
``ARCCachePolicy``), decision-identical to vLLM's. ``import kvcache`` imports neither vLLM nor
torch; ``kvcache.vllm`` is the adapter vLLM loads by configuration.
"""

from kvcache._context import ReqContext
from kvcache._core import (
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
    __version__,
    order_request_keys,
)

__all__ = [
    "ARCCachePolicy",
    "BaseCachePolicy",
    "ChunkStatus",
    "DuplicateKeyError",
    "InvalidArgumentError",
    "InvalidChunkError",
    "InvalidKeyError",
    "InvalidStateError",
    "InvalidTypeError",
    "KeyNotFoundError",
    "KvCacheError",
    "LRUCachePolicy",
    "NotEvictableError",
    "ReqContext",
    "__version__",
    "order_request_keys",
]
