"""Hostile input drawn at random (hypothesis): any non-bytes key refuses a whole batch or store,
any negative count and any ``ref_cnt`` beyond int32 is an argument error, any int32 ``ref_cnt``
is stored as given. The targets are those of ``test_hostile_inputs.py``."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvcache
from tests.support.hostile import raises_unchanged, ready
from tests.support.hostile_targets import (
    IAE,
    IKE,
    POLICIES,
    TARGETS,
    K,
)

# --- properties -------------------------------------------------------------------------------

NOT_BYTES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=False),
    st.text(max_size=40),
    st.binary(max_size=40).map(bytearray),
    st.lists(st.binary(max_size=8), max_size=3),
    st.tuples(st.binary(max_size=8)),
)
SETTINGS = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@pytest.mark.parametrize("target", POLICIES)
@SETTINGS
@given(bad=NOT_BYTES, position=st.integers(0, 3), method=st.sampled_from(["touch", "evict"]))
def test_any_non_bytes_key_in_a_batch_is_refused_whole(
    target: str, bad: Any, position: int, method: str
) -> None:
    env = TARGETS[target]()
    keys: list[Any] = [K[0], K[1], K[5]]
    keys.insert(position, bad)
    if method == "touch":
        raises_unchanged(env.obj, lambda: env.obj.touch(keys, env.ctx), IKE)
    else:
        raises_unchanged(env.obj, lambda: env.obj.evict(1, keys), IKE)


@pytest.mark.parametrize("target", ["m-lru", "m-arc"])
@SETTINGS
@given(bad=NOT_BYTES, position=st.integers(0, 2))
def test_any_non_bytes_key_in_a_store_is_refused_whole(
    target: str, bad: Any, position: int
) -> None:
    env = TARGETS[target]()
    keys: list[Any] = [K[5], K[6]]
    keys.insert(position, bad)
    raises_unchanged(env.obj, lambda: env.obj.prepare_store(keys, env.ctx), IKE)


@pytest.mark.parametrize("target", POLICIES)
@SETTINGS
@given(n=st.integers(max_value=-1))
def test_any_negative_count_is_an_invalid_argument(target: str, n: int) -> None:
    env = TARGETS[target]()
    raises_unchanged(env.obj, lambda: env.obj.evict(n, set()), IAE)


@SETTINGS
@given(value=st.one_of(st.integers(min_value=2**31), st.integers(max_value=-(2**31) - 1)))
def test_any_ref_cnt_beyond_int32_is_an_invalid_argument(value: int) -> None:
    chunk = ready(1)
    raises_unchanged(chunk, lambda: setattr(chunk, "ref_cnt", value), IAE)


@SETTINGS
@given(value=st.integers(min_value=-(2**31), max_value=2**31 - 1))
def test_any_int32_ref_cnt_is_stored_in_the_record(value: int) -> None:
    chunk = kvcache.ChunkStatus(3)
    chunk.ref_cnt = value
    raw = memoryview(chunk).cast("B")
    assert int.from_bytes(raw[0:4], "little", signed=True) == value == chunk.ref_cnt
