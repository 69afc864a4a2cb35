"""Argument checks shared by the pool and the engine, raising kvcache's typed errors."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from typing import TypeVar

import numpy as np

from kvcache._core import (
    MAX_ITEMS,
    InvalidArgumentError,
    InvalidTypeError,
    OutOfMemoryError,
    OutOfRangeError,
)

_INT64_MAX = np.iinfo(np.int64).max

_T = TypeVar("_T")


def declared_len(items: object) -> int | None:
    """What ``items`` says it holds (``len``), as the Rust side reads it before any argument
    (``conversion::declared_len``): None without a length, and a length beyond any index
    (``OverflowError``: ``range(2**70)``) as more than any bound. A length only ever refuses;
    it never sizes anything."""
    try:
        return len(items)  # type: ignore[arg-type]
    except TypeError:
        return None
    except OverflowError:
        return MAX_ITEMS + 1


def too_many(name: str) -> InvalidArgumentError:
    return InvalidArgumentError(
        f"{name}: more than {MAX_ITEMS} items, the most kvcache reads from one argument"
    )


def bounded_list(name: str, items: Iterable[_T]) -> list[_T]:
    """``items`` as a list of at most ``MAX_ITEMS`` items, as the Rust side reads its
    arguments: a length above the bound is refused (``InvalidArgumentError``) before anything
    is read, an endless iterator after one item past the bound, never drained further, and
    memory the system refuses is ``OutOfMemoryError``."""
    n = declared_len(items)
    if n is not None and n > MAX_ITEMS:
        raise too_many(name)
    try:
        out = list(itertools.islice(items, MAX_ITEMS + 1))
    except MemoryError as exc:
        raise OutOfMemoryError(f"not enough memory to read {name}") from exc
    if len(out) > MAX_ITEMS:
        raise too_many(name)
    return out


def check_count(name: str, value: object) -> int:
    """Positive ``int`` (not ``bool``) or a typed error: pyo3 alone would turn -1 into an
    ``OverflowError`` and accept ``True``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidTypeError(f"{name} must be an int, got {type(value).__name__}")
    if value <= 0:
        raise InvalidArgumentError(f"{name} must be positive, got {value}")
    return value


def as_ids(name: str, ids: object) -> np.ndarray:
    """A 1-d int64 or int32 array for the planner, without copying when ``ids`` already is one.

    Arrays (numpy, torch, anything with the buffer protocol or numpy's array interface) are
    converted vectorised; Python sequences (lists, tuples, ranges, anything with a length and
    items by index) are read item by item, never past ``MAX_ITEMS + 1``. Floats and bools are
    refused rather than truncated, and so is anything that is not a sequence, None, sets and
    generators included (``InvalidTypeError``, never drained); integers beyond int64 are out
    of range (``OutOfRangeError``), like any other bad id; nested sequences are not 1-d
    (``InvalidArgumentError``), and so are more than ``MAX_ITEMS`` ids, refused before
    anything is copied: an array's size, a sequence's length first. Memory the system refuses
    is ``OutOfMemoryError``.
    """
    if isinstance(ids, np.ndarray) and ids.ndim == 1 and ids.dtype in (np.int64, np.int32):
        if ids.size > MAX_ITEMS:  # a zero-stride view claims any size: no caller may read it
            raise too_many(name)
        return ids
    try:
        if _array_like(ids):
            return _array_ids(name, ids)
        return _sequence_ids(name, ids)
    except MemoryError as exc:
        if isinstance(exc, OutOfMemoryError):
            raise
        raise OutOfMemoryError(f"not enough memory to convert {name}") from exc


def _array_like(obj: object) -> bool:
    """Whether numpy takes ``obj`` as an array (a view or its own conversion), not as a Python
    sequence it would read item by item."""
    if isinstance(obj, np.ndarray):
        return True
    if any(hasattr(obj, a) for a in ("__array__", "__array_interface__", "__array_struct__")):
        return True
    try:
        memoryview(obj)  # type: ignore[arg-type]
    except TypeError:
        return False
    except Exception:  # an exporter that refused (a released view): numpy says why
        return True
    return True


def _array_ids(name: str, ids: object) -> np.ndarray:
    try:
        arr = np.asarray(ids)
    except (TypeError, ValueError, BufferError) as exc:
        raise InvalidTypeError(f"{name} must be a sequence of ints: {exc}") from exc
    if arr.ndim == 0:  # a scalar, bytes
        raise InvalidTypeError(f"{name} must be a sequence of ints, got {type(ids).__name__}")
    if arr.ndim != 1:
        raise InvalidArgumentError(f"{name} must be 1-d, got shape {arr.shape}")
    if arr.size > MAX_ITEMS:
        raise too_many(name)
    if arr.size == 0:
        return np.empty(0, dtype=np.int64)
    if arr.dtype == object:
        return _int64_array(name, arr.tolist())
    if arr.dtype.kind == "u":
        if int(arr.max()) > _INT64_MAX:
            raise OutOfRangeError(f"{name} contains an id beyond int64")
    elif arr.dtype.kind != "i":
        raise InvalidTypeError(f"{name} must be integers, got dtype {arr.dtype}")
    return np.ascontiguousarray(arr, dtype=np.int64)


def _sequence_ids(name: str, ids: object) -> np.ndarray:
    n = declared_len(ids)
    if n is None or not hasattr(type(ids), "__getitem__") or isinstance(ids, str | Mapping):
        # None, a bare int, a set, a generator: refused, never drained
        raise InvalidTypeError(f"{name} must be a sequence of ints, got {type(ids).__name__}")
    if n > MAX_ITEMS:
        raise too_many(name)
    if isinstance(ids, range):
        try:
            return np.arange(ids.start, ids.stop, ids.step, dtype=np.int64)
        except OverflowError as exc:
            raise OutOfRangeError(f"{name} contains an id beyond int64") from exc
    if isinstance(ids, list | tuple) and type(ids) in (list, tuple):
        return _int64_array(name, ids)  # exact: they hold what their length says
    return _int64_array(name, bounded_list(name, ids))  # type: ignore[arg-type]


def _int64_array(name: str, items: list[object] | tuple[object, ...]) -> np.ndarray:
    """Python ints (numpy integers too) as int64, each item checked: numpy alone would expand
    a nested sequence (``[range(2**30)]``) before the shape could be refused."""
    if not all(type(v) is int for v in items):
        for v in items:
            if isinstance(v, bool | np.bool_):
                raise InvalidTypeError(f"{name} must contain only ints, got a bool")
            if isinstance(v, int | np.integer):
                continue
            if not isinstance(v, str | bytes) and declared_len(v) is not None:
                raise InvalidArgumentError(f"{name} must be 1-d, got a nested sequence")
            raise InvalidTypeError(f"{name} must contain only ints, got {type(v).__name__}")
        items = [int(v) for v in items]  # type: ignore[call-overload]
    try:
        return np.array(items, dtype=np.int64)
    except OverflowError as exc:
        raise OutOfRangeError(f"{name} contains an id beyond int64") from exc
