"""``HostChunkPool``: the Rust-owned host mapping plus the pinning policy and torch view."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Literal, Self

from kvcache import _core

if TYPE_CHECKING:
    from types import TracebackType

    import torch

logger = logging.getLogger(__name__)

PinMode = bool | Literal["auto"]


def check_count(name: str, value: object) -> int:
    """Positive ``int`` (not ``bool``) or a typed error: pyo3 alone would turn -1 into an
    ``OverflowError`` and accept ``True``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")
    return value


class HostChunkPool(_core.HostChunkPool):
    """``num_chunks`` chunks of ``chunk_bytes`` bytes of host memory for offloaded KV cache.

    Why not ``torch.empty(..., pin_memory=True)``: torch's pinned allocator rounds every
    allocation up to a power of two. This pool is one page-aligned anonymous mapping of exactly
    ``num_chunks * chunk_bytes`` bytes (rounded up to a page); pages become resident when first
    touched, or all at once when pinned.

    Views: ``memoryview(pool)``, ``numpy.frombuffer(pool, ...)``, ``torch.frombuffer(pool, ...)``
    and :meth:`tensor` all alias the pool's memory without copying.

    Pinning (``pin``): with ``True`` or ``"auto"`` and CUDA available, the memory is registered
    with the CUDA runtime (``cudaHostRegister``, in pieces of at most 64 GiB aligned to chunks),
    which makes DMA fast and lets GPU kernels read and write it directly. If registration
    fails, the runtime's sticky error is cleared; ``"auto"`` then logs a warning and stays
    pageable, ``True`` raises ``RuntimeError``. Without CUDA, ``"auto"`` stays pageable quietly
    and ``True`` raises. :attr:`pinned` reports what actually happened.

    Lifetime: :meth:`close` (also on ``with`` exit, or when the pool is collected) unregisters
    the memory and returns its pages to the system, exactly once. It is refused
    (``RuntimeError``) while transfers are in flight. Views that outlive ``close()`` never crash
    the process: the address range stays mapped (reading zeros) until the last view and the
    pool object are gone, and is unmapped then.
    """

    def __new__(cls, num_chunks: int, chunk_bytes: int, *, pin: PinMode = "auto") -> Self:
        check_count("num_chunks", num_chunks)
        check_count("chunk_bytes", chunk_bytes)
        if pin is not True and pin is not False and pin != "auto":
            raise ValueError(f"pin must be True, False or 'auto', got {pin!r}")
        return super().__new__(cls, num_chunks, chunk_bytes)

    def __init__(self, num_chunks: int, chunk_bytes: int, *, pin: PinMode = "auto") -> None:
        # Set before pinning: the engine reads it to decide whether a GPU kernel may address
        # the pool with host pointers (true once registered on a unified-addressing system).
        self.device_can_use_host_pointer = False
        if pin is False:
            return
        from kvcache.transfer import _cuda

        try:
            _cuda.pin_pool(self, required=pin is True)
        except BaseException:
            self.close()
            raise

    def tensor(self) -> torch.Tensor:
        """A ``torch.uint8`` view of shape ``(num_chunks, chunk_bytes)`` (no copy)."""
        import torch

        # Going through a memoryview keeps a buffer export open for the tensor's lifetime
        # (torch.frombuffer on the pool itself would only hold a reference).
        flat = torch.frombuffer(memoryview(self), dtype=torch.uint8)
        return flat.view(self.num_chunks, self.chunk_bytes)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> int:
        """Unregister and release the memory (idempotent); see the class docs.

        Returns the number of unregister calls that failed (logged; their errors cleared).
        """
        failures = super().close()
        if failures:
            logger.warning("cudaHostUnregister failed for %d piece(s) of the pool", failures)
        return failures

    def __repr__(self) -> str:
        state = "closed" if self.closed else ("pinned" if self.pinned else "pageable")
        return (
            f"HostChunkPool(num_chunks={self.num_chunks}, chunk_bytes={self.chunk_bytes}, {state})"
        )
