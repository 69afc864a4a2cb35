"""Fixtures of the fake CUDA runtime's own tests: one library per module, reset around each test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.fakecuda import FakeCuda


@pytest.fixture(scope="module")
def fake() -> FakeCuda:
    return FakeCuda()


@pytest.fixture
def cuda(fake: FakeCuda) -> Iterator[FakeCuda]:
    fake.reset()
    yield fake
    fake.reset()
