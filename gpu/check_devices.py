"""Where the GPU check's "GPU" tensors live and how its engines reach them: a CUDA device,
the fake CUDA runtime of tests/fakecuda (CPU memory declared as device memory), or the CPU
(the Rust copier; what needs CUDA is skipped with why)."""

from __future__ import annotations

import contextlib
import ctypes
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from check_results import Skip, check

REPO = Path(__file__).resolve().parent.parent


class Device:
    """Where the "GPU" tensors live and how engines reach them."""

    kind = "cpu"

    def __init__(self) -> None:
        import torch

        self.torch = torch

    def tensors(self, count: int, blocks: int, page: int, seed: int) -> list[Any]:
        gen = self.torch.Generator().manual_seed(seed)
        host = [
            self.torch.randint(0, 256, (blocks, page), dtype=self.torch.uint8, generator=gen)
            for _ in range(count)
        ]
        return [self.place(t) for t in host]

    def place(self, t: Any) -> Any:
        return t

    def cpu(self, t: Any) -> Any:
        return t.cpu()

    def pool(self, num_chunks: int, chunk_bytes: int, pin: str) -> Any:
        from kvcache.transfer import HostChunkPool

        return HostChunkPool(num_chunks, chunk_bytes, pin=False)

    def engine(self, layers: list[Any], pool: Any, **kw: Any) -> Any:
        from kvcache.transfer import TransferEngine

        kw.pop("batch", None)
        kw.pop("copy", None)
        kw.pop("kernel_max_run_bytes", None)
        kw.pop("kernel_min_runs", None)
        return TransferEngine(layers, pool, **kw)

    def sync(self) -> None:
        pass

    def needs_cuda(self, what: str) -> None:
        raise Skip(f"{what} needs CUDA or the fake runtime (--device cuda|fake)")

    def needs_gpu(self, what: str) -> None:
        raise Skip(f"{what} needs a GPU (--device cuda)")

    @contextlib.contextmanager
    def pending_write(self, block: Any, value: int) -> Iterator[None]:
        """Within the block, the compute stream is still writing ``value`` into ``block``."""
        self.needs_cuda("a pending compute-stream write")
        yield

    def pinning_pool(self, chunk_bytes: int) -> tuple[Any, int, Callable[[], None]]:
        """A pool whose background pinning is still running, a chunk copies may use meanwhile,
        and a function that lets the pinning finish."""
        self.needs_cuda("background pinning")
        raise AssertionError

    def info(self) -> dict[str, Any]:
        return {"type": "cpu", "torch": self.torch.__version__}


class CudaDevice(Device):
    kind = "cuda"

    def __init__(self) -> None:
        super().__init__()
        self.dev = self.torch.device("cuda", self.torch.cuda.current_device())

    def place(self, t: Any) -> Any:
        return t.to(self.dev)

    def pool(self, num_chunks: int, chunk_bytes: int, pin: str) -> Any:
        from kvcache.transfer import HostChunkPool

        mode: Any = {"pinned": True, "background": "background", "pageable": False}[pin]
        return HostChunkPool(num_chunks, chunk_bytes, pin=mode, device=self.dev.index)

    def engine(self, layers: list[Any], pool: Any, **kw: Any) -> Any:
        from kvcache.transfer import TransferEngine

        batch = kw.pop("batch", True)
        engine = TransferEngine(layers, pool, **kw)
        if not batch:
            for q in engine._backend._dma.values():
                q.stop_batching()
        return engine

    def sync(self) -> None:
        self.torch.cuda.synchronize(self.dev)

    def needs_cuda(self, what: str) -> None:
        return None

    def needs_gpu(self, what: str) -> None:
        return None

    @contextlib.contextmanager
    def pending_write(self, block: Any, value: int) -> Iterator[None]:
        # ~50 ms of device time before the write: the store is submitted long before it lands.
        self.torch.cuda._sleep(100_000_000)
        block.fill_(value)
        yield

    def pinning_pool(self, chunk_bytes: int) -> tuple[Any, int, Callable[[], None]]:
        num = (8 << 30) // chunk_bytes  # 8 GiB: pinning takes a while (~0.1 s per GiB)
        pool = self.pool(num, chunk_bytes, "background")
        return pool, num - 1, lambda: None

    def info(self) -> dict[str, Any]:
        props = self.torch.cuda.get_device_properties(self.dev)
        driver = ctypes.c_int(0)
        with contextlib.suppress(OSError):
            ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(driver))
        return {
            "type": "cuda",
            "name": props.name,
            "index": self.dev.index,
            "memory_gib": round(props.total_memory / 2**30, 1),
            "torch": self.torch.__version__,
            "cuda": self.torch.version.cuda,
            "driver": f"{driver.value // 1000}.{driver.value % 1000 // 10}",
            "triton": version("triton"),
        }


class FakeDevice(Device):
    """The CUDA backend on the fake CUDA runtime of tests/fakecuda (CPU memory declared as
    device memory; streams on threads; the kernel's model)."""

    kind = "fake"

    def __init__(self) -> None:
        super().__init__()
        sys.path.insert(0, str(REPO))
        from tests.fakecuda import shim

        self.shim = shim
        shim.fake().reset(1)
        self.cuda = shim.TorchCuda(1)
        self.corrupt = False

    def pool(self, num_chunks: int, chunk_bytes: int, pin: str) -> Any:
        from kvcache.transfer import HostChunkPool

        pool = HostChunkPool(num_chunks, chunk_bytes, pin=False)
        if pin == "pinned":
            self.shim.pin(pool)
        return pool

    def engine(self, layers: list[Any], pool: Any, **kw: Any) -> Any:
        kw.setdefault("copy", "dma")
        if self.corrupt:
            self.shim.fake().corrupt_copy(1)
        return self.shim.engine_on_fake(layers, pool, cuda=self.cuda, **kw)

    def needs_cuda(self, what: str) -> None:
        return None

    @contextlib.contextmanager
    def pending_write(self, block: Any, value: int) -> Iterator[None]:
        f = self.shim.fake()
        staged = self.torch.full_like(block, value)
        f.device_tensor(0, staged)
        compute = self.cuda.compute[0].cuda_stream
        gate = f.stream_gate(compute)
        check(
            f.memcpy_async(block.data_ptr(), staged.data_ptr(), block.numel(), compute) == 0,
            "queueing the compute write",
        )
        try:
            yield
        finally:
            f.gate_open(gate)
            f.stream_synchronize(compute)

    def pinning_pool(self, chunk_bytes: int) -> tuple[Any, int, Callable[[], None]]:
        from kvcache.transfer import HostChunkPool

        f = self.shim.fake()
        num = (2 << 30) // chunk_bytes  # two 1 GiB pieces: copies wait only for their own
        pool = HostChunkPool(num, chunk_bytes, pin=False)
        f.register_gate(True)
        self.shim.pin(pool, background=True)
        for _ in range(2000):
            if f.registers_waiting():
                break
            time.sleep(0.005)
        return pool, num - 1, lambda: f.register_gate(False)

    def info(self) -> dict[str, Any]:
        return {"type": "fake", "torch": self.torch.__version__, "runtime": "tests/fakecuda"}


def version(name: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:
        return None


def make_device(kind: str) -> Device:
    if kind == "cuda":
        return CudaDevice()
    if kind == "fake":
        return FakeDevice()
    return Device()
