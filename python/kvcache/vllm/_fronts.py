"""The device side of a vLLM transfer job, as each supported vLLM release hands it over.

vLLM 0.33's connector passes its worker a ``GPULoadStoreSpec`` (device block ids, each group's
block count and logical first block). vLLM 0.34's resolves that spec first and passes
``DevicePointers``: one device address and size per (group, data reference, block), each
group's block and reference counts, and the same first block indices. A *front* reads the
running release's form and gives the worker what the transfer engine plans from
(:class:`DeviceJob`), plus that release's shape of a failed job's result. The worker picks
its front once, at import (:func:`front_for`), so nothing else in it depends on the release.

vLLM 0.34's pointers come from another component and are not trusted: they are turned back
into block ids by :meth:`TransferEngine.block_ids_from_pointers`, which refuses any job with
a pointer that does not start a block of the tensor its reference names, references of a
group that disagree, sizes other than the references' or counts other than the layout's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from vllm.v1.kv_offload.base import TransferResult

from kvcache._core import InvalidTypeError

if TYPE_CHECKING:
    from kvcache.transfer import TransferEngine


class DeviceJob(NamedTuple):
    """A job's device side as the engine plans it (``store``/``load`` arguments)."""

    block_ids: Any
    group_sizes: Sequence[int]
    block_indices: Sequence[int]


class Front(Protocol):
    #: The class the release's connector passes for the device side.
    takes: type

    def device_job(self, engine: TransferEngine, device: object) -> DeviceJob: ...

    def failed(self, job_id: int, nbytes: int, seconds: float | None) -> TransferResult: ...


def _check_type(device: object, expected: type) -> None:
    if not isinstance(device, expected):
        raise InvalidTypeError(
            f"the device side must be a {expected.__name__}, got {type(device).__name__}"
        )


class SpecFront:
    """vLLM 0.33: a ``GPULoadStoreSpec`` already holds block ids."""

    def __init__(self) -> None:
        from vllm.v1.kv_offload.base import GPULoadStoreSpec

        self.takes: type = GPULoadStoreSpec

    def device_job(self, engine: TransferEngine, device: object) -> DeviceJob:
        _check_type(device, self.takes)
        return DeviceJob(device.block_ids, device.group_sizes, device.block_indices)  # type: ignore[attr-defined]

    def failed(self, job_id: int, nbytes: int, seconds: float | None) -> TransferResult:
        # vLLM 0.33's own worker never reports a failure; the job's size and time are kept
        # for the log reader (its connector stops at any failed result either way).
        return TransferResult(
            job_id=job_id, success=False, transfer_size=nbytes, transfer_time=seconds
        )


class PointerFront:
    """vLLM 0.34: ``DevicePointers``, validated and turned back into block ids."""

    def __init__(self) -> None:
        from vllm.v1.kv_offload.base import DevicePointers

        self.takes: type = DevicePointers

    def device_job(self, engine: TransferEngine, device: object) -> DeviceJob:
        _check_type(device, self.takes)
        counts = device.group_block_counts  # type: ignore[attr-defined]
        ids = engine.block_ids_from_pointers(
            device.ptrs,  # type: ignore[attr-defined]
            device.sizes,  # type: ignore[attr-defined]
            group_block_counts=counts,
            group_data_ref_counts=device.group_data_ref_counts,  # type: ignore[attr-defined]
        )
        return DeviceJob(ids, counts, device.block_indices)  # type: ignore[attr-defined]

    def failed(self, job_id: int, nbytes: int, seconds: float | None) -> TransferResult:
        # As vLLM 0.34's worker reports a failed copy: neither size nor time, which its
        # connector's statistics would otherwise count as moved.
        return TransferResult(job_id=job_id, success=False)


def front_for(semantics: str) -> Front:
    """The front of vLLM release ``semantics`` (``"0.33"`` or ``"0.34"``)."""
    return SpecFront() if semantics == "0.33" else PointerFront()
