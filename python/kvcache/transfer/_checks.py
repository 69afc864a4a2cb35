"""Argument checks shared by the pool and the engine, raising kvcache's typed errors."""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import TypeVar

import numpy as np

from kvcache._core import MAX_ITEMS, InvalidArgumentError, InvalidTypeError, OutOfRangeError

_INT64_MAX = np.iinfo(np.int64).max

_T = TypeVar("_T")


def bounded_list(name: str, items: Iterable[_T]) -> list[_T]:
    """``items`` as a list of at most ``MAX_ITEMS`` items, as the Rust side reads its
    arguments: an endless iterator is refused (``InvalidArgumentError``) after one item past
    the bound, never drained further."""
    out = list(itertools.islice(items, MAX_ITEMS + 1))
    if len(out) > MAX_ITEMS:
        raise InvalidArgumentError(
            f"{name}: more than {MAX_ITEMS} items, the most kvcache reads from one argument"
        )
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

    Vectorised (no per-id Python work). Floats and bools are refused rather than truncated, and
    so is anything that is not a sequence, None included (``InvalidTypeError``); integers beyond
    int64 are out of range (``OutOfRangeError``), like any other bad id; nested sequences are
    not 1-d (``InvalidArgumentError``), and so are more than ``MAX_ITEMS`` ids, before any copy.
    A generator is not a sequence: it is refused, never drained.
    """
    if isinstance(ids, np.ndarray) and ids.ndim == 1 and ids.dtype in (np.int64, np.int32):
        return ids
    try:
        arr = np.asarray(ids)
    except (TypeError, ValueError) as exc:
        raise InvalidTypeError(f"{name} must be a sequence of ints: {exc}") from exc
    if arr.ndim == 0:  # None, a bare int, any other non-sequence
        raise InvalidTypeError(f"{name} must be a sequence of ints, got {type(ids).__name__}")
    if arr.ndim != 1:
        raise InvalidArgumentError(f"{name} must be 1-d, got shape {arr.shape}")
    if arr.size > MAX_ITEMS:
        raise InvalidArgumentError(
            f"{name}: more than {MAX_ITEMS} items, the most kvcache reads from one argument"
        )
    if arr.size == 0:
        return np.empty(0, dtype=np.int64)
    if arr.dtype == object:
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in arr.tolist()):
            raise InvalidTypeError(f"{name} must contain only ints")
        try:
            arr = np.asarray(arr.tolist(), dtype=np.int64)
        except OverflowError as exc:
            raise OutOfRangeError(f"{name} contains an id beyond int64") from exc
    elif arr.dtype.kind == "u":
        if int(arr.max()) > _INT64_MAX:
            raise OutOfRangeError(f"{name} contains an id beyond int64")
    elif arr.dtype.kind != "i":
        raise InvalidTypeError(f"{name} must be integers, got dtype {arr.dtype}")
    return np.ascontiguousarray(arr, dtype=np.int64)
