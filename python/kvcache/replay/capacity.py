"""Cache capacities: chunk counts, percentages of a workload, or bytes of host memory.

A ``--capacity`` item is one of

* a chunk count (``4096``);
* a percentage of the workload's unique blocks (``10%``: ``round(0.10 * unique_blocks)``);
* a size in bytes (``64GiB``, ``500GB``, ``1.5TiB``), what an operator writes into vLLM's
  ``cpu_bytes_to_use``. It needs the bytes of one offloaded block, given directly or derived
  from the model (:func:`kv_bytes_per_block`), and becomes a chunk count the way vLLM's
  ``CPUOffloadingSpec`` computes it: ``bytes // round_up(bytes_per_block, page size)``.

A capacity above the workload's unique blocks is clamped to them (:func:`resolve_capacities`):
such a cache never evicts, so every hit, store and eviction is the same as at the clamp, while the
manager would still size its tables by the larger number (a 10⁹-chunk table is gigabytes).
"""

from __future__ import annotations

import decimal
import math
import mmap
import re
from collections.abc import Iterable
from dataclasses import dataclass

from kvcache.replay.errors import ConfigError, quoted

__all__ = [
    "DTYPE_BYTES",
    "MAX_CHUNKS",
    "MAX_PERCENT",
    "PAGE_BYTES",
    "BlockSize",
    "Capacity",
    "CapacitySpec",
    "format_bytes",
    "kv_bytes_per_block",
    "parse_capacities",
    "parse_size",
    "resolve_capacities",
]

#: vLLM pads every offloaded chunk to a whole number of host pages (its ``BLOCK_SIZE_ALIGNMENT``).
PAGE_BYTES = mmap.PAGESIZE

#: Bytes per element of the KV cache's data types, by the names vLLM and torch use.
DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "fp32": 4,
    "float16": 2,
    "fp16": 2,
    "half": 2,
    "bfloat16": 2,
    "bf16": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "int8": 1,
}

_UNITS: dict[str, int] = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"(?P<number>[0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*(?P<unit>[a-z]+)", re.IGNORECASE)
#: Far beyond any host's memory; keeps a typo from turning into an absurd number.
_MAX_BYTES = 2**60
#: A capacity in chunks: what the manager's ``num_chunks`` holds (a signed 64-bit count).
MAX_CHUNKS = 2**63 - 1
#: A capacity as a percentage: anything above 100 % is clamped to the workload anyway; the
#: bound keeps ``percent x unique blocks`` a finite number.
MAX_PERCENT = 10_000


def parse_size(text: str) -> int:
    """``"64GiB"`` -> 68719476736. Units: B, KB/MB/GB/TB (powers of 1000), KiB/MiB/GiB/TiB
    (powers of 1024), case-insensitive; fractions are rounded down to whole bytes."""
    match = _SIZE.fullmatch(text.strip())
    unit = _UNITS.get(match["unit"].lower()) if match else None
    if match is None or unit is None:
        raise ConfigError(
            "expected a number and a unit (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), "
            f"not {quoted(text)}"
        )
    number = match["number"]
    # Exact (a float would round 2**60 + 1 bytes down to 2**60 without a word); a whole part
    # longer than 1 EiB's 19 digits is refused before it is converted at all.
    if len(number.split(".")[0].lstrip("0")) > len(str(_MAX_BYTES)):
        raise ConfigError(f"size {quoted(text)} is out of range (at most 1 EiB)")
    with decimal.localcontext() as exact:
        exact.prec = len(number) + 20  # every digit of the number times the unit
        value = decimal.Decimal(number) * unit
    if value < 1:
        raise ConfigError(f"a size must be at least 1 byte, not {quoted(text)}")
    if value > _MAX_BYTES:
        raise ConfigError(f"size {quoted(text)} is out of range (at most 1 EiB)")
    return int(value)


