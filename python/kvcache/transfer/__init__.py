"""Host chunk pool and asynchronous GPU <-> host transfer engine.

``HostChunkPool`` is host memory for offloaded KV-cache chunks: an exact-size anonymous mapping
owned by Rust (no power-of-two rounding), exported through the buffer protocol and pinned with
the CUDA runtime when possible (blocking, or in the background). ``TransferEngine`` moves
chunks between that pool and per-layer KV-cache tensors: asynchronously on dedicated CUDA
streams, or, with CPU tensors, on Rust worker threads, so the same API runs (and is tested) on
machines without a GPU. Several KV-cache groups, partial chunks and padded pages follow vLLM's
worker contract (0.33.0 and 0.34.0).

Importing this package imports neither torch nor CUDA; torch is imported when a pool is pinned
or viewed as a tensor, or when an engine is created.
"""

from kvcache.transfer._engine import TransferEngine
from kvcache.transfer._jobs import JobResult
from kvcache.transfer._pool import HostChunkPool

__all__ = ["HostChunkPool", "JobResult", "TransferEngine"]
