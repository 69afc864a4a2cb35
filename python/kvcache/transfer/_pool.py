"""``HostChunkPool``: the Rust-owned host mapping plus the pinning policy and torch view."""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any, Literal, Self

from kvcache import _core
from kvcache._core import (
    InvalidArgumentError,
    InvalidStateError,
    InvalidTypeError,
    TransferError,
)
from kvcache.transfer import _cuda
from kvcache.transfer._checks import check_count

if TYPE_CHECKING:
    from types import TracebackType

    import torch

logger = logging.getLogger(__name__)

PinMode = bool | Literal["auto", "background"]


class HostChunkPool(_core.HostChunkPool):
    """``num_chunks`` chunks of ``chunk_bytes`` bytes of host memory for offloaded KV cache.

    Why not ``torch.empty(..., pin_memory=True)``: torch's pinned allocator rounds every
    allocation up to a power of two. This pool is one page-aligned anonymous mapping of exactly
    ``num_chunks * chunk_bytes`` bytes (rounded up to a page); pages become resident when first
    touched, or all at once when pinned.

    Views: ``memoryview(pool)``, ``numpy.frombuffer(pool, ...)``, ``torch.frombuffer(pool, ...)``
    and :meth:`tensor` all alias the pool's memory without copying.

    Pinning (``pin``): with ``True``, ``"auto"`` or ``"background"`` and CUDA available, the
    memory is registered with the CUDA runtime (``cudaHostRegister``, in pieces aligned to
    chunks, each prefaulted by several threads first), which makes DMA fast and lets GPU kernels
    read and write it directly. ``True`` and ``"auto"`` block until done; ``"background"``
    returns at once and registers on a thread of its own, in pieces of at most 1 GiB, while
    the pool is already usable as pageable memory (:attr:`pinned` turns True when every piece
    is registered; :meth:`pin_status` reports progress). If registration fails, the pieces
    already registered are rolled back and the runtime's sticky error cleared; ``"auto"`` and
    ``"background"`` then log a warning and stay pageable, ``True`` raises ``TransferError``.
    Without CUDA, ``"auto"``/``"background"`` stay pageable quietly and ``True`` raises.
    ``device`` (a CUDA device index): every CUDA call of the pinning and unpinning runs with
    it current, on whichever thread (default: the calling thread's current device), so a
    rank's pool never touches another GPU.

    ``buffer``: instead of a mapping of its own, the pool uses the first
    ``num_chunks * chunk_bytes`` bytes of this writable, C-contiguous, page-aligned buffer
    (for example a shared mapping other processes also use), holding its export for as long
    as the pool or a transfer using it lives; it is pinned like an own mapping, and closing
    the pool unpins it but leaves its bytes alone.

    Lifetime: :meth:`close` (also on ``with`` exit, or when the pool is collected) stops a
    background registration, unregisters the memory and returns its pages to the system,
    exactly once. It is refused (``TransferError``) while transfers are in flight. Views that
    outlive ``close()`` never crash the process: the address range stays mapped (reading zeros)
    until the last view and the pool object are gone, and is unmapped then.
    """

    def __new__(
        cls,
        num_chunks: int,
        chunk_bytes: int,
        *,
        pin: PinMode = "auto",
        device: int | None = None,
        buffer: Any = None,
    ) -> Self:
        check_count("num_chunks", num_chunks)
        check_count("chunk_bytes", chunk_bytes)
        if device is not None:
            if isinstance(device, bool) or not isinstance(device, int):
                raise InvalidTypeError(
                    f"device must be an int or None, got {type(device).__name__}"
                )
            if not 0 <= device < 1 << 16:
                raise InvalidArgumentError(f"device must be a CUDA device index, got {device}")
        if pin is not True and pin is not False and pin not in ("auto", "background"):
            raise InvalidArgumentError(
                f"pin must be True, False, 'auto' or 'background', got {pin!r}"
            )
        return super().__new__(cls, num_chunks, chunk_bytes, buffer=buffer)

    def __init__(
        self,
        num_chunks: int,
        chunk_bytes: int,
        *,
        pin: PinMode = "auto",
        device: int | None = None,
        buffer: Any = None,
    ) -> None:
        if "_pin_reported" in vars(self):
            # Running __init__ again would re-pin, and close the pool on a failure.
            raise InvalidStateError("HostChunkPool.__init__ called on a pool already set up")
        # Whether a GPU kernel may address the pool with host pointers: true once registered
        # on a unified-addressing system (checked when registration completes).
        self.device_can_use_host_pointer = False
        self._pin_runtime: _cuda.CudaRuntime | None = None
        self._pin_device: int | None = None
        self._pin_lock = threading.Lock()
        self._pin_reported = True
        if pin is False:
            return
        try:
            rt = _cuda.runtime()
            if rt is None:
                if pin is True:
                    raise TransferError("pin=True but CUDA is not available")
                logger.debug("CUDA not available: the host chunk pool stays pageable")
                return
            _cuda.register_pool(
                self, rt, required=pin is True, background=pin == "background", device=device
            )
        except BaseException:
            self.close()
            raise

    def report_pinning(self) -> None:
        """The first time a background registration is seen finished: completes its
        bookkeeping and logs how it ended (INFO when pinned, WARNING when it failed), once.
        The transfer engine calls this whenever it collects results, whatever its copy method;
        after the report it costs one attribute test."""
        if self._pin_reported:
            return
        with self._pin_lock:  # two threads seeing it finish at once would both report it
            if not self._pin_reported:
                self._report_pinning_locked()

    def _report_pinning_locked(self) -> None:
        status = self.pin_status()
        state = status["state"]
        if state == "pinning":
            return
        self._pin_reported = True
        if state == "pinned" and self._pin_runtime is not None:
            _cuda.finish_registration(self, self._pin_runtime)
            logger.info(
                "host chunk pool pinned in the background: %.1f GiB in %d piece(s), %.1f s",
                self.nbytes / 2**30,
                status["pieces"],
                status["seconds"],
            )
        elif state == "failed":
            # The pieces already registered stay so until close(): copies may be using them.
            logger.warning(
                "pinning the host chunk pool failed (CUDA error %d at offset %d); the "
                "%.1f GiB before it stay pinned until the pool is closed, the rest stays "
                "pageable (slower)",
                status["code"],
                status["offset"],
                status["offset"] / 2**30,
            )

    @property
    def kernel_ready(self) -> bool:
        """Pinned, and GPU kernels may use the pool's host addresses (see
        :meth:`report_pinning`, which this calls)."""
        self.report_pinning()
        return bool(self.pinned and self.device_can_use_host_pointer)

    def tensor(self) -> torch.Tensor:
        """A ``torch.uint8`` view of shape ``(num_chunks, chunk_bytes)`` (no copy)."""
        import torch

        # Going through a memoryview keeps a buffer export open for the tensor's lifetime
        # (torch.frombuffer on the pool itself would only hold a reference).
        # (Before Python 3.12 a native buffer exporter has no __buffer__ a type checker sees.)
        flat = torch.frombuffer(memoryview(self), dtype=torch.uint8)  # type: ignore[arg-type]
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
        if self.closed:
            state = "closed"
        elif self.pinned:
            state = "pinned"
        else:
            state = self.pin_status()["state"].replace("unpinned", "pageable")
        return (
            f"HostChunkPool(num_chunks={self.num_chunks}, chunk_bytes={self.chunk_bytes}, {state})"
        )