def format_bytes(n: float) -> str:
    """``68719476736`` -> ``"64 GiB"`` (binary units, at most one decimal)."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            value = n / size
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.1f} {unit}"
    return f"{n:.0f} B"


def kv_bytes_per_block(
    *, layers: int, kv_heads: int, head_size: int, dtype: str, block_tokens: int
) -> int:
    """Bytes of KV cache one offloaded block holds: a key and a value vector per layer, KV head
    and token (``2 * layers * kv_heads * head_size * dtype bytes * block_tokens``).

    ``kv_heads`` counts the model's KV heads, all tensor-parallel ranks together. This is the
    layout of standard (multi-head or grouped-query) attention; for MLA or hybrid models give the
    bytes per block directly.
    """
    for name, value in (
        ("layers", layers),
        ("KV heads", kv_heads),
        ("head size", head_size),
        ("block tokens", block_tokens),
    ):
        if value < 1:
            raise ConfigError(f"{name} must be >= 1, not {value}")
    width = DTYPE_BYTES.get(dtype.lower())
    if width is None:
        raise ConfigError(f"unknown KV dtype {dtype!r} (choose from {', '.join(DTYPE_BYTES)})")
    return 2 * layers * kv_heads * head_size * width * block_tokens


@dataclass(frozen=True, slots=True, kw_only=True)
class BlockSize:
    """The host memory one offloaded block takes, and where that figure came from."""

    bytes: int
    #: How it was obtained, for the report (e.g. "2 x 32 layers x 8 KV heads x ...").
    source: str

    def __post_init__(self) -> None:
        if not 1 <= self.bytes <= _MAX_BYTES:
            raise ConfigError(f"bytes per block must be between 1 and 2**60, not {self.bytes}")

    @property
    def chunk_bytes(self) -> int:
        """What vLLM reserves per chunk: the block rounded up to whole host pages."""
        return -(-self.bytes // PAGE_BYTES) * PAGE_BYTES


@dataclass(frozen=True, slots=True)
class CapacitySpec:
    """One ``--capacity`` item: a chunk count, a percentage of the unique blocks, or bytes."""

    text: str
    chunks: int | None = None
    percent: float | None = None
    bytes: int | None = None

    def needs_block_size(self) -> ConfigError:
        """The error for a capacity in bytes given without the bytes per block."""
        return ConfigError(
            f"capacity {self.text} is in bytes: give --bytes-per-block, or the model's "
            "--num-layers, --num-kv-heads and --head-size"
        )

    def resolve(self, unique_blocks: int, block: BlockSize | None = None) -> int:
        """The capacity in chunks (before clamping) for a workload of ``unique_blocks`` keys."""
        if self.chunks is not None:
            return self.chunks
        if self.bytes is not None:
            if block is None:
                raise self.needs_block_size()
            chunks = self.bytes // block.chunk_bytes
            if chunks < 1:
                raise ConfigError(
                    f"capacity {self.text} holds less than one chunk of "
                    f"{format_bytes(block.chunk_bytes)}"
                )
            return chunks
        assert self.percent is not None
        chunks = round(self.percent / 100.0 * unique_blocks)
        if chunks < 1:
            raise ConfigError(
                f"capacity {self.text} of {unique_blocks} unique blocks is less than one chunk"
            )
        return chunks


def parse_capacities(text: str) -> list[CapacitySpec]:
    """Parse ``"10%,4096,64GiB"``; anything else is a ConfigError."""
    specs = []
    for raw in text.split(","):
        item = raw.strip()
        if not item:
            raise ConfigError(f"empty item in --capacity {quoted(text)}")
        malformed = f"malformed capacity {quoted(item)} (expected e.g. 10%, 4096 or 64GiB)"
        if item.endswith("%"):
            try:
                percent = float(item[:-1])
            except ValueError:
                raise ConfigError(malformed) from None
            if not (math.isfinite(percent) and 0 < percent <= MAX_PERCENT):
                raise ConfigError(
                    f"capacity must be > 0% and at most {MAX_PERCENT:,}%, not {quoted(item)}"
                )
            specs.append(CapacitySpec(item, percent=percent))
        elif item[-1:].isalpha():
            try:
                size = parse_size(item)
            except ConfigError as exc:
                raise ConfigError(f"malformed capacity {quoted(item)}: {exc}") from None
            specs.append(CapacitySpec(item, bytes=size))
        else:
            digits = item.lstrip("+-")
            if digits.isdigit() and len(digits) > len(str(MAX_CHUNKS)):
                chunks = MAX_CHUNKS + 1  # out of range, and more than Python may convert
            else:
                try:
                    chunks = int(item)
                except ValueError:
                    raise ConfigError(malformed) from None
            if not 0 < chunks <= MAX_CHUNKS:
                raise ConfigError(
                    f"capacity must be > 0 and at most {MAX_CHUNKS:,} chunks, not {quoted(item)}"
                )
            specs.append(CapacitySpec(item, chunks=chunks))
    return specs


@dataclass(frozen=True, slots=True, kw_only=True)
class Capacity:
    """A resolved capacity: what the manager gets, and what was asked for."""

    #: The item as given (``"10%"``, ``"4096"``, ``"64GiB"``).
    spec: str
    #: Chunks the manager is built with.
    chunks: int
    #: Chunks the item asked for; larger than ``chunks`` when clamped.
    requested: int
    #: Host bytes one chunk takes (vLLM's page-rounded figure), when the block size is known.
    chunk_bytes: int | None = None

    @property
    def clamped(self) -> bool:
        return self.requested > self.chunks

    @property
    def bytes(self) -> int | None:
        """Host memory of ``chunks`` chunks, when the block size is known."""
        return None if self.chunk_bytes is None else self.chunks * self.chunk_bytes


def resolve_capacities(
    specs: Iterable[CapacitySpec | Capacity],
    *,
    unique_blocks: int,
    block: BlockSize | None = None,
) -> list[Capacity]:
    """Resolve each item to chunks, clamped to ``unique_blocks`` (see the module docstring).

    Already resolved items pass through unchanged.
    """
    resolved = []
    for spec in specs:
        if isinstance(spec, Capacity):
            resolved.append(spec)
            continue
        requested = spec.resolve(unique_blocks, block)
        resolved.append(
            Capacity(
                spec=spec.text,
                chunks=min(requested, max(unique_blocks, 1)),
                requested=requested,
                chunk_bytes=None if block is None else block.chunk_bytes,
            )
        )
    return resolved
