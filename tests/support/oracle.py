"""The vLLM oracle the suite compares against: 0.33.0 or 0.34.0, whichever is installed."""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest

ORACLE_VERSIONS = ("0.33.0", "0.34.0")


def load_oracle() -> ModuleType | None:
    """vLLM's kv_offload package, or None when vLLM is not installed."""
    try:
        vllm = importlib.import_module("vllm")
    except ImportError:
        return None
    if getattr(vllm, "__version__", None) not in ORACLE_VERSIONS:
        pytest.fail(
            f"the oracle must be vLLM {' or '.join(ORACLE_VERSIONS)}, found {vllm.__version__}"
        )
    return importlib.import_module("vllm.v1.kv_offload")


def require_oracle() -> None:
    """Oracle tests fail (not skip) without vLLM: CI must run them.

    Set KVCACHE_ALLOW_NO_ORACLE=1 to skip them on a machine without vLLM.
    """
    if load_oracle() is None:
        if os.environ.get("KVCACHE_ALLOW_NO_ORACLE") == "1":
            pytest.skip("vLLM is not installed (KVCACHE_ALLOW_NO_ORACLE=1)")
        pytest.fail("vLLM is not installed: run `make install` (or `make test`)")


def oracle_semantics() -> str:
    """The installed oracle's semantics name: ``"0.33"`` or ``"0.34"``."""
    import vllm

    return ".".join(vllm.__version__.split(".")[:2])
